"""The control-plane daemon: asyncio on uvloop, one owner task per ZMQ socket.

Tasks, all children of one :class:`asyncio.TaskGroup` (the supervisor; if one fails
the daemon stops)::

    client socket owner   ROUTER  recv -> core.on_client,  its outbox -> send
    rank socket owner     ROUTER  recv -> core.on_agent,   its outbox -> send
    report socket owner   PULL    recv -> core.on_report
    ticker                        core.on_tick every TICK_S (staleness, lost ranks, deadlines, queue TTL)
    drain watcher                 SIGTERM/SIGINT -> drain -> cancel the others -> return

A bug in a core handler is the core's to recover from (the requests concerned end with
``Reject internal``); one in that recovery is counted (``internal_errors_unrecovered``)
and logged here, and the daemon serves on. Errors that repeat (bad frames, failed
sends) are counted and logged at most once per ``LOG_INTERVAL_S`` each.

The core (:mod:`controlplane.core`) is synchronous and does no I/O; sends it returns go
to the owning socket's bounded outbox. A send that fails (``EHOSTUNREACH`` under
``ROUTER_MANDATORY``, ``EAGAIN`` at the high-water mark, or a full outbox) is handed back
to the core, which turns it into "client gone" or "rank unreachable".
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable

import structlog
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from controlplane.config import DaemonConfig
from controlplane.curve import KeyPair, load_key_pair, serve_curve
from controlplane.core import DispatcherCore, Send, ToAgent, ToClient
from controlplane.protocol import (
    Channel, FrameError, agent_message_channel, client_request_channel, encode, report_channel,
)
from controlplane.ratelimited_log import RateLimitedLog

TICK_S = 0.05
FLUSH_GRACE_S = 0.2
LOG_INTERVAL_S = 10.0


def configure_logging(level: str) -> None:
    """structlog, JSON lines on stderr."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.daemon_id = config.daemon_id or uuid.uuid4().hex[:12]
        # Ranks keep echoing the dispatch numbers of a previous daemon incarnation; start
        # above any number it can have handed out (fewer than 10**6 per second per rank).
        first_dispatch_seq = time.time_ns() // 1000
        self.log = structlog.get_logger("controlplane").bind(daemon=self.daemon_id)
        self.rare_log = RateLimitedLog(self.log, LOG_INTERVAL_S)
        self.core = DispatcherCore(config, self.daemon_id, time.monotonic(), first_dispatch_seq,
                                   log=self.rare_log)
        self._context = zmq.asyncio.Context()
        self._curve_keys: KeyPair | None = None
        self._authenticator: AsyncioAuthenticator | None = None
        if config.curve:
            self._curve_keys = load_key_pair(config.curve_secret_key_file)
            self._authenticator = AsyncioAuthenticator(self._context)
            self._authenticator.start()
            self._authenticator.configure_curve(domain="*", location=str(config.curve_authorized_keys_dir))
        self._client_outbox: asyncio.Queue[ToClient] = asyncio.Queue(config.outbox_size)
        self._agent_outbox: asyncio.Queue[ToAgent] = asyncio.Queue(config.outbox_size)
        self._drain_requested = asyncio.Event()
        self._ready = asyncio.Event()
        self._sockets: list[zmq.asyncio.Socket] = []
        try:
            self.client_socket = self._socket(zmq.ROUTER, config.client_address)
            self.rank_socket = self._socket(zmq.ROUTER, config.rank_address, handover=True)
            self.report_socket = self._socket(zmq.PULL, config.report_address)
        except OSError:
            self._close()
            raise

    def _close(self) -> None:
        for socket in self._sockets:
            socket.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    def _socket(self, kind: int, address: str, *, handover: bool = False) -> zmq.asyncio.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, self.config.send_hwm)
        socket.setsockopt(zmq.RCVHWM, self.config.recv_hwm)
        if self._curve_keys is not None:
            serve_curve(socket, self._curve_keys)
        if kind == zmq.ROUTER:
            socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if handover:
                socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        try:
            socket.bind(address)
        except zmq.ZMQError as error:
            socket.close()
            raise OSError(f"cannot bind {address}: {error}") from None
        self._sockets.append(socket)
        return socket

    def request_drain(self) -> None:
        self._drain_requested.set()

    @property
    def ready(self) -> asyncio.Event:
        return self._ready

    async def serve(self) -> None:
        """Run until drained (SIGTERM/SIGINT or :meth:`request_drain`)."""
        self.log.info("daemon started", client=self.config.client_address, rank=self.config.rank_address,
                      report=self.config.report_address, policy=self.config.policy, pid=os.getpid(),
                      curve=self.config.curve)
        try:
            async with asyncio.TaskGroup() as tasks:
                workers = [
                    tasks.create_task(self._own_router(self.client_socket, self._client_outbox,
                                                       client_request_channel(self.config.max_frame_bytes),
                                                       self.core.on_client, "client")),
                    tasks.create_task(self._own_router(self.rank_socket, self._agent_outbox,
                                                       agent_message_channel(self.config.max_frame_bytes),
                                                       self.core.on_agent, "agent")),
                    tasks.create_task(self._own_reports()),
                    tasks.create_task(self._tick()),
                ]
                tasks.create_task(self._drain_watcher(workers))
                self._ready.set()
        finally:
            self._close()
            self.log.info("daemon stopped", counters=dict(self.core.counters),
                          log_lines_suppressed=self.rare_log.suppressed())

    # ------------------------------------------------------------------ plumbing
    def _deliver(self, sends: list[Send]) -> None:
        pending = list(sends)
        while pending:
            send = pending.pop(0)
            outbox = self._client_outbox if isinstance(send, ToClient) else self._agent_outbox
            try:
                outbox.put_nowait(send)
            except asyncio.QueueFull:
                where = "client" if isinstance(send, ToClient) else "agent"
                self.core.counters[f"outbox_full_{where}"] += 1
                self.rare_log.warning(f"outbox_full:{where}", "outbox full; the send failed",
                                      peer=send.identity.decode(errors="replace"),
                                      message=type(send.message).__name__)
                pending.extend(self._handled("send_failed", self.core.on_send_failed, send))

    def _drop(self, where: str, peer: bytes | None, error: FrameError) -> None:
        self.core.counters[f"frames_dropped_{error.kind}"] += 1
        self.rare_log.warning(f"frame_dropped:{where}:{error.kind}", "frame dropped", socket=where,
                              kind=error.kind, detail=error.detail[:200],
                              peer=peer.decode(errors="replace") if peer is not None else None)

    async def _own_router(
        self,
        socket: zmq.asyncio.Socket,
        outbox: asyncio.Queue,
        channel: Channel,
        handle: Callable[[bytes, object, float], list[Send]],
        where: str,
    ) -> None:
        receive: asyncio.Future | None = None
        take: asyncio.Future | None = None
        try:
            while True:
                if receive is None:
                    receive = asyncio.ensure_future(socket.recv_multipart(copy=False))
                if take is None:
                    take = asyncio.ensure_future(outbox.get())
                done, _ = await asyncio.wait({receive, take}, return_when=asyncio.FIRST_COMPLETED)
                if take in done:
                    self._send(socket, take.result())
                    take = None
                    while not outbox.empty():
                        self._send(socket, outbox.get_nowait())
                if receive in done:
                    frames = receive.result()
                    receive = None
                    self._receive(frames, channel, handle, where)
        finally:
            for future in (receive, take):
                if future is not None:
                    future.cancel()

    def _receive(self, frames: list, channel: Channel, handle: Callable, where: str) -> None:
        peer = frames[0].bytes
        if len(frames) != 2:
            self._drop(where, peer, FrameError("bad_framing", f"{len(frames) - 1} payload frames, expected 1"))
            return
        try:
            message = channel.decode(frames[1].buffer)
        except FrameError as error:
            self._drop(where, peer, error)
            return
        self._deliver(self._handled(where, handle, peer, message))

    def _handled(self, where: str, handle: Callable[..., list[Send]], *inputs: object) -> list[Send]:
        """What the core sends in answer to ``inputs``. The core recovers from a bug in a
        handler itself; this is the backstop for a bug in that recovery."""
        try:
            return handle(*inputs, time.monotonic())
        except Exception:
            self.core.counters["internal_errors_unrecovered"] += 1
            name = type(inputs[-1]).__name__ if inputs else where
            self.rare_log.error(f"unrecovered:{where}:{name}", "message handling failed; no answer sent",
                                exc_info=True, socket=where, message=name)
            return []

    def _send(self, socket: zmq.asyncio.Socket, send: Send) -> None:
        # With NOBLOCK, zmq.asyncio attempts the send at once and resolves the future now.
        sent = socket.send_multipart([send.identity, encode(send.message)], flags=zmq.NOBLOCK, copy=False)
        error = sent.exception() if sent.done() else None
        if error is not None:
            if not isinstance(error, zmq.ZMQError) or error.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise error
            self.rare_log.info(f"send_failed:{error.errno}", "send failed",
                               peer=send.identity.decode(errors="replace"),
                               message=type(send.message).__name__, error=error.strerror)
            self._deliver(self._handled("send_failed", self.core.on_send_failed, send))

    async def _own_reports(self) -> None:
        channel = report_channel()
        while True:
            frames = await self.report_socket.recv_multipart(copy=False)
            if len(frames) != 1:
                self._drop("report", None, FrameError("bad_framing", f"{len(frames)} frames, expected 1"))
                continue
            try:
                report = channel.decode(frames[0].buffer)
            except FrameError as error:
                self._drop("report", None, error)
                continue
            self._deliver(self._handled("report", self.core.on_report, report))

    async def _tick(self) -> None:
        known: set[str] = set()
        while True:
            await asyncio.sleep(TICK_S)
            self._deliver(self._handled("tick", self.core.on_tick))
            ranks = {state.rank for state in self.core.registry.ranks()}
            for rank in sorted(ranks - known):
                self.log.info("rank joined", rank=rank)
            for rank in sorted(known - ranks):
                self.log.warning("rank gone", rank=rank)
            known = ranks

    async def _drain_watcher(self, workers: list[asyncio.Task]) -> None:
        """Wait for a drain request, drain, then cancel ``workers`` (the supervisor ends)."""
        await self._drain_requested.wait()
        self.log.info("draining", in_flight=self.core.in_flight, queued=self.core.queued)
        self._deliver(self._handled("drain", lambda now: self.core.begin_drain()))
        deadline = time.monotonic() + self.config.drain_timeout_s
        while not self.core.idle and time.monotonic() < deadline:
            await asyncio.sleep(TICK_S)
        if not self.core.idle:
            self.log.warning("drain timed out; aborting", in_flight=self.core.in_flight)
            self._deliver(self._handled("drain", lambda now: self.core.abort_all(
                "the daemon stopped before the request finished")))
        flush_deadline = time.monotonic() + FLUSH_GRACE_S
        while (not self._client_outbox.empty() or not self._agent_outbox.empty()) \
                and time.monotonic() < flush_deadline:
            await asyncio.sleep(0.01)
        for task in workers:
            task.cancel()


def run(config: DaemonConfig) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code."""
    import uvloop

    configure_logging(config.log_level)

    async def main() -> None:
        daemon = Daemon(config)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, daemon.request_drain)
        await daemon.serve()

    try:
        uvloop.run(main())
    except OSError as error:
        structlog.get_logger("controlplane").error("cannot start", error=str(error))
        return 1
    return 0
