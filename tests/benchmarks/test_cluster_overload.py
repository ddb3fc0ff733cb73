"""The overload benchmark's configurations, timeout widening and verdicts, on a short run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.sim import cluster_overload, cluster_sim


def test_every_router_runs_over_both_rank_settings_and_pab_in_both_modes() -> None:
    cases = cluster_sim.build_cases(Path("/nonexistent.csv"), 50)
    labels = {c.label for c in cluster_overload.fixed_configurations(cases["bursty"])}
    for max_defer in cluster_overload.MAX_DEFERS:
        policy = cluster_overload.fb_policy(max_defer)
        for router in ("pab_least_loaded", "pab_cache_aware"):
            assert {f"{policy} + {router} (queue)", f"{policy} + {router} (spill)"} <= labels
        assert f"{policy} + cache_aware" in labels
    azure = {c.router for c in cluster_overload.fixed_configurations(cases["azure"])}
    assert "cache_aware" not in azure and "pab_cache_aware" not in azure  # no shared prefixes
    assert cluster_overload.fb_policy(2.0) == cluster_sim.FAIRBATCHING  # the default


def point(policy: str, router: str, rps: float) -> dict:
    return {"policy": policy, "router": router, "effective_rps": rps,
            "by_prompt_bucket": {"<512": rps / 400}, "by_slo_class": {"standard": rps / 400}}


def test_the_best_sjf_timeout_prefers_the_shorter_on_a_tie() -> None:
    sjf = cluster_overload.SJF
    points = {"a": point(f"{sjf},timeout=1", "round_robin", 200.0),
              "b": point(f"{sjf},timeout=2", "cache_aware", 210.0),
              "c": point(f"{sjf},timeout=3", "round_robin", 210.0),
              "d": point(cluster_sim.FAIRBATCHING, "cache_aware", 250.0)}
    assert cluster_overload.best_sjf_timeout(points) == (2.0, [1.0, 2.0, 3.0])


def test_the_verdict_divides_the_best_pab_by_the_best_of_the_rest() -> None:
    results = {"w": {"2x": {
        "ours": point(cluster_sim.FAIRBATCHING, "pab_cache_aware", 240.0),
        "ours-queue": point(cluster_sim.FAIRBATCHING, "pab_least_loaded", 120.0),
        "theirs": point(f"{cluster_overload.SJF},timeout=2", "round_robin", 200.0),
        "load": point(cluster_sim.FAIRBATCHING, "request_count", 230.0),
    }}}
    verdict = cluster_overload.verdicts(results)["w"]["2x"]
    assert (verdict["ours"], verdict["baseline"]) == ("ours", "load")
    assert verdict["ratio"] == pytest.approx(240 / 230)


@pytest.mark.slow
def test_a_short_run_writes_both_files(tmp_path: Path) -> None:
    rates = tmp_path / "cluster_sim.json"
    rates.write_text(json.dumps({"workloads": {"azure": {"overload_rates": {"2x": 60.0}}}}))
    code = cluster_overload.main(["--requests", "40", "--workloads", "azure", "--rates", str(rates),
                                  "--out", str(tmp_path)])
    assert code == 0
    document = json.loads((tmp_path / "cluster_overload.json").read_text())
    verdict = document["verdicts"]["azure"]["2x"]
    assert verdict["ours_rps"] > 0 and verdict["baseline_rps"] > 0
    assert "best PAB / best other" in (tmp_path / "cluster_overload.md").read_text()


def test_rates_from_a_file_that_is_not_a_results_document_are_refused(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SystemExit) as exit_info:
        cluster_overload.main(["--rates", str(bad), "--no-write"])
    assert exit_info.value.code == 2
    assert "not a cluster_sim results JSON" in capsys.readouterr().err
