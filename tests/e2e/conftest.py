"""Session-shared SGLang servers for end-to-end tests.

``sglang_server(args, env)`` returns a running server for those extra arguments and
environment; identical requests in one test session get the same server.  At most
:data:`MAX_ALIVE` servers run at once: starting another stops the least recently used.
Each server's log is kept under the session's temporary directory.
"""

from __future__ import annotations

import importlib.util
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from servers import Server, launch, start, wait_exit

from benchmarks.server.emulated import write_fb_config

#: Servers alive at once; ``E2E_MAX_SERVERS=1`` trades start-ups for memory.
MAX_ALIVE = int(os.environ.get("E2E_MAX_SERVERS", "2"))

ServerKey = tuple[tuple[str, ...], tuple[tuple[str, str], ...]]


class ServerPool:
    """Servers keyed by (args, env); the least recently used is stopped beyond ``limit``."""

    def __init__(self, model_path: Path, log_dir: Path, limit: int = MAX_ALIVE) -> None:
        self.model_path = model_path
        self.log_dir = log_dir
        self.limit = limit
        self._servers: OrderedDict[ServerKey, Server] = OrderedDict()
        self._launched = 0

    def get(self, args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> Server:
        key: ServerKey = (tuple(args), tuple(sorted((env or {}).items())))
        server = self._servers.get(key)
        if server is not None and server.alive():
            self._servers.move_to_end(key)
            return server
        if server is not None:
            self._servers.pop(key).stop()
        self._make_room()
        server = launch(self.model_path, args, env, self._next_log_path())
        self._servers[key] = server
        return server

    def run_to_exit(
        self, args: Sequence[str] = (), env: Mapping[str, str] | None = None, timeout: float = 180
    ) -> tuple[int, str]:
        """Start a server expected to stop by itself; return its exit code and log text."""
        self._make_room()
        server = start(self.model_path, args, env, self._next_log_path())
        return wait_exit(server, timeout), server.log_text()

    def _make_room(self) -> None:
        while len(self._servers) >= self.limit:
            _, oldest = self._servers.popitem(last=False)
            oldest.stop()

    def _next_log_path(self) -> Path:
        self._launched += 1
        return self.log_dir / f"server-{self._launched}.log"

    def stop_all(self) -> None:
        while self._servers:
            _, server = self._servers.popitem(last=False)
            server.stop()


def _require_sglang() -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _require_sglang()
    from sglang_ext.adapter.emulated_gpu.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def server_pool(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerPool]:
    _require_sglang()
    pool = ServerPool(tiny_model_dir, tmp_path_factory.mktemp("server-logs"))
    try:
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture(scope="session")
def sglang_server(server_pool: ServerPool) -> Callable[..., Server]:
    """Factory: ``sglang_server(args=(...), env={...})`` -> a running, shared :class:`Server`."""
    return server_pool.get



@pytest.fixture(scope="session")
def fb_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped FairBatching config, with its initial step model scaled like the emulated
    GPU (as a deployment would start from coefficients fitted on its own GPU)."""
    return write_fb_config(tmp_path_factory.mktemp("fb-config"))
