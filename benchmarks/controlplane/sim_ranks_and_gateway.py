"""The processes the control-plane benchmarks start beside the daemon: one process of
simulated ranks and the OpenAI-compatible gateway (each in its own session, its log in a
file; stop them with :func:`benchmarks.support.processes.stop_group`)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.support.processes import spawn
from controlplane.client import Client
from controlplane.config import DaemonConfig


def start_sim_ranks(config: DaemonConfig, log_path: Path, *, ranks: int, agent_id: str,
                    time_scale: float, extra: Sequence[str] = ()) -> subprocess.Popen:
    """``python -m sglang_ext.sim.rank``: ``ranks`` simulated ranks joining the daemon of
    ``config``, stepping ``time_scale`` x real time; ``extra``: more of its flags."""
    return spawn([sys.executable, "-m", "sglang_ext.sim.rank", "--daemon", config.rank_address,
                  "--report-address", config.report_address, "--agent-id", agent_id,
                  "--ranks", str(ranks), *extra, "--time-scale", f"{time_scale:g}",
                  "--log-level", "warning"], log_path)


def start_gateway(client_address: str, port: int, log_path: Path,
                  extra: Sequence[str] = ()) -> subprocess.Popen:
    """``python -m controlplane gateway`` on ``127.0.0.1:PORT`` in front of the daemon."""
    return spawn([sys.executable, "-m", "controlplane", "gateway", "--daemon", client_address,
                  "--listen", f"127.0.0.1:{port}", *extra], log_path)


def wait_for_ranks(client_address: str, count: int, timeout_s: float = 60.0) -> None:
    """Until ``count`` ranks report to the daemon (none stale); RuntimeError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with Client(client_address) as client:
        while sum(not rank.stale for rank in client.status().ranks) < count:
            if time.monotonic() > deadline:
                raise RuntimeError("the simulated ranks did not report")
            time.sleep(0.2)
