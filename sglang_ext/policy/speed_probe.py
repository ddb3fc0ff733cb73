"""The device's speed against the step-model file, read from the first steps served.

A file fitted to another GPU is usually wrong by a factor before it is wrong in shape: a
larger model or a slower card runs every step a few times longer. The online learner
(``sglang_ext.policy.step_model``) follows such a factor only after a few dozen steps,
because its anchor counts the file as evidence, and until then every step it plans runs
that factor past its budget: on a cold start under a burst, steps of hundreds of
milliseconds against a 50 ms TPOT.

:class:`SpeedProbe` watches the first :data:`PROBE_STEPS` steps. Once it has
:data:`MIN_SAMPLES`, the median of ``measured / file's prediction`` is the device's speed
factor; when that leaves ``[1 / RESCALE_BAND, RESCALE_BAND]`` of the factor in use, the
learner starts again from the file with every weight times the factor, and relearns the
steps seen so far. The median ignores a single stalled or warm-up step. On the device a
file was fitted to, the factor stays near 1 and nothing changes.
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
        """Records one step; returns the new factor when the median ratio left the band
        around the factor in use (the learner restarts from the file times it), else None."""
        if self.done:
            return None
        self.samples.append((shape, measured_s))
        predicted = self.initial.predict_step(shape)
        if predicted > 0.0:
            self.ratios.append(measured_s / predicted)
        if len(self.ratios) < MIN_SAMPLES:
            return None
        median = statistics.median(self.ratios)
        if self.factor / RESCALE_BAND <= median <= self.factor * RESCALE_BAND:
            return None
        self.factor = median
        return median
