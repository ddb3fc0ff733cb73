"""A real daemon on loopback in this process, on its own uvloop thread (the tests' own;
the daemon as a process is :mod:`benchmarks.controlplane.live_daemon`)."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager
from dataclasses import dataclass

from benchmarks.controlplane.live_daemon import loopback_config
from controlplane.config import DaemonConfig


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
