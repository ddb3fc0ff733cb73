"""The simulator's start-up calibration (``--calibrate``): the scheduler's plan served by the
policy on the simulated device, the fit adopted before the workload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_ext.policy.policies import POLICIES, PolicyContext
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_model import StepModelFile
from sglang_ext.sim.commands import main
from sglang_ext.sim.profile import bundled_profile_path, load_profile
from sglang_ext.sim.startup_calibration import calibrate_on_device

REPO = Path(__file__).resolve().parents[2]
FOREIGN = StepModelFile.load(REPO / "configs" / "step_models" / "llama3.1-8b-h100.toml")
OWN = StepModelFile.load(REPO / "configs" / "step_models" / "qwen3-32b-h100nvl.toml")
SLO = Slo(2.0, 0.05)


def test_calibration_starts_the_policy_from_the_device_not_the_file() -> None:
    profile = load_profile(bundled_profile_path("qwen3-32b-h100nvl"))
    policy = POLICIES.get("fb-steady")(PolicyContext(SLO, FOREIGN.model, initial_linear_model=FOREIGN.linear))
    fit = calibrate_on_device(profile, policy, SLO)
    assert fit is not None and fit.steps >= 20
    assert fit.fitted_error < 0.1 < fit.file_error
    adopted = policy.initial_step_model
    assert adopted is fit.model.model and policy.step_model.coefficients is not FOREIGN.model
    # the device's own file's smallest step, not the H100 file's third of it
    own = OWN.model.smallest_step_s
    assert abs(adopted.smallest_step_s - own) < 0.15 * own
    assert abs(FOREIGN.model.smallest_step_s - own) > 0.5 * own


@pytest.mark.slow
def test_the_cli_flag_calibrates_fairbatching_and_records_it(tmp_path: Path) -> None:
    common = ["run", "--profile", "qwen3-32b-h100nvl", "--head-seconds", "20", "--rate", "3",
              "--step-model", str(REPO / "configs" / "step_models" / "llama3.1-8b-h100.toml"),
              "--policy", "fb-steady+defer", "--policy", "sarathi@256"]
    assert main([*common, "--calibrate", "--out", str(tmp_path / "on")]) == 0
    assert main([*common, "--out", str(tmp_path / "off")]) == 0
    on = json.loads((tmp_path / "on" / "results.json").read_text())
    off = json.loads((tmp_path / "off" / "results.json").read_text())
    assert on["scenario"]["calibrate"] is True and off["scenario"]["calibrate"] is False

    def load(document: dict, name: str) -> dict:
        return document["policies"][name]["loads"][0]

    # the baseline has no step model to fit: the same run either way
    assert load(on, "sarathi@256") == load(off, "sarathi@256")
    # FairBatching starts from the device's fit, so its model is off by less at the start
    assert load(on, "fb-steady+defer")["steps"] > 0
    assert load(on, "fb-steady+defer") != load(off, "fb-steady+defer")
