"""The simulator's models of SGLang's own waiting orders (``sglang_ext.sim.competitors
.sglang_orders``) against the real scheduler: the same requests, arriving at the same
steps, start their prefills in the same order under stock SGLang's ``--schedule-policy``
(mixed chunk, 256-token chunks, radix cache on) and under the simulator's policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.server.scheduler_harness import run_scenario

pytest.importorskip("sglang")

pytestmark = pytest.mark.sglang

#: a long prompt being chunked, then prompts of several lengths arriving behind it, and
#: later ones that must wait their turn by response ratio (aging), not by length alone
REQUESTS = [
    {"rid": "long", "prompt_tokens": 1200, "max_new_tokens": 4, "at_step": 0},
    {"rid": "a", "prompt_tokens": 900, "max_new_tokens": 4, "at_step": 1},
    {"rid": "b", "prompt_tokens": 150, "max_new_tokens": 4, "at_step": 1},
    {"rid": "c", "prompt_tokens": 500, "max_new_tokens": 4, "at_step": 1},
    {"rid": "d", "prompt_tokens": 60, "max_new_tokens": 4, "at_step": 6},
    {"rid": "e", "prompt_tokens": 300, "max_new_tokens": 4, "at_step": 7},
    {"rid": "f", "prompt_tokens": 700, "max_new_tokens": 4, "at_step": 7},
]
CHUNK = 256


def first_prefill_order(steps: list[dict]) -> list[str]:
    order: list[str] = []
    for step in steps:
        for rid in step.get("prefills", {}):
            if rid not in order:
                order.append(rid)
    return order


def simulated_order(policy_name: str) -> list[str]:
    from sglang_ext.policy.slo import Slo, SloCatalog
    from sglang_ext.sim.engine import SimEngine
    from sglang_ext.sim.profile import bundled_profile_path, load_profile
    from sglang_ext.sim.runner import PolicySpec, Scenario, build_policy
    from sglang_ext.sim.workloads import bundled_sample

    profile = load_profile(bundled_profile_path("llama3.1-8b-h100"))
    catalog = SloCatalog("standard", {"standard": Slo(2.0, 0.05)})
    policy = build_policy(Scenario(bundled_sample(), profile, catalog),
                          PolicySpec(policy_name, token_budget=CHUNK))
    engine = SimEngine(profile, policy)
    order: list[str] = []
    decide = policy.form_batch

    def recording(requests, now):  # the chunks in the order the policy packed them
        decision = decide(requests, now)
        order.extend(rid for rid, _ in decision.prefill_chunks if rid not in order)
        return decision

    policy.form_batch = recording
    pending = sorted(REQUESTS, key=lambda r: r["at_step"])
    for step in range(200):
        while pending and pending[0]["at_step"] <= step:
            spec = pending.pop(0)
            engine.submit(spec["rid"], engine.now, spec["prompt_tokens"], spec["max_new_tokens"],
                          catalog.default, "standard")
        engine.step()
        if not pending and not engine.has_work:
            break
    return order


@pytest.mark.parametrize("sglang_policy, simulated", [("hrrn", "sarathi-hrrn"),
                                                      ("shortest-prefill-first", "sarathi-spf")])
def test_the_simulated_order_starts_prefills_as_sglang_does(tmp_path: Path, sglang_policy: str,
                                                            simulated: str) -> None:
    scenario = {"requests": REQUESTS, "overlap": False, "timeout_s": 150,
                "enable_mixed_chunk": True, "chunked_prefill_size": CHUNK,
                "schedule_policy": sglang_policy}
    real = first_prefill_order(run_scenario(scenario, tmp_path, sglang_policy, timeout_s=300)["steps"])
    assert sorted(real) == sorted(r["rid"] for r in REQUESTS)
    assert simulated_order(simulated) == real
