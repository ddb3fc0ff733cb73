"""benchmarks.server.fair_capacity without a server: its probes pooled over seeds, the
bisection on a synthetic attainment curve (run, interrupted, resumed and replayed from the
saved points), the overload loads, the tables rendered from saved points, the resume keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.server.admission as adm
import benchmarks.server.fair_capacity as fc
from sglang_ext.bundled import CONFIGS_DIR
from sglang_ext.policy.slo import SloCatalog
from sglang_ext.sim.metrics import RequestRecord, summarize

CATALOG = SloCatalog.from_toml(CONFIGS_DIR / "slo.toml")
TUNING = fc.StockTuning(512, 16, "test defaults")
ONE = fc.Setting(fc.ONE_CLASS, "gamma:4")
THREE = fc.Setting(fc.THREE_CLASSES, "gamma:4")
#: each configuration's synthetic capacity at 90% overall (req/s)
CAPACITY = {"mixed-512-queue-16": 4.0, "mixed-512-timeout": 5.0,
            "mixed-512-queue-16-priority": 4.5, "mixed-512-queue-16-sjf": 4.8, "fb-defer": 6.5}


def _plan(settings=(ONE,), seeds=(0,), **changes) -> fc.Plan:
    fields = {"settings": tuple(settings), "seeds": tuple(seeds), "seconds": 30.0,
              "min_requests": 150, "targets": (0.9,), "tolerance": 0.03, "max_probes": 24,
              "start": 5.0, "min_rate": 1.0, "max_rate": 40.0, "overloads": (1.5, 2.0),
              "configs": fc.configurations(TUNING), "tuning": TUNING}
    return fc.Plan(**{**fields, **changes})


def _attainment(rate: float, capacity: float) -> float:
    """1 at low load, 0.9 at ``capacity``, falling fast beyond."""
    return max(0.0, 1.0 - 0.1 * (rate / capacity) ** 4)


def _synthetic(config: str, rate: float, seed: int) -> dict:
    """A replay's saved summary: 100 short prompts at the configuration's curve, 40 of
    1024-2047 tokens that fail 10% earlier, 5 of >= 4096 that always fail (too few to be the
    worst bucket)."""
    capacity = CAPACITY[config]
    short = round(100 * _attainment(rate, capacity))
    long = round(40 * _attainment(rate, 0.9 * capacity))
    return {
        "config": config, "rate": rate, "seed": seed, "requests": 145,
        "attainment": (short + long) / 145, "effective_rps": rate * (short + long) / 145,
        "rejected": 0, "aborted": 145 - short - long, "token_goodput": 1000.0,
        "tpot_ms": {"p99": 40.0},
        "by_prompt_tokens": {"<512": {"requests": 100, "attainment": short / 100},
                             "1024-2047": {"requests": 40, "attainment": long / 40},
                             ">=4096": {"requests": 5, "attainment": 0.0}},
        "by_slo_class": {"standard": {"requests": 145, "attainment": (short + long) / 145}},
        "machine_during_run": {"cpu": {"cpu0": {"busy_pct": 50.0, "steal_pct": 0.0}},
                               "load_average_before": [1.0, 1.0, 1.0],
                               "load_average_after": [1.5, 1.0, 1.0],
                               "foreign_sglang_servers": []},
        "wall_s": 45.0,
    }


@pytest.fixture
def fake_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """``run_seed`` replaced by the synthetic curve; the calls it got."""
    calls: list[tuple] = []

    def run_seed(bench, server, setting, rate, seed):
        calls.append((server.config.name, setting.mix, rate, seed))
        return _synthetic(server.config.name, rate, seed)

    monkeypatch.setattr(fc, "run_seed", run_seed)
    return calls


def _bench(tmp_path: Path, plan: fc.Plan) -> fc.Bench:
    return fc.Bench(plan, tmp_path, Path("tiny-model"), 0.0)


# ------------------------------------------------------------------ pooling
def _records(long_met: int, long_count: int) -> list[RequestRecord]:
    records = []
    for index in range(25 + long_count):
        prompt, met = (100, True) if index < 25 else (1500, index - 25 < long_met)
        record = RequestRecord(index, 0.0, CATALOG.classes["standard"], prompt, 2, "standard")
        first = 0.1 if met else 10.0
        record.on_token(0, first)
        record.on_token(1, first + 0.01)
        records.append(record)
    return records


def _saved(long_met: int, long_count: int, seed: int) -> dict:
    return {"seed": seed, **adm.point_result(summarize(_records(long_met, long_count), 4.0, 10.0))}


def test_one_seed_pooled_is_the_replays_own_summary() -> None:
    point = _saved(10, 20, 0)
    load = fc.pooled_load([point], 4.0)
    assert load["attainment"] == point["attainment"]
    assert load["worst_prompt_bucket"]["label"] == "1024-2047"
    assert point["worst_prompt_bucket"]["label"] == "1024-2047"
    assert load["worst_prompt_bucket"]["attainment"] == point["worst_prompt_bucket"]["attainment"]
    assert load["worst_slo_class"]["attainment"] == point["worst_slo_class"]["attainment"]


def test_seeds_are_pooled_request_by_request() -> None:
    # 15 long prompts per seed: too few to be the worst alone, 30 pooled are enough
    runs = [_saved(5, 15, 0), _saved(10, 15, 1)]
    assert all(run["worst_prompt_bucket"]["label"] == "<512" for run in runs)
    load = fc.pooled_load(runs, 4.0)
    assert load["requests"] == 80 and load["seeds"] == [0, 1]
    assert load["attainment"] == pytest.approx((25 + 5 + 25 + 10) / 80)
    assert load["effective_rps"] == pytest.approx(4.0 * 65 / 80)
    bucket = load["worst_prompt_bucket"]
    assert (bucket["label"], bucket["requests"]) == ("1024-2047", 30)
    assert bucket["attainment"] == pytest.approx(0.5)
    assert list(load["by_prompt_tokens"]) == ["<512", "1024-2047"]  # the buckets' order


# ------------------------------------------------------------------ bisection
def _measured(rate: float, measure: str) -> float:
    point = _synthetic("fb-defer", rate, 0)
    if measure == "overall":
        return point["attainment"]
    return point["by_prompt_tokens"]["1024-2047"]["attainment"]


def test_bisection_finds_each_measure_within_the_tolerance(tmp_path: Path, fake_runs) -> None:
    plan = _plan()
    bench, log = _bench(tmp_path, plan), fc.ProbeLog(tmp_path / "points.jsonl")
    config = adm.fairbatching_config("defer")
    with fc.LazyServer(bench, config) as server:
        search = fc.search_capacity(
            lambda rate: fc.run_probe(bench, log, server, ONE, rate, fc.BISECTION), plan)
    assert search["complete"]
    overall = search["capacity"]["0.9"]["overall"]
    bucket = search["capacity"]["0.9"]["worst_prompt_bucket"]
    assert overall["resolved"] and bucket["resolved"]
    for entry, measure in ((overall, "overall"), (bucket, "worst_prompt_bucket")):
        # the curve itself meets 90% at the capacity and fails it at the next probe up
        assert _measured(entry["capacity"], measure) >= 0.9 > _measured(entry["next_fail"], measure)
        assert entry["next_fail"] / entry["capacity"] - 1 <= plan.tolerance
    # the 5 prompts >= 4096 tokens, always late, are too few to be the worst bucket, but
    # they count overall: there 90% goes first
    assert 5.0 < overall["capacity"] < bucket["capacity"] < 6.5
    assert bucket["worst_at_next_fail"] == "1024-2047"
    assert len(fake_runs) == len(search["loads"]) <= plan.max_probes


def test_an_interrupted_bisection_resumes_and_replays_from_the_saved_points(
        tmp_path: Path, fake_runs) -> None:
    plan = _plan()
    bench = _bench(tmp_path, plan)
    config = adm.timeout_config(512)

    left = [3]

    def interrupted(rate: float) -> dict:
        if not left[0]:
            raise fc.NotProbed("stopped")
        left[0] -= 1
        return fc.run_probe(bench, log, server, ONE, rate, fc.BISECTION)

    log = fc.ProbeLog(tmp_path / "points.jsonl")
    with fc.LazyServer(bench, config) as server:
        partial = fc.search_capacity(interrupted, plan)
    assert not partial["complete"] and len(partial["loads"]) == 3
    assert all(not m["resolved"] for m in partial["capacity"]["0.9"].values())

    log = fc.ProbeLog(tmp_path / "points.jsonl")  # a new process: the saved points only
    with fc.LazyServer(bench, config) as server:
        full = fc.search_capacity(
            lambda rate: fc.run_probe(bench, log, server, ONE, rate, fc.BISECTION), plan)
    assert full["complete"] and len(fake_runs) == len(full["loads"])  # nothing ran twice

    saved = fc.ProbeLog(tmp_path / "points.jsonl")
    replayed = fc.search_capacity(lambda rate: saved.saved_load(config.name, ONE, plan, rate), plan)
    assert replayed["capacity"] == full["capacity"] and replayed["loads"] == full["loads"]


def test_max_probes_leaves_the_bracket_unresolved(tmp_path: Path, fake_runs) -> None:
    plan = _plan(max_probes=2)
    bench, log = _bench(tmp_path, plan), fc.ProbeLog(tmp_path / "points.jsonl")
    with fc.LazyServer(bench, adm.timeout_config(512)) as server:
        search = fc.search_capacity(
            lambda rate: fc.run_probe(bench, log, server, ONE, rate, fc.BISECTION), plan)
    assert len(fake_runs) == 2 and search["complete"]
    assert not search["capacity"]["0.9"]["overall"]["resolved"]
    assert fc._cap_text(search["capacity"]["0.9"]["overall"]).endswith("*")


# ------------------------------------------------------------------ resume keys
def test_resume_keys_separate_settings_seconds_and_failures(tmp_path: Path) -> None:
    log = fc.ProbeLog(tmp_path / "points.jsonl")
    base = {"config": "fb-defer", "mix": fc.ONE_CLASS, "arrivals": "gamma:4", "seconds": 30.0,
            "min_requests": 150, "rate": 5.0}
    log.add({**base, "seed": 0, "attainment": 0.9})
    log.add({**base, "seed": 1, "error": "exit code 1"})
    log.add({**base, "seed": 2, "seconds": 10.0})
    log.add({**base, "seed": 2, "mix": fc.THREE_CLASSES})
    log.add({**base, "seed": 2, "arrivals": "trace"})
    log.add({**base, "seed": 2, "min_requests": 100})
    plan = _plan()
    assert fc.point_key_of("fb-defer", ONE, plan, 5.0, 0) == (
        "fb-defer", fc.ONE_CLASS, "gamma:4", 30.0, 150, 5.0, 0)
    runs = fc.ProbeLog(tmp_path / "points.jsonl").runs("fb-defer", ONE, plan, 5.0, (0, 1, 2))
    assert [run["seed"] for run in runs] == [0]  # a failed seed is run again; others differ
    with pytest.raises(fc.NotProbed):
        log.saved_load("fb-defer", ONE, _plan(seeds=(1, 2)), 5.0)


def test_a_probe_runs_only_the_seeds_not_saved(tmp_path: Path, fake_runs) -> None:
    plan = _plan(seeds=(0, 1, 2))
    bench, log = _bench(tmp_path, plan), fc.ProbeLog(tmp_path / "points.jsonl")
    log.add({**_synthetic("fb-defer", 5.0, 1), "mix": fc.ONE_CLASS, "arrivals": "gamma:4",
             "seconds": 30.0, "min_requests": 150})
    with fc.LazyServer(bench, adm.fairbatching_config("defer")) as server:
        load = fc.run_probe(bench, log, server, ONE, 5.0, fc.BISECTION)
    assert fake_runs == [("fb-defer", fc.ONE_CLASS, 5.0, 0), ("fb-defer", fc.ONE_CLASS, 5.0, 2)]
    assert load["seeds"] == [0, 1, 2] and load["requests"] == 3 * 145
    saved = fc.ProbeLog(tmp_path / "points.jsonl").points
    assert {p["phase"] for p in saved[1:]} == {fc.BISECTION} and saved[1]["slo_mix"] == "standard:1"
    assert saved[1]["run_seconds"] == 30.0 and plan.run_seconds(2.5) == 60.0  # 150 requests


def test_a_failed_run_is_saved_and_run_again_once(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes = [{"error": "exit code 1"}, {"error": "exit code 1"}, {}]

    def run_seed(bench, server, setting, rate, seed):
        return {**_synthetic(server.config.name, rate, seed), **outcomes.pop(0)}

    monkeypatch.setattr(fc, "run_seed", run_seed)
    plan = _plan(seeds=(0, 1))
    bench, log = _bench(tmp_path, plan), fc.ProbeLog(tmp_path / "points.jsonl")
    with fc.LazyServer(bench, adm.fairbatching_config("defer")) as server:
        load = fc.run_probe(bench, log, server, ONE, 5.0, fc.BISECTION)
    assert load["seeds"] == [1] and not outcomes  # seed 0 failed twice, seed 1 ran once
    assert [("error" in p, p["seed"]) for p in log.points] == [(True, 0), (True, 0), (False, 1)]


# ------------------------------------------------------------------ the whole run, rendered
def test_the_run_places_overload_at_the_best_stock_capacity_and_resumes(
        tmp_path: Path, fake_runs) -> None:
    plan = _plan(settings=(ONE, THREE))
    bench = _bench(tmp_path, plan)
    names = [c.name for c in plan.configs]
    assert names == list(CAPACITY)  # stock first, the shipped one last
    fc.run_benchmark(bench, fc.ProbeLog(tmp_path / "points.jsonl"), set(names))
    # priority by class only with three classes
    assert not any(config == "mixed-512-queue-16-priority" and mix == fc.ONE_CLASS
                   for config, mix, _, _ in fake_runs)
    log = fc.ProbeLog(tmp_path / "points.jsonl")
    document = fc.build_document(plan, log, tmp_path / "points.jsonl")
    entry = document["settings"][0]
    best = entry["best_stock"]
    assert best["config"] == "mixed-512-timeout" and 4.0 < best["capacity_90"] < 5.0
    assert entry["loads"] == {"1.5x": fc.round_rate(1.5 * best["capacity_90"]),
                              "2x": fc.round_rate(2 * best["capacity_90"])}
    assert all(entry["overload"][load][name] is not None for load in entry["loads"]
               for name in entry["configs"])
    overload = [p for p in log.points if p["phase"] == fc.OVERLOAD]
    assert len(overload) == 2 * (4 + 5)

    ran = len(fake_runs)
    fc.run_benchmark(bench, fc.ProbeLog(tmp_path / "points.jsonl"), set(names))
    assert len(fake_runs) == ran  # resumed: everything saved, nothing runs

    text = fc.render(json.loads(json.dumps(document)))  # as saved in the JSON
    assert fc.EMULATED_CAVEAT in text
    row = next(line for line in text.splitlines() if line.startswith("| one class, gamma:4"))
    ours = entry["capacity"]["fb-defer"]["capacity"]["0.9"]["overall"]["capacity"]
    assert f"x ({ours:.2f} / {best['capacity_90']:.2f})" in row
    assert "cap90 worst bucket yes; cap90 worst class yes" in row  # 6.5 against 5.0: 1.3x
    assert "| `mixed-512-queue-16-sjf` |" in text and "CPU busy 50%" in text
    assert "No other SGLang server ran on the machine during any probe." in text


def test_render_marks_what_was_not_run(tmp_path: Path, fake_runs) -> None:
    plan = _plan(settings=(ONE,), max_probes=2)
    bench = _bench(tmp_path, plan)
    fc.run_benchmark(bench, fc.ProbeLog(tmp_path / "points.jsonl"),
                     {"mixed-512-timeout", "fb-defer"})
    text = fc.render(fc.build_document(plan, fc.ProbeLog(tmp_path / "points.jsonl"),
                                       tmp_path / "points.jsonl"))
    assert "| `mixed-512-queue-16` | n/a / n/a / n/a | - | - | not run | - |" in text
    # two probes per bisection (5 and 2.5 req/s for the stock one: capacity 2.5*), then the
    # overload loads 3.75 and 5 req/s: 5 was probed already and is not run again
    assert [(name, rate) for name, _, rate, _ in fake_runs] == [
        ("mixed-512-timeout", 5.0), ("mixed-512-timeout", 2.5), ("mixed-512-timeout", 3.75),
        ("fb-defer", 5.0), ("fb-defer", 10.0), ("fb-defer", 3.75)]
    assert "| `mixed-512-timeout` | 2.5* / 2.5* / 2.5* |" in text


def test_plan_round_trips_through_its_json_and_estimates_its_length() -> None:
    plan = _plan(settings=(ONE, THREE), seeds=(0, 1, 2))
    assert fc.Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    every = {c.name for c in plan.configs}
    estimate = fc.estimate(plan, every)
    assert estimate["bisections"] == 4 + 5 and estimate["overload_probes"] == 2 * 9
    assert estimate["launches"] == 5 + 3  # the first three stock ones again for overload
    assert estimate["seconds_per_probe"] == 3 * (30.0 + fc.PROBE_OVERHEAD_S)


def test_stock_tuning_comes_from_the_admission_points_else_the_defaults() -> None:
    assert fc.stock_tuning([]).chunk == 512 and fc.stock_tuning([]).queue == 16
    points = [{"config": f"mixed-{chunk}", "rate": 10.0, "seed": 0, "effective_rps": value}
              for chunk, value in ((256, 3.0), (512, 4.0), (1024, 1.0))]
    points += [{"config": "mixed-512-queue-32", "rate": 10.0, "seed": 0, "effective_rps": 6.0},
               {"config": "mixed-512-queue-8", "rate": 10.0, "seed": 0, "effective_rps": 5.0}]
    tuning = fc.stock_tuning(points)
    assert (tuning.chunk, tuning.queue) == (512, 32) and "points.jsonl" in tuning.source
    names = [c.name for c in fc.configurations(tuning, (16,))]
    assert names == ["mixed-512-queue-32", "mixed-512-queue-16", "mixed-512-timeout",
                     "mixed-512-queue-32-priority", "mixed-512-queue-32-sjf", "fb-defer"]
    on_timeout = {c.name: c for c in fc.configurations(tuning, priority_on="timeout")}
    sjf = on_timeout["mixed-512-timeout-sjf"]
    assert sjf.env == (("SGLANG_REQ_WAITING_TIMEOUT", "2"),) and sjf.priority == "prompt-length"
    assert "--max-queued-requests" not in sjf.args and "--enable-priority-scheduling" in sjf.args
