"""The simulator's KV outlook for the admission forecast, and what it changes on a rank
whose KV memory, not its compute, is what runs out."""

from __future__ import annotations

import pytest
from sim_helpers import SLO, llama, make_policy, small_kv_profile, synthetic_requests

from sglang_ext.bundled import CONFIGS_DIR
from sglang_ext.policy.admission import AdmissionMode, AdmissionSettings
from sglang_ext.policy.slo import SloCatalog
from sglang_ext.policy.step_model import StepModelFile
from sglang_ext.sim.engine import SimEngine
from sglang_ext.sim.policy_spec import parse_policy
from sglang_ext.sim.profile import bundled_profile_path, load_profile
from sglang_ext.sim.runner import Scenario, build_policy, replay
from sglang_ext.sim.workloads import bundled_sample

NVL = "qwen3-32b-h100nvl"


def _engine(profile, mode: AdmissionMode = AdmissionMode.REJECT) -> SimEngine:
    policy = make_policy("fb-smooth", profile, admission=AdmissionSettings(mode))
    return SimEngine(profile, policy, seed=0)


def test_outlook_follows_the_engines_rule_and_gives_memory_back_when_the_last_token_is_due():
    engine = _engine(llama())
    engine.submit("a", 0.0, 1000, 50, SLO)
    while engine.records["a"].first_token_s is None:
        engine.step()
    engine.submit("b", engine.now, 400, 30, SLO)
    decoding = engine.active_requests[0]
    outlook = engine.kv_outlook()
    # the engine admits a prompt whose prompt and outputs fit beside what the decoding
    # request holds and the share of its remaining outputs SGLang reserves
    remaining = 50 - decoding.next_output_index
    reserve = remaining * engine.new_token_ratio.current
    assert outlook.free_tokens == pytest.approx(engine.kv_capacity - engine.kv_used - reserve)
    # a queued prompt is expected to reserve the median of the arrivals' outputs
    assert outlook.reserves == {} and outlook.new_reserve == 40.0
    # the last token is due 49 TPOTs after the first, but at one token per TPOT (the
    # only class present) it comes no later than that from now
    due = min(decoding.first_token_time + 49 * SLO.tpot_s, engine.now + remaining * SLO.tpot_s)
    assert outlook.release_times == (pytest.approx(due),)
    assert outlook.released_through == (pytest.approx(decoding.context + reserve),)


def _admitted_ttft_misses(profile, share_kv: bool) -> tuple[int, int]:
    engine = _engine(profile)
    if not share_kv:
        engine._share_kv_outlook = lambda: None
    requests = synthetic_requests(400, 24.0, seed=5, prompt=(200, 3000), output=(50, 400))
    for request in requests:
        engine.submit(request.req_id, request.arrival, request.prompt, request.output, SLO)
    engine.run_until_idle(requests[-1].arrival + 300)
    admitted = [r for r in engine.records.values() if not r.rejected]
    misses = sum(1 for r in admitted if r.ttft_s is None or r.ttft_s > SLO.ttft_s)
    return len(admitted), misses


@pytest.mark.slow
def test_on_a_memory_bound_rank_admitted_requests_meet_their_ttft():
    profile = small_kv_profile(40_000)
    admitted, misses = _admitted_ttft_misses(profile, share_kv=True)
    blind_admitted, blind_misses = _admitted_ttft_misses(profile, share_kv=False)
    assert misses < blind_misses
    assert misses / admitted < blind_misses / blind_admitted


def _on_time_on_a_memory_bound_device(kv_aware: bool) -> int:
    """fb-smooth under defer on the simulated Qwen3-32B / H100 NVL (a 16 GB KV pool) with
    its own step-model file, the bundled sample's first 120 s at 5 req/s: requests on
    time; ``kv_aware=False`` withholds the KV outlook from its fallback only (the
    forecast keeps it)."""
    scenario = Scenario(bundled_sample().head(120.0), load_profile(bundled_profile_path(NVL)),
                        SloCatalog.from_toml(CONFIGS_DIR / "slo.toml"),
                        step_model=StepModelFile.load(CONFIGS_DIR / "step_models" / f"{NVL}.toml"))
    policy = build_policy(scenario, parse_policy("fb-smooth+defer"))
    if not kv_aware:
        policy._kv_bound = lambda groups: False
    engine, _ = replay(scenario, policy, 5.0)
    return sum(record.slo_met for record in engine.records.values())


def test_on_a_memory_bound_device_fb_smooth_keeps_its_decodes_running_and_more_on_time():
    """The in-time prompts need more KV than is free: stretching the step for them frees
    none, and the decodes it defers hold their memory for longer (392 on time against
    379 of 456)."""
    assert _on_time_on_a_memory_bound_device(True) > 1.02 * _on_time_on_a_memory_bound_device(False)


def test_under_reject_the_policy_sees_the_outlook_of_every_step():
    engine = _engine(llama(), AdmissionMode.REJECT)
    engine.submit("a", 0.0, 1000, 50, SLO)
    seen = []
    form_batch = engine.policy.form_batch

    def recording(requests, now):
        seen.append(engine.policy.kv_outlook.free_tokens)
        return form_batch(requests, now)

    engine.policy.form_batch = recording
    for _ in range(3):
        expected = engine.kv_outlook().free_tokens
        engine.step()
        assert seen[-1] == expected
    assert len(seen) == 3
