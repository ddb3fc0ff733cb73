"""The router comparison at several arrival seeds (:mod:`benchmarks.routers`): runs keyed by
seed, points saved without one read as seed 0, the tuned smg routers swept per seed, the
page's means and per-seed ratios, and a one-seed page as it was -- from synthetic points, no
server."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import pytest
from test_router_comparison import point, synthetic_points

from benchmarks.routers.analysis import against, comparison_rows, main_points, seed_verdicts, wins
from benchmarks.routers.command import build_plan, main, parse_seeds
from benchmarks.routers.rendering import render_json, render_markdown
from benchmarks.routers.runs import Bench, Plan, point_key, run_key, smg_limits
from benchmarks.routers.traffic import point_seed

TUNED = {0: 512, 1: 256, 2: 512}  # smg-ca's best C per seed
SMG_BEST = {0: 21.0, 1: 20.0, 2: 22.5}
DAEMON = {0: 25.2, 1: 24.6, 2: 26.1}


def lim(c: int, q: int = 4) -> dict:
    return smg_limits(c, q) | {"queue_timeout_s": 2}


def tuned_record(c: int) -> dict:
    return {"limits": [c, 4], "rate": 30.0, "concurrency_grid": [128, 256, 512, 1024],
            "queue_during_concurrency": 4, "queue_grid": [4],
            "verdicts": {"max_concurrent": "interior", "queue_size": "not swept"}}


def seeded_points(seeds=(0, 1, 2)) -> list[dict]:
    """Bursty at 30 req/s at each seed: smg-ca swept (its best C per seed, ``TUNED``), smg-rr,
    cp-default and cp-one."""
    points = []
    for seed in seeds:
        best = TUNED[seed]
        for c in (128, 256, 512, 1024):
            goodput = SMG_BEST[seed] if c == best else SMG_BEST[seed] - 2
            points.append(point("bursty", 30.0, "smg-ca", goodput, lim(c), "sweep", seed=seed,
                                tuned=tuned_record(c) if c == best else None))
        points += [point("bursty", 30.0, "smg-rr", 15.0 + seed, seed=seed),
                   point("bursty", 30.0, "cp-default", DAEMON[seed], seed=seed),
                   point("bursty", 30.0, "cp-one", DAEMON[seed] - 0.5, seed=seed)]
    return points


# ---------------------------------------------------------------- keys and the plan
def test_the_run_key_includes_the_seed() -> None:
    limits = lim(64)
    keys = {run_key("bursty", 30.0, "smg-ca", limits, seed) for seed in (0, 1, 2)}
    assert len(keys) == 3
    assert run_key("bursty", 30.0, "smg-ca", limits, 2) == ("bursty", 30.0, "smg-ca", (64, 4), 2)
    assert point_key(point("bursty", 30.0, "smg-ca", 20.0, limits, seed=2)) == \
        run_key("bursty", 30.0, "smg-ca", limits, 2)


def test_a_point_saved_without_a_seed_reads_as_seed_0(tmp_path: Path) -> None:
    old = point("bursty", 30.0, "cp-default", 25.0)
    assert "seed" not in old and point_seed(old) == 0
    assert point_key(old) == run_key("bursty", 30.0, "cp-default", None, 0)
    path = tmp_path / "points.jsonl"
    new = point("bursty", 30.0, "cp-one", 24.0, seed=1)
    path.write_text(f"{json.dumps(old)}\n{json.dumps(new)}\n")
    plan = Plan(workloads=("bursty",), rates={"bursty": (30.0,)}, seconds=1.0,
                sweep_concurrency=(16,), sweep_queue=(), sweep_queue_at=4, max_extensions=0,
                quick=False, seeds=(0, 1))
    bench = Bench(plan, stack=None, points_path=path, meta={})
    assert set(bench.runs) == {run_key("bursty", 30.0, "cp-default", None, 0),
                               run_key("bursty", 30.0, "cp-one", None, 1)}
    # --append: the old point is seed 0's run, not run again (the stack would be needed)
    assert bench.run("bursty", 30.0, "cp-default", seed=0)["result"]["goodput"] == 25.0
    assert run_key("bursty", 30.0, "cp-default", None, 1) not in bench.runs


def test_seeds_on_the_command_line_default_to_0_and_keep_their_order() -> None:
    assert parse_seeds(None) == (0,) and parse_seeds("") == (0,)
    assert parse_seeds("2,0,1,2") == (2, 0, 1)
    ns = argparse.Namespace(quick=True, azure_rates=None, prefix_rates=None, bursty_rates="30",
                            workloads="bursty", seconds=None, sweep_concurrency=None,
                            sweep_queue=None, sweep_queue_at=16, max_extensions=None,
                            routers="smg-ca,cp-default")
    assert build_plan(ns).seeds == (0,)  # no --seeds: the one default seed
    assert build_plan(argparse.Namespace(**vars(ns), seeds="0,1,2")).seeds == (0, 1, 2)


# ---------------------------------------------------------------- the sweep per seed
def test_each_seed_sweeps_smg_and_runs_every_router_at_its_own_best(tmp_path: Path) -> None:
    """Bench.workload with three seeds against a fake runner whose smg-ca goodput peaks at a
    different C per seed: each seed sweeps, keeps its own best, and runs every rate there."""
    plan = Plan(workloads=("bursty",), rates={"bursty": (20.0, 30.0)}, seconds=1.0,
                sweep_concurrency=(128, 256, 512, 1024), sweep_queue=(), sweep_queue_at=4,
                max_extensions=0, quick=False, routers=("smg-ca", "cp-default"), per_rate=False,
                seeds=(0, 1, 2))
    bench = Bench.__new__(Bench)
    bench.plan, bench.points_path, bench.runs = plan, tmp_path / "points.jsonl", {}
    runs = []

    def fake_run(workload, rate, name, limits=None, phase="main", tuned=None, seed=0):
        key = run_key(workload, rate, name, limits, seed)
        if key in bench.runs:
            return bench.runs[key]
        runs.append(key)
        c = (limits or {}).get("max_concurrent")
        good = 90 if c is None else 100 - abs(c - TUNED[seed]) // 64
        result = {"good": good, "goodput": good * rate / 100, "attainment": good / 100,
                  "ttft_ms": {"p99": 1.0}}
        p = {"workload": workload, "rate": rate, "router": name, "limits": limits, "phase": phase,
             "seed": seed, "result": result}
        if tuned is not None:
            p["tuned"] = tuned
        bench.runs[key] = p
        return p

    bench.run = fake_run
    bench.workload("bursty")
    saved = [json.loads(line) for line in bench.points_path.read_text().splitlines()]
    chosen = {point_seed(p): p["tuned"]["limits"] for p in saved if p.get("tuned")}
    assert chosen == {0: [512, 4], 1: [256, 4], 2: [512, 4]}
    every = {(router, rate, seed) for router in ("smg-ca", "cp-default") for rate in (20.0, 30.0)
             for seed in (0, 1, 2)}
    assert {(key[2], key[1], key[4]) for key in runs} >= every
    assert [key[4] for key in runs] == sorted(key[4] for key in runs)  # one seed after the other
    compared = {(p["rate"], point_seed(p)): p["limits"]["max_concurrent"]
                for p in main_points(bench.runs.values()) if p["router"] == "smg-ca"}
    assert compared == {(rate, seed): TUNED[seed] for rate in (20.0, 30.0) for seed in (0, 1, 2)}


def test_main_points_take_each_seeds_own_tuned_limits() -> None:
    rows = [p for p in main_points(seeded_points()) if p["router"] == "smg-ca"]
    assert [(point_seed(p), p["limits"]["max_concurrent"]) for p in rows] == \
        [(0, 512), (1, 256), (2, 512)]


# ---------------------------------------------------------------- means and ratios
def test_rows_of_several_seeds_are_means_with_each_seeds_goodput() -> None:
    rows = {r["router"]: r for r in comparison_rows(seeded_points())}
    assert rows["cp-default"]["result"]["goodput"] == pytest.approx(25.3)
    assert rows["smg-ca"]["result"]["goodput"] == pytest.approx(21.167)
    attainment = (0.7 + 0.67 + 0.75) / 3
    assert rows["smg-ca"]["result"]["attainment"] == pytest.approx(attainment, abs=1e-4)
    assert [s["goodput"] for s in rows["cp-default"]["by_seed"]] == [25.2, 24.6, 26.1]
    assert [s["limits"]["max_concurrent"] for s in rows["smg-ca"]["by_seed"]] == [512, 256, 512]


def test_the_daemon_against_smgs_best_is_the_ratio_of_means_and_each_seeds_ratio() -> None:
    (verdict,) = seed_verdicts(seeded_points())
    assert verdict["best"] == "cp-default" and verdict["rival"] == "smg-ca"
    assert verdict["seeds"] == [0, 1, 2]
    assert verdict["ratio"] == pytest.approx(25.3 / (63.5 / 3), abs=1e-4)
    assert [s["ratio"] for s in verdict["per_seed"]] == pytest.approx(
        [DAEMON[s] / SMG_BEST[s] for s in (0, 1, 2)], abs=1e-4)
    line = ("goodput, bursty at 30 req/s, mean over seeds 0, 1, 2: 25.30 (cp-default) against "
            "21.17 (smg-ca), 1.20x; per seed: seed 0 1.20x, seed 1 1.23x, seed 2 1.16x")
    assert wins(seeded_points(), "cp") == [line]


def test_each_seeds_ratio_is_against_smgs_best_at_that_seed() -> None:
    """smg-rr beats smg-ca at seed 1 only: seed 1's ratio is against smg-rr."""
    points = [p for p in seeded_points() if not (p["router"] == "smg-rr" and point_seed(p) == 1)]
    points.append(point("bursty", 30.0, "smg-rr", 23.0, seed=1))
    (verdict,) = seed_verdicts(points)
    assert [(s["seed"], s["rival"], s["rival_goodput"]) for s in verdict["per_seed"]] == \
        [(0, "smg-ca", 21.0), (1, "smg-rr", 23.0), (2, "smg-ca", 22.5)]
    assert verdict["rival"] == "smg-ca/smg-rr"
    assert verdict["rival_goodput"] == pytest.approx((21.0 + 23.0 + 22.5) / 3, abs=1e-3)


