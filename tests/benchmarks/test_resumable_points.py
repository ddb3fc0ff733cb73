"""The resumable-points machinery of the real-server benchmarks (:mod:`benchmarks.support.points`,
:mod:`benchmarks.server.stock_vs_fairbatching`): saving and resuming points, picking the best stock-mixed chunk,
mean and spread over seeds, the replay targets' verdicts and the rendered table -- all from
synthetic points, no server."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import benchmarks.server.stock_vs_fairbatching as bs
import benchmarks.support.points as bp

PLAN = bs.Plan(random_rates=(10.0, 16.0), replay_rates=(2.0, 4.0), random_seconds=60.0,
               replay_seconds=60.0, configs=bs.CONFIGS, workloads=bs.WORKLOADS, seeds=(0, 1, 2),
               quiet_wait_s=0.0)
CONFIG = {c.name: c for c in bs.CONFIGS}


def _pcts(p50: float, p99: float) -> dict:
    return {"p50": p50, "p90": (p50 + p99) / 2, "p99": p99, "mean": p50}


def replay_result(rate: float, attainment: float, max_tpot_p99: float = 40.0,
                  max_tbt_p50: float = 40.0) -> dict:
    per_class = {name: {"attainment": attainment, "ttft_ms": _pcts(80, 300)} for name in bs.REPLAY_CLASSES}
    return {
        "rate": rate, "requests": 120, "attainment": attainment, "effective_rps": rate * attainment,
        "envelope_attainment": 1.0, "ttft_attainment": 1.0, "tpot_attainment": attainment,
        "rejected": 0, "aborted": 0, "unfinished": 0, "output_tokens_per_s": 350.0,
        "ttft_ms": _pcts(60, 250), "tpot_ms": _pcts(15, max_tpot_p99), "mean_tpot_ms": _pcts(14, 20),
        "max_tbt_ms": _pcts(max_tbt_p50, 2 * max_tbt_p50), "per_class": per_class,
    }


def random_result(goodput: float, attainment: float = 1.0, tpot_p99: float = 25.0) -> dict:
    result = {key: None for key in bs.RANDOM_KEYS}
    result.update(completed=600, request_goodput=goodput, slo_attainment=attainment,
                  slo_attainment_by_metric={"ttft": 1.0, "tpot": attainment},
                  median_ttft_ms=80.0, p99_ttft_ms=270.0, median_tpot_ms=18.0, p99_tpot_ms=tpot_p99,
                  request_throughput=goodput, output_throughput=870.0)
    return result


def point(config: str, workload: str, rate: float, seed: int, result: dict | None = None,
          plan: bs.Plan = PLAN, **extra) -> dict:
    p = {"config": config, "workload": workload, "rate": rate, "seed": seed,
         "params": bs.run_params(plan, workload), "launch_args": list(CONFIG[config].args),
         "command": f"python -m tool --seed {seed}", "exit_code": 0, "wall_s": 80.0,
         "machine_during_run": {"cpu": {"cpu0": {"busy_pct": 50.0}, "cpu1": {"busy_pct": 40.0}},
                                "foreign_sglang_servers": []},
         "server": {"name": config, "description": f"{config} server", "launch": f"launch {config}",
                    "env": {"FAIRBATCHING_EMULATED_GPU": bs.PROFILE}, "start_s": 30.0,
                    "server_info": {"chunked_prefill_size": 512, "enable_mixed_chunk": True,
                                    "disable_overlap_schedule": False, "version": "0.5.23"}},
         "commit": "abc1234", "dirty": False, "date_utc": f"2026-11-25 10:00:0{seed}",
         "argv": ["--resume"], "raw_dir": "out/bench_sglang/x",
         "machine": {"cpu_model": "Test CPU", "logical_cpus": 2, "python": "CPython 3.11",
                     "platform": "Linux"}}
    if result is not None:
        p["result"] = result
    p.update(extra)
    return p


# ------------------------------------------------------------------ the points file
def test_append_load_and_move_aside(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "points.jsonl"
    assert bp.load_points(path) == []
    assert bp.move_aside(path) is None
    bp.append_point(path, {"config": "a", "rate": 1.0})
    bp.append_point(path, {"config": "b", "rate": 2.0, "error": "boom"})
    assert bp.load_points(path) == [{"config": "a", "rate": 1.0}, {"config": "b", "rate": 2.0, "error": "boom"}]
    moved = bp.move_aside(path)
    assert moved is not None and moved.name.startswith("points-") and moved.suffix == ".jsonl"
    assert not path.exists() and len(bp.load_points(moved)) == 2
    path.write_text('{"config": "a"}\n{not json\n')
    with pytest.raises(ValueError, match="points.jsonl:2"):
        bp.load_points(path)


def test_done_keys_skip_errors_and_compare_dicts_canonically() -> None:
    fields = ("config", "rate", "params")
    points = [{"config": "a", "rate": 1.0, "params": {"x": 1, "y": 2}},
              {"config": "b", "rate": 1.0, "params": {"x": 1}, "error": "exit code 1"}]
    done = bp.done_keys(points, fields)
    assert bp.point_key({"config": "a", "rate": 1.0, "params": {"y": 2, "x": 1}}, fields) in done
    assert bp.point_key({"config": "b", "rate": 1.0, "params": {"x": 1}}, fields) not in done
    # bench_sglang_admission's key: plain values, as its run loop compares them
    assert bp.done_keys([{"config": "m", "rate": 10.0, "seed": 0}], ("config", "rate", "seed")) == {("m", 10.0, 0)}


def test_latest_by_key_prefers_the_last_good_point() -> None:
    fields = ("config",)
    good, failed, later = {"config": "a", "v": 1}, {"config": "a", "error": "x"}, {"config": "a", "v": 2}
    assert bp.latest_by_key([good, failed], fields) == [good]
    assert bp.latest_by_key([failed, good, later], fields) == [later]
    assert bp.latest_by_key([failed], fields) == [failed]


def test_spread_skips_missing_values() -> None:
    assert bp.spread([1.0, None, 3.0, math.nan, 2]) == {"mean": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert bp.spread([None, math.nan]) is None
    assert bp.spread([]) is None


# ------------------------------------------------------------------ resume and selection
def test_todo_skips_saved_points_and_reruns_errors() -> None:
    fb = CONFIG["fairbatching"]
    saved = [point("fairbatching", "replay", 2.0, 0, replay_result(2.0, 1.0)),
             point("fairbatching", "replay", 2.0, 1, error="exit code 1"),
             point("fairbatching", "random", 10.0, 0, random_result(9.0))]
    plan = bs.Plan((10.0,), (2.0,), 60.0, 60.0, (fb,), bs.WORKLOADS, (0, 1), 0.0)
    todo = bs.todo_points(plan, fb, bp.done_keys(saved, bs.POINT_KEY))
    # seeds outermost; the failed seed-1 replay point runs again
    assert todo == [("random", 10.0, 1), ("replay", 2.0, 1)]
    # other run-defining parameters (seconds per run): nothing is reused
    short = bs.Plan((10.0,), (2.0,), 60.0, 20.0, (fb,), bs.WORKLOADS, (0, 1), 0.0)
    assert bs.todo_points(short, fb, bp.done_keys(saved, bs.POINT_KEY)) == [
        ("replay", 2.0, 0), ("random", 10.0, 1), ("replay", 2.0, 1)]
    # another configuration's points do not count
    mixed = CONFIG["stock-mixed-512"]
    assert len(bs.todo_points(plan, mixed, bp.done_keys(saved, bs.POINT_KEY))) == 4


def test_parse_seeds_and_random_seed_mapping() -> None:
    assert bs.parse_seeds("3") == (0, 1, 2)
    assert bs.parse_seeds("0,4") == (0, 4)
    assert bs.parse_seeds("4,") == (4,)
    for bad in ("0", "x", "-1,2"):
        with pytest.raises(Exception):
            bs.parse_seeds(bad)
    # seed 0 keeps the earlier one-seed runs' seeds (rate index + 1 at the default rates)
    assert [bs.random_seed(0, r) for r in bs.DEFAULT_RANDOM_RATES] == [1, 2, 3]
    assert bs.random_seed(2, 16.0) == 200_002
    assert bs.random_seed(1, 12.5) == 112_500
    # the dataset does not depend on which rates a part of the run selected
    assert bs.random_dataset_size(10.0, 60.0) == bs.random_dataset_size(22.0, 60.0) == 22 * 60 + 50


def test_select_points_shows_the_latest_parameters_only() -> None:
    short = bs.Plan((10.0,), (2.0,), 20.0, 20.0, bs.CONFIGS, bs.WORKLOADS, (0,), 0.0)
    old = point("stock", "replay", 2.0, 0, replay_result(2.0, 0.5), plan=short)
    failed = point("stock", "replay", 2.0, 0, error="exit code 1")
    good = point("stock", "replay", 2.0, 0, replay_result(2.0, 0.9))
    other = point("stock", "random", 10.0, 0, random_result(9.0), plan=short)
    shown, ignored = bs.select_points([old, failed, good, other])
    assert shown == [good, other]  # random's last parameters are the short ones: shown
    assert ignored == [old, failed]


# ------------------------------------------------------------------ aggregation
def _grid() -> list[dict]:
    """Replay at 2 and 4 req/s, three seeds: stock-mixed-512 best at 2, 1024 at 4; a tie at 2
    between 256 and 512 on attainment, broken by max-TPOT p99."""
    att = {  # (config, rate) -> attainment per seed
        ("stock", 2.0): (0.90, 0.92, 0.94), ("stock", 4.0): (0.70, 0.72, 0.74),
        ("stock-mixed-256", 2.0): (1.0, 1.0, 1.0), ("stock-mixed-256", 4.0): (0.95, 0.96, 0.97),
        ("stock-mixed-512", 2.0): (1.0, 1.0, 1.0), ("stock-mixed-512", 4.0): (0.97, 0.98, 0.99),
        ("stock-mixed-1024", 2.0): (0.98, 0.99, 1.0), ("stock-mixed-1024", 4.0): (0.99, 1.0, 1.0),
        ("fairbatching", 2.0): (0.99, 1.0, 1.0), ("fairbatching", 4.0): (0.88, 0.90, 0.92),
    }
    tpot = {"stock-mixed-256": 35.0, "stock-mixed-512": 30.0, "fairbatching": 32.0}
    tbt = {"stock-mixed-512": 30.0, "stock-mixed-1024": 40.0, "fairbatching": 50.0}
    points = []
    for (config, rate), values in att.items():
        for seed, value in enumerate(values):
            points.append(point(config, "replay", rate, seed,
                                replay_result(rate, value, tpot.get(config, 40.0) + seed,
                                              tbt.get(config, 100.0) * (1 if rate == 2.0 else 4))))
    return points


def test_aggregate_mean_and_spread_over_seeds() -> None:
    points = _grid() + [point("fairbatching", "replay", 4.0, 3, error="exit code 1")]
    cells = bs.aggregate(points)
    cell = cells[("replay", 4.0, "fairbatching")]
    assert cell["seeds"] == [0, 1, 2] and cell["failed_seeds"] == [3]
    assert cell["metrics"]["attainment"] == pytest.approx({"mean": 0.90, "min": 0.88, "max": 0.92, "n": 3})
    assert cell["metrics"]["max_tpot_p99"] == pytest.approx({"mean": 33.0, "min": 32.0, "max": 34.0, "n": 3})
    assert cell["metrics"]["effective_rps"]["mean"] == pytest.approx(3.6)
    assert cell["metrics"]["interactive_attainment"]["n"] == 3


def test_best_stock_mixed_per_point() -> None:
    points = _grid() + [point("stock-mixed-256", "random", 10.0, s, random_result(9.5)) for s in range(3)]
    points += [point("stock-mixed-1024", "random", 10.0, s, random_result(9.0 + s)) for s in range(3)]
    best = bs.best_stock_mixed(bs.aggregate(points))
    assert best[("replay", 2.0)] == "stock-mixed-512"  # tie with 256 on attainment: lower max-TPOT p99
    assert best[("replay", 4.0)] == "stock-mixed-1024"
    assert best[("random", 10.0)] == "stock-mixed-1024"  # mean goodput 10.0 > 9.5
    assert bs.best_of(bs.aggregate(points), "replay", 4.0, bs.STOCK_NAMES) == "stock-mixed-1024"


def test_comparisons_flag_differences_within_the_seeds_spread() -> None:
    cells = bs.aggregate(_grid())
    rows = bs.comparisons(cells, bs.best_stock_mixed(cells))
    by = {(r["rate"], r["metric"]): r for r in rows}
    low = by[(2.0, "attainment")]  # 99.7% (99-100) vs 100%: within 1 pp
    assert low["baseline"] == "stock-mixed-512" and low["verdict"] == 0
    high = by[(4.0, "attainment")]  # 90% (88-92) vs 99.7% (99-100): worse, beyond the spread
    assert high["verdict"] == -1 and not high["within_noise"]
    assert by[(2.0, "max_tbt_p50")]["verdict"] == -1  # 50 ms vs 30 ms
    noisy = bs.comparisons(bs.aggregate([
        point("stock-mixed-512", "replay", 2.0, s, replay_result(2.0, a)) for s, a in enumerate((0.90, 1.0))
    ] + [point("fairbatching", "replay", 2.0, s, replay_result(2.0, a)) for s, a in enumerate((0.92, 0.94))]),
        {("replay", 2.0): "stock-mixed-512"})
    att = next(r for r in noisy if r["metric"] == "attainment")
    assert att["verdict"] == -1 and att["within_noise"]  # 93% vs 95%, spread 10 pp


def test_target_verdicts() -> None:
    cells = bs.aggregate(_grid())
    rows = {t["target"]: t for t in bs.targets(cells, bs.best_stock_mixed(cells))}
    # (i) 2 req/s: 99.7% vs 100% (512) ok; 4 req/s: 90% vs 99.7% (1024) miss
    assert rows["i"]["verdict"] == "MISS"
    assert [r["ok"] for r in rows["i"]["rates"]] == [True, False]
    assert "fairbatching 90.0% vs 99.7% (`stock-mixed-1024`), -9.7 pp -- miss" in rows["i"]["rates"][1]["text"]
    # (ii) 2 req/s: fb 33 vs 512's 31 ms: miss; 4 req/s: 33 vs 1024's 41 ms: ok
    assert [r["ok"] for r in rows["ii"]["rates"]] == [False, True]
    # (iii) 2 req/s: 50 vs 30 ms (512) = 1.67x miss; 4 req/s: 200 vs 160 ms (1024) = 1.25x ok
    assert [r["ok"] for r in rows["iii"]["rates"]] == [False, True]
    assert "1.25x" in rows["iii"]["rates"][1]["text"]
    lines = bs.target_lines(list(rows.values()))
    assert lines[0].startswith("- (i) **MISS** -- replay attainment")
    # all pass: fairbatching as good as the best everywhere
    good = [p for p in _grid() if p["config"] != "fairbatching"]
    good += [point("fairbatching", "replay", rate, 0, replay_result(rate, 1.0, 20.0, 30.0)) for rate in (2.0, 4.0)]
    cells = bs.aggregate(good)
    assert [t["verdict"] for t in bs.targets(cells, bs.best_stock_mixed(cells))] == ["PASS"] * 3
    # no fairbatching points: not a pass
    cells = bs.aggregate([p for p in _grid() if p["config"] != "fairbatching"])
    assert [t["verdict"] for t in bs.targets(cells, bs.best_stock_mixed(cells))] == ["n/a"] * 3


# ------------------------------------------------------------------ rendering
def test_render_from_synthetic_points(tmp_path: Path) -> None:
    points = _grid() + [point(c, "random", 10.0, s, random_result(9.0 + 0.1 * s))
                        for c in CONFIG if "random" in CONFIG[c].workloads for s in range(3)]
    points.append(point("fairbatching", "replay", 4.0, 3, error="exit code 1; see x.log"))
    doc = bs.build_doc(points, tmp_path / "points.jsonl")
    text = bs.render(doc)
    for needle in ("## (a) `sglang.benchmark.serving`", "## (b) `benchmarks.server.trace_replay`", "## Targets on the replay workload",
                   "- (i) **MISS**", "## Where FairBatching loses", "*within noise*", "## Caveats",
                   "## Runs: exact commands and machine load", "## Failed points",
                   "stock-mixed-512 *(best mixed)*", "Best stock-mixed chunk per rate (by mean attainment",
                   "2 req/s: `stock-mixed-512` (256: 100.0%, 512: 100.0%, 1024: 99.0%)",
                   "| 4 | fairbatching | 3 (0,1,2; failed: 3) |", "90.0% <sub>88.0–92.0%</sub>",
                   "**Code:** commit abc1234 (55 points)"):
        assert needle in text, needle
    assert "Shorter runs" not in text
    data = json.loads(bs.results_json(doc))
    assert len(data["points"]) == len(points) and "server" not in data["points"][0]
    assert {t["target"]: t["verdict"] for t in data["targets"]} == {"i": "MISS", "ii": "MISS", "iii": "MISS"}
    assert {(b["workload"], b["rate"]): b["config"] for b in data["best_stock_mixed"]}[("replay", 4.0)] == "stock-mixed-1024"


def test_main_render_only_and_resume_run_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # main() changes directory; monkeypatch changes it back
    points_path, out = tmp_path / "points.jsonl", tmp_path / "docs"
    plan = bs.Plan((16.0,), (4.0,), 20.0, 20.0, bs.CONFIGS, bs.WORKLOADS, (0,), 0.0)
    for config in ("stock-mixed-512", "fairbatching"):
        bp.append_point(points_path, point(config, "replay", 4.0, 0, replay_result(4.0, 0.9), plan=plan))

    def no_runs(*args: object) -> int:
        raise AssertionError("nothing should run")

    monkeypatch.setattr(bs, "run_all", no_runs)
    common = ["--points", str(points_path), "--out", str(out)]
    assert bs.main([*common, "--render-only"]) == 0
    text = (out / "table.md").read_text()
    assert "Shorter runs than the full benchmark's 60 s (replay)" in text
    assert json.loads((out / "results.json").read_text())["points_file"] == str(points_path)
    (out / "table.md").unlink()
    assert bs.main([*common, "--quick", "--configs", "stock-mixed-512,fairbatching", "--workloads", "replay",
                    "--seeds", "1", "--resume"]) == 0
    assert (out / "table.md").exists() and len(bp.load_points(points_path)) == 2
    # without --resume the old points are moved aside, and a new run would start
    with pytest.raises(AssertionError, match="nothing should run"):
        bs.main([*common, "--quick", "--configs", "fairbatching", "--workloads", "replay", "--seeds", "1"])
    assert not points_path.exists() and len(list(tmp_path.glob("points-*.jsonl"))) == 1


def test_admission_benchmark_uses_the_shared_points_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import benchmarks.server.admission as adm

    monkeypatch.setattr(adm, "POINTS", tmp_path / "points.jsonl")
    assert adm.load_points() == []
    bp.append_point(adm.POINTS, {"config": "mixed-512", "rate": 10.0, "seed": 0, "effective_rps": 9.0})
    assert adm.load_points() == [{"config": "mixed-512", "rate": 10.0, "seed": 0, "effective_rps": 9.0}]
    assert adm.best_chunk(adm.load_points()) is None  # not every chunk measured yet
    for chunk, rate, value in ((256, 10.0, 8.0), (1024, 10.0, 7.0), (512, 16.0, 1.0), (256, 16.0, 9.0)):
        bp.append_point(adm.POINTS, {"config": f"mixed-{chunk}", "rate": rate, "seed": 0, "effective_rps": value})
    # 10 req/s is the only rate every chunk has: 512 is best there, whatever 16 req/s says
    assert adm.best_chunk(adm.load_points()) == 512
