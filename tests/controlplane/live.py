"""A real daemon on loopback for tests: in-process on its own uvloop thread, or as a process."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import zmq

from controlplane import protocol as p
from controlplane.config import DaemonConfig

REPO = Path(__file__).resolve().parents[2]


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def loopback_config(**overrides) -> DaemonConfig:
    client, rank, report = free_ports(3)
    return DaemonConfig(client_address=f"tcp://127.0.0.1:{client}", rank_address=f"tcp://127.0.0.1:{rank}",
                        report_address=f"tcp://127.0.0.1:{report}", **overrides)


@dataclass
class ThreadDaemon:
    config: DaemonConfig
    daemon: object
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    def stop(self, timeout: float = 10.0) -> None:
        self.loop.call_soon_threadsafe(self.daemon.request_drain)
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "daemon did not stop"

    def counters(self) -> dict[str, int]:
        return dict(self.daemon.core.counters)


def start_thread_daemon(config: DaemonConfig) -> ThreadDaemon:
    import uvloop

    from controlplane.daemon import Daemon

    loop = uvloop.new_event_loop()
    started = threading.Event()
    holder: dict = {}

    def main() -> None:
        asyncio.set_event_loop(loop)

        async def serve() -> None:
            daemon = Daemon(config)
            holder["daemon"] = daemon
            task = asyncio.ensure_future(daemon.serve())
            await daemon.ready.wait()
            started.set()
            await task

        try:
            loop.run_until_complete(serve())
        except BaseException as error:  # surfaced to the test through `holder`
            holder["error"] = error
            started.set()
        finally:
            loop.close()

    thread = threading.Thread(target=main, name="daemon", daemon=True)
    thread.start()
    assert started.wait(10), "daemon did not start"
    if "error" in holder:
        raise holder["error"]
    return ThreadDaemon(config, holder["daemon"], loop, thread)


@contextmanager
def thread_daemon(**overrides):
    running = start_thread_daemon(loopback_config(**overrides))
    try:
        yield running
    finally:
        if running.thread.is_alive():
            running.stop()


def write_config(path: Path, config: DaemonConfig) -> Path:
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
    config: DaemonConfig
    config_path: Path
    process: subprocess.Popen
    log_path: Path

    def terminate(self, timeout: float = 15.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def start_process_daemon(tmp_path: Path, config: DaemonConfig, name: str = "daemon") -> ProcessDaemon:
    """``python -m controlplane serve --config <file>``; logs go to a file (a full pipe would block it)."""
    config_path = write_config(tmp_path / f"{name}.toml", config)
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "controlplane", "serve", "--config", str(config_path)],
                                   stdout=log, stderr=log, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    running = ProcessDaemon(config, config_path, process, log_path)
    if not wait_for_pong(config.client_address, timeout=20.0):
        running.kill()
        raise RuntimeError(f"daemon did not answer; log:\n{log_path.read_text()[-3000:]}")
    return running


@contextmanager
def process_daemon(tmp_path: Path, config: DaemonConfig):
    """``start_process_daemon`` for a fixture: stopped (SIGTERM, then SIGKILL) on exit."""
    running = start_process_daemon(tmp_path, config)
    try:
        yield running
    finally:
        try:
            running.terminate()
        finally:
            running.kill()


def wait_for_pong(address: str, timeout: float) -> bool:
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
