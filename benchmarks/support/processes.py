"""Processes a benchmark starts in their own session (so that their whole process group can
be stopped), with their output in a log file."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from benchmarks.support.paths import REPO


def spawn(command: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None,
          cwd: Path | None = REPO) -> subprocess.Popen:
    """Start ``command`` in its own session, stdout and stderr appended to ``log_path``
    (after a ``$ command`` line; a log file, because a full pipe would block it), stdin
    closed. ``env``: the whole environment (default: this one, with Python's output
    unbuffered so that the log is current); ``cwd=None``: this process's."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"$ {shlex.join(command)}\n".encode())
        log.flush()
        return subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=cwd,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"} if env is None
                                else dict(env),
                                start_new_session=True)


def stop_group(process: subprocess.Popen | None, timeout: float = 15.0) -> int | None:
    """Stop a process started in its own session and everything in its group: SIGTERM to
    the process (an SGLang server shuts its own children down), up to ``timeout`` seconds
    for it to exit, then SIGKILL to the whole group (children may outlive it). Returns its
    exit code, None when there is no process or it could not be reaped."""
    if process is None:
        return None
    if process.poll() is None:
        try:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        return process.wait(5)
    except subprocess.TimeoutExpired:
        return None
