"""benchmarks.controlplane.relay_cost: the scratch checkout's gateway streams with the plain
relay, the table's medians, bad arguments; and one short run of both relays against the
real stack (the control plane and simulated ranks as processes, streamed over HTTP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.controlplane import relay_cost


def test_the_scratch_checkout_binds_the_plain_relay_in_the_gateway(tmp_path):
    checkout = relay_cost.plain_checkout(tmp_path / "plain")
    probe = ("import controlplane.gateway as gateway, controlplane.gateway_sse as sse; "
             "from benchmarks.controlplane.plain_relay import plain_relay; "
             "print(gateway.relay is plain_relay, sse.relay is plain_relay)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=checkout, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(checkout)}, check=True)
    assert result.stdout.split() == ["True", "True"]
    from controlplane import gateway_sse
    assert gateway_sse.relay.__module__ == "controlplane.gateway_sse"  # this checkout's is untouched


def test_the_table_shows_each_rates_medians_and_their_ratio():
    rows = [{"relay": relay, "rate": rate, "control_plane_cpu_us_per_token": value}
            for relay, rate, value in [("stepped", 5.0, 100.0), ("stepped", 5.0, 300.0), ("stepped", 5.0, 110.0),
                                       ("plain", 5.0, 120.0), ("plain", 5.0, 121.0), ("plain", 5.0, 500.0)]]
    assert relay_cost.table(rows, [5.0]).splitlines()[-1] == "| 5 | 110.0 | 121.0 | 1.10x |"


@pytest.mark.parametrize("argv", [["--rates", "fast"], ["--rates", "0"], ["--rounds", "0"], ["--seconds", "-1"]])
def test_bad_arguments_are_refused_before_anything_runs(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        relay_cost.main(argv)
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.slow
def test_both_relays_stream_every_token_and_the_run_is_saved(tmp_path):
    assert relay_cost.main(["--rates", "4", "--rounds", "1", "--seconds", "2", "--out", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "relay_cost.json").read_text())
    rows = document["rows"]
    assert [row["relay"] for row in rows] == ["stepped", "plain"]
    assert rows[0]["tokens"] == rows[1]["tokens"] >= 100 * rows[0]["finished"] > 0
    assert all(row["failed"] == 0 for row in rows)
    assert document["machine"]["git_commit"] and "| 4 |" in (tmp_path / "relay_cost.md").read_text()
