"""Output lengths predicted per task from a Gaussian fitted online (SLO-aware annealing §5.1).

A request's output length is unknown when it arrives. The predictor keeps, per task
(an SLO class name; the SLO itself when a request names no class), the running mean and
standard deviation of the output lengths of that task's finished requests (Welford's
update). Before a task has finished ``MIN_SAMPLES`` requests its estimate is the prior
(``NOMINAL_OUTPUT_TOKENS``, spread 0). Consumers: the end-to-end SLO's token envelope
(the mean) and the ``slo-anneal`` policy (a draw from the Gaussian, as the paper does).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

from sglang_ext.policy.slo import NOMINAL_OUTPUT_TOKENS

MIN_SAMPLES = 2


@dataclass(frozen=True, slots=True)
class OutputEstimate:
    mean: float  # tokens
    std: float  # tokens
    samples: int  # finished requests behind the estimate (0: the prior)

    @property
    def expected_tokens(self) -> int:
        return max(1, round(self.mean))


PRIOR = OutputEstimate(float(NOMINAL_OUTPUT_TOKENS), 0.0, 0)


class _Moments:
    __slots__ = ("count", "mean", "m2")

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        delta = value - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (value - self.mean)


class OutputLengthModel:
    """Per-task online Gaussian of output lengths."""

    def __init__(self, prior: OutputEstimate = PRIOR) -> None:
        self.prior = prior
        self._tasks: dict[Hashable, _Moments] = {}

    def estimate(self, task: Hashable) -> OutputEstimate:
        moments = self._tasks.get(task)
        if moments is None or moments.count < MIN_SAMPLES:
            return self.prior
        return OutputEstimate(moments.mean, math.sqrt(moments.m2 / (moments.count - 1)),
                              moments.count)

    def observe(self, task: Hashable, output_tokens: int) -> None:
        """A request of ``task`` finished with ``output_tokens`` output tokens."""
        if output_tokens < 1:
            raise ValueError(f"an output length is >= 1 token, got {output_tokens}")
        self._tasks.setdefault(task, _Moments()).add(float(output_tokens))
