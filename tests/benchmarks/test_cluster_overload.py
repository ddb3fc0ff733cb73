"""The overload benchmark's configurations, timeout widening and verdicts, on a short run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.sim import cluster_overload, cluster_sim
from controlplane.retry import DEFAULT_MAX_RETRIES


def test_every_router_runs_over_every_rank_setting_and_pab_in_every_mode() -> None:
    cases = cluster_sim.build_cases(Path("/nonexistent.csv"), 50)
    labels = {c.label for c in cluster_overload.fixed_configurations(cases["bursty"])}
    for give_up, max_defer in cluster_overload.RANK_SETTINGS:
        policy = cluster_overload.fb_policy(max_defer, give_up)
        for router in ("pab_least_loaded", "pab_cache_aware"):
            assert {f"{policy} + {router} (queue)", f"{policy} + {router} (spill)",
                    f"{policy} + {router} (reject, 3 retries)"} <= labels
        assert f"{policy} + cache_aware" in labels
    azure = {c.router for c in cluster_overload.fixed_configurations(cases["azure"])}
    assert "cache_aware" not in azure and "pab_cache_aware" not in azure  # no shared prefixes
    assert cluster_overload.fb_policy(2.0) == cluster_sim.FAIRBATCHING  # the default
    assert cluster_overload.fb_policy(3.0, 0.9) == f"{cluster_sim.FAIRBATCHING}:0.9:max_defer=3"


def test_only_the_daemons_reject_mode_is_resubmitted_as_the_gateway_does() -> None:
    configuration = cluster_overload.Configuration
    assert configuration("fb", "pab_cache_aware", "reject").client_retries == DEFAULT_MAX_RETRIES
    assert configuration("fb", "pab_cache_aware", "spill").client_retries == 0
    assert configuration("fb", "pab_cache_aware", "queue").client_retries == 0
    assert configuration("fb", "request_count", "reject").client_retries == 0  # refuses nothing
    assert configuration("fb", "request_count", "reject").label == "fb + request_count"


def point(policy: str, router: str, rps: float) -> dict:
    return {"policy": policy, "router": router, "effective_rps": rps,
            "by_prompt_bucket": {"<512": rps / 400}, "by_slo_class": {"standard": rps / 400},
            "seeds": {"0": rps - 10, "1": rps + 10}}


def test_a_point_over_seeds_is_their_mean_and_keeps_each_seeds_figure() -> None:
    by_seed = {seed: point(cluster_sim.FAIRBATCHING, "cache_aware", rps) | {
        "attainment": rps / 400, "rejected": 0, "queue_timeout": 0, "spilled": seed}
        for seed, rps in ((0, 200.0), (1, 260.0))}
    mean = cluster_overload.mean_point(by_seed)
    assert mean["effective_rps"] == 230.0 and mean["spilled"] == 0.5
    assert mean["by_slo_class"] == {"standard": 0.575}
    assert mean["seeds"] == {"0": 200.0, "1": 260.0}


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
    assert verdict["ratio_per_seed"] == pytest.approx({"0": 230 / 220, "1": 250 / 240})


@pytest.mark.slow
def test_a_short_run_writes_both_files(tmp_path: Path) -> None:
    rates = tmp_path / "cluster_sim.json"
    rates.write_text(json.dumps({"workloads": {"prefix": {"overload_rates": {"2x": 60.0}}}}))
    code = cluster_overload.main(["--requests", "40", "--workloads", "prefix", "--rates", str(rates),
                                  "--seeds", "0,1", "--only", "cache_aware", "--out", str(tmp_path)])
    assert code == 0
    document = json.loads((tmp_path / "cluster_overload.json").read_text())
    verdict = document["verdicts"]["prefix"]["2x"]
    assert verdict["ours_rps"] > 0 and verdict["baseline_rps"] > 0
    assert set(verdict["ratio_per_seed"]) == {"0", "1"}
    assert all("cache_aware" in label for label in document["results"]["prefix"]["2x"])
    assert "best PAB / best other" in (tmp_path / "cluster_overload.md").read_text()


@pytest.mark.slow
def test_a_rerun_keeps_the_committed_figures_of_what_it_did_not_run(tmp_path: Path) -> None:
    rates = tmp_path / "cluster_sim.json"
    rates.write_text(json.dumps({"workloads": {"prefix": {"overload_rates": {"2x": 60.0}}}}))
    common = ["--requests", "40", "--workloads", "prefix", "--rates", str(rates), "--seeds", "0"]
    full, partial = tmp_path / "full", tmp_path / "partial"
    assert cluster_overload.main([*common, "--only", "cache_aware", "--out", str(full)]) == 0
    assert cluster_overload.main([*common, "--only", "pab_cache_aware", "--keep",
                                  str(full / "cluster_overload.json"), "--out", str(partial)]) == 0
    before = json.loads((full / "cluster_overload.json").read_text())
    after = json.loads((partial / "cluster_overload.json").read_text())
    assert after["results"] == before["results"]  # deterministic: the rerun rows are equal
    kept = after["kept"]["labels"]["prefix"]
    assert kept and all("pab_cache_aware" not in label for label in kept)
    assert "*kept*" in (partial / "cluster_overload.md").read_text()


def test_keeping_a_run_at_other_seeds_or_sizes_is_refused() -> None:
    kept = {"seeds": [0, 1, 2], "requests": 6000, "results": {}}
    with pytest.raises(ValueError, match="seeds"):
        cluster_overload.keep_results({}, kept, [0], 6000)
    with pytest.raises(ValueError, match="requests"):
        cluster_overload.keep_results({}, kept, [0, 1, 2], 40)


def test_a_run_from_another_step_model_keeps_only_what_never_reads_one() -> None:
    sjf = f"{cluster_overload.SJF},timeout=2"
    points = {"sjf": point(sjf, "round_robin", 200.0),
              "fb": point(cluster_sim.FAIRBATCHING, "request_count", 230.0),
              "pab": point(cluster_sim.FAIRBATCHING, "pab_cache_aware", 240.0),
              "sarathi-pab": point("sarathi@1024", "pab_least_loaded", 100.0)}
    kept = {"seeds": [0], "requests": 40, "results": {"w": {"2x": points}}}
    other_start: dict = {}
    assert cluster_overload.keep_results(other_start, kept, [0], 40, "h20.toml") == {"w": ["sjf"]}
    assert list(other_start["w"]["2x"]) == ["sjf"]
    same_start: dict = {}
    labels = cluster_overload.keep_results(same_start, kept | {"step_model": "h20.toml"}, [0], 40,
                                           "h20.toml")
    assert labels == {"w": list(points)}


@pytest.mark.parametrize(("argv", "message"), [
    (["--seeds", "a,b"], "--seeds 'a,b': expected integers"),
    (["--only", "("], "--only '('"),
    (["--workloads", "nope"], "--workloads: expected names"),
    (["--keep", "/nonexistent.json"], "--keep needs --only"),
    (["--only", "pab", "--keep", "/nonexistent.json"], "--keep /nonexistent.json: not a"),
    (["--step-model", "/nonexistent.toml"], "--step-model /nonexistent.toml:"),
])
def test_bad_options_are_refused_before_anything_runs(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cluster_overload.main([*argv, "--no-write"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_rates_from_a_file_that_is_not_a_results_document_are_refused(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SystemExit) as exit_info:
        cluster_overload.main(["--rates", str(bad), "--no-write"])
    assert exit_info.value.code == 2
    assert "not a cluster_sim results JSON" in capsys.readouterr().err
