"""Launching the stock ``python -m sglang.launch_server`` on CPU (emulated GPU), for the
real-server benchmarks and the end-to-end tests (``tests/e2e/servers.py`` re-exports it).

:func:`launch` starts the server in its own process group with the given extra arguments
and environment, sends its output to a log file, and waits until ``/health_generate``
answers 200 (a real generation through the scheduler); :func:`start` does not wait.
:meth:`Server.stop` terminates the whole process group (HTTP server, scheduler,
detokenizer, DP controller). Standard library only; importing it does not import sglang.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.support.ports import free_port
from benchmarks.support.processes import spawn, stop_group

__all__ = [
    "CPU_ARGS",
    "Server",
    "ServerFailed",
    "launch",
    "server_env",
    "start",
    "wait_exit",
]

#: Flags the stock server needs on a CPU machine (see docs/sglang.md, the emulated-GPU section).
CPU_ARGS: tuple[str, ...] = (
    "--device", "cpu",
    "--load-format", "dummy",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--tp", "1",
    "--sleep-on-idle",
)  # fmt: skip

_PORT_TAKEN = "address already in use"

#: Variables of this project that a test server must not inherit from the caller.
_PROJECT_ENV_PREFIX = "FAIRBATCHING_"


class ServerFailed(RuntimeError):
    """The server exited or did not become healthy; the message ends with its log's tail."""


@dataclass
class Server:
    """A running server: its URL, process and log file."""

    url: str
    process: subprocess.Popen
    log_path: Path
    args: tuple[str, ...]
    env: dict[str, str] = field(repr=False)

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def stop(self, timeout: float = 20.0) -> int | None:
        """Stop the server and everything in its process group; return the exit code."""
        return stop_group(self.process, timeout)


def server_env(extra: Mapping[str, str]) -> dict[str, str]:
    """The caller's environment without ``FAIRBATCHING_*`` variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PROJECT_ENV_PREFIX)}
    env.update(extra)
    return env


def start(
    model_path: str | Path,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log_path: str | Path | None = None,
    python: str = sys.executable,
) -> Server:
    """Start a server on a free port in its own process group; do not wait for it.

    ``args`` come after :data:`CPU_ARGS` and the model/port flags; ``env`` is added to the
    caller's environment (minus ``FAIRBATCHING_*``).
    """
    port = free_port()
    log_path = Path(log_path) if log_path is not None else Path(f"sglang-{port}.log")
    command = [
        python, "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        *CPU_ARGS,
        "--host", "127.0.0.1",
        "--port", str(port),
        *args,
    ]  # fmt: skip
    process = spawn(command, log_path, server_env(env or {}), cwd=None)
    return Server(f"http://127.0.0.1:{port}", process, log_path, tuple(args), dict(env or {}))


def launch(
    model_path: str | Path,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log_path: str | Path | None = None,
    timeout: float = 240.0,
    python: str = sys.executable,
    attempts: int = 3,
) -> Server:
    """:func:`start`, then wait until the server generates; raise :class:`ServerFailed`.

    A start that loses its port to another process (the port is free when picked, but not
    reserved) is retried on a new port, up to ``attempts`` times.  On failure the process
    group is killed.
    """
    for attempt in range(1, attempts + 1):
        server = start(model_path, args, env, log_path, python)
        log_start = server.log_path.stat().st_size
        try:
            _wait_healthy(server, timeout)
            return server
        except ServerFailed:
            server.stop()
            lost_port = _PORT_TAKEN in server.log_text()[log_start:]
            if not lost_port or attempt == attempts:
                raise
        except BaseException:
            server.stop()
            raise
    raise AssertionError("unreachable")


def wait_exit(server: Server, timeout: float) -> int:
    """Wait for a server that should stop on its own; kill it and raise if it does not."""
    try:
        code = server.process.wait(timeout)
    except subprocess.TimeoutExpired:
        server.stop()
        raise ServerFailed(f"server still running after {timeout:.0f} s{_tail(server)}") from None
    server.stop()  # reap any child left behind
    return code


def _wait_healthy(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not server.alive():
            raise ServerFailed(
                f"server exited with code {server.process.returncode} during start-up"
                f"{_tail(server)}"
            )
        try:
            with urllib.request.urlopen(f"{server.url}/health_generate", timeout=10) as reply:
                if reply.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(1.0)
    raise ServerFailed(f"server not healthy after {timeout:.0f} s{_tail(server)}")


def _tail(server: Server, lines: int = 40) -> str:
    try:
        text = server.log_text().splitlines()[-lines:]
    except OSError:
        return ""
    return f"\n--- last {len(text)} lines of {server.log_path} ---\n" + "\n".join(text)
