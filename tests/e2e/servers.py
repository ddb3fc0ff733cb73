"""Launching the stock ``python -m sglang.launch_server`` for end-to-end tests.

The code lives in :mod:`sglang_ext.server_launch` (the benchmark script uses it too);
this module re-exports its public names for ``conftest.py`` and the tests.
"""

from __future__ import annotations

from sglang_ext.server_launch import (
    CPU_ARGS,
    Server,
    ServerFailed,
    free_port,
    launch,
    server_env,
    start,
    wait_exit,
)

__all__ = [
    "CPU_ARGS",
    "Server",
    "ServerFailed",
    "free_port",
    "launch",
    "server_env",
    "start",
    "wait_exit",
]
