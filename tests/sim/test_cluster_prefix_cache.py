"""The cluster simulator with shared prefixes: each rank's prefix cache and the prompts the
balancers see."""

from __future__ import annotations

import pytest
from sim_helpers import CATALOG, llama

from sglang_ext.sim.cluster import ClusterConfig, ClusterConfigError, ClusterSimulation
from sglang_ext.sim.prefix_cache import UNIT_TOKENS, RankPrefixCache, SharedPrefix, prompt_units
from sglang_ext.sim.runner import Scenario, parse_policy
from sglang_ext.sim.workloads import TraceRequest, Workload


def test_prompt_units_share_the_prefix_and_nothing_else() -> None:
    a = prompt_units(0, 4096 + 100, SharedPrefix(3, 4096))
    b = prompt_units(1, 4096 + 100, SharedPrefix(3, 4096))
    c = prompt_units(2, 4096 + 100, SharedPrefix(4, 4096))
    assert len(a) == (4096 + 100) // UNIT_TOKENS
    assert a[:256] == b[:256] and a[256:] != b[256:]
    assert not set(a) & set(c)
    assert not set(prompt_units(5, 500, None)) & set(prompt_units(6, 500, None))


def test_the_rank_cache_serves_prefixes_and_yields_to_running_requests() -> None:
    cache = RankPrefixCache(max_tokens=10_000)
    units = prompt_units(0, 4196, SharedPrefix(0, 4096))
    assert cache.cached_tokens(units, 4196, 10_000) == 0
    cache.insert(units, 10_000)
    other = prompt_units(1, 4196, SharedPrefix(0, 4096))
    assert cache.cached_tokens(other, 4196, 10_000) == 4096
    assert cache.cached_tokens(units, 4196, 10_000) == 4192  # whole units only
    whole = prompt_units(2, 4112, SharedPrefix(0, 4112))
    cache.insert(whole, 10_000)
    assert cache.cached_tokens(whole, 4112, 10_000) == 4111  # never the whole prompt
    assert cache.cached_tokens(other, 4196, 2048) == 2048  # shrunk to the free KV
    assert cache.held_tokens == 2048


def prefix_workload(count: int, groups: int, gap_s: float = 0.05) -> tuple[Workload, list]:
    requests = tuple(TraceRequest(i * gap_s, 4096 + 64, 16) for i in range(count))
    return Workload(requests, "prefixes"), [SharedPrefix(i % groups, 4096) for i in range(count)]


def run(balancer: str, count: int = 120, groups: int = 5, **config) -> ClusterSimulation:
    workload, prefixes = prefix_workload(count, groups)
    scenario = Scenario(workload=workload, profile=llama(), catalog=CATALOG)
    simulation = ClusterSimulation(scenario, parse_policy("sarathi@1024"),
                                   ClusterConfig(4, balancer, **config), prefixes)
    simulation.run(workload.mean_rate)
    return simulation


@pytest.mark.parametrize("balancer", ["cache_aware", "pab_cache_aware", "round_robin"])
def test_every_request_is_served_with_its_whole_prompt_on_record(balancer: str) -> None:
    simulation = run(balancer)
    records = simulation.records
    assert sorted(records) == list(range(120))
    assert all(r.prompt_tokens == 4096 + 64 and r.finished for r in records.values())
    assert simulation.counters["prompt_tokens_dispatched"] == 120 * (4096 + 64)


@pytest.mark.slow
def test_affinity_prefills_each_prefix_about_once_where_round_robin_prefills_it_per_rank() -> None:
    affine = run("cache_aware").counters
    spread = run("round_robin").counters
    assert affine["prompt_tokens_cached"] >= (120 - 5 * 2) * 4096
    assert spread["prompt_tokens_cached"] <= (120 - 20) * 4096
    assert affine["prompt_tokens_cached"] > spread["prompt_tokens_cached"]


@pytest.mark.slow
def test_a_small_rank_cache_evicts_and_misses() -> None:
    roomy = run("round_robin").counters["prompt_tokens_cached"]
    tight = run("round_robin", rank_cache_tokens=4096).counters["prompt_tokens_cached"]
    assert tight < roomy


def test_without_prefixes_nothing_is_cached_or_passed() -> None:
    workload, _ = prefix_workload(20, 2)
    scenario = Scenario(workload=workload, profile=llama(), catalog=CATALOG)
    simulation = ClusterSimulation(scenario, parse_policy("sarathi@1024"),
                                   ClusterConfig(2, "cache_aware"))
    simulation.run(workload.mean_rate)
    assert simulation.counters["prompt_tokens_cached"] == 0
    assert all(rank.cache is None for rank in simulation.ranks)


def test_prefixes_must_match_the_workload() -> None:
    workload, prefixes = prefix_workload(10, 2)
    scenario = Scenario(workload=workload, profile=llama(), catalog=CATALOG)
    with pytest.raises(ClusterConfigError, match="9 prefixes for 10 requests"):
        ClusterSimulation(scenario, parse_policy("sarathi@1024"), ClusterConfig(2, "round_robin"),
                          prefixes[:9])
