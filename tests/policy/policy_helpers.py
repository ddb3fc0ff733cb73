"""Shared builders for the policy tests (imported as a plain module: pytest puts this
directory on ``sys.path`` because ``tests/policy`` is not a package)."""

from __future__ import annotations

from collections.abc import Hashable

from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_model import StepCoefficients
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.policy.view import RequestView

# Round coefficients so expectations can be computed by hand:
# a = 5 ms per step, b = 0.1 ms per new token, c = 0.001 ms per context token.
A = 0.005
B = 1e-4
C = 1e-6
COEF = StepCoefficients(A, B, C)

SLO = Slo(ttft_s=1.0, tpot_s=0.05)
NOW = 100.0


def request(
    req_id: Hashable,
    slack: float,
    *,
    prefill: int = 0,
    context: int = 0,
    slo: Slo = SLO,
    next_output_index: int | None = None,
    now: float = NOW,
    arrival_seq: int = 0,
) -> RequestView:
    """A request whose next token has ``slack`` seconds left at ``now``.

    ``prefill > 0`` makes a prefill (next output index 0 unless given); otherwise a
    decode (next output index 5 unless given). ``arrival`` is solved from the slack.
    """
    if next_output_index is None:
        next_output_index = 0 if prefill > 0 else 5
    arrival = now + slack - slo.ttft_s - slo.tpot_s * next_output_index
    prompt = prefill + context if next_output_index == 0 else max(1, context - next_output_index)
    return RequestView(
        req_id=req_id,
        arrival=arrival,
        slo=slo,
        next_output_index=next_output_index,
        pending_prefill=prefill,
        context=context,
        prompt_tokens=prompt,
        arrival_seq=arrival_seq,
    )


def measured_step(new_tokens: int, context: int, prefill_tokens: int = 0) -> StepShape:
    """A step of ``prefill_tokens`` prompt tokens (one chunk) and one decode per other new
    token, over ``context`` cached tokens: the totals a linear step model reads."""
    decodes = new_tokens - prefill_tokens
    if prefill_tokens:
        return StepShape(prefill_tokens, prefill_tokens * (prefill_tokens + 1) / 2, 0, decodes,
                         context, 1)
    return StepShape(0, 0.0, 0, decodes, context, 0)
