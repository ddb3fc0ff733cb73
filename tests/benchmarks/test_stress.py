"""The stress benchmark's schedules and summary (the runs themselves start servers:
``python -m benchmarks.server.stress``)."""

from __future__ import annotations

import pytest

from benchmarks.server.stress import UNMEETABLE, schedule, summarise


@pytest.mark.slow
def test_schedules_are_seeded_and_hostile() -> None:
    assert schedule(3, 8192, 1024) == schedule(3, 8192, 1024)
    runs = [schedule(seed, 8192, 1024) for seed in range(60)]
    requests = [r for run in runs for r in run]
    assert {r.behaviour for r in requests} == {"complete", "disconnect", "give_up"}
    assert any(len(r.prompt) > 8192 for r in requests), "prompts past the pool"
    assert any(r.slo == UNMEETABLE for r in requests)
    assert {len(run) for run in runs} >= {8, 1024}
    assert all(a.at_s <= b.at_s for run in runs for a, b in zip(run, run[1:]))
    shared = [r.prompt[:500] for r in requests if len(r.prompt) > 600]
    assert len(set(shared)) < len(shared), "long prompts share prefixes"


def test_the_summary_counts_per_configuration_and_pool() -> None:
    run = {"config": "fairbatching", "pool_tokens": 8192, "requests": 10, "crashed": False,
           "not_one_answer": 0, "retracted": 2, "leak_warnings": 0, "stuck": 0, "client_timeouts": 1,
           "ttft_p99_s": 0.5}
    crashed = {**run, "crashed": True, "retracted": None, "ttft_p99_s": None}
    table = summarise([run, crashed, {**run, "pool_tokens": 32768}])
    assert table["fairbatching"]["runs"] == 3 and table["fairbatching"]["crashes"] == 1
    assert table["fairbatching@8192"]["retracted"] == 2 and table["fairbatching@8192"]["stuck"] == 2
    assert table["fairbatching@32768"]["runs"] == 1


def test_the_table_has_a_row_per_configuration() -> None:
    from benchmarks.server.stress import render

    row = {"runs": 2, "requests": 9, "crashes": 0, "not_one_answer": 1, "retracted": 3.0, "leak_warnings": 0,
           "stuck": 0, "ttft_p99_s_median_over_runs": None}
    text = render({"fairbatching": row, "stock-mixed-256": {**row, "ttft_p99_s_median_over_runs": 1.234}},
                  {"command": "python -m benchmarks.server.stress", "commit": "abc", "date": "today", "wall_s": 5})
    assert "| fairbatching | 2 | 9 | 0 | 1 | 3 | 0 | 0 | - |" in text
    assert "| stock-mixed-256 | 2 | 9 | 0 | 1 | 3 | 0 | 0 | 1.23 |" in text
