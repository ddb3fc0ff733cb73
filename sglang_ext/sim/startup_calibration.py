"""The simulator's start-up calibration (``--calibrate``): what a FairBatching scheduler
does when it starts with ``calibrate = true`` (``sglang_ext.policy.startup_calibration``).

The plan's synthetic requests are served by the policy itself on the simulated device
before the workload arrives; the file's form is fitted to the steps they took and the
policy adopts the fit as its initial model, as the scheduler does. The workload then runs
on a fresh engine with that policy, so the calibration's requests and time count in no
figure (a server reports ready only after its calibration).
"""

from __future__ import annotations

from sglang_ext.policy.policies import BatchPolicy
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.startup_calibration import (
    TIMEOUT_S,
    Calibration,
    CalibrationFit,
    calibration_plan,
    calibration_slo,
)
from sglang_ext.sim.engine import SimEngine
from sglang_ext.sim.profile import HardwareProfile

#: token ids are not simulated: any vocabulary of two ids gives the plan its lengths
_VOCAB_SIZE = 2


def calibrate_on_device(
    profile: HardwareProfile, policy: BatchPolicy, slo: Slo, seed: int = 0
) -> CalibrationFit | None:
    """Run the plan through ``policy`` on ``profile``'s simulated GPU (its requests with
    :func:`calibration_slo` of the default class's ``slo``) and adopt the fit; None (the
    file's model kept) when the plan is empty or its steps cannot be fitted."""
    engine = SimEngine(profile, policy, seed=seed, record_steps=True)
    plan = calibration_plan(engine.kv_capacity, engine.kv_capacity, _VOCAB_SIZE)
    if not plan:
        return None
    for request in plan:
        engine.submit(request.rid, 0.0, len(request.input_ids), request.max_new_tokens,
                      calibration_slo(slo))
    engine.run_until_idle(TIMEOUT_S)
    calibration = Calibration(set())
    for step in engine.step_log:
        if step.shape is not None:
            calibration.record(step.shape, step.duration_s)
    current = policy.initial_step_model
    try:
        fit = calibration.fit(current.form, current)
    except ValueError:
        return None
    policy.adopt_initial_model(fit.model.model, fit.model.linear)
    return fit
