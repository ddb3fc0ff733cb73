"""smg's priority scheduler as a router baseline: its YAML, the class header, the sweep of
its reserved slots and the keys its points are found by; the YAML also against the real
smg binary where the ``bench-router`` extra is installed."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.routers.analysis import main_points, router_label, tuned_limits
from benchmarks.routers.command import find_smg
from benchmarks.routers.load_generator import smg_priority_headers
from benchmarks.routers.rendering import render_markdown
from benchmarks.routers.runs import Bench, Plan, run_key, smg_limits
from benchmarks.routers.stack import (
    PRIORITY_SMG,
    SMG_PRIORITY_CLASS,
    TUNED_SMG,
    class_ttfts,
    limits_key,
    priority_scheduler_yaml,
)
from benchmarks.routers.traffic import Request
from benchmarks.support.ports import free_ports

LIMITS = smg_limits(32, 16, 4)


def test_every_slo_class_has_an_smg_class_and_the_router_is_tuned() -> None:
    assert set(SMG_PRIORITY_CLASS) == set(class_ttfts())
    assert set(SMG_PRIORITY_CLASS.values()) == {"interactive", "default", "bulk"}
    assert PRIORITY_SMG <= set(TUNED_SMG)


def test_the_header_names_the_requests_class_as_smg_does() -> None:
    assert smg_priority_headers(Request(0, 0.0, 10, 2, slo_class="relaxed")) == {"x-smg-priority": "bulk"}
    assert smg_priority_headers(Request(0, 0.0, 10, 2)) == {"x-smg-priority": "default"}  # standard


def test_the_yaml_reserves_slots_for_interactive_and_times_each_queue_out_at_its_ttft() -> None:
    text = priority_scheduler_yaml(LIMITS, {"interactive": 0.5, "standard": 2.0, "relaxed": 5.0})
    rows = dict(line.strip().split(": ", 1) for line in text.splitlines()[1:])
    assert rows["interactive"] == ("{reserved_floor: 4, reserved_per_slot: 0.0, queue_size: 16, "
                                   "queue_timeout_secs: 1, starvation_threshold_secs: 1, can_preempt: true}")
    assert "queue_timeout_secs: 2," in rows["default"] and "reserved_floor: 0," in rows["default"]
    assert "queue_timeout_secs: 5," in rows["bulk"] and "can_preempt: false" in rows["bulk"]


def test_the_limits_key_carries_the_reserved_slots_only_for_the_priority_scheduler() -> None:
    assert limits_key(smg_limits(32, 16)) == (32, 16)
    assert limits_key(LIMITS) == (32, 16, 4)
    assert limits_key(None) is None


def test_the_reserved_slots_are_swept_after_c_and_q_and_stay_below_c(tmp_path: Path) -> None:
    """Bench.sweep against a fake runner whose goodput peaks at C=16, Q=8 and R=12 (beyond
    what C allows: R stops below C)."""
    plan = Plan(workloads=("bursty",), rates={"bursty": (20.0,)}, seconds=1.0,
                sweep_concurrency=(8, 16, 32), sweep_queue=(4, 8, 16), sweep_queue_at=8,
                max_extensions=3, quick=False, routers=("smg-prio",), sweep_reserved=(0, 2, 4))
    bench = Bench.__new__(Bench)
    bench.plan, bench.points_path, bench.runs = plan, tmp_path / "points.jsonl", {}
    seen = []

    def fake_run(workload, rate, name, limits=None, phase="main", tuned=None, seed=0):
        c, q, r = limits_key(limits)
        seen.append((c, q, r))
        good = 1000 - 10 * abs(c - 16) - 10 * abs(q - 8) - abs(r - 12)
        point = {"workload": workload, "rate": rate, "router": name, "limits": limits, "phase": phase,
                 "result": {"good": good, "ttft_ms": {"p99": 100.0}}}
        bench.runs[run_key(workload, rate, name, limits, seed)] = point
        return point

    bench.run = fake_run
    tuned = bench.sweep("bursty", "smg-prio")
    assert tuned["limits"] == [16, 8, 8]  # 16 would be the next edge: not below C
    assert tuned["reserved_grid"] == [0, 2, 4, 8]
    assert all(r == 0 for c, q, r in seen[:6])  # C and Q swept with nothing reserved
    assert all(r < c for c, q, r in seen)
    saved = [json.loads(line) for line in bench.points_path.read_text().splitlines()]
    assert tuned_limits(saved, "smg-prio") == {"bursty": (16, 8, 8)}


def point(rate: float, limits: dict, good: float, tuned: dict | None = None, phase: str = "main") -> dict:
    result = {"requests": 100, "completed": 100, "good": int(good), "failed": 0, "failures": {},
              "attainment": good / 100, "goodput": rate * good / 100,
              "ttft_ms": {"p50": 100.0, "p90": 200.0, "p99": 300.0},
              "tpot_ms": {"p50": 20.0, "p90": 30.0, "p99": 40.0},
              "e2e_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0}, "ttft_attainment": 1.0, "output_tokens": 100}
    p = {"workload": "bursty", "rate": rate, "router": "smg-prio", "limits": limits, "phase": phase,
         "result": result, "prefill": {"computed_fraction": 0.5}}
    if tuned is not None:
        p["tuned"] = tuned
    return p


def test_the_comparison_keeps_the_chosen_reserved_slots_and_the_page_shows_them() -> None:
    tuned = {"limits": [32, 16, 4], "rate": 20.0, "concurrency_grid": [16, 32, 64], "queue_grid": [16],
             "reserved_grid": [0, 4, 16], "verdicts": {"max_concurrent": "interior",
                                                       "queue_size": "not swept",
                                                       "interactive_reserved": "interior"}}
    points = [point(20.0, smg_limits(32, 16, 0), 80.0, phase="sweep"),
              point(20.0, smg_limits(32, 16, 16), 70.0, phase="sweep"),
              point(20.0, smg_limits(32, 16, 4), 90.0, tuned=tuned, phase="sweep"),
              point(20.0, smg_limits(32, 16, 4), 90.0, tuned=tuned)]
    (chosen,) = main_points(points)
    assert limits_key(chosen["limits"]) == (32, 16, 4)
    assert router_label(chosen) == "smg-prio (C=32, Q=16, R=4)"
    text = render_markdown(points, {"notes": []})
    assert "smg cache_aware + priority scheduler sweep at 20 req/s" in text
    assert "R=4; concurrency interior, queue size not swept, interactive reserved interior." in text
    assert "| 20 | **32** | **16** | **4** | 18.00 |" in text


def start_smg(smg: str, config: Path, log: Path) -> subprocess.Popen:
    (port,) = free_ports(1)
    with log.open("w") as out:
        return subprocess.Popen(
            [smg, "launch", "--host", "127.0.0.1", "--port", str(port),
             "--worker-urls", "http://127.0.0.1:9", "--policy", "cache_aware",
             "--max-concurrent-requests", "32", "--priority-scheduler-enabled",
             "--priority-scheduler-config", str(config),
             "--priority-scheduler-default-max-class", "interactive", "--log-level", "info"],
            stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_the_real_smg_starts_with_the_yaml_and_refuses_a_malformed_one(tmp_path: Path) -> None:
    smg = find_smg(None)
    if smg is None:
        pytest.skip("smg is not installed (the bench-router extra; FB_SMG names its binary)")
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    text = priority_scheduler_yaml(LIMITS, class_ttfts())
    good.write_text(text)
    bad.write_text(text.replace("queue_timeout_secs: 1,", "queue_timeout_secs: 0.5,"))
    refused = start_smg(smg, bad, tmp_path / "bad.log")
    assert refused.wait(timeout=60) != 0  # smg's queue timeouts are whole seconds
    assert "priority_scheduler_config" in (tmp_path / "bad.log").read_text()
    log = tmp_path / "good.log"
    process = start_smg(smg, good, log)
    try:
        deadline = time.monotonic() + 60
        while "Starting router on" not in log.read_text():  # past the config's validation
            assert process.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        assert process.poll() is None
    finally:
        process.terminate()
        process.wait(timeout=20)
