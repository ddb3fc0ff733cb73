"""Start-up calibration: fit the step model on the device itself before the server takes
traffic (``calibrate = true``, the default when no ``step_model`` file is named).

When a scheduler starts, it queues a plan of synthetic requests (random token ids,
``ignore_eos``, never streamed to any client): prompts of 16 to a few thousand tokens
whose outputs end at staggered lengths, so the steps that serve them are prefill-only,
mixed (later prompts beside earlier decodes) and decode-only over batches that shrink as
outputs end, at growing context. SGLang's own readiness warm-up request queues behind
them, so the server reports ready only after the plan has run (a few seconds on a GPU).
Every step's features and measured time are recorded; when the last synthetic request
ends, the step-model file's form is fitted to them (``fit_step_model``), logged beside
the file's error on the same steps, and adopted as the policy's initial model, which
the online model then keeps recalibrating. A fit that fails (too few or too uniform
steps) is logged and the file's model is kept.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_model import StepModelError, StepModelFile, StepPredictor, fit_step_model
from sglang_ext.policy.step_shape import StepShape

CALIBRATION_RID_PREFIX = "fairbatching-calibration-"
#: prompt lengths of the plan, tokens (capped by what the pool and the context hold)
PROMPT_LENGTHS = (16, 64, 256, 1024, 2048, 4096)
#: output lengths, staggered so the decode batch shrinks in steps
OUTPUT_LENGTHS = (4, 12, 24, 48)
#: requests in the plan; at most this share of the KV pool is used
PLAN_REQUESTS = 48
POOL_SHARE = 0.5
SEED = 0xFB
#: a calibration still running this long after it started ends with the steps it has
#: (its requests were aborted elsewhere, or the device is far slower than any plan
#: expects), so that held requests never wait for ever
TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class CalibrationRequest:
    rid: str
    input_ids: tuple[int, ...]
    max_new_tokens: int


def calibration_plan(pool_tokens: int, context_len: int, vocab_size: int,
                     requests: int = PLAN_REQUESTS) -> tuple[CalibrationRequest, ...]:
    """The synthetic requests: every prompt length of :data:`PROMPT_LENGTHS` that fits
    (each request's prompt and output within ``context_len``, all of them within
    :data:`POOL_SHARE` of ``pool_tokens``), cycled with :data:`OUTPUT_LENGTHS`; empty when
    not even the shortest fits."""
    rng = random.Random(SEED)
    budget = int(pool_tokens * POOL_SHARE)
    longest_output = max(OUTPUT_LENGTHS)
    lengths = [n for n in PROMPT_LENGTHS if n + longest_output <= min(context_len, budget)]
    plan: list[CalibrationRequest] = []
    used = 0
    for index in range(requests):
        if not lengths:
            break
        prompt = lengths[index % len(lengths)]
        output = OUTPUT_LENGTHS[(index // len(lengths)) % len(OUTPUT_LENGTHS)]
        if used + prompt + output > budget:
            continue
        used += prompt + output
        ids = tuple(rng.randrange(1, max(2, vocab_size)) for _ in range(prompt))
        plan.append(CalibrationRequest(f"{CALIBRATION_RID_PREFIX}{index}", ids, output))
    return tuple(plan)


def calibration_slo(default: Slo) -> Slo:
    """The SLO every calibration request carries: the default class's TPOT, so that its
    steps are shaped as serving steps, and a first-token target as long as the
    calibration may last, so that none is ever hopeless or ended by admission ``defer``
    however slow the device (no client waits for them)."""
    return Slo(TIMEOUT_S, default.tpot_s)


def is_calibration_rid(rid: object) -> bool:
    return isinstance(rid, str) and rid.startswith(CALIBRATION_RID_PREFIX)


@dataclass(frozen=True, slots=True)
class CalibrationFit:
    model: StepModelFile
    steps: int
    seconds: float  # wall time from the plan's start to its last request's end
    fitted_error: float  # median |relative error| of the fit on the recorded steps
    file_error: float  # the same for the model it replaces

    def summary(self) -> str:
        model = self.model.model
        knee = getattr(model, "knee_tokens", None)
        return (f"fitted the {model.form} step model on this device over {self.steps} steps in "
                f"{self.seconds:.1f} s: a={model.a_s * 1e3:.3f} ms, b={model.b_s_per_token * 1e6:.2f} "
                f"us/token" + (f", knee={knee:.0f} tokens" if knee is not None else "")
                + f", smallest step {model.smallest_step_s * 1e3:.2f} ms; median |error| on "
                f"these steps {self.fitted_error:.1%} (the file's: {self.file_error:.1%})")


@dataclass
class Calibration:
    """One scheduler's calibration in progress: the requests still running and the steps
    recorded so far."""

    pending: set[str]
    started_at: float = field(default_factory=time.perf_counter)
    shapes: list[StepShape] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def record(self, shape: StepShape, measured_s: float) -> None:
        self.shapes.append(shape)
        self.seconds.append(measured_s)

    def overdue(self, now: float) -> bool:
        """``now``: ``time.perf_counter()``."""
        return now - self.started_at > TIMEOUT_S

    def finished(self, rid: str) -> bool:
        """Mark ``rid`` done; True when it was the last."""
        self.pending.discard(rid)
        return not self.pending

    def fit(self, form: str, current: StepPredictor) -> CalibrationFit:
        """The model of ``form`` fitted to the recorded steps; StepModelError when they
        cannot be fitted."""
        fitted = fit_step_model(form, self.shapes, self.seconds)
        return CalibrationFit(
            fitted, len(self.shapes), time.perf_counter() - self.started_at,
            _median_error(fitted.model, self.shapes, self.seconds),
            _median_error(current, self.shapes, self.seconds),
        )


def _median_error(model: StepPredictor, shapes: Sequence[StepShape], seconds: Sequence[float]) -> float:
    errors = [abs(model.usable().predict_step(s) / t - 1.0) for s, t in zip(shapes, seconds, strict=True)
              if t > 0 and math.isfinite(t)]
    return statistics.median(errors) if errors else math.nan


__all__ = ["CALIBRATION_RID_PREFIX", "Calibration", "CalibrationFit", "CalibrationRequest",
           "StepModelError", "calibration_plan", "calibration_slo", "is_calibration_rid"]
