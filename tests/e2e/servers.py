"""Launching the stock ``python -m sglang.launch_server`` for end-to-end tests.

The code lives in :mod:`benchmarks.server.stock_server` (the benchmarks use it too);
this module re-exports its public names for ``conftest.py`` and the tests.
"""

from __future__ import annotations

from benchmarks.server.emulated import PROFILE, TIME_SCALE
from benchmarks.server.stock_server import (
    CPU_ARGS,
    Server,
    ServerFailed,
    launch,
    server_env,
    start,
    wait_exit,
)
from benchmarks.support.ports import free_port

EMULATED_PROFILE = PROFILE
EMULATED_TIME_SCALE = str(TIME_SCALE)  # as an environment variable's value

__all__ = [
    "EMULATED_PROFILE",
    "EMULATED_TIME_SCALE",
    "CPU_ARGS",
    "Server",
    "ServerFailed",
    "free_port",
    "launch",
    "server_env",
    "start",
    "wait_exit",
]
