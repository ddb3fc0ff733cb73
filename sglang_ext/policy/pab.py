"""Prefill Admission Budget (FairBatching §3.4, Appendix A).

How many more prompt tokens this rank can prefill within the global TTFT SLO, in the
worst case where every decode is deferred until its slack runs out and then runs one
step per TPOT; the time left is converted to prefill tokens at ``b + c`` seconds per
token, and the prompt tokens still queued are subtracted::

    PAB = 1/(b+c) * [ TTFT - (max(0, TTFT - min slack)/TPOT + 1) * a
                      - sum_i max(0, TTFT - slack_i)/TPOT * (b + context_i * c) ]
          - sum_{i in prefill} remaining_prompt_i

Sums and the minimum range over decodes and prefills alike (a queued prefill will be
decoding inside the window); ``context_i`` is the request's KV length once its
prefill completes. Per-request step counts are clamped at 0 (a request whose slack
exceeds the TTFT window costs nothing inside it). The result may be negative.

Deviation from the paper (the lateness guard, ``sglang_ext.policy.batch_former``): a
late request counts as due now (slack clamped at 0), not as owing ever more steps, so
one late request cannot drive the budget, and every admission on it, to zero.

With the knee step model (``sglang_ext.policy.knee_step_model``) the same worst case is
costed with its terms: a decode step costs ``a`` plus, per request it serves,
``b + d * KV_i * max(1, saturation / n)`` (``n`` the requests in the window; prefill
tokens fill the steps past the knee, so the floor is not charged twice); each queued
prompt costs its prefill time ``b * p + e * p * (context + (p + 1) / 2) + c * context``;
and what is left becomes the longest prompt that fits it, ``b * x + e * x (x + 1) / 2``
(solved in closed form; negative at ``b`` per token when nothing is left).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sglang_ext.policy.knee_step_model import KneeStepModel
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_model import StepPredictor
from sglang_ext.policy.view import RequestState


def prefill_admission_budget(
    requests: Sequence[RequestState], now: float, coefficients: StepPredictor, slo: Slo
) -> float:
    window = _Window.of(requests, now, coefficients, slo)
    if isinstance(coefficients, KneeStepModel):
        left = slo.ttft_s - window.batches * coefficients.a_s - window.decode_s - window.queued_s
        return coefficients.prompt_for_work(left / coefficients.b_s_per_token)
    a, b, c = coefficients.a_s, coefficients.b_s_per_token, coefficients.c_s_per_context_token
    return (slo.ttft_s - window.batches * a - window.decode_s) / (b + c) - window.queued_prompt


@dataclass(frozen=True, slots=True)
class _Window:
    """The worst case over the TTFT window: its decode steps (``batches``), the decode
    time they take, and the queued prompts (in tokens, and in prefill seconds)."""

    batches: float
    decode_s: float
    queued_prompt: int
    queued_s: float

    @classmethod
    def of(cls, requests: Sequence[RequestState], now: float, model: StepPredictor,
           slo: Slo) -> _Window:
        ttft, tpot = slo.ttft_s, slo.tpot_s
        count = len(requests)
        knee = isinstance(model, KneeStepModel)
        decode_cost_s = model.decode_cost_s
        prefill_cost_s = model.prefill_cost_s
        min_slack = ttft
        decode_time = 0.0
        queued_prompt = 0
        queued_time = 0.0
        for request in requests:
            req_slo = request.slo
            slack = request.arrival + req_slo.ttft_s + req_slo.tpot_s * request.next_output_index - now
            if slack < 0.0:
                slack = 0.0
            if slack < min_slack:
                min_slack = slack
            steps = (ttft - slack) / tpot
            pending = request.pending_prefill
            if steps > 0:
                decode_time += steps * decode_cost_s(request.context + pending, count)
            if pending:
                queued_prompt += pending
                if knee:
                    queued_time += prefill_cost_s(pending, request.context, model.knee_tokens)
        return cls((ttft - min_slack) / tpot + 1, decode_time, queued_prompt, queued_time)
