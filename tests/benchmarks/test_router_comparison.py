"""The router comparison (:mod:`benchmarks.routers`): workload generation, the per-request
metrics and goodput, the added-latency and CPU summaries, the sweep's best-point and
edge rules and the rendered page -- from synthetic records and points, no server; and one
end-to-end ``--quick`` run when smg (the ``bench-router`` extra) and SGLang are installed."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from benchmarks.routers.analysis import (
    cpu_summary,
    main_points,
    rate_tuned_limits,
    smg_wins,
    tuned_limits,
    wins,
)
from benchmarks.routers.command import build_plan, main
from benchmarks.routers.records import (
    SLO,
    Record,
    added_latency,
    cpu_per_1000,
    meets_slo,
    percentile,
    prefill_summary,
    summarize,
)
from benchmarks.routers.rendering import render_json, render_markdown
from benchmarks.routers.runs import QUICK_SECONDS, Bench, Plan, run_key
from benchmarks.routers.stack import (
    DAEMON_DEFAULT_POLICY,
    DAEMON_ROUTERS,
    EMBEDDED_ROUTERS,
    ROUTERS,
    Stack,
    check_daemon_config,
    DaemonSettings,
    daemon_router_name,
)
from benchmarks.routers.limit_sweep import (
    QUICK_SWEEP_CONCURRENCY,
    edge_extension,
    pick_best,
    sweep_verdict,
)
from benchmarks.routers.load_generator import completion_body
from benchmarks.routers.traffic import (
    CLASS_MIX,
    CONTEXT_MARGIN,
    Request,
    azure_requests,
    bursty_requests,
    chars_per_token,
    gamma_times,
    poisson_times,
    prefix_requests,
    prompt_text,
)
from benchmarks.server.emulated import MAX_PROMPT_TOKENS, TINY_MODEL_CONTEXT
from benchmarks.support.paths import REPO

WORDS = ["alpha", "beta", "gamma", "delta", "eps"]


# ---------------------------------------------------------------- workloads
def test_poisson_times_are_seeded_start_at_zero_and_average_one_over_the_rate() -> None:
    times = poisson_times(10.0, 5000, seed=3)
    assert times == poisson_times(10.0, 5000, seed=3)
    assert times != poisson_times(10.0, 5000, seed=4)
    assert times[0] == 0.0 and all(b > a for a, b in zip(times, times[1:]))
    assert (times[-1] / (len(times) - 1)) == pytest.approx(0.1, rel=0.05)
    with pytest.raises(ValueError):
        poisson_times(0.0, 3, 0)


def test_azure_requests_take_the_trace_head_in_order_and_fit_the_context() -> None:
    lengths = [(100, 10), (9000, 50), (6000, 4000), (5, 0)] * 10
    requests = azure_requests(2.0, 10.0, seed=0, lengths=lengths)
    assert len(requests) == 20
    assert [r.index for r in requests] == list(range(20))
    assert (requests[0].prompt_tokens, requests[0].output_tokens) == (100, 10)
    assert requests[1].prompt_tokens == MAX_PROMPT_TOKENS  # capped
    third = requests[2]
    assert third.prompt_tokens + third.output_tokens <= TINY_MODEL_CONTEXT - CONTEXT_MARGIN
    assert requests[3].output_tokens == 1  # at least one token
    assert all(r.prefix_id is None for r in requests)
    with pytest.raises(ValueError, match="trace has"):
        azure_requests(10.0, 10.0, 0, lengths[:5])


def test_prefix_requests_draw_groups_and_lengths_in_their_ranges_deterministically() -> None:
    requests = prefix_requests(10.0, 30.0, seed=1, prefixes=6, prefix_tokens=100,
                                  suffix=(5, 9), output=(3, 4))
    assert requests == prefix_requests(10.0, 30.0, seed=1, prefixes=6, prefix_tokens=100,
                                          suffix=(5, 9), output=(3, 4))
    assert len(requests) == 300
    assert {r.prefix_id for r in requests} == set(range(6))
    assert all(105 <= r.prompt_tokens <= 109 and r.prefix_tokens == 100 for r in requests)
    assert {r.output_tokens for r in requests} == {3, 4}


def test_gamma_times_are_seeded_start_at_zero_and_are_as_bursty_as_asked() -> None:
    times = gamma_times(10.0, 4.0, 4000, seed=3)
    assert times == gamma_times(10.0, 4.0, 4000, seed=3) and times[0] == 0.0
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert mean == pytest.approx(0.1, rel=0.3) and 2.5 < cv < 6.0
    with pytest.raises(ValueError):
        gamma_times(10.0, 0.0, 5, seed=0)


def test_bursty_requests_are_the_prefix_workload_at_bursty_times_with_three_classes() -> None:
    bursty = bursty_requests(10.0, 60.0, seed=1)
    assert bursty == bursty_requests(10.0, 60.0, seed=1)
    plain = prefix_requests(10.0, 60.0, seed=1)
    assert [(r.prompt_tokens, r.output_tokens, r.prefix_id) for r in bursty] == \
        [(r.prompt_tokens, r.output_tokens, r.prefix_id) for r in plain]
    assert [r.at_s for r in bursty] == gamma_times(10.0, 4.0, len(plain), seed=1)
    shares = {name: sum(r.slo_class == name for r in bursty) / len(bursty) for name, _ in CLASS_MIX}
    for name, weight in CLASS_MIX:
        assert shares[name] == pytest.approx(weight, abs=0.07)
    assert all(r.slo_class is None for r in plain)


def test_the_request_body_names_its_class_or_carries_the_standard_targets() -> None:
    assert completion_body(None, "hi", 4)["custom_params"] == {"slo": SLO}
    body = completion_body("m", "hi", 4, "interactive")
    assert body["custom_params"] == {"slo": {"class": "interactive"}} and body["model"] == "m" and body["stream"]


def test_prompts_share_the_prefix_text_of_their_group_and_have_one_word_per_token() -> None:
    requests = prefix_requests(5.0, 10.0, seed=0, prefixes=2, prefix_tokens=50, suffix=(7, 7))
    texts = [prompt_text(r, WORDS, seed=0) for r in requests]
    for request, text in zip(requests, texts):
        words = text.split(" ")
        assert len(words) == request.prompt_tokens
        same_group = [t for r, t in zip(requests, texts) if r.prefix_id == request.prefix_id]
        assert all(t.split(" ")[:50] == words[:50] for t in same_group)
    by_group = {r.prefix_id: t.split(" ")[:50] for r, t in zip(requests, texts)}
    assert by_group[0] != by_group[1]
    # distinct requests differ after the prefix, and a prefix-less prompt is its own words
    assert len({t for t in texts}) == len(texts)
    plain = Request(0, 0.0, 12, 3)
    assert len(prompt_text(plain, WORDS, 0).split(" ")) == 12
    assert chars_per_token(["ab", "abcd"]) == pytest.approx(4.0)


# ---------------------------------------------------------------- metrics
def record(ttft: float | None = 0.1, tpot: float = 0.02, tokens: int = 11, status: int = 200,
           error: str | None = None, expected: int | None = None, sent: float = 1.0) -> Record:
    r = Record(0, sent, tokens if expected is None else expected, status=status, error=error)
    if ttft is not None:
        r.first_token_s = sent + ttft
        r.last_token_s = r.first_token_s + tpot * (tokens - 1)
        r.completion_tokens = tokens
    return r


def test_record_times_and_the_slo_check() -> None:
    r = record(ttft=0.5, tpot=0.03, tokens=11)
    assert r.ok and r.ttft_s == pytest.approx(0.5) and r.tpot_s == pytest.approx(0.03)
    assert r.e2e_s == pytest.approx(0.8)
    assert meets_slo(r)
    assert not meets_slo(record(ttft=2.5))
    assert not meets_slo(record(tpot=0.06))
    assert meets_slo(record(tokens=1))  # no TPOT with one token
    assert not meets_slo(record(status=429))
    assert not meets_slo(record(error="stream error: rank lost"))
    assert not record(tokens=5, expected=10).ok  # cut short
    assert not record(ttft=None).ok
    cut = Record(0, 0.0, 10, status=200, error="client: TimeoutError", events=4)
    assert cut.streamed_tokens == 4  # no usage event: one token per text chunk
    assert record(tokens=7).streamed_tokens == 7 and record(status=429, ttft=None).streamed_tokens == 0


def test_percentile_matches_numpy_linear_interpolation() -> None:
    np = pytest.importorskip("numpy")
    values = [random.Random(1).random() for _ in range(37)]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None


def test_summarize_counts_goodput_as_rate_times_attainment_and_every_failure_as_a_miss() -> None:
    records = [record() for _ in range(6)] + [record(ttft=3.0), record(status=429),
                                              record(status=200, error="client: TimeoutError"),
                                              record(tpot=0.07)]
    s = summarize(records, rate=5.0)
    assert (s["requests"], s["good"], s["completed"], s["failed"]) == (10, 6, 8, 2)
    assert s["attainment"] == 0.6 and s["goodput"] == 3.0
    assert s["failures"] == {"429": 1, "200:client": 1}
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["output_tokens"] == 10 * 11  # every token streamed, a missed SLO's too
    assert s["tpot_ms"]["p99"] > 50
    assert summarize([], 3.0)["goodput"] == 0.0


def test_each_request_is_judged_by_its_class_and_attainment_is_reported_per_class() -> None:
    fast, slow = record(ttft=0.3), record(ttft=0.9)
    relaxed = record(ttft=4.0, tpot=0.15)
    fast.slo_class = slow.slo_class = "interactive"
    relaxed.slo_class = "relaxed"
    assert meets_slo(fast) and not meets_slo(slow) and meets_slo(relaxed)
    assert meets_slo(slow, SLO) and not meets_slo(relaxed, SLO)  # an explicit SLO overrides the class
    s = summarize([fast, slow, relaxed, record()], rate=4.0)
    assert s["good"] == 3 and s["goodput"] == 3.0 and s["ttft_attainment"] == 0.75
    assert s["by_class"]["interactive"] == {"requests": 2, "good": 1, "attainment": 0.5,
                                            "ttft_p99_ms": pytest.approx(894.0)}
    assert s["by_class"]["relaxed"]["attainment"] == 1.0 and s["by_class"]["standard"]["requests"] == 1
    assert "by_class" not in summarize([record(), record()], rate=1.0)  # one class: no breakdown


def test_added_latency_is_the_difference_of_medians_and_cpu_is_per_thousand_requests() -> None:
    a = added_latency([0.012, 0.011, 0.030], [0.010, 0.009, 0.011])
    assert a["added_ms"] == pytest.approx(2.0) and a["n"] == 3
    assert added_latency([], [0.01]) is None
    assert prefill_summary(1000, 400, 100)["computed_fraction"] == 0.25
    assert prefill_summary(1000, 0, 0)["computed_fraction"] is None
    assert cpu_per_1000(3.0, 600) == 5.0
    assert cpu_per_1000(3.0, 0) is None
    assert cpu_per_1000(3.0, None) is None  # tokens a run did not record
    assert cpu_per_1000(0.5, 30_000, 4) == pytest.approx(0.0167)


# ---------------------------------------------------------------- the sweep
def pts(goods: dict[int, int], p99: dict[int, float] | None = None) -> list[dict]:
    return [{"c": c, "good": g, "ttft_p99": (p99 or {}).get(c, 100.0)} for c, g in goods.items()]


def test_pick_best_prefers_goodput_then_an_interior_tie_then_ttft() -> None:
    assert pick_best(pts({8: 10, 16: 30, 32: 20}), "c")["c"] == 16
    # a flat top reaching the edge: the interior member of the tie
    assert pick_best(pts({8: 10, 16: 30, 32: 30}, {16: 500.0, 32: 100.0}), "c")["c"] == 16
    # ties inside the grid: the lower TTFT p99
    assert pick_best(pts({8: 1, 16: 30, 32: 30, 64: 2}, {16: 500.0, 32: 100.0}), "c")["c"] == 32
    with pytest.raises(ValueError):
        pick_best([], "c")


def test_edge_extension_grows_the_grid_until_the_best_is_interior() -> None:
    assert edge_extension([16, 32, 64], 32) is None
    assert edge_extension([16, 32, 64], 64) == 128
    assert edge_extension([16, 32, 64], 16, lower_bound=1) == 8
    assert edge_extension([1, 2, 4], 1, lower_bound=1) is None  # nothing lower exists
    assert edge_extension([0, 4, 16], 0, lower_bound=0) is None
    assert edge_extension([1, 4, 16], 1, lower_bound=0) == 0
    assert edge_extension([5], 5) == 10
    with pytest.raises(ValueError):
        edge_extension([1, 2], 3)


def test_sweep_verdicts() -> None:
    assert sweep_verdict([16, 32, 64], 32) == "interior"
    assert sweep_verdict([16, 32, 64], 64) == "edge"
    assert sweep_verdict([16, 32, 64], 16, lower_bound=1) == "edge"
    assert sweep_verdict([0, 4, 16], 0, lower_bound=0).startswith("at the lower bound")


def test_the_sweep_extends_an_edge_best_and_stops_when_interior(tmp_path: Path) -> None:
    """Bench.sweep against a fake runner whose goodput peaks at C=256, Q=8."""
    plan = Plan(workloads=("prefix",), rates={"prefix": (10.0, 16.0)}, seconds=1.0,
                sweep_concurrency=(16, 32, 64, 128), sweep_queue=(4, 16, 64), sweep_queue_at=16,
                max_extensions=3, quick=False)
    bench = Bench.__new__(Bench)
    bench.plan, bench.points_path, bench.runs = plan, tmp_path / "points.jsonl", {}
    calls = []

    def fake_run(workload, rate, name, limits=None, phase="main", tuned=None, seed=0):
        c, q = limits["max_concurrent"], limits["queue_size"]
        calls.append((c, q))
        good = 1000 - abs(c - 256) - 3 * abs(q - 8)
        point = {"workload": workload, "rate": rate, "router": name, "limits": limits, "phase": phase,
                 "result": {"good": good, "ttft_ms": {"p99": 100.0}}}
        bench.runs[run_key(workload, rate, name, limits, seed)] = point
        return point

    bench.run = fake_run
    tuned = bench.sweep("prefix")
    assert tuned["limits"] == [256, 4]
    assert tuned["concurrency_grid"] == [16, 32, 64, 128, 256, 512]
    assert tuned["queue_grid"] == [2, 4, 16, 64]  # the queue swept at the best concurrency
    assert tuned["verdicts"] == {"max_concurrent": "interior", "queue_size": "interior"}
    assert all(rate == 16.0 for (_, rate, _, _, _) in bench.runs)  # at the top rate
    saved = [json.loads(line) for line in bench.points_path.read_text().splitlines()]
    assert saved[-1]["tuned"] == tuned


def test_a_lower_rate_with_misses_gets_its_own_concurrency_sweep(tmp_path: Path) -> None:
    """Bench.workload: limits tuned at the top rate; at a lower rate where they leave misses,
    the concurrency limit is swept again (queue as tuned); where they do not, it is not."""
    plan = Plan(workloads=("prefix",), rates={"prefix": (8.0, 12.0, 16.0)}, seconds=1.0,
                sweep_concurrency=(16, 32, 64), sweep_queue=(), sweep_queue_at=16,
                max_extensions=2, quick=False, routers=("smg-ca",))
    bench = Bench.__new__(Bench)
    bench.plan, bench.points_path, bench.runs = plan, tmp_path / "points.jsonl", {}
    peak = {16.0: 16, 12.0: 64, 8.0: 16}  # the best concurrency per rate

    def fake_run(workload, rate, name, limits=None, phase="main", tuned=None, seed=0):
        c = limits["max_concurrent"]
        good = 100 - abs(c - peak[rate]) // 8
        point = {"workload": workload, "rate": rate, "router": name, "limits": limits, "phase": phase,
                 "result": {"good": good, "attainment": good / 100, "ttft_ms": {"p99": 1.0}}}
        bench.runs[run_key(workload, rate, name, limits, seed)] = point
        return point

    bench.run = fake_run
    bench.workload("prefix")
    saved = [json.loads(line) for line in bench.points_path.read_text().splitlines()]
    assert tuned_limits(saved) == {"prefix": (16, 16)}
    assert rate_tuned_limits(saved) == {("prefix", 12.0): (64, 16)}  # 8 req/s had no miss
    retuned = [p for p in saved if p.get("rate_tuned")][0]["rate_tuned"]
    assert retuned["grid"] == [16, 32, 64, 128] and retuned["verdict"] == "interior"


# ---------------------------------------------------------------- rendering
def point(workload: str, rate: float, router: str, goodput: float, limits=None, phase="main",
          tuned=None, added=1.0, cpu=5.0, **extra) -> dict:
    n = 100
    good = round(goodput / rate * n)
    result = {"requests": n, "completed": n, "good": good, "failed": 0, "failures": {},
              "attainment": good / n, "goodput": goodput,
              "ttft_ms": {"p50": 100.0, "p90": 200.0, "p99": 300.0},
              "tpot_ms": {"p50": 20.0, "p90": 30.0, "p99": 40.0},
              "e2e_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0}, "ttft_attainment": 1.0}
    tokens = 200 * n  # 200 output tokens a request
    result["output_tokens"] = tokens
    p = {"workload": workload, "rate": rate, "router": router, "limits": limits, "phase": phase,
         "result": result, "prefill": {"computed_fraction": 0.5},
         "cpu": {"router_s": cpu * n / 1000, "servers_s": 10.0, "router_s_per_1000": cpu,
                 "output_tokens": tokens, "router_s_per_1000_tokens": cpu_per_1000(cpu * n / 1000, tokens, 4)},
         "probe": {"router_ttft_s": [0.02 + added / 1000] * 3, "direct_ttft_s": [0.02] * 3}, **extra}
    if tuned is not None:
        p["tuned"] = tuned
    return p


def synthetic_points() -> list[dict]:
    lim = lambda c, q: {"max_concurrent": c, "queue_size": q, "queue_timeout_s": 2}  # noqa: E731
    tuned = {"limits": [32, 16], "rate": 16.0, "concurrency_grid": [16, 32, 64],
             "queue_during_concurrency": 16, "queue_grid": [4, 16, 64],
             "verdicts": {"max_concurrent": "interior", "queue_size": "interior"}}
    pts = [point("prefix", 16.0, "smg-ca", g, lim(c, q), "sweep", added=1.5, cpu=4.0)
           for c, q, g in ((16, 16, 10.0), (64, 16, 12.0), (32, 4, 11.0), (32, 64, 12.5))]
    pts.append(point("prefix", 16.0, "smg-ca", 14.0, lim(32, 16), "sweep", tuned=tuned, added=1.5, cpu=4.0))
    pts += [point("prefix", 8.0, "smg-ca", 8.0, lim(32, 16), tuned=tuned, added=1.5, cpu=4.0),
            point("prefix", 8.0, "smg-rr", 8.0, added=2.0, cpu=4.5),
            point("prefix", 16.0, "smg-rr", 9.0, added=2.0, cpu=4.5),
            point("prefix", 8.0, "cp-default", 8.0, added=3.0, cpu=30.0),
            point("prefix", 16.0, "cp-default", 12.0, added=3.0, cpu=30.0, server_died={"server-a.log": "boom"}),
            point("prefix", 8.0, "cp-pab", 7.9, added=3.5, cpu=31.0),
            point("prefix", 16.0, "cp-pab", 11.0, added=3.5, cpu=31.0),
            point("prefix", 8.0, "cp-least", 8.0, added=3.2, cpu=33.0),
            point("prefix", 16.0, "cp-least", 13.0, added=3.2, cpu=33.0),
            point("azure", 6.0, "smg-rr", 5.0, added=2.0, cpu=9.0),
            point("azure", 6.0, "cp-default", 6.0, added=3.0, cpu=60.0),
            {"workload": "azure", "rate": 9.0, "router": "cp-pab", "error": "RuntimeError: x"}]
    return pts


def test_main_points_take_a_per_rate_choice_over_the_workload_one() -> None:
    points = synthetic_points()
    lim = {"max_concurrent": 64, "queue_size": 16, "queue_timeout_s": 2}
    points.append(point("prefix", 8.0, "smg-ca", 7.0, lim, "rate-sweep",
                        rate_tuned={"limits": [64, 16], "grid": [16, 32, 64, 128], "verdict": "interior"}))
    ca = {p["rate"]: p["limits"]["max_concurrent"] for p in main_points(points) if p["router"] == "smg-ca"}
    assert ca == {8.0: 64, 16.0: 32}
    text = render_markdown(points, {})
    assert "Per-rate concurrency sweep at 8 req/s" in text and "| 8 | **64** | **16** | 7.00 |" in text


def test_a_second_sweep_at_a_higher_rate_leaves_the_first_rates_choice_in_place() -> None:
    lim = lambda c, q: {"max_concurrent": c, "queue_size": q, "queue_timeout_s": 2}  # noqa: E731
    first = {"limits": [256, 16], "rate": 18.0}
    second = {"limits": [512, 16], "rate": 30.0}
    pts = [point("bursty", 18.0, "smg-ca", 17.7, lim(256, 16), "sweep", tuned=first),
           point("bursty", 18.0, "smg-ca", 13.3, lim(512, 16), "sweep"),
           point("bursty", 30.0, "smg-ca", 20.0, lim(512, 16), "sweep", tuned=second),
           point("bursty", 30.0, "smg-ca", 18.0, lim(256, 16), "sweep")]
    chosen = {p["rate"]: p["limits"]["max_concurrent"] for p in main_points(pts)}
    assert chosen == {18.0: 256, 30.0: 512}


def test_each_tuned_smg_router_keeps_its_own_choice_and_sweep_table() -> None:
    lim = lambda c, q: {"max_concurrent": c, "queue_size": q, "queue_timeout_s": 2}  # noqa: E731
    points = synthetic_points()
    least = {"limits": [64, 16], "rate": 16.0, "concurrency_grid": [16, 64, 256],
             "queue_during_concurrency": 16, "queue_grid": [16],
             "verdicts": {"max_concurrent": "interior", "queue_size": "not swept"}}
    points += [point("prefix", 16.0, "smg-ll", 13.5, lim(16, 16), "sweep"),
               point("prefix", 16.0, "smg-ll", 12.0, lim(256, 16), "sweep"),
               point("prefix", 16.0, "smg-ll", 14.5, lim(64, 16), "sweep", tuned=least),
               point("prefix", 8.0, "smg-ll", 8.0, lim(64, 16), tuned=least),
               point("prefix", 8.0, "smg-ll", 6.0, lim(32, 16))]  # not its choice: left out
    chosen = {(p["router"], p["rate"]): p["limits"]["max_concurrent"] for p in main_points(points)
              if p["router"] in ("smg-ca", "smg-ll")}
    assert chosen == {("smg-ca", 8.0): 32, ("smg-ca", 16.0): 32, ("smg-ll", 8.0): 64, ("smg-ll", 16.0): 64}
    assert tuned_limits(points, "smg-ll") == {"prefix": (64, 16)} and tuned_limits(points) == {"prefix": (32, 16)}
    text = render_markdown(points, {})
    assert "smg least_load sweep at 16 req/s" in text and "smg cache_aware sweep at 16 req/s" in text
    assert "| 16 | smg-ll (C=64, Q=16) | **14.50** |" in text
    assert "goodput, prefix at 16 req/s: 14.50 (smg-ll) against 13.00 (cp-least)" in "\n".join(wins(points, "smg"))
    assert render_json(points, {})["sweeps"]["smg-ll"]["prefix"]["best"] == [64, 16]


def test_main_points_keep_only_the_tuned_cache_aware_limits_and_skip_errors() -> None:
    rows = main_points(synthetic_points())
    ca = [p for p in rows if p["router"] == "smg-ca"]
    assert {(p["rate"], p["limits"]["max_concurrent"], p["limits"]["queue_size"]) for p in ca} == \
        {(8.0, 32, 16), (16.0, 32, 16)}
    assert not any("error" in p for p in rows)
    assert [p["router"] for p in rows if p["workload"] == "prefix" and p["rate"] == 16.0] == \
        ["smg-rr", "smg-ca", "cp-default", "cp-pab", "cp-least"]
    assert tuned_limits(synthetic_points()) == {"prefix": (32, 16)}


def test_smg_wins_names_goodput_latency_and_cpu_wins_only() -> None:
    found = smg_wins(synthetic_points())
    text = "\n".join(found)
    # the daemon's best at 16 req/s is cp-least (13.00), above cp-default's 12.00
    assert "goodput, prefix at 16 req/s: 14.00 (smg-ca) against 13.00 (cp-least), 1.08x" in text
    assert "prefix at 8 req/s" not in text  # a tie is no win
    assert "azure at 6" not in text  # the daemon wins there
    assert any(w.startswith("added latency") for w in found)
    assert any(w.startswith("router CPU, prefix") for w in found)
    # per streamed token too: smg 4.0-4.5 s / 1000 req at 200 tokens a request, the daemon 30-33
    assert "router CPU, prefix: 4.5 s per 1000 requests or less for smg against 30.0 s or more for the " \
           "daemon (6.7x); per 1000 streamed output tokens 0.020-0.022 s against 0.150-0.165 s" in text
    daemon = wins(synthetic_points(), "cp")
    assert daemon == ["goodput, azure at 6 req/s: 6.00 (cp-default) against 5.00 (smg-rr), 1.20x"]


def test_render_markdown_and_json_hold_the_tables_the_sweep_and_the_caveats() -> None:
    meta = {"git": {"commit": "abc1234", "dirty": False}, "started": "now", "machine": "2 vCPUs",
            "seconds": 30.0, "commands": ["scripts/bench_routers.sh"], "smg_version": "1.13.0",
            "notes": ["a note"]}
    text = render_markdown(synthetic_points(), meta)
    assert "from `out/bench_routers/points.jsonl`; do not edit." in text  # a page from before it was recorded
    assert "from `out/rt/points.jsonl`; do not edit." in render_markdown(
        synthetic_points(), meta | {"points": "out/rt/points.jsonl"})
    assert "## Where smg wins" in text and "Machine caveats" in text and "emulated" in text
    assert "## Where the daemon wins" in text and "A FairBatching server crashed in 1 run(s)" in text
    assert "| 16 | smg-ca (C=32, Q=16) | **14.00** |" in text
    assert "| 16 | cp-default † |" in text and "† a server died" in text
    assert "router CPU s / 1000 req | router CPU s / 1000 tokens |" in text
    assert "| 16 | cp-least | 13.00 | 0.810 | 0 | 100 / 200 / 300 | 20.0 / 30.0 / 40.0 | 50% | 33.0 | 0.165 |" \
        in text
    defaults = "its defaults, `policy = pab_cache_aware` and `on_no_budget = reject`"
    assert (f"`cp-default` / `cp-one` / `cp-pab` / `cp-least` / `cp-spill` = the daemon ({defaults} / "
            f"{defaults} / `policy = pab` / `policy = pab_least_loaded` / `on_no_budget = spill`, other "
            "keys default") in text
    assert "(`cp-one`: the gateway in the daemon's process, `serve --http`)" in text
    assert "| cp-least | 6 |" in text and "CPU s / 1000 tokens (prefix): router, servers" in text
    assert "| 33.0, 100 | 0.165, 0.50 |" in text  # prefix: per request, then per token
    assert "best C=32, Q=16; concurrency interior, queue size interior" in text
    assert "| **32** | **16** | 14.00 |" in text
    assert "## Router added latency" in text and "| smg-rr |" in text
    assert "scripts/bench_routers.sh" in text and "- a note" in text
    data = render_json(synthetic_points(), meta)
    assert data["sweeps"]["smg-ca"]["prefix"]["best"] == [32, 16] and data["sweeps"]["smg-ca"]["azure"] is None
    assert data["added_latency"]["cp-pab"]["added_ms"] == pytest.approx(3.5)
    assert data["cpu"]["prefix"]["cp-default"]["router_s_per_1000"] == pytest.approx(30.0)
    assert data["cpu"]["prefix"]["cp-least"]["router_s_per_1000_tokens"] == pytest.approx(0.165)
    assert any(c["router"] == "cp-least" for c in data["comparison"])
    json.dumps(data)


def test_a_workload_with_classes_gets_per_class_columns() -> None:
    classes = {"interactive": {"requests": 20, "good": 12, "attainment": 0.6, "ttft_p99_ms": 812.0},
               "relaxed": {"requests": 30, "good": 30, "attainment": 1.0, "ttft_p99_ms": 2100.0},
               "standard": {"requests": 50, "good": 45, "attainment": 0.9, "ttft_p99_ms": 1500.0}}
    bursty = point("bursty", 13.0, "cp-default", 11.7)
    bursty["result"]["by_class"] = classes
    text = render_markdown([bursty, point("prefix", 13.0, "cp-default", 13.0)], {})
    assert "## Bursty, three SLO classes (the shared prefixes at gamma arrivals of CV 4; classes " \
           "interactive 20%, standard 50%, relaxed 30%)" in text
    assert "attainment interactive / relaxed / standard | TTFT p99 ms interactive / relaxed / standard |" in text
    assert "| 5.0 | 0.025 | 0.60 / 1.00 / 0.90 | 812 / 2100 / 1500 |" in text
    prefix_table = text.split("## Shared prefixes")[1].split("##")[0]
    assert "attainment interactive" not in prefix_table


def test_cpu_per_token_is_unknown_where_a_run_did_not_record_its_tokens() -> None:
    old = point("azure", 6.0, "smg-rr", 5.0, cpu=9.0)
    del old["result"]["output_tokens"], old["cpu"]["output_tokens"], old["cpu"]["router_s_per_1000_tokens"]
    new = point("azure", 9.0, "smg-rr", 8.0, cpu=9.0)
    assert cpu_summary([new])["azure"]["smg-rr"]["router_s_per_1000_tokens"] == pytest.approx(0.045)
    summary = cpu_summary([old, new])["azure"]["smg-rr"]
    assert summary["router_s_per_1000"] == pytest.approx(9.0)
    assert summary["router_s_per_1000_tokens"] is None and summary["output_tokens"] is None
    text = render_markdown([old], {})
    assert "| 6 | smg-rr | **5.00** |" in text and "| 9.0 | - |" in text and "| 9.0, 100 | -, - |" in text


# ---------------------------------------------------------------- the daemon's routers
def test_every_daemon_router_is_named_from_its_settings_and_its_config_parses(tmp_path: Path) -> None:
    from controlplane.config import ConfigError, DaemonConfig

    defaults = DaemonConfig()
    assert defaults.policy == DAEMON_DEFAULT_POLICY == "pab_cache_aware"
    assert set(DAEMON_ROUTERS) <= set(ROUTERS) and "cp-least" in ROUTERS and "cp-cache" not in ROUTERS
    assert DAEMON_ROUTERS["cp-least"] == DaemonSettings("pab_least_loaded")
    assert DAEMON_ROUTERS["cp-default"] == DaemonSettings()
    assert DAEMON_ROUTERS["cp-spill"] == DaemonSettings(on_no_budget="spill")
    # no two routers run the daemon the same way: the defaults' own name is cp-default
    assert all(settings == settings.normalised() for settings in DAEMON_ROUTERS.values())
    assert daemon_router_name(DaemonSettings(DAEMON_DEFAULT_POLICY, defaults.on_no_budget)) == "cp-default"
    assert daemon_router_name(DaemonSettings(DAEMON_DEFAULT_POLICY), embedded=True) == "cp-one"
    assert EMBEDDED_ROUTERS <= set(DAEMON_ROUTERS)
    stack = Stack(tmp_path, "smg", WORDS)
    for name, settings in DAEMON_ROUTERS.items():
        assert daemon_router_name(settings, embedded=name in EMBEDDED_ROUTERS) == name
        text = stack.daemon_config_text(settings)
        check_daemon_config(text)
        config = DaemonConfig.from_mapping(tomllib.loads(text)["daemon"])
        assert config.policy == (settings.policy or DAEMON_DEFAULT_POLICY)
        assert config.on_no_budget == (settings.on_no_budget or defaults.on_no_budget)
        assert config.chars_per_token == pytest.approx(stack.chars_per_token)
        assert config.client_address == stack.addresses["client"]
        assert config.log_level == "warning"
    comment = stack.daemon_config_comment()
    assert comment.startswith("# daemon config: [daemon]; client_address = ") and "\n" not in comment
    assert 'policy = "POLICY"' in comment
    with pytest.raises(KeyError):
        daemon_router_name(DaemonSettings("power_of_two"))
    with pytest.raises(ConfigError):
        check_daemon_config(stack.daemon_config_text(DaemonSettings("no_such_policy")))
    with pytest.raises(ConfigError):
        check_daemon_config(stack.daemon_config_text(DaemonSettings(on_no_budget="drop")))


def test_the_daemon_restarts_for_every_run_and_names_its_router(tmp_path: Path) -> None:
    class Alive:
        pid = 1

        def poll(self):
            return None

    stack = Stack(tmp_path, "smg", WORDS)
    spawned = []

    def fake_spawn(settings, embedded=False):
        spawned.append(settings.policy)
        stack.daemon, stack.daemon_settings, stack.daemon_embedded = Alive(), settings, embedded
        stack.gateway = None if embedded else Alive()

    stack.spawn_daemon, stack.wait_daemon = fake_spawn, lambda: None
    routers = [stack.start_daemon(DaemonSettings(p))
               for p in ("pab", "pab", "pab_least_loaded", "pab_least_loaded", None)]
    routers.append(stack.start_daemon(DaemonSettings(), embedded=True))
    routers.append(stack.start_daemon(DaemonSettings(on_no_budget="spill")))
    assert spawned == ["pab", "pab", "pab_least_loaded", "pab_least_loaded", None, None, None]  # its trees start empty
    assert [r.name for r in routers] == ["cp-pab", "cp-pab", "cp-least", "cp-least", "cp-default", "cp-one",
                                         "cp-spill"]
    assert "policy = pab_least_loaded;" in routers[2].command
    assert "policy = default (pab_cache_aware);" in routers[4].command
    assert "policy = default (pab_cache_aware), on_no_budget = spill;" in routers[6].command
    assert "--http" in routers[5].command and "gateway --listen" not in routers[5].command
    assert len(routers[5].pids) == 1 and len(routers[4].pids) == 2  # its CPU: the one process


def test_plans_and_the_cli_refuse_unknown_names(tmp_path: Path) -> None:
    parser_args = ["--quick", "--workloads", "prefix"]
    import argparse

    ns = argparse.Namespace(quick=True, azure_rates=None, prefix_rates="5,6", workloads="prefix",
                            seconds=None, sweep_concurrency=None, sweep_queue=None,
                            sweep_queue_at=16, max_extensions=None, routers="smg-rr,cp-pab")
    plan = build_plan(ns)
    assert plan.rates["prefix"] == (5.0, 6.0) and plan.seconds == QUICK_SECONDS
    assert plan.max_extensions == 0 and plan.routers == ("smg-rr", "cp-pab")
    with pytest.raises(SystemExit):
        build_plan(argparse.Namespace(**{**vars(ns), "workloads": "nope"}))
    with pytest.raises(SystemExit):
        build_plan(argparse.Namespace(**{**vars(ns), "routers": "nginx"}))
    assert parser_args  # the CLI takes the same names
    points = tmp_path / "points.jsonl"
    points.write_text("".join(json.dumps(p) + "\n" for p in synthetic_points()))
    assert main(["--render-only", "--points", str(points), "--out", str(tmp_path)]) == 0
    assert "Where smg wins" in (tmp_path / "routers.md").read_text()


# ---------------------------------------------------------------- end to end
def _smg() -> str | None:
    for candidate in (os.environ.get("FB_SMG"), shutil.which("smg"),
                      *sorted(glob.glob(os.path.expanduser("~/.cache/fairbatching/env-*bench-router*/bin/smg")))):
        if candidate and Path(candidate).exists():
            return candidate
    return None


@pytest.mark.slow
@pytest.mark.e2e
def test_quick_run_end_to_end(tmp_path: Path) -> None:
    """``--quick`` on the shared-prefix workload: two servers, the daemon, smg; every router
    serves the run and the page is rendered (about 3-4 minutes on 2 vCPUs)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (the `sglang` extra)")
    smg = _smg()
    if smg is None:
        pytest.skip("smg is not installed: `FB_EXTRAS=bench-router source scripts/_env.sh` "
                    "(or scripts/bench_routers.sh) makes its environment; or set FB_SMG")
    points = tmp_path / "points.jsonl"
    command = [sys.executable, "-m", "benchmarks.routers", "--quick", "--workloads", "prefix,bursty",
               "--seconds", "8", "--smg", smg, "--points", str(points), "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = [json.loads(line) for line in points.read_text().splitlines()]
    assert {p["router"] for p in saved} == set(ROUTERS)
    for p in saved:
        assert "error" not in p, p
        assert p["result"]["completed"] > 0, p
        assert p["probe"]["router_ttft_s"] and p["cpu"]["router_s"] > 0
    assert tuned_limits(saved)["prefix"][0] in QUICK_SWEEP_CONCURRENCY
    bursty = [p for p in saved if p["workload"] == "bursty"]
    assert bursty and all(set(p["result"]["by_class"]) == {"interactive", "standard", "relaxed"} for p in bursty)
    text = (tmp_path / "routers.md").read_text()
    assert "## Where smg wins" in text and "Shared prefixes" in text
    assert "Bursty, three SLO classes" in text and "attainment interactive / relaxed / standard" in text
