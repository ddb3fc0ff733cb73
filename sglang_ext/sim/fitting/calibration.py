"""Offline profiling of a simulated GPU: the paper's offline fit of ``a + b*n + c*ctx``,
and the knee model's.

Runs a grid of prefill-only, decode-only and mixed steps through a *separately
seeded* noisy GPU, the profile's (roofline or service curve), and fits the step model
by least squares to the measured times only, as a profiler on real hardware sees them.
The online model starts from this fit.
"""

from __future__ import annotations

import functools

from sglang_ext.policy.step_model import (
    StepCoefficients,
    StepModelFile,
    StepSample,
    fit_least_squares,
    fit_step_model,
)
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.sim.profile import HardwareProfile
from sglang_ext.sim.service_curve import make_gpu

PROFILING_SEED = 0xFB


def profiling_grid() -> list[StepShape]:
    shapes = []
    for chunk in (64, 256, 512, 1024, 2048, 4096, 8192):
        for prefix in (0, 2048, 8192):
            shapes.append(StepShape(chunk, chunk * (prefix + (chunk + 1) / 2), prefix, 0, 0, 1))
    for batch in (1, 8, 32, 64, 128, 256):
        for mean_context in (256, 1024, 4096):
            shapes.append(StepShape(0, 0.0, 0, batch, batch * mean_context, 0))
    for batch in (16, 64):
        for chunk in (256, 1024, 4096):
            shapes.append(
                StepShape(chunk, chunk * (chunk + 1) / 2, 0, batch, batch * 1024, 1)
            )
    return shapes


def profile_steps(
    profile: HardwareProfile, repeats: int = 3, seed: int = PROFILING_SEED
) -> tuple[list[StepShape], list[float]]:
    """The profiling grid's shapes (each ``repeats`` times) and their measured times."""
    gpu = make_gpu(profile, seed)
    shapes = [shape for shape in profiling_grid() for _ in range(repeats)]
    return shapes, [gpu.measure_step_s(shape) for shape in shapes]


def profile_samples(
    profile: HardwareProfile, repeats: int = 3, seed: int = PROFILING_SEED
) -> list[StepSample]:
    shapes, seconds = profile_steps(profile, repeats, seed)
    return [StepSample(shape.new_tokens, shape.prefill_context + shape.decode_context, time)
            for shape, time in zip(shapes, seconds, strict=True)]


@functools.lru_cache(maxsize=16)
def offline_fit(profile: HardwareProfile, seed: int = PROFILING_SEED) -> StepCoefficients:
    return fit_least_squares(profile_samples(profile, seed=seed))


@functools.lru_cache(maxsize=16)
def offline_step_model(
    profile: HardwareProfile, form: str = "knee", seed: int = PROFILING_SEED
) -> StepModelFile:
    """The offline fit of ``form``, with the linear model fitted beside it."""
    shapes, seconds = profile_steps(profile, seed=seed)
    return fit_step_model(form, shapes, seconds)
