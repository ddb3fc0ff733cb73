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

EMULATED_PROFILE = "llama3.1-8b-h100"
EMULATED_TIME_SCALE = "2.0"  # emulated step times are the profile's, doubled

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
