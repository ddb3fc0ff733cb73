"""benchmarks.controlplane.cpu_cost's argument plumbing (nothing is started or measured):
``--coalesce-ms`` is checked like the simulated rank's, reaches every part's simulated
ranks as their ``--coalesce-ms`` and is recorded in the JSON figures."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks.controlplane import cpu_cost


def test_coalesce_ms_defaults_to_0_and_refuses_what_the_rank_would(capsys):
    parser = cpu_cost.build_parser()
    assert parser.parse_args([]).coalesce_ms == 0.0
    assert parser.parse_args(["--coalesce-ms", "10"]).coalesce_ms == 10.0
    for bad in ("-1", "abc", "51"):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["--coalesce-ms", bad])
        assert exit_info.value.code == 2
        assert f"expected milliseconds from 0 to 50, got {bad!r}" in capsys.readouterr().err


def test_the_stack_starts_its_simulated_ranks_with_the_window(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(cpu_cost, "start_process_daemon",
                        lambda scratch, config: SimpleNamespace(process=SimpleNamespace(pid=1)))
    monkeypatch.setattr(cpu_cost, "start_sim_ranks",
                        lambda config, log, **options: started.append(options) or SimpleNamespace(pid=2))
    monkeypatch.setattr(cpu_cost, "wait_for_ranks", lambda address, count: None)
    cpu_cost.Stack(tmp_path / "a", ranks=2, time_scale=1.0, coalesce_ms=5.0)
    cpu_cost.Stack(tmp_path / "b", ranks=2, time_scale=1.0)
    assert [list(options["extra"]) for options in started] == [["--coalesce-ms", "5"],
                                                                ["--coalesce-ms", "0"]]


def test_every_part_gets_the_window_and_the_figures_record_it(tmp_path, monkeypatch):
    calls = []

    def part(name):
        def run(*args, coalesce_ms):
            calls.append((name, coalesce_ms))
            return {"part": name}
        return run

    for name in ("run_idle", "run_load", "run_ceiling"):
        monkeypatch.setattr(cpu_cost, name, part(name))
    figures = tmp_path / "cpu.json"
    assert cpu_cost.main(["--coalesce-ms", "7.5", "--json", str(figures)]) == 0
    assert calls == [("run_idle", 7.5), ("run_load", 7.5), ("run_load", 7.5),
                     ("run_ceiling", 7.5), ("run_ceiling", 7.5)]
    assert json.loads(figures.read_text())["coalesce_ms"] == 7.5
