"""The cluster benchmark's workloads and verdicts (the runs themselves: ``--quick``)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.sim import cluster_sim


def test_the_workloads_share_prefixes_where_they_say() -> None:
    cases = cluster_sim.build_cases(Path("/nonexistent.csv"), 300)  # the bundled sample
    assert cases["azure"].prefixes is None
    prefix, bursty = cases["prefix"], cases["bursty"]
    assert len(prefix.prefixes) == len(prefix.scenario.workload.requests) == 300
    assert {p.tokens for p in prefix.prefixes} == {4096}
    assert len({p.group for p in prefix.prefixes}) > 100
    assert bursty.scenario.arrivals == "gamma:4"
    assert {r.slo_class for r in bursty.scenario.workload.requests} == {
        "interactive", "standard", "relaxed"}
    azure = cases["azure"].scenario.workload.requests
    assert all(b.prompt_tokens == a.prompt_tokens + cluster_sim.BURSTY_PREFIX_TOKENS
               for a, b in zip(azure, bursty.scenario.workload.requests, strict=True))


def entry(policy: str, router: str, overall: float, bucket: float, klass: float) -> dict:
    capacity = {m: {"capacity": c} for m, c in (
        ("overall", overall), ("worst_prompt_bucket", bucket), ("worst_slo_class", klass))}
    return {"policy": policy, "router": router, "capacity": {"0.9": capacity}, "loads": []}


def test_verdicts_compare_the_best_of_each_side_per_measure() -> None:
    configurations = {
        "a": entry(cluster_sim.FAIRBATCHING, "pab_cache_aware", 120, 90, 100),
        "b": entry(cluster_sim.FAIRBATCHING, "request_count", 110, 95, 100),
        "c": entry("sarathi@1024", "cache_aware", 100, 80, 100),
    }
    verdict = cluster_sim.verdicts({"w": {"configurations": configurations}})["w"]
    paper = verdict["pab-aware FairBatching / best baseline"]
    assert paper["overall"]["ours_capacity"] == 120
    assert paper["overall"]["baseline_capacity"] == 100
    increment = verdict["pab routers / load routers, FairBatching ranks"]
    assert increment["worst_prompt_bucket"]["baseline"] == f"{cluster_sim.FAIRBATCHING} + request_count"
    assert verdict["pab_cache_aware / cache_aware"]["overall"]["baseline_capacity"] == 100
