"""The start-up calibration's plan and fit (``sglang_ext.policy.startup_calibration``),
without SGLang: the plan fits the pool and the context, spans the step kinds the fit
needs, and the fit recovers a knee model from the steps such a plan produces."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sglang_ext.policy.startup_calibration import (
    CALIBRATION_RID_PREFIX,
    OUTPUT_LENGTHS,
    POOL_SHARE,
    Calibration,
    calibration_plan,
    is_calibration_rid,
)
from sglang_ext.policy.knee_step_model import KneeStepModel
from sglang_ext.policy.step_model import StepModelError
from sglang_ext.policy.step_shape import StepShape

DEVICE = KneeStepModel(0.0025, 1.3e-4, 0.0, 7.7e-8, 4.2e-9, 150.0, 0.0)


@pytest.mark.parametrize("pool, context", [(65_536, 8192), (400_000, 131_072), (6_000, 2048)])
def test_the_plan_fits_the_pool_and_the_context(pool: int, context: int) -> None:
    plan = calibration_plan(pool, context, vocab_size=32_000)
    assert plan and all(is_calibration_rid(r.rid) for r in plan)
    assert len({r.rid for r in plan}) == len(plan)
    assert sum(len(r.input_ids) + r.max_new_tokens for r in plan) <= pool * POOL_SHARE
    assert all(len(r.input_ids) + r.max_new_tokens <= context for r in plan)
    assert all(0 < token < 32_000 for r in plan for token in r.input_ids)
    assert {r.max_new_tokens for r in plan} <= set(OUTPUT_LENGTHS)
    assert len({len(r.input_ids) for r in plan}) >= 3  # several prompt sizes


def test_a_pool_too_small_for_any_request_gives_no_plan() -> None:
    assert calibration_plan(40, 8192, vocab_size=100) == ()


def test_the_plan_is_the_same_on_every_rank() -> None:
    assert calibration_plan(65_536, 8192, 1000) == calibration_plan(65_536, 8192, 1000)


def test_only_its_own_ids_are_calibration_ids() -> None:
    assert is_calibration_rid(f"{CALIBRATION_RID_PREFIX}3")
    assert not is_calibration_rid("client-3") and not is_calibration_rid(3)


def served_steps() -> list[StepShape]:
    """What serving a plan looks like: prefills alone and beside decodes, then decode
    batches shrinking as outputs end."""
    steps = [StepShape(n, n * (n + 1) / 2, 0, 0, 0, 1) for n in (16, 64, 256, 1024, 2048)]
    steps += [StepShape(n, n * (n + 1) / 2, 0, d, d * 300, 1) for n, d in ((256, 8), (1024, 16))]
    for batch in (48, 36, 24, 12):
        steps += [StepShape(0, 0.0, 0, batch, batch * (400 + 10 * k), 0) for k in range(6)]
    return steps


def test_the_fit_recovers_the_device_and_reports_both_errors() -> None:
    rng = np.random.default_rng(0)
    calibration = Calibration({f"{CALIBRATION_RID_PREFIX}0"})
    for shape in served_steps():
        calibration.record(shape, DEVICE.predict_step(shape) * math.exp(0.02 * rng.standard_normal()))
    wrong = KneeStepModel(0.0013, 2.3e-5, 0.0, 4.7e-8, 7.5e-10, 226.8, 0.0)
    fit = calibration.fit("knee", wrong)
    assert fit.steps == len(served_steps())
    assert fit.fitted_error < 0.03 < fit.file_error
    assert fit.model.model.smallest_step_s == pytest.approx(DEVICE.smallest_step_s, rel=0.1)
    assert "fitted the knee step model on this device" in fit.summary()
    assert calibration.finished(f"{CALIBRATION_RID_PREFIX}0")


def test_too_few_steps_cannot_be_fitted() -> None:
    calibration = Calibration(set())
    calibration.record(StepShape(0, 0.0, 0, 4, 400, 0), 0.02)
    with pytest.raises(StepModelError):
        calibration.fit("knee", DEVICE)


def test_a_calibration_is_overdue_after_its_timeout() -> None:
    from sglang_ext.policy.startup_calibration import TIMEOUT_S

    calibration = Calibration({f"{CALIBRATION_RID_PREFIX}0"})
    assert not calibration.overdue(calibration.started_at + TIMEOUT_S / 2)
    assert calibration.overdue(calibration.started_at + TIMEOUT_S + 1)
