"""A real control-plane daemon on loopback, as a process: its config on free ports, started
and stopped, and a probe that it answers. The control-plane benchmarks and the tests use it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import zmq

from benchmarks.support.ports import free_ports
from benchmarks.support.processes import spawn
from controlplane import protocol as p
from controlplane.config import DaemonConfig


def loopback_config(**overrides) -> DaemonConfig:
    """A daemon config on three free loopback ports, with ``overrides``."""
    client, rank, report = free_ports(3)
    return DaemonConfig(client_address=f"tcp://127.0.0.1:{client}", rank_address=f"tcp://127.0.0.1:{rank}",
                        report_address=f"tcp://127.0.0.1:{report}", **overrides)


def write_config(path: Path, config: DaemonConfig) -> Path:
    """``config`` as the daemon's TOML file (its ``[daemon]`` table)."""
    import msgspec

    table = msgspec.to_builtins(config)
    lines = ["[daemon]"] + [f"{key} = {toml_value(value)}" for key, value in table.items()
                            if value not in ("", None)]
    path.write_text("\n".join(lines) + "\n")
    return path


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


@dataclass
class ProcessDaemon:
    """A daemon process and its files. Not frozen: a test that restarts the daemon on the
    same address swaps in the new process (and log) so the fixture stops that one."""

    config: DaemonConfig
    config_path: Path
    process: subprocess.Popen
    log_path: Path

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM (the daemon drains), then its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def start_process_daemon(directory: Path, config: DaemonConfig, name: str = "daemon") -> ProcessDaemon:
    """``python -m controlplane serve --config DIRECTORY/NAME.toml``, its log in
    ``DIRECTORY/NAME.log``; returns once it answers a ping."""
    config_path = write_config(directory / f"{name}.toml", config)
    log_path = directory / f"{name}.log"
    process = spawn([sys.executable, "-m", "controlplane", "serve", "--config", str(config_path)],
                    log_path)
    running = ProcessDaemon(config, config_path, process, log_path)
    if not wait_for_pong(config.client_address, timeout=20.0):
        running.kill()
        raise RuntimeError(f"daemon did not answer; log:\n{log_path.read_text()[-3000:]}")
    return running


@contextmanager
def process_daemon(directory: Path, config: DaemonConfig):
    """``start_process_daemon`` for a fixture: stopped (SIGTERM, then SIGKILL) on exit."""
    running = start_process_daemon(directory, config)
    try:
        yield running
    finally:
        try:
            running.terminate()
        finally:
            running.kill()


def wait_for_pong(address: str, timeout: float) -> bool:
    """Whether a daemon answers a ping at ``address`` within ``timeout`` seconds."""
    context = zmq.Context.instance()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(address)
        try:
            dealer.send(p.encode(p.Ping(1)))
            if dealer.poll(500):
                return isinstance(p.client_reply_channel().decode(dealer.recv()), p.Pong)
        finally:
            dealer.close()
    return False
