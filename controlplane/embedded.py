"""The daemon and its OpenAI-compatible gateway in one process (``serve --http``).

The gateway's SDK client (:class:`LocalClient`) talks to the daemon through calls on the
shared event loop instead of a ZMQ socket: no second process, and per engine step one
hop fewer (no encode, send, receive and decode of the replies between the daemon and the
gateway, and no second loop to wake). Everything else is the two-process stack's own
code: the daemon still serves SDK clients and ranks on its sockets, and the gateway's
handlers, retries, limits and errors are the same.

Shutting down: SIGTERM or SIGINT drains the daemon (requests in flight finish, streaming
through the gateway; new ones are refused), then the gateway stops.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import msgspec
import structlog

from controlplane.client import AsyncClient
from controlplane.config import DaemonConfig
from controlplane.daemon import Daemon, configure_logging
from controlplane.errors import ControlPlaneError, DaemonUnavailable
from controlplane.gateway import GatewaySettings, serve


class LocalClient(AsyncClient):
    """The SDK bound to a :class:`~controlplane.daemon.Daemon` in this process."""

    def __init__(self, daemon: Daemon, **options: object) -> None:
        super().__init__(f"in-process (clients at {daemon.config.client_address})", **options)
        self._daemon = daemon
        self._to_daemon: Callable[[object], None] | None = None

    def _connect(self) -> None:
        if self._to_daemon is None:
            self._to_daemon = self._daemon.attach_local(self._guarded(self._on_message))

    def _send(self, message: msgspec.Struct) -> None:
        if self._closed or self._to_daemon is None:
            raise ControlPlaneError("the client is closed")
        try:
            self._to_daemon(message)
        except ConnectionError as error:
            raise DaemonUnavailable(str(error)) from None


async def serve_with_gateway(config: DaemonConfig, settings: GatewaySettings, host: str, port: int,
                             announce: Callable[[str], None] | None = None) -> None:
    """Run the daemon and the gateway on this loop until SIGTERM or SIGINT (then drain);
    ``OSError`` when an address cannot be bound."""
    daemon = Daemon(config)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, daemon.request_drain)
    await serve_daemon_and_gateway(daemon, settings, host, port, announce)


async def serve_daemon_and_gateway(daemon: Daemon, settings: GatewaySettings, host: str, port: int,
                                   announce: Callable[[str], None] | None = None) -> None:
    """Serve ``daemon`` and, once it is ready, the gateway in front of it, until the daemon
    is drained (:meth:`~controlplane.daemon.Daemon.request_drain`); then stop the gateway.
    ``OSError`` when the gateway cannot listen (the daemon stops too)."""
    stop_gateway = asyncio.Event()

    async def gateway() -> None:
        await daemon.ready.wait()
        client = LocalClient(daemon)
        try:
            await serve(client, settings, host, port, stop_gateway, announce=announce)
        finally:
            await client.close()

    async def daemon_then_gateway() -> None:
        try:
            await daemon.serve()
        finally:
            stop_gateway.set()

    try:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(daemon_then_gateway())
            tasks.create_task(gateway())
    except* OSError as errors:
        raise errors.exceptions[0] from None


def run(config: DaemonConfig, settings: GatewaySettings, host: str, port: int,
        announce: Callable[[str], None] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code (1: an address cannot be
    bound)."""
    import uvloop

    configure_logging(config.log_level)
    try:
        uvloop.run(serve_with_gateway(config, settings, host, port, announce))
    except OSError as error:
        structlog.get_logger("controlplane").error("cannot start", error=str(error))
        return 1
    return 0
