"""How far a step-time model's predictions are from the measured steps, overall and per
kind of step (decode-only, mixed, prefill-heavy): what an operator reads to tell whether
the model has learned the device."""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from sglang_ext.policy.step_shape import StepShape

STEP_KINDS = ("decode", "mixed", "prefill")
#: a step is prefill-heavy when at least this share of its new tokens are prompt tokens
PREFILL_HEAVY_SHARE = 0.9


def step_kind(shape: StepShape) -> str:
    """``decode`` (no prompt tokens), ``prefill`` (prompt tokens at least
    :data:`PREFILL_HEAVY_SHARE` of the step's new tokens) or ``mixed``."""
    if shape.prefill_tokens == 0:
        return "decode"
    if shape.prefill_tokens >= PREFILL_HEAVY_SHARE * shape.new_tokens:
        return "prefill"
    return "mixed"


@dataclass(frozen=True, slots=True)
class PredictionError:
    samples: int  # steps observed
    outliers: int  # steps that took over twice the prediction (stalls, pauses)
    mean_abs_relative: float  # EWMA of |predicted - measured| / measured
    last_relative: float  # (measured - predicted) / measured of the latest step
    p95_abs_relative: float  # over the recent window
    median_abs_relative: float = 0.0  # over the recent window
    by_kind: tuple[tuple[str, int, float], ...] = ()  # (kind, steps seen, recent median |error|)

    def kind_median(self, kind: str) -> float | None:
        for name, _, median in self.by_kind:
            if name == kind:
                return median
        return None


class StepErrorLog:
    """Relative errors of the steps observed: an EWMA, a recent window (kept sorted too,
    so its p95, read after every step, costs no sort), and a recent window per
    :func:`step_kind`."""

    def __init__(self, window: int = 256) -> None:
        self.samples = 0
        self._outliers = 0
        self._ewma = 0.0
        self._last = 0.0
        self._recent: deque[float] = deque(maxlen=window)
        self._recent_sorted: list[float] = []
        self._seen = dict.fromkeys(STEP_KINDS, 0)
        self._by_kind: dict[str, deque[float]] = {kind: deque(maxlen=window) for kind in STEP_KINDS}

    @property
    def recent(self) -> tuple[float, ...]:
        return tuple(self._recent)

    def record(self, shape: StepShape, predicted_s: float, measured_s: float) -> float:
        """Log one step; returns (measured - predicted) / measured."""
        relative = (measured_s - predicted_s) / measured_s
        self.samples += 1
        self._last = relative
        recent, ordered = self._recent, self._recent_sorted
        if len(recent) == recent.maxlen:
            del ordered[bisect.bisect_left(ordered, recent[0])]
        recent.append(abs(relative))
        bisect.insort(ordered, abs(relative))
        kind = step_kind(shape)
        self._seen[kind] += 1
        self._by_kind[kind].append(abs(relative))
        alpha = 0.02 if self.samples > 50 else 1.0 / self.samples
        self._ewma += alpha * (abs(relative) - self._ewma)
        if measured_s > 2.0 * predicted_s:
            self._outliers += 1
        return relative

    @property
    def p95_abs_relative(self) -> float:
        """The recent window's p95 of |error| (0.0 before any step)."""
        recent = self._recent_sorted
        return recent[min(len(recent) - 1, int(0.95 * len(recent)))] if recent else 0.0

    def summary(self) -> PredictionError:
        recent = self._recent_sorted
        p95 = self.p95_abs_relative
        median = statistics.median(recent) if recent else 0.0
        by_kind = tuple((kind, self._seen[kind], statistics.median(values))
                        for kind, values in self._by_kind.items() if values)
        return PredictionError(self.samples, self._outliers, self._ewma, self._last, p95,
                               median, by_kind)


def check_learning_rates(forgetting: float, anchor_weight: float, anchor_follow: float,
                         error: type[ValueError] = ValueError) -> None:
    """The online models' shared settings, refused with ``error`` when out of range."""
    if not 0.0 < forgetting <= 1.0:
        raise error(f"forgetting must be in (0, 1], got {forgetting}")
    if anchor_weight <= 0:
        raise error(f"anchor_weight must be > 0, got {anchor_weight}")
    if not 0.0 <= anchor_follow < 1.0:
        raise error(f"anchor_follow must be in [0, 1), got {anchor_follow}")


class LearnedModel:
    """What every online step model exposes besides ``observe``: the model in use, its
    prediction, and its error log (``_coefficients`` and ``_errors``, set by the learner)."""

    _coefficients: Any
    _errors: StepErrorLog

    @property
    def coefficients(self) -> Any:
        return self._coefficients

    @property
    def error(self) -> PredictionError:
        return self._errors.summary()

    @property
    def errors(self) -> StepErrorLog:
        return self._errors

    def keep_errors(self, errors: StepErrorLog) -> None:
        """Continue ``errors`` (another learner's log of the same steps) as this one's: the
        errors the steps were planned with, not this learner's hindsight."""
        self._errors = errors

    @property
    def recent_abs_relative_errors(self) -> tuple[float, ...]:
        return self._errors.recent

    def predict(self, shape: StepShape) -> float:
        return self._coefficients.predict_step(shape)
