"""The benchmarks' shared helpers: server-sent events, free ports, a process group stopped
whole, the machine and git state, and the deprecated ``python -m sglang_ext.replay`` alias."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.support.machine import cpu_times, cpu_usage, machine_info, machine_line
from benchmarks.support.paths import REPO, relative
from benchmarks.support.ports import free_port, free_ports
from benchmarks.support.processes import spawn, stop_group
from benchmarks.support.sse import json_events, json_events_async
from sglang_ext.provenance import git_state

STREAM = [b": a comment", b'data: {"n": 1}', b"", b'data:{"n": 2}\n', b"event: x",
          b"data: [DONE]", b'data: {"n": 3}']


def test_json_events_stop_at_done_and_skip_other_lines() -> None:
    assert list(json_events(STREAM)) == [{"n": 1}, {"n": 2}]
    assert list(json_events(line.decode() for line in STREAM)) == [{"n": 1}, {"n": 2}]
    assert list(json_events([b'data: {"n": 1}'])) == [{"n": 1}]  # no [DONE]: the stream's end


def test_json_events_async_reads_the_same_stream() -> None:
    async def lines():
        for line in STREAM:
            yield line

    async def collect() -> list:
        return [event async for event in json_events_async(lines())]

    assert asyncio.run(collect()) == [{"n": 1}, {"n": 2}]


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(5)
    assert len(set(ports)) == 5
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))


def test_stop_group_stops_the_children_too(tmp_path: Path) -> None:
    """The leader ignores SIGTERM and leaves a child behind: SIGKILL to the group ends both."""
    child_pid = tmp_path / "child.pid"
    script = ("import os, signal, subprocess, sys, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              f"open({str(child_pid)!r}, 'w').write(str(child.pid))\n"
              "time.sleep(60)\n")
    process = spawn([sys.executable, "-c", script], tmp_path / "log" / "leader.log")
    deadline = time.monotonic() + 20
    while not child_pid.exists() or not child_pid.read_text():
        assert time.monotonic() < deadline, (tmp_path / "log" / "leader.log").read_text()
        time.sleep(0.05)
    assert stop_group(process, timeout=0.5) is not None
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid):
        assert time.monotonic() < deadline, "the child outlived stop_group"
        time.sleep(0.05)
    assert (tmp_path / "log" / "leader.log").read_text().startswith("$ ")
    assert stop_group(None) is None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_machine_and_git_state() -> None:
    git = git_state()
    assert git["commit"] != "unknown" and isinstance(git["dirty"], bool)
    info = machine_info()
    assert info["git_commit"].startswith(git["commit"])
    assert "logical CPUs" in machine_line(info)
    before = cpu_times()
    assert set(cpu_usage(before, cpu_times())) <= set(before)


def test_relative_paths() -> None:
    assert relative(REPO / "docs" / "bench") == Path("docs/bench")
    assert relative(Path("/")) == Path("/")


def test_the_old_replay_command_runs_the_new_one_from_a_checkout(tmp_path: Path) -> None:
    here = subprocess.run([sys.executable, "-m", "sglang_ext.replay", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert here.returncode == 0 and "python -m benchmarks.server.trace_replay" in here.stdout
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    elsewhere = subprocess.run([sys.executable, "-m", "sglang_ext.replay", "--help"], cwd=tmp_path,
                               capture_output=True, text=True, timeout=120, env=env)
    assert elsewhere.returncode == 2
    assert elsewhere.stderr.strip().count("\n") == 0
    assert "python -m benchmarks.server.trace_replay" in elsewhere.stderr


@pytest.mark.parametrize("module", ["benchmarks.sim.decision_time", "benchmarks.routers",
                                    "benchmarks.server.trace_replay"])
def test_a_benchmark_runs_with_python_m_from_the_root(module: str) -> None:
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
