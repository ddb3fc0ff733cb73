"""The device's speed against the step-model file, read from the first steps served.

A file fitted to another GPU is usually wrong by a factor before it is wrong in shape: a
larger model or a slower card runs every step a few times longer. The online learner
(``sglang_ext.policy.step_model``) follows such a factor only after a few dozen steps,
because its anchor counts the file as evidence, and until then every step it plans runs
that factor past its budget: on a cold start under a burst, steps of hundreds of
milliseconds against a 50 ms TPOT.

:class:`SpeedProbe` watches the first :data:`PROBE_STEPS` steps. From the
:data:`MIN_SAMPLES`-th on, when all but one of them ran more than :data:`RESCALE_BAND`
times the file's prediction (times the factor in use), the device is slower than the
file at every kind of step seen: the learner starts again from the file with every weight
times the median ratio, and relearns the steps seen so far. One stalled or warm-up step
does not decide it, and a factor that overshot comes back (never below 1). A device
faster than the file needs no help: in the file's units its steps' regressors are large,
and the learner's data outweigh its anchor at once, while a scaled restart on a device
faster at some kinds of step than at others (a decode-only step as fast as the file's, a
prefill ten times faster) would start it further off. On the device a file was fitted
to, nothing changes.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from sglang_ext.policy.step_model import StepPredictor
from sglang_ext.policy.step_shape import StepShape

PROBE_STEPS = 16
MIN_SAMPLES = 3
RESCALE_BAND = 1.5


@dataclass(slots=True)
class SpeedProbe:
    """The first steps' ``measured / predicted`` against ``initial`` (the file's model);
    :meth:`observe` says when the learner should restart scaled."""

    initial: StepPredictor
    factor: float = 1.0
    samples: list[tuple[StepShape, float]] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.samples) >= PROBE_STEPS

    def observe(self, shape: StepShape, measured_s: float) -> float | None:
        """Records one step; returns the new factor when the learner should restart from
        the file times it (module docstring), else None."""
        if self.done:
            return None
        self.samples.append((shape, measured_s))
        predicted = self.initial.predict_step(shape)
        if predicted > 0.0:
            self.ratios.append(measured_s / predicted)
        if len(self.ratios) < MIN_SAMPLES:
            return None
        ratios = sorted(self.ratios)
        slower = ratios[1] > self.factor * RESCALE_BAND
        back = self.factor > 1.0 and ratios[-2] < self.factor / RESCALE_BAND
        if not (slower or back):
            return None
        self.factor = max(1.0, statistics.median(ratios))
        return self.factor
