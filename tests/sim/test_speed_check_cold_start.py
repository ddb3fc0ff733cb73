"""A cold start on a device several times slower than the step-model file: the simulated
Qwen3-32B / H100 NVL from the H100 (Llama 3.1 8B) file, with a burst at once. The policy's
speed check (``sglang_ext.policy.speed_probe``) plans at the device's speed after its
first steps; without it the learner needs a few dozen."""

from __future__ import annotations

from pathlib import Path

from sglang_ext.policy.policies import POLICIES, PolicyContext
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_model import StepModelFile
from sglang_ext.policy.variants import FairBatchingVariant
from sglang_ext.sim.engine import SimEngine
from sglang_ext.sim.profile import bundled_profile_path, load_profile
from sglang_ext.sim.workloads import bundled_sample

REPO = Path(__file__).resolve().parents[2]
FOREIGN = StepModelFile.load(REPO / "configs" / "step_models" / "llama3.1-8b-h100.toml")
SLO = Slo(2.0, 0.05)
FIRST_STEPS = 20


def cold_start(probe: bool) -> tuple[int, SimEngine]:
    """Steps among the first that overran their budget by half, and the engine, after a
    burst of the bundled sample's first 40 requests at t = 0."""
    profile = load_profile(bundled_profile_path("qwen3-32b-h100nvl"))
    policy: FairBatchingVariant = POLICIES.get("fb-smooth")(
        PolicyContext(SLO, FOREIGN.model, initial_linear_model=FOREIGN.linear))
    if not probe:
        policy._speed_probe = None
    engine = SimEngine(profile, policy, seed=0, record_steps=True)
    for index, request in enumerate(bundled_sample().requests[:40]):
        engine.submit(index, 0.0, request.prompt_tokens, min(request.output_tokens, 64), SLO)
    while len(engine.step_log) < FIRST_STEPS:
        engine.step()
    overran = sum(step.duration_s > 1.5 * step.predicted_s for step in engine.step_log[:FIRST_STEPS])
    return overran, engine


def test_after_its_first_steps_the_policy_plans_at_the_devices_speed():
    probed, engine = cold_start(probe=True)
    unprobed, _ = cold_start(probe=False)
    assert engine.policy.speed_factor > 2.0
    assert probed <= 4  # the three steps the check needs, and one to spare
    assert unprobed >= 2 * probed + 4
