"""FairBatching batch formation: Algorithm 1 of the paper, as a pure function.

Resolutions of the printed algorithm's ambiguities (each covered by a test):
- ``min_slack`` and ``min_tpot_slo`` (lines 18-19) range over *all* active requests,
  prefills included.
- A prefill chunk costs ``b * cp + c * context`` and that whole cost is subtracted
  (line 45 prints ``- b*cp + c*context``, a sign slip).
- ``cp`` is rounded down and a chunk below one token is skipped; only prefills are
  chunked (a decode is one token).
- Urgent decodes are always included, even past the time or token budget: under
  extreme load FairBatching degrades to Sarathi-like decode-first batching (§3.3).
- ``MAX_TOKEN_BUDGET`` caps new tokens per step (default 8192, a CUDA-graph limit).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from operator import itemgetter

from sglang_ext.policy.step_model import StepCoefficients
from sglang_ext.policy.view import BatchDecision, RequestState

DEFAULT_MAX_TOKEN_BUDGET = 8192
_by_slack = itemgetter(0)


@dataclass(frozen=True, slots=True)
class Triage:
    """Lines 13-33: slack per request, the initial time budget, and the three groups."""

    init_time_budget_s: float  # max(min slack, min TPOT), seconds
    min_tpot_s: float
    # (slack_s, request) sorted by slack ascending
    urgent_decodes: list[tuple[float, RequestState]]
    prefills: list[tuple[float, RequestState]]
    deferrable_decodes: list[tuple[float, RequestState]]


def triage(
    requests: Sequence[RequestState], now: float, *, anchored: bool = False
) -> Triage | None:
    """Group active requests; ``None`` when there is nothing to run.

    ``anchored=True`` measures a request's slack after its first token against
    ``first_token_time + tpot * j`` (the ``fb-anchor`` variant) instead of the paper's
    ``arrival + ttft + tpot * j``; the first token keeps the TTFT deadline.
    """
    if not requests:
        return None
    decodes: list[tuple[float, RequestState]] = []
    prefills: list[tuple[float, RequestState]] = []
    add_decode, add_prefill = decodes.append, prefills.append
    min_slack = math.inf
    min_tpot = math.inf
    for request in requests:
        slo = request.slo
        tpot = slo.tpot_s
        index = request.next_output_index
        if anchored and index and request.first_token_time is not None:
            slack = request.first_token_time + tpot * index - now
        else:
            slack = request.arrival + slo.ttft_s + tpot * index - now
        if slack < min_slack:
            min_slack = slack
        if tpot < min_tpot:
            min_tpot = tpot
        if request.pending_prefill:
            add_prefill((slack, request))
        else:
            add_decode((slack, request))
    init_time_budget = max(min_slack, min_tpot)
    decodes.sort(key=_by_slack)
    split = bisect_left(decodes, init_time_budget + min_tpot, key=_by_slack)
    prefills.sort(key=_by_slack)
    return Triage(init_time_budget, min_tpot, decodes[:split], prefills, decodes[split:])


def pack(
    groups: Triage,
    coefficients: StepCoefficients,
    *,
    token_budget: int,
    time_budget_s: float | None,
) -> BatchDecision:
    """Lines 34-48: fill the step from the urgent, prefill and deferrable groups in turn.

    ``time_budget_s=None`` packs under the token budget alone (the ``fb-fb`` / ``fb-tb``
    variants); ``coefficients`` then only feed the prediction.
    """
    a, b, c = coefficients.a_s, coefficients.b_s_per_token, coefficients.c_s_per_context_token
    urgent = groups.urgent_decodes
    decode_ids: list[Hashable] = [request.req_id for _, request in urgent]
    urgent_cost = b * len(urgent) + c * sum([request.context for _, request in urgent])
    time_left = (math.inf if time_budget_s is None else time_budget_s - a) - urgent_cost
    tokens_left = token_budget - len(urgent)
    predicted = a + urgent_cost
    chunks: list[tuple[Hashable, int]] = []

    for _, request in groups.prefills:
        if tokens_left <= 0:
            break
        new_tokens = request.pending_prefill
        context_cost = c * request.context
        cost = b * new_tokens + context_cost
        if cost <= time_left and new_tokens <= tokens_left:
            chunk = new_tokens
        elif time_left == math.inf:
            chunk = min(tokens_left, new_tokens)
            cost = b * chunk + context_cost
        elif context_cost <= time_left:
            chunk = min(tokens_left, new_tokens, math.floor((time_left - context_cost) / b))
            if chunk < 1:
                continue
            cost = b * chunk + context_cost
        else:
            continue
        chunks.append((request.req_id, chunk))
        time_left -= cost
        tokens_left -= chunk
        predicted += cost
        if time_left < b:
            break  # nothing that costs at least one token fits any more

    deferrable = groups.deferrable_decodes
    all_cost = b * len(deferrable) + c * sum([request.context for _, request in deferrable])
    if all_cost <= time_left and len(deferrable) <= tokens_left:
        decode_ids.extend([request.req_id for _, request in deferrable])
        predicted += all_cost
    else:
        for _, request in deferrable:
            if tokens_left < 1 or time_left < b:
                break
            cost = b + c * request.context
            if cost <= time_left:
                decode_ids.append(request.req_id)
                time_left -= cost
                tokens_left -= 1
                predicted += cost

    return BatchDecision(tuple(decode_ids), tuple(chunks), predicted, time_budget_s)


def form_batch(
    requests: Sequence[RequestState],
    now: float,
    coefficients: StepCoefficients,
    *,
    max_token_budget: int = DEFAULT_MAX_TOKEN_BUDGET,
) -> BatchDecision:
    """Algorithm 1 with the adaptive time budget (the ``fb`` policy)."""
    groups = triage(requests, now)
    if groups is None:
        return BatchDecision.make_empty()
    return pack(
        groups, coefficients, token_budget=max_token_budget, time_budget_s=groups.init_time_budget_s
    )
