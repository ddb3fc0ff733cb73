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


def test_the_workloads_are_seeded_and_the_prefix_one_shares_its_prompts_text():
    short = http_cpu.bodies("short", 5.0, 20.0)
    assert short == http_cpu.bodies("short", 5.0, 20.0) and short[0][0] == 0.0
    assert all(body["prompt"] == http_cpu.PROMPT and 100 <= body["max_tokens"] <= 200 for _, body in short)
    prefix = http_cpu.bodies("prefix", 13.0, 10.0)
    assert len(prefix) == 130 and all(32 <= body["max_tokens"] <= 128 for _, body in prefix)
    heads = {body["prompt"][:2000] for _, body in prefix}
    assert 1 < len(heads) <= 24 and len({body["prompt"] for _, body in prefix}) == 130
    with pytest.raises(ValueError, match="unknown workload 'long'"):
        http_cpu.bodies("long", 1.0, 1.0)


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
