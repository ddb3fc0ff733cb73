"""The batching study's GPU: a batch of ``b`` tokens takes ``S(b) = c + a * max(0, b - b0)``.

The discrete-event batching study (``shared/seeds/des_batching_study.txt``) models the GPU at
the batch level: a fixed per-batch setup cost ``c`` plus a marginal cost ``a`` per token past a
threshold ``b0``.  Here ``b`` is the step's token load, ``prefill_tokens + decode_requests``
(one token per decode); context length, attention and per-request overheads cost nothing.  The
study gives the form, not the numbers; a profile's ``[service]`` table gives them
(:class:`~sglang_ext.sim.profile.ServiceSpec`, ``configs/profiles/des-study.toml``).

Measured time: with ``marginal = "fixed"`` (the chunked-prefill experiment's deterministic
curve) it is ``S(b)`` exactly and draws nothing; with ``"exponential"`` (the workload-sensitivity
experiment's "per-token marginal cost governed by an exponential distribution with mean a") it
is ``c + a * E * max(0, b - b0)`` with one ``E ~ Exp(1)`` per step, one draw per call from a
seeded generator.  :func:`make_gpu` picks this model or the roofline from the profile.
"""

from __future__ import annotations

import numpy as np

from sglang_ext.policy.step_shape import StepShape
from sglang_ext.sim.gpu import RooflineGpu, StepBreakdown
from sglang_ext.sim.profile import HardwareProfile

__all__ = ["ServiceCurveGpu", "make_gpu"]


class ServiceCurveGpu:
    """``S(b) = c + a * max(0, b - b0)``; the engine's GPU interface (``breakdown``,
    ``ideal_step_s``, ``measure_step_s``) with the roofline's signatures."""

    __slots__ = ("_exponential", "_per_token_s", "_rng", "_setup_s", "_threshold",
                 "profile", "seed", "stalls", "steps")

    def __init__(self, profile: HardwareProfile, seed: int = 0) -> None:
        if profile.service is None:
            raise ValueError(f"profile {profile.name!r} has no [service] table")
        service = profile.service
        self.profile = profile
        self.seed = seed
        self.stalls = 0  # the curve has no stalls; kept for the roofline's interface
        self.steps = 0  # measure_step_s calls so far
        self._rng = np.random.default_rng(seed)
        self._setup_s = service.setup_ms / 1e3
        self._per_token_s = service.per_token_us / 1e6
        self._threshold = service.threshold_tokens
        self._exponential = service.marginal == "exponential"

    def marginal_tokens(self, shape: StepShape) -> int:
        """``max(0, b - b0)``; raises ValueError for an empty or negative shape."""
        if shape.prefill_tokens < 0 or shape.decode_requests < 0:
            raise ValueError(f"negative quantity in step shape {shape}")
        if shape.new_tokens <= 0:
            raise ValueError(f"empty step (no new tokens): {shape}")
        return max(0, shape.new_tokens - self._threshold)

    def breakdown(self, shape: StepShape) -> StepBreakdown:
        """The setup cost as overhead, the marginal cost as the linear (compute) term."""
        marginal_s = self._per_token_s * self.marginal_tokens(shape)
        return StepBreakdown(
            overhead_s=self._setup_s, linear_s=marginal_s, attention_s=0.0,
            linear_compute_s=marginal_s, linear_memory_s=0.0,
            attention_compute_s=0.0, attention_memory_s=0.0,
        )

    def ideal_step_s(self, shape: StepShape) -> float:
        """``S(b)`` in seconds (the mean under the exponential marginal)."""
        return self._setup_s + self._per_token_s * self.marginal_tokens(shape)

    def measure_step_s(self, shape: StepShape) -> float:
        """One step's time in seconds, always > 0 (see the module docstring)."""
        marginal_s = self._per_token_s * self.marginal_tokens(shape)
        if self._exponential:
            marginal_s *= float(self._rng.standard_exponential())
        self.steps += 1
        return self._setup_s + marginal_s

    def __repr__(self) -> str:
        return f"ServiceCurveGpu(profile={self.profile.name!r}, seed={self.seed})"


def make_gpu(profile: HardwareProfile, seed: int = 0) -> RooflineGpu | ServiceCurveGpu:
    """The profile's GPU model: the service curve when it has ``[service]``, else the roofline."""
    if profile.service is not None:
        return ServiceCurveGpu(profile, seed)
    return RooflineGpu(profile, seed)
