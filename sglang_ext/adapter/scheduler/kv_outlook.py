"""The rank's KV memory as SGLang's prefill admission sees it, for the admission forecast
(:class:`sglang_ext.policy.admission.KvOutlook`).

SGLang's ``PrefillAdder`` starts a prefill only if its prompt plus all its outputs
(``min(max_new_tokens, CLIP_MAX_NEW_TOKENS)``) fit in the free and evictable KV, after
each running request's reserve for its remaining outputs (those times
``new_token_ratio``, or 1 with ``ignore_eos``). The outlook mirrors that, and expects
each running request to give back what it holds and reserves when its last token is
due: its first token plus one TPOT per further token, the pace FairBatching keeps under
load (faster service gives memory back earlier, so the forecast errs on the safe side).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np
from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

from sglang_ext.adapter.scheduler.request_store import RequestStore
from sglang_ext.policy import compiled
from sglang_ext.policy.admission import KvOutlook
from sglang_ext.policy.request_table import RequestTable
from sglang_ext.policy.view import RequestState


def output_reserve(req: Any, new_token_ratio: float, *, from_start: bool = False) -> float:
    """KV tokens SGLang's adder sets aside for a running ``req``'s outputs still to come
    (with ``from_start``, for all of them, as when it arrived); ``new_token_ratio=1`` for
    a prompt it admits, whose outputs it charges whole."""
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
    chunked: tuple[Any, RequestState] | None = None,
) -> KvOutlook:
    """``decoding``: (``Req``, view) of running and parked requests; ``queued``: the
    waiting queue; ``chunked``: the cut prompt SGLang is prefilling, whose remaining
    prompt tokens and outputs come out of free memory before any queued prefill (it
    continues first), so it needs nothing more in the forecast. A queued prompt reserves
    all its remaining outputs, as the adder charges them; an arrival is expected to
    reserve the median of what the known requests reserved when they arrived."""
    free = float(free_and_evictable)
    releases = []
    initial = []
    reserves = {}
    clip = CLIP_MAX_NEW_TOKENS
    split = len(decoding)
    # output_reserve (from now and from the start) and last_token_due inlined, the same
    # operations, in one loop: it runs over every request at every decision under
    # admission defer (``reference_kv_outlook`` in tests/adapter/test_scheduler_state.py
    # is the plain form)
    for position, (req, view) in enumerate(chain(decoding, queued)):
        params = req.sampling_params
        max_new = params.max_new_tokens or 0
        ratio = 1.0 if params.ignore_eos else new_token_ratio
        remaining = max_new - len(req.output_ids)
        if remaining < 0:
            remaining = 0
        whole = clip if clip < remaining else remaining
        initial.append(clip if clip < max_new else max_new if max_new > 0 else 0)
        if position >= split:
            reserves[view.req_id] = float(whole)
            continue
        reserve = whole * ratio
        free -= reserve
        slo = view.slo
        first = view.first_token_time
        anchor = first if first is not None else view.arrival + slo.ttft_s
        later = max_new - 1
        releases.append((anchor + (later if later > 0 else 0) * slo.tpot_s, view.context + reserve))
    if chunked is not None:
        req, view = chunked
        free -= view.pending_prefill + output_reserve(req, new_token_ratio)
        reserves[view.req_id] = -float(view.pending_prefill)  # need_of: already held
    new_reserve = statistics.median(initial) if initial else 0.0
    return KvOutlook.of(free, releases, reserves, new_reserve)


def kv_outlook_of_table(
    free_and_evictable: int,
    new_token_ratio: float,
    table: RequestTable,
    store: RequestStore,
    store_rows: np.ndarray,
    outputs: Sequence[int],
    decoding: int,
    chunked: Any | None = None,
) -> KvOutlook:
    """:func:`kv_outlook` from a decision's table: its first ``decoding`` rows are the
    running and parked requests, then the cut prompt when ``chunked`` (its ``Req``), then
    the waiting queue; ``store_rows`` their rows in ``store``, ``outputs`` each one's
    ``len(req.output_ids)``. The same operations per request, the reserves taken from the
    free memory in order and the releases summed in time order, bit for bit (compiled,
    ``compiled.kv_outlook``, where it is built)."""
    queued_from = decoding + (chunked is not None)
    parts = _compiled_parts if compiled.kv_outlook is not None else _reference_parts
    free, times, through, queued_reserves, new_reserve = parts(
        free_and_evictable, new_token_ratio, table, store, store_rows, outputs, decoding,
        queued_from)
    reserves = dict(zip(table.ids[queued_from:].tolist(), queued_reserves))
    if chunked is not None:
        view = table[decoding]
        free -= view.pending_prefill + output_reserve(chunked, new_token_ratio)
        reserves[view.req_id] = -float(view.pending_prefill)
    return KvOutlook(free, times, through, reserves, new_reserve)


def _reference_parts(
    free_and_evictable: int, new_token_ratio: float, table: RequestTable, store: RequestStore,
    store_rows: np.ndarray, outputs: Sequence[int], decoding: int, queued_from: int,
) -> tuple[float, tuple[float, ...], tuple[float, ...], list[float], float]:
    """The outlook before the cut prompt: the free tokens, the release times and tokens
    released through each, the queued requests' reserves, an arrival's reserve."""
    columns = table.columns
    queued = slice(queued_from, None)
    clip = CLIP_MAX_NEW_TOKENS
    max_new = store.max_new[store_rows]
    remaining = np.maximum(max_new - np.asarray(outputs, dtype=np.int64), 0)
    whole = np.minimum(remaining, clip)
    initial = np.concatenate((max_new[:decoding], max_new[queued]))
    new_reserve = _median(np.minimum(np.maximum(initial, 0), clip))
    ratio = np.where(store.ignore_eos[store_rows[:decoding]], 1.0, new_token_ratio)
    reserve = whole[:decoding] * ratio
    free = float(np.subtract.accumulate(np.concatenate(([float(free_and_evictable)], reserve)))[-1])
    first = columns.first[:decoding]
    due = columns.arrival[:decoding] + columns.ttft[:decoding]
    anchor = np.where(np.isnan(first), due, first)
    times = anchor + np.maximum(max_new[:decoding] - 1, 0) * columns.tpot[:decoding]
    tokens = columns.context[:decoding] + reserve
    order = np.lexsort((tokens, times))
    return (free, tuple(times[order].tolist()), tuple(np.add.accumulate(tokens[order]).tolist()),
            whole[queued].astype(np.float64).tolist(), new_reserve)


def _compiled_parts(
    free_and_evictable: int, new_token_ratio: float, table: RequestTable, store: RequestStore,
    store_rows: np.ndarray, outputs: Sequence[int], decoding: int, queued_from: int,
) -> tuple[float, tuple[float, ...], tuple[float, ...], list[float], float]:
    """:func:`_reference_parts` by the compiled path, bit for bit."""
    columns = table.columns
    return compiled.kv_outlook(
        free_and_evictable, new_token_ratio, CLIP_MAX_NEW_TOKENS, decoding, queued_from,
        store_rows, store.max_new, store.ignore_eos,
        outputs if type(outputs) is list else list(outputs), columns.first, columns.arrival,
        columns.ttft, columns.tpot, columns.context)


def _median(values: np.ndarray) -> float:
    """``statistics.median`` of integers, as a float (0.0 of none)."""
    if not len(values):
        return 0.0
    ordered = np.sort(values).tolist()
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[middle])
    return (ordered[middle - 1] + ordered[middle]) / 2
