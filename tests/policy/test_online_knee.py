"""The online knee learner (``sglang_ext.policy.online_knee``) and the per-kind error log
(``sglang_ext.policy.step_error``), on synthetic devices whose truth is a knee model:
started from another device's file, the learner must find the device's knee and predict
within a few percent of what the device measures."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from sglang_ext.policy.knee_step_model import KneeStepModel
from sglang_ext.policy.online_knee import OnlineKneeModel
from sglang_ext.policy.step_error import StepErrorLog, step_kind
from sglang_ext.policy.step_model import OnlineStepModel, StepCoefficients, online_step_model
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.sim.fitting.predictor_check import synthetic_serving_stream

#: a fast device: floor ~6.5 ms up to 227 tokens, 23 us per token past it
FAST = KneeStepModel(0.0013, 2.29e-5, 0.0, 4.7e-8, 7.5e-10, 226.8, 0.0)
#: a slow, compute-poor device: floor ~9.9 ms up to 32 tokens, 267 us per token past it
SLOW = KneeStepModel(0.0016, 2.67e-4, 0.0, 5.0e-8, 7.2e-9, 31.5, 0.0)
#: a dense model filling its card: floor ~20 ms up to ~150 tokens, 130 us per token past it
HEAVY = KneeStepModel(0.0025, 1.3e-4, 0.0, 7.7e-8, 4.2e-9, 150.0, 0.0)


def tail_median_error(model, device: KneeStepModel, seed: int = 1, steps: int = 600,
                      after: int = 200, noise: float = 0.03) -> float:
    rng = np.random.default_rng(seed)
    errors = []
    for shape in synthetic_serving_stream(seed, steps):
        measured = device.predict_step(shape) * math.exp(noise * rng.standard_normal())
        errors.append(abs(model.observe(shape, measured)))
    return statistics.median(errors[after:])


@pytest.mark.parametrize("start, device", [(FAST, SLOW), (SLOW, FAST), (FAST, HEAVY), (SLOW, HEAVY)])
def test_from_another_devices_file_it_predicts_within_five_percent_after_200_steps(start, device):
    assert tail_median_error(OnlineKneeModel(start), device) < 0.05


def test_it_finds_the_devices_knee() -> None:
    model = OnlineKneeModel(FAST)
    tail_median_error(model, HEAVY)
    assert 100 <= model.knee_tokens <= 230  # the grid's neighbours of 150
    floor = model.coefficients.smallest_step_s
    assert floor == pytest.approx(HEAVY.smallest_step_s, rel=0.1)


def test_with_the_knee_frozen_a_mismatched_file_stays_far_off() -> None:
    """What the learner fixes: the frozen knee's model cannot fit the slow device."""
    frozen = tail_median_error(OnlineStepModel(FAST), SLOW)
    learned = tail_median_error(OnlineKneeModel(FAST), SLOW)
    assert frozen > 2 * learned


def test_on_its_own_device_it_keeps_the_files_knee_and_accuracy() -> None:
    model = OnlineKneeModel(HEAVY)
    assert tail_median_error(model, HEAVY) < 0.035
    assert model.knee_tokens == pytest.approx(HEAVY.knee_tokens)


def test_before_any_step_it_is_the_file() -> None:
    model = OnlineKneeModel(HEAVY)
    assert model.coefficients == HEAVY and model.knee_tokens == HEAVY.knee_tokens
    assert model.error.samples == 0


def test_online_step_model_picks_the_learner_by_form() -> None:
    assert isinstance(online_step_model(FAST), OnlineKneeModel)
    assert isinstance(online_step_model(FAST, learn_knee=False), OnlineStepModel)
    assert isinstance(online_step_model(StepCoefficients(0.005, 2e-5, 4e-8)), OnlineStepModel)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_a_bad_measurement_is_refused(bad: float) -> None:
    model = OnlineKneeModel(FAST)
    with pytest.raises(ValueError, match="measured step time"):
        model.observe(StepShape(0, 0.0, 0, 4, 4000, 0), bad)
    assert model.error.samples == 0


