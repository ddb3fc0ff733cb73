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


def triage(requests: Sequence[RequestState], now: float) -> Triage | None:
    """Group active requests; ``None`` when there is nothing to run."""
    if not requests:
        return None
    decodes: list[tuple[float, RequestState]] = []
    prefills: list[tuple[float, RequestState]] = []
    min_slack = math.inf
    min_tpot = math.inf
    for request in requests:
        slo = request.slo
        slack = request.arrival + slo.ttft_s + slo.tpot_s * request.next_output_index - now
        if slack < min_slack:
            min_slack = slack
        if slo.tpot_s < min_tpot:
            min_tpot = slo.tpot_s
        (prefills if request.pending_prefill > 0 else decodes).append((slack, request))
    init_time_budget = max(min_slack, min_tpot)
    urgent_threshold = init_time_budget + min_tpot
    decodes.sort(key=_by_slack)
    split = len(decodes)
    for position, (slack, _) in enumerate(decodes):
        if slack >= urgent_threshold:
            split = position
            break
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
    time_left = math.inf if time_budget_s is None else time_budget_s - a
    tokens_left = token_budget
    predicted = a
    decode_ids: list[Hashable] = []
    chunks: list[tuple[Hashable, int]] = []

    for _, request in groups.urgent_decodes:
        cost = b + c * request.context
        decode_ids.append(request.req_id)
        time_left -= cost
        tokens_left -= 1
        predicted += cost

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

    for _, request in groups.deferrable_decodes:
        if tokens_left < 1:
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
