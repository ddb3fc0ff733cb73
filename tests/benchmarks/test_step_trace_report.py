""":mod:`benchmarks.server.step_trace_report` on a hand-made step log and client token times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.server import step_trace_report


def step(k: int, at: float, tokens: list, parked: list, device_s: float = 0.010) -> dict:
    return {"step": k, "decided_at": at - 0.012, "decision_s": 0.0002, "planned_start": at - 0.010,
            "waiting": 0, "budget_s": 0.05, "predicted_s": 0.010, "launched_at": at - 0.011,
            "done_at": at - 0.001, "processed_at": at, "device_s": device_s, "new_tokens": 2,
            "prefill_tokens": 0, "decodes": 2, "context": 100, "tokens": tokens, "parked": parked}


@pytest.fixture
def logs(tmp_path: Path) -> tuple[Path, Path]:
    steps = [
        step(0, 1.00, [["a", 1, 1.5], ["b", 1, 1.5]], []),
        step(1, 1.01, [["b", 2, 1.6]], ["a"]),
        step(2, 1.02, [["b", 3, 1.7]], ["a"]),
        step(3, 1.03, [["a", 2, 1.04], ["b", 4, 1.8]], []),
    ]
    steps_path = tmp_path / "steps.jsonl"
    steps_path.write_text("".join(json.dumps(s) + "\n" for s in steps) + '{"torn')
    clients = [
        {"rid": "a", "slo_class": "interactive", "sent_at": 0.9, "tokens": [1.005, 1.035]},
        {"rid": "b", "slo_class": "interactive", "sent_at": 0.9, "tokens": [1.005, 1.015, 1.025, 1.035]},
    ]
    tokens_path = tmp_path / "tokens.jsonl"
    tokens_path.write_text("".join(json.dumps(c) + "\n" for c in clients))
    return steps_path, tokens_path


def test_the_longest_gap_splits_into_parked_steps_and_the_producing_step(logs) -> None:
    report = step_trace_report.build_report(*logs, None)
    assert report["steps"]["steps"] == 4, "the torn last line is skipped"
    assert report["steps"]["steps_with_parked"] == 2
    assert report["steps"]["host_unhidden_ms"]["p50"] == pytest.approx(0.0)
    tokens = report["tokens"]
    assert tokens["requests_joined"] == 2
    assert tokens["delivery_ms"]["p50"] == pytest.approx(5.0)
    gap = tokens["longest_gap_ms"]
    assert gap["gap"]["p99"] == pytest.approx(30.0)  # a: 1.005 -> 1.035
    assert gap["parked"]["p99"] == pytest.approx(20.0)  # a was parked in steps 1 and 2
    assert gap["steps_between"]["p99"] == pytest.approx(10.0)
    assert tokens["max_tpot_violations"]["requests"] == 0
    assert tokens["emitted_minus_deadline_ms"]["p99"] == pytest.approx(-10.0)  # a's second token


def test_cli_prints_the_tables_and_refuses_a_missing_file(logs, tmp_path: Path, capsys) -> None:
    steps_path, tokens_path = logs
    out = tmp_path / "report.json"
    assert step_trace_report.main(["--steps", str(steps_path), "--tokens", str(tokens_path),
                                   "--json", str(out)]) == 0
    assert "longest gap per request: parked" in capsys.readouterr().out
    assert json.loads(out.read_text())["tokens"]["requests_joined"] == 2
    assert step_trace_report.main(["--steps", str(tmp_path / "missing.jsonl")]) == 2
