"""Who pays, on the real-server side, without a server: SGLang's per-request priority (the
server flags of each mode, the priority each request is sent with, SGLang's own order of
those priorities) and the summary columns of the real-server tables (attainment per
prompt-length bucket and SLO class, the worst of each, token goodput) from synthetic
records: the replay's, and those of ``sglang.benchmark.serving --output-details``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import benchmarks.server.admission as adm
import benchmarks.server.stock_vs_fairbatching as bs
from benchmarks.server import priority
from benchmarks.server.client_runs import replay_command, serving_records
from benchmarks.server.trace_replay import ReplayRequest, request_body, summary_line
from sglang_ext.bundled import CONFIGS_DIR
from sglang_ext.policy.slo import SloCatalog
from sglang_ext.sim.metrics import MIN_GROUP_REQUESTS, RequestRecord, summarize

CATALOG = SloCatalog.from_toml(CONFIGS_DIR / "slo.toml")
CONFIG = {c.name: c for c in bs.CONFIGS}


# ------------------------------------------------------------------ priority: class -> priority
def test_class_priority_is_minus_the_ttft_target_tightest_most_urgent() -> None:
    priorities = priority.class_priorities(CATALOG)
    assert priorities == {"standard": -2000, "interactive": -500, "relaxed": -5000}
    # SGLang's default sign serves larger values first
    assert sorted(priorities, key=priorities.get, reverse=True) == ["interactive", "standard", "relaxed"]
    # an end-to-end class ranks by its envelope's first-token budget (code: 0.25 x 14 s)
    multi = priority.class_priorities(SloCatalog.from_toml(CONFIGS_DIR / "slo-multi.toml"))
    assert multi == {"chat": -2000, "code": -3500}


def test_request_priority_and_launch_flags_per_mode() -> None:
    assert priority.request_priority("none", CATALOG, "interactive", 700) is None
    assert priority.request_priority("class", CATALOG, "interactive", 700) == -500
    assert priority.request_priority("class", CATALOG, "standard", 10) == -2000
    assert priority.request_priority("prompt-length", CATALOG, "interactive", 700) == 700
    assert priority.launch_args("none") == ()
    assert priority.launch_args("class") == ("--enable-priority-scheduling",)
    assert priority.launch_args("prompt-length") == (
        "--enable-priority-scheduling", "--schedule-low-priority-values-first")
    for bad in (lambda: priority.launch_args("sjf"),
                lambda: priority.request_priority("fifo", CATALOG, "standard", 1)):
        with pytest.raises(ValueError, match="unknown priority mode"):
            bad()


@pytest.mark.sglang
def test_sglangs_own_sort_serves_the_tightest_class_then_the_shortest_prompt_first() -> None:
    """SGLang 0.5.23's waiting-queue sort under priority scheduling, on the priorities the
    client sends: default sign (-1) for the class mode, low values first (+1) for SJF."""
    policy = pytest.importorskip("sglang.srt.managers.schedule_policy").SchedulePolicy

    def req(name: str, value: int, entered: float) -> SimpleNamespace:
        return SimpleNamespace(name=name, priority=value,
                               time_stats=SimpleNamespace(wait_queue_entry_time=entered))

    queue = [req(name, priority.request_priority("class", CATALOG, name, 0), t)
             for t, name in enumerate(("relaxed", "standard", "interactive", "standard"))]
    policy._sort_by_priority_and_fcfs(queue, -1)  # priority_sign without --schedule-low-...
    assert [(r.name, r.time_stats.wait_queue_entry_time) for r in queue] == [
        ("interactive", 2), ("standard", 1), ("standard", 3), ("relaxed", 0)]
    queue = [req(str(n), priority.request_priority("prompt-length", CATALOG, "standard", n), t)
             for t, n in enumerate((4000, 30, 900, 30))]
    policy._sort_by_priority_and_fcfs(queue, 1)  # with --schedule-low-priority-values-first
    assert [(r.name, r.time_stats.wait_queue_entry_time) for r in queue] == [
        ("30", 1), ("30", 3), ("900", 2), ("4000", 0)]


def test_the_request_body_and_the_replay_command_carry_the_priority() -> None:
    request = ReplayRequest("r1", 0.0, 5, 3, "interactive")
    assert "priority" not in request_body(request, 5)
    body = request_body(request, 5, -500)
    assert body["priority"] == -500 and len(body["input_ids"]) == 5
    plain = replay_command("http://x", 4.0, 30.0, "trace", 0, "standard:1", "o.json")
    assert "--priority" not in plain  # unchanged: the saved points' commands stay the same
    assert replay_command("http://x", 4.0, 30.0, "trace", 0, "standard:1", "o.json",
                          priority="class")[-2:] == ["--priority", "class"]


# ------------------------------------------------------------------ the benchmarks' configurations
def test_priority_configurations_extend_the_best_mixed_chunk_with_its_queue_limit() -> None:
    queued = CONFIG["stock-mixed-512-queue-16"]
    assert queued.args == (*CONFIG["stock-mixed-512"].args, "--max-queued-requests", "16")
    assert queued.priority == "none" and queued.workloads == bs.WORKLOADS
    by_class = CONFIG["stock-mixed-512-queue-16-priority"]
    sjf = CONFIG["stock-mixed-512-queue-16-sjf"]
    assert by_class.args == (*queued.args, "--enable-priority-scheduling")
    assert sjf.args == (*queued.args, "--enable-priority-scheduling", "--schedule-low-priority-values-first")
    assert (by_class.priority, sjf.priority) == ("class", "prompt-length")
    # (a)'s load generator sends one priority for every request: the replay only
    plan = bs.Plan((16.0,), (4.0,), 20.0, 20.0, bs.CONFIGS, bs.WORKLOADS, (0,), 0.0)
    assert bs.todo_points(plan, sjf, set()) == [("replay", 4.0, 0)]
    assert len(bs.todo_points(plan, queued, set())) == 2
    # they are stock configurations, but not among the chunk sizes the best stock-mixed is from
    assert {by_class.name, sjf.name, queued.name} <= set(bs.STOCK_NAMES)
    assert bs.MIXED_NAMES == ("stock-mixed-256", "stock-mixed-512", "stock-mixed-1024")


def test_admission_benchmark_runs_shortest_first_at_the_best_queue_limit() -> None:
    points = [{"config": f"mixed-512-queue-{q}", "rate": rate, "seed": 0, "effective_rps": value}
              for q, rate, value in ((8, 16.0, 7.9), (16, 16.0, 8.7), (32, 16.0, 5.2), (16, 24.0, 9.1))]
    assert adm.best_queue(points, 512) == 16  # 16 req/s is the rate every limit has
    assert adm.best_queue(points, 256) is None
    config = adm.sjf_config(512, 16)
    assert config.name == "mixed-512-queue-16-sjf" and config.priority == "prompt-length"
    assert config.args[-4:] == ("--max-queued-requests", "16", "--enable-priority-scheduling",
                                "--schedule-low-priority-values-first")


# ------------------------------------------------------------------ the summary columns
def _records(met_long: int) -> list[RequestRecord]:
    """25 short interactive requests (all met), 20 of 1024-2047 tokens in standard
    (``met_long`` of them met), 5 of >= 4096 tokens (none met: too few to be the worst)."""
    slo = CATALOG.classes
    records = []

    def add(prompt: int, name: str, met: bool) -> None:
        record = RequestRecord(len(records), 0.0, slo[name], prompt, 2, name)
        first = 0.1 if met else 10.0  # 10 s: past either class's TTFT
        record.on_token(0, first)
        record.on_token(1, first + 0.01)
        records.append(record)

    for _ in range(25):
        add(100, "interactive", True)
    for index in range(20):
        add(1500, "standard", index < met_long)
    for _ in range(5):
        add(5000, "standard", False)
    return records


def test_summary_names_the_worst_bucket_and_class_among_groups_of_twenty() -> None:
    summary = summarize(_records(10), 4.0, 10.0)
    bucket, klass = summary["worst_prompt_bucket"], summary["worst_slo_class"]
    assert MIN_GROUP_REQUESTS == 20
    # >=4096 (0% of 5) is too small: the worst is 1024-2047 at 50%
    assert (bucket["label"], bucket["attainment"], bucket["requests"]) == ("1024-2047", 0.5, 20)
    assert bucket["sizes"] == {"<512": 25, "1024-2047": 20, ">=4096": 5}
    assert (klass["label"], klass["attainment"]) == ("standard", 0.4)  # 10 of 25
    # token goodput: the 35 requests that met, prompt + 2 output tokens each, over 10 s
    assert summary["token_goodput"] == pytest.approx((25 * 102 + 10 * 1502) / 10.0)
    line = summary_line(summary)
    assert "worst prompt bucket 1024-2047 50.0% (n=20)" in line
    assert "worst SLO class standard 40.0% (n=25)" in line and "token goodput 1,757 tok/s" in line


def _replay_point(config: str, seed: int, met_long: int) -> dict:
    records = _records(met_long)
    result = summarize(records, 4.0, 10.0)
    result["per_class"] = {name: summarize([r for r in records if r.slo_class == name], 4.0, 10.0)
                           for name in bs.REPLAY_CLASSES}
    return {"config": config, "workload": "replay", "rate": 4.0, "seed": seed, "result": result}


def test_replay_table_shows_buckets_worst_groups_and_token_goodput() -> None:
    points = [_replay_point("stock-mixed-512", seed, met) for seed, met in enumerate((10, 14))]
    points += [_replay_point("stock-mixed-512-queue-16-sjf", 0, 20)]
    cells = bs.aggregate(points)
    cell = cells[("replay", 4.0, "stock-mixed-512")]
    assert cell["metrics"]["worst_bucket_attainment"] == pytest.approx(
        {"mean": 0.6, "min": 0.5, "max": 0.7, "n": 2})
    assert cell["metrics"]["bucket:>=4096"]["mean"] == 0.0
    assert cell["labels"]["worst_bucket_attainment"] == [["1024-2047", 2]]
    lines = bs.replay_groups_table(cells, {("replay", 4.0): "stock-mixed-512"})
    assert lines[0].startswith("| rate req/s | config | <512 tokens | 512-1023 tokens | 1024-2047 tokens")
    assert lines[0].endswith("| worst bucket | interactive | standard | worst class | token goodput tok/s |")
    row = next(line for line in lines if "stock-mixed-512 *(best mixed)*" in line)
    assert "60.0% <sub>50.0–70.0%</sub> <sub>n=20</sub>" in row  # the 1024-2047 bucket
    assert "`1024-2047` 60.0% <sub>50.0–70.0%</sub>" in row  # the worst bucket
    assert "`standard` 48.0% <sub>40.0–56.0%</sub>" in row  # the worst class
    # all the long ones met: the worst bucket is the 100% tie, first in order; classes too
    sjf = next(line for line in lines if line.startswith("| 4 | stock-mixed-512-queue-16-sjf"))
    assert "`<512` 100.0%" in sjf and "`interactive` 80.0%" not in sjf
    # a point saved before these fields: dashes, no failure
    old = {**points[0], "config": "stock", "result": {"attainment": 0.9, "requests": 50}}
    row = next(line for line in bs.replay_groups_table(bs.aggregate([old]), {}) if "| stock |" in line)
    assert row.count(" - ") >= 5


def test_admission_table_has_the_worst_groups_and_token_goodput() -> None:
    def point(config: str, met: int) -> dict:
        summary = summarize(_records(met), 4.0, 10.0)
        return {"config": config, "rate": 4.0, "seed": 0, **adm.point_result(summary)}

    text = adm.render([point("mixed-512-queue-16", 10), point("mixed-512-queue-16-sjf", 20)])
    assert "Worst prompt-length bucket and worst SLO class" in text
    assert "| mixed-512-queue-16 | bucket `1024-2047` 50%, class `standard` 40%, 1,757 tok/s |" in text
    assert "| mixed-512-queue-16-sjf | bucket `<512` 100%" in text
    kept = point("x", 10)
    assert kept["by_slo_class"] == {"interactive": {"requests": 25, "attainment": 1.0},
                                    "standard": {"requests": 25, "attainment": 0.4}}


# ------------------------------------------------------------------ (a): sglang.benchmark.serving's records
def _serving_result(n_short: int, n_long_met: int, n_long_missed: int) -> dict:
    """A ``--output-details`` result: short prompts (600 tokens) that meet the SLO, long
    ones (1100) of which some meet and some run at a mean TPOT of 60 ms; one error."""
    rows = ([(600, 10, 0.2, [0.03] * 9, "")] * n_short
            + [(1100, 10, 0.5, [0.04] * 9, "")] * n_long_met
            + [(1100, 10, 0.5, [0.01, 0.53] + [0.0] * 7, "")] * n_long_missed  # 540 ms / 9
            + [(700, 0, 0.0, [], "HTTP 503")])
    keys = ("input_lens", "output_lens", "ttfts", "itls", "errors")
    return {**{key: [row[i] for row in rows] for i, key in enumerate(keys)},
            "duration": 20.0, "request_rate": 16.0}


def test_serving_records_keep_the_tools_ttft_and_mean_tpot_rule() -> None:
    slo = CATALOG.classes["standard"]
    assert serving_records({"ttfts": []}, slo, "standard") is None  # no --output-details
    records = serving_records(_serving_result(1, 1, 1), slo, "standard")
    short, long_met, stalled, failed = records
    assert short.slo_met and long_met.slo_met
    # a stall then a catch-up: mean TPOT 60 ms > 50 ms, a miss under the tool's rule too
    assert not stalled.slo_met and stalled.max_tpot_s == pytest.approx(0.06)
    assert long_met.max_tpot_s == pytest.approx(0.04) and long_met.ttft_s == 0.5
    assert failed.aborted and not failed.slo_met
    assert (short.prompt_tokens, short.output_tokens, short.slo_class) == (600, 10, "standard")


def test_random_workload_rows_get_the_worst_bucket_and_token_goodput(tmp_path: Path) -> None:
    result = {key: None for key in bs.RANDOM_KEYS} | _serving_result(25, 10, 10)
    result.update(request_goodput=1.75, slo_attainment=35 / 46, completed=45)
    output = tmp_path / "out.jsonl"
    output.write_text(json.dumps(result) + "\n")
    parsed = bs.parse_random(output)
    groups = parsed["groups"]
    assert groups["worst_prompt_bucket"]["label"] == "1024-2047"  # 10 of 20 met
    assert groups["worst_prompt_bucket"]["attainment"] == 0.5
    assert groups["attainment"] == pytest.approx(parsed["slo_attainment"])  # the tool's verdicts
    assert groups["token_goodput"] == pytest.approx((25 * 610 + 10 * 1110) / 20.0)
    point = {"config": "stock-mixed-512", "workload": "random", "rate": 16.0, "seed": 0, "result": parsed}
    cells = bs.aggregate([point])
    row = next(line for line in bs.random_table(cells, {}) if line.startswith("| 16 |"))
    assert row.endswith("| `1024-2047` 50.0% | 1,318 |")
    # a point saved before --output-details: dashes
    old = {**point, "result": {key: parsed[key] for key in bs.RANDOM_KEYS}}
    assert bs.random_table(bs.aggregate([old]), {})[-1].endswith("| - | - |")
