"""Offline profiling of a simulated GPU: the paper's offline fit of ``a + b*n + c*ctx``.

Runs a grid of prefill-only, decode-only and mixed steps through a *separately
seeded* noisy GPU (only measured times, as a profiler on real hardware sees) and fits
the linear step model by least squares. The online model starts from this fit.
"""

from __future__ import annotations

import functools

from sglang_ext.policy.step_model import StepCoefficients, StepSample, fit_least_squares
from sglang_ext.sim.gpu import RooflineGpu, StepShape
from sglang_ext.sim.profile import HardwareProfile

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
                StepShape(chunk, chunk * (chunk + 1) / 2, 0, batch, batch * 1024, 1 + batch)
            )
    return shapes


def profile_samples(
    profile: HardwareProfile, repeats: int = 3, seed: int = PROFILING_SEED
) -> list[StepSample]:
    gpu = RooflineGpu(profile, seed)
    samples = []
    for shape in profiling_grid():
        context = shape.prefill_context + shape.decode_context
        for _ in range(repeats):
            samples.append(StepSample(shape.new_tokens, context, gpu.measure_step_s(shape)))
    return samples


@functools.lru_cache(maxsize=16)
def offline_fit(profile: HardwareProfile, seed: int = PROFILING_SEED) -> StepCoefficients:
    return fit_least_squares(profile_samples(profile, seed=seed))
