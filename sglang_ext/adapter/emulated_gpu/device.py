"""The emulated GPU: the profile's step times (its roofline, or the batching study's service
curve for a profile with ``[service]``) on an in-order device timeline, every step recorded."""

from __future__ import annotations

import time

from sglang_ext.adapter.batch_shape import BatchShape
from sglang_ext.sim.service_curve import make_gpu

from .settings import EmulationSettings
from .timeline import DeviceTimeline, StepLog, StepRecord

__all__ = ["EmulatedDevice"]


class EmulatedDevice:
    """Charges each launched step the profile's measured step time times ``time_scale``.

    ``launch`` returns at once with the step's record; the caller waits for ``record.end``
    (SGLang's overlap mode does so in the result's ``copy_done.synchronize()``).
    """

    def __init__(self, settings: EmulationSettings, seed: int, log: StepLog) -> None:
        self.settings = settings
        self.gpu = make_gpu(settings.profile, seed=seed)
        self.timeline = DeviceTimeline()
        self.log = log
        self._scale = settings.time_scale

    def step_seconds(self, shape: BatchShape) -> float:
        """Emulated duration of one step (0 for a step that computes no token)."""
        if shape.step.new_tokens <= 0:
            return 0.0
        return self.gpu.measure_step_s(shape.step) * self._scale

    def launch(self, shape: BatchShape, now: float | None = None) -> StepRecord:
        """Queue one step on the device at ``now`` (default: the current monotonic time)."""
        launch = time.monotonic() if now is None else now
        start, end = self.timeline.schedule(launch, self.step_seconds(shape))
        step = shape.step
        record = StepRecord(
            launch=launch,
            start=start,
            end=end,
            mode=shape.mode,
            new_tokens=step.new_tokens,
            context=step.total_context,
            num_reqs=shape.num_reqs,
            prefill_tokens=step.prefill_tokens,
            prefill_reqs=step.prefill_requests,
            decode_reqs=step.decode_requests,
            seq_lens_sum=shape.seq_lens_sum,
        )
        self.log.append(record)
        return record