def test_a_linear_model_follows_a_device_several_times_slower() -> None:
    """The rescaling both learners share: without it the anchor, counted in the file's
    units, holds a weight that must grow five-fold to a fraction of the move."""
    start, device = StepCoefficients(0.005, 2e-5, 4e-8), StepCoefficients(0.025, 1e-4, 2e-7)
    model = OnlineStepModel(start)
    rng = np.random.default_rng(3)
    errors = []
    for shape in synthetic_serving_stream(2, 600):
        measured = device.predict_step(shape) * math.exp(0.03 * rng.standard_normal())
        errors.append(abs(model.observe(shape, measured)))
    assert statistics.median(errors[200:]) < 0.05


# --------------------------------------------------------------------------- the error log


@pytest.mark.parametrize("shape, kind", [
    (StepShape(0, 0.0, 0, 32, 32_000, 0), "decode"),
    (StepShape(512, 131_328.0, 0, 0, 0, 1), "prefill"),
    (StepShape(512, 131_328.0, 0, 8, 8000, 1), "prefill"),  # 98% prompt tokens
    (StepShape(64, 2080.0, 0, 32, 32_000, 1), "mixed"),
])
def test_step_kinds(shape: StepShape, kind: str) -> None:
    assert step_kind(shape) == kind


def test_the_log_keeps_a_median_per_kind() -> None:
    log = StepErrorLog(window=8)
    decode, prefill = StepShape(0, 0.0, 0, 4, 400, 0), StepShape(100, 5050.0, 0, 0, 0, 1)
    for predicted in (0.9, 1.1, 1.0):
        log.record(decode, predicted, 1.0)
    log.record(prefill, 0.5, 1.0)
    summary = log.summary()
    assert summary.samples == 4
    assert summary.kind_median("decode") == pytest.approx(0.1)
    assert summary.kind_median("prefill") == pytest.approx(0.5)
    assert summary.kind_median("mixed") is None
    assert {kind: seen for kind, seen, _ in summary.by_kind} == {"decode": 3, "prefill": 1}


def learned_trajectory(steps: int = 400) -> tuple[list[dict], np.ndarray, np.ndarray]:
    model = OnlineKneeModel(KneeStepModel(0.0013, 2.29e-5, 1e-9, 4.7e-8, 7.5e-10, 226.8, 16.0))
    rng = np.random.default_rng(3)
    fields = []
    for step, shape in enumerate(synthetic_serving_stream(4, steps)):
        if step % 3 == 0:  # few decodes: below every saturation on the grid
            shape = StepShape.from_requests([(1, 900)] * (1 + step % 7) + [(1 + step % 300, 40)])
        model.observe(shape, SLOW.predict_step(shape) * math.exp(0.05 * rng.standard_normal()))
        fields.append(model.coefficients.fields())
    return fields, model._gram.copy(), model._moment.copy()


@pytest.mark.usefixtures("compiled_path")
def test_the_compiled_learner_learns_what_numpy_learns_bit_for_bit(monkeypatch) -> None:
    from sglang_ext.policy import compiled

    fields, gram, moment = learned_trajectory()
    monkeypatch.setattr(compiled, "knee_update", None)
    monkeypatch.setattr(compiled, "knee_system", None)
    reference_fields, reference_gram, reference_moment = learned_trajectory()
    assert fields == reference_fields
    assert gram.tobytes() == reference_gram.tobytes()
    assert moment.tobytes() == reference_moment.tobytes()


@pytest.mark.usefixtures("compiled_path")
def test_the_compiled_learner_refuses_arrays_of_another_shape() -> None:
    from sglang_ext.policy import compiled

    model = OnlineKneeModel(FAST)
    features = FAST.features(StepShape.from_requests([(1, 900)]))
    with pytest.raises(TypeError, match="gram"):
        compiled.knee_update(features, 1.0, 1, 900, 0.01, 0.995, model._knees, model._saturations,
                             model._scale, model._gram[:, :4, :4].copy(), model._moment)
    with pytest.raises(TypeError, match="knee_system takes 7 arguments"):
        compiled.knee_system(0, 2.0)
    with pytest.raises(IndexError, match="candidate"):
        compiled.knee_system(len(model._knees), 2.0, model._gram, model._moment, model._prior,
                             *model._system)