def test_a_seed_only_one_side_ran_is_left_out_of_the_ratio() -> None:
    points = [p for p in seeded_points()
              if not (p["router"].startswith("smg") and point_seed(p) == 2)]
    cell = {r["router"]: r for r in comparison_rows(points)}
    verdict = against([cell["cp-default"], cell["cp-one"]], [cell["smg-ca"], cell["smg-rr"]])
    assert verdict["seeds"] == [0, 1]
    assert verdict["goodput"] == pytest.approx((25.2 + 24.6) / 2)


def test_the_page_of_several_seeds_shows_means_per_seed_goodputs_sweeps_and_ratios() -> None:
    text = render_markdown(seeded_points(), {})
    assert "3 arrival seeds per point (0, 1, 2), smg's limits swept per seed" in text
    assert "bursty: gamma, CV 4; seeds 0, 1, 2) per point" in text
    assert "| rate | router | goodput | goodput per seed (0 / 1 / 2) | attainment |" in text
    assert "| 30 | smg-ca (C=512/256/512, Q=4) | 21.17 | 21.00 / 20.00 / 22.50 | 0.707 |" in text
    assert "| 30 | cp-default | **25.30** | 25.20 / 24.60 / 26.10 | 0.843 |" in text
    assert "## The daemon against smg's best, per seed" in text
    verdict_row = ("| bursty | 30 | cp-default | 25.30 | smg-ca | 21.17 | 1.20x | "
                   "seed 0: 25.20 / 21.00 (smg-ca) = 1.20x; "
                   "seed 1: 24.60 / 20.00 (smg-ca) = 1.23x; "
                   "seed 2: 26.10 / 22.50 (smg-ca) = 1.16x |")
    assert verdict_row in text
    for seed, c in TUNED.items():
        assert (f"smg cache_aware sweep at 30 req/s, seed {seed} (queue timeout 2 s): "
                f"best C={c}, Q=4") in text
    data = render_json(seeded_points(), {})
    assert [p["seed"] for p in data["comparison"] if p["router"] == "cp-default"] == [0, 1, 2]
    assert {r["router"] for r in data["seed_means"]} == {"smg-rr", "smg-ca", "cp-default", "cp-one"}
    assert data["seed_verdicts"][0]["per_seed"][1]["ratio"] == pytest.approx(1.23)
    sweeps = data["sweeps"]["smg-ca"]["bursty"]
    best = {seed: sweep["best"] for seed, sweep in sweeps.items()}
    assert best == {"0": [512, 4], "1": [256, 4], "2": [512, 4]}
    json.dumps(data)


