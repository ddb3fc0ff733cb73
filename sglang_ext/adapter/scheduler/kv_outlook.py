"""The rank's KV memory as SGLang's prefill admission sees it, for the admission forecast
(:class:`sglang_ext.policy.admission.KvOutlook`).

SGLang's ``PrefillAdder`` starts a prefill only if its prompt plus its reserved outputs
(``min(max_new_tokens, CLIP_MAX_NEW_TOKENS)`` times ``new_token_ratio``, or 1 with
``ignore_eos``) fit in the free and evictable KV, after each running request's reserve
for its remaining outputs. The outlook mirrors that, and expects each running request to
give back what it holds and reserves when its last token is due: its first token plus
one TPOT per further token, the pace FairBatching keeps under load (faster service gives
memory back earlier, so the forecast errs on the safe side).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

from sglang_ext.policy.admission import KvOutlook, last_token_due
from sglang_ext.policy.view import RequestState


def output_reserve(req: Any, new_token_ratio: float, *, from_start: bool = False) -> float:
    """KV tokens SGLang's adder sets aside for ``req``'s outputs still to come (with
    ``from_start``, for all of them, as when it arrived)."""
    params = req.sampling_params
    produced = 0 if from_start else len(req.output_ids)
    remaining = max(0, (params.max_new_tokens or 0) - produced)
    ratio = 1.0 if params.ignore_eos else new_token_ratio
    return min(remaining, CLIP_MAX_NEW_TOKENS) * ratio


def kv_outlook(
    free_and_evictable: int,
    new_token_ratio: float,
    decoding: Sequence[tuple[Any, RequestState]],
    queued: Sequence[tuple[Any, RequestState]],
) -> KvOutlook:
    """``decoding``: (``Req``, view) of running and parked requests; ``queued``: the
    chunked request and the waiting queue. An arrival is expected to reserve the median
    of what the known requests reserved when they arrived."""
    free = float(free_and_evictable)
    releases = []
    initial = []
    for req, view in decoding:
        reserve = output_reserve(req, new_token_ratio)
        free -= reserve
        initial.append(output_reserve(req, new_token_ratio, from_start=True))
        due = last_token_due(view, req.sampling_params.max_new_tokens or 0)
        releases.append((due, view.context + reserve))
    reserves = {}
    for req, view in queued:
        reserves[view.req_id] = output_reserve(req, new_token_ratio)
        initial.append(output_reserve(req, new_token_ratio, from_start=True))
    new_reserve = statistics.median(initial) if initial else 0.0
    return KvOutlook.of(free, releases, reserves, new_reserve)
