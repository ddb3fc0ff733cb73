"""A sweep is deterministic: worker processes change nothing but the wall time."""

from __future__ import annotations

import json

import pytest
from sim_helpers import CATALOG, llama, synthetic_workload

from sglang_ext.sim.runner import Scenario
from sglang_ext.sim.sweep import plan_sweep, run_sweep

RATES = (4.0, 8.0)


def _scenario(seed: int = 0) -> Scenario:
    return Scenario(synthetic_workload(40), llama(), CATALOG, arrivals="poisson", seed=seed,
                    drain_s=60.0)


def _sweep(scenario: Scenario, jobs: int):
    plan = plan_sweep(["fb", "sarathi", "sglang-default"], budgets=(256, 1024))
    ticks, planned = [], []
    document, samples = run_sweep(scenario, plan, RATES, cdf_rate=8.0, jobs=jobs,
                                  progress=ticks.append, planned=planned.append)
    # the static runs and the two explicit budgets, each at every rate
    assert sum(ticks) == sum(planned) == (len(plan.runs) + 2) * len(RATES)
    return document, samples


@pytest.mark.slow
def test_two_workers_give_the_same_results_as_one():
    scenario = _scenario()
    serial, serial_samples = _sweep(scenario, jobs=1)
    parallel, parallel_samples = _sweep(scenario, jobs=2)
    assert json.dumps(serial, sort_keys=True) == json.dumps(parallel, sort_keys=True)
    assert serial_samples == parallel_samples
    assert set(serial["policies"]) == {"fb", "sarathi", "sarathi@256", "sarathi@1024",
                                       "sglang-default"}
    assert set(serial_samples) == set(serial["policies"])  # every label has CDF samples


@pytest.mark.slow
def test_the_seed_is_the_only_source_of_randomness():
    again, _ = _sweep(_scenario(), jobs=1)
    first, _ = _sweep(_scenario(), jobs=1)
    assert json.dumps(first, sort_keys=True) == json.dumps(again, sort_keys=True)
    other, _ = _sweep(_scenario(seed=1), jobs=1)
    assert other["scenario"]["seed"] == 1
    first_loads = first["policies"]["fb"]["loads"]
    other_loads = other["policies"]["fb"]["loads"]
    assert [l["ttft_ms"] for l in first_loads] != [l["ttft_ms"] for l in other_loads]
