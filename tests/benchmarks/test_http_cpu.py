"""benchmarks.controlplane.http_cpu: its modes, and one short run of each against the real
stack (the control plane and simulated ranks as processes, streamed over HTTP)."""

from __future__ import annotations

import json

import pytest

from benchmarks.controlplane import http_cpu


def test_an_unknown_mode_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown mode 'both'"):
        http_cpu.HttpStack(tmp_path, tmp_path / "scratch", "both")
    with pytest.raises(SystemExit) as exit_info:
        http_cpu.main(["--modes", "gateway,both"])
    assert exit_info.value.code == 2 and "unknown mode 'both'" in capsys.readouterr().err


@pytest.mark.slow
def test_each_mode_streams_tokens_and_counts_its_processes_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(http_cpu, "RATE", 4.0)
    figures = tmp_path / "http.jsonl"
    assert http_cpu.main(["--seconds", "2", "--json", str(figures)]) == 0
    rows = [json.loads(line) for line in figures.read_text().splitlines()]
    assert [row["mode"] for row in rows] == ["gateway", "embedded"]
    for row in rows:
        assert row["finished"] >= 1 and row["failed"] == 0 and row["tokens"] >= 100 * row["finished"]
        assert row["control_plane_cpu_us_per_token"] > 0
    assert set(rows[0]["cpu_s"]) == {"daemon", "gateway", "ranks"}
    assert set(rows[1]["cpu_s"]) == {"daemon", "ranks"}