def test_two_seeds_and_a_row_missing_one_show_a_dash() -> None:
    points = [p for p in seeded_points((0, 1))
              if not (p["router"] == "cp-one" and point_seed(p) == 1)]
    text = render_markdown(points, {})
    assert "goodput per seed (0 / 1)" in text
    assert "| 30 | cp-one | 24.70 | 24.70 / - |" in text
    assert "seed 0: 25.20 / 21.00 (smg-ca) = 1.20x; seed 1: 24.60 / 20.00 (smg-ca) = 1.23x |" \
        in text


# ---------------------------------------------------------------- one seed: as it was
def with_seed(points: list[dict], seed: int) -> list[dict]:
    out = copy.deepcopy(points)
    for p in out:
        p["seed"] = seed
    return out


def test_one_seed_renders_as_points_without_seeds_do() -> None:
    meta = {"git": {"commit": "abc1234", "dirty": False}, "started": "now", "machine": "2 vCPUs",
            "seconds": 30.0, "commands": ["scripts/bench_routers.sh"], "notes": ["a note"]}
    plain = synthetic_points()
    assert render_markdown(with_seed(plain, 0), meta) == render_markdown(plain, meta)
    assert render_json(with_seed(plain, 0), meta) == render_json(plain, meta)
    text = render_markdown(plain, meta)
    assert "One seed per point." in text and "bursty: gamma, CV 4; seed 0) per point" in text
    assert "per seed" not in text and "mean over seeds" not in text
    assert "| rate | router | goodput | attainment | failed | TTFT p50 / p90 / p99 ms |" \
        in text
    assert "smg cache_aware sweep at 16 req/s (queue timeout 2 s)" in text
    data = render_json(plain, meta)
    assert "seed_means" not in data and "seed_verdicts" not in data
    assert all("seed" not in p for p in data["comparison"])
    assert data["sweeps"]["smg-ca"]["prefix"]["best"] == [32, 16]
    # another single seed changes only the seed named in the runs line
    other = render_markdown(with_seed(plain, 5), meta)
    assert other == text.replace("CV 4; seed 0)", "CV 4; seed 5)")


def test_render_only_reads_old_points_as_one_seed(tmp_path: Path) -> None:
    points = tmp_path / "points.jsonl"
    points.write_text("".join(json.dumps(p) + "\n" for p in synthetic_points()))
    assert main(["--render-only", "--points", str(points), "--out", str(tmp_path / "a")]) == 0
    points.write_text("".join(json.dumps(p) + "\n" for p in with_seed(synthetic_points(), 0)))
    assert main(["--render-only", "--points", str(points), "--out", str(tmp_path / "b")]) == 0
    for name in ("routers.md", "routers.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
