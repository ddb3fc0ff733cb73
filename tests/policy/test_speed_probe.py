"""The first steps' speed check (``sglang_ext.policy.speed_probe``) in the FairBatching
family: a device several times slower than the step-model file is planned for within a
few steps, a device the file fits and a single stalled step change nothing."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from sglang_ext.policy.knee_step_model import KneeStepModel
from sglang_ext.policy.policies import POLICIES, PolicyContext
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.speed_probe import MIN_SAMPLES, PROBE_STEPS, SpeedProbe
from sglang_ext.policy.step_model import StepCoefficients
from sglang_ext.policy.variants import FairBatchingVariant
from sglang_ext.sim.fitting.predictor_check import synthetic_serving_stream

#: the shipped H100 file's model (Llama 3.1 8B)
FILE = KneeStepModel(0.0013, 2.29e-5, 0.0, 4.7e-8, 7.5e-10, 226.8, 0.0)
#: a dense model filling its card: floor ~20 ms, 130 us per token past ~150 tokens
HEAVY = KneeStepModel(0.0025, 1.3e-4, 0.0, 7.7e-8, 4.2e-9, 150.0, 0.0)
SLO = Slo(ttft_s=2.0, tpot_s=0.05)


def policy(name: str = "fb-smooth") -> FairBatchingVariant:
    return POLICIES.get(name)(PolicyContext(SLO, FILE))


def serve(target, device: KneeStepModel, steps: int, *, noise: float = 0.03,
          stall_first: float = 1.0) -> list[float]:
    """Feeds ``steps`` synthetic steps measured on ``device`` to ``target``'s
    ``observe_step``; returns each step's relative error as the policy predicted it."""
    rng = np.random.default_rng(3)
    errors = []
    for index, shape in enumerate(synthetic_serving_stream(5, steps)):
        measured = device.predict_step(shape) * math.exp(noise * rng.standard_normal())
        if index == 0:
            measured *= stall_first
        predicted = target.step_model.coefficients.predict_step(shape)
        errors.append(abs(measured - predicted) / measured)
        target.observe_step(shape, measured)
    return errors


def test_on_a_device_several_times_slower_the_steps_after_the_first_few_are_planned_near_it():
    probed = policy()
    probed_error = statistics.median(serve(probed, HEAVY, 24)[MIN_SAMPLES:12])
    unprobed = policy()
    unprobed._speed_probe = None
    unprobed_error = statistics.median(serve(unprobed, HEAVY, 24)[MIN_SAMPLES:12])
    assert probed_error < 0.2
    assert unprobed_error > 2 * probed_error
    assert 2.0 < probed.speed_factor < 6.0  # HEAVY's steps run 2-5x the file's here
    assert unprobed.speed_factor == 1.0


def test_the_restarted_learner_keeps_the_log_of_the_errors_the_steps_were_planned_with():
    probed = policy()
    serve(probed, HEAVY, 8)
    log = probed.step_model.error
    assert log.samples == 8
    assert log.mean_abs_relative > 0.2  # the first steps, planned with the file


def test_on_the_device_the_file_fits_nothing_restarts():
    probed = policy()
    learner = probed.step_model
    serve(probed, FILE, PROBE_STEPS + 4)
    assert probed.step_model is learner
    assert probed.speed_factor == 1.0
    assert probed._speed_probe is None  # done after its steps


def test_a_single_stalled_first_step_does_not_rescale():
    probed = policy()
    learner = probed.step_model
    serve(probed, FILE, PROBE_STEPS, stall_first=20.0)
    assert probed.step_model is learner


def test_a_device_faster_than_the_file_is_left_to_the_learner():
    probed = policy()
    learner = probed.step_model
    faster = KneeStepModel(*(w / 4 for w in FILE.weights), FILE.knee_tokens, 0.0)
    serve(probed, faster, PROBE_STEPS)
    assert probed.step_model is learner


def test_the_probe_reports_a_factor_only_when_all_but_one_step_agree():
    shape = next(iter(synthetic_serving_stream(5, 1)))
    truth = FILE.predict_step(shape)
    probe = SpeedProbe(FILE)
    assert probe.observe(shape, 4 * truth) is None  # fewer than MIN_SAMPLES
    assert probe.observe(shape, 4 * truth) is None
    assert probe.observe(shape, 4 * truth) == pytest.approx(4.0)
    assert probe.observe(shape, 5 * truth) is None  # within the band of 4
    assert probe.observe(shape, 4 * truth) is None
    one_off = SpeedProbe(FILE)
    assert [one_off.observe(shape, r * truth) for r in (4, 1)] == [None, None]
    assert one_off.observe(shape, 4 * truth) == pytest.approx(4.0)  # one of three disagrees
    split = SpeedProbe(FILE)
    assert [split.observe(shape, r * truth) for r in (4, 1, 1, 4, 4)] == [None] * 5


def test_a_calibrated_start_probes_against_the_fitted_model():
    probed = policy()
    probed.adopt_initial_model(HEAVY, StepCoefficients(0.02, 1.3e-4, 8e-8))
    learner = probed.step_model
    serve(probed, HEAVY, PROBE_STEPS)
    assert probed.step_model is learner
