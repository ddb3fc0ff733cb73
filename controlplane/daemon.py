"""The control-plane daemon: asyncio on uvloop, its sockets read by callbacks, not tasks.

Each socket (client ROUTER, rank ROUTER, report PULL) is a plain ZMQ socket whose file
descriptor the loop watches (:class:`controlplane.socket_pump.SocketPump`): one wake-up
reads every message waiting, without a future per message, and hands each to the core
(``on_client``, ``on_agent``, ``on_report``). The two ROUTER sockets, which carry a
message per engine step (from every rank, and to every client streaming), are served on
the loop's own thread where they can (:class:`controlplane.loop_router.LoopRouter`,
``transport``): the daemon speaks ZMTP to its peers' libzmq sockets itself, with no
thread wake-up between a message and the loop. Two tasks, children of one
:class:`asyncio.TaskGroup` (the supervisor)::

    ticker          core.on_tick every TICK_S (staleness, lost ranks, deadlines, queue TTL);
                    an agent is judged silent only up to the last time the rank socket was
                    seen empty (its heartbeat may wait unread in a daemon that fell behind);
                    the loop's busy share (LoopBusy) sets core.saturated: while it is at
                    least max_loop_busy new submits are refused overloaded
    drain watcher   SIGTERM/SIGINT -> drain -> cancel the ticker -> return

Sends go out inline (``zmq.NOBLOCK``) as the core returns them. Replies about a client's
requests (``Dispatched``, ``Chunk``, ``Finish``, ``Reject``) wait until the end of the
socket pump's pass (or, for what a timer or the local client caused, of the loop pass)
and leave as one :class:`~controlplane.protocol.Replies` per client (protocol version 5;
a lone reply goes alone), so the tokens of one engine step cost one message to each
client, not one per token. ZMQ's high-water marks bound what waits in the
sockets.

A bug in a core handler is the core's to recover from (the requests concerned end with
``Reject internal``); one in that recovery is counted (``internal_errors_unrecovered``)
and logged here, and the daemon serves on. Errors that repeat (bad frames, failed
sends) are counted and logged at most once per ``LOG_INTERVAL_S`` each.

A send that fails (``EHOSTUNREACH`` under ``ROUTER_MANDATORY``, ``EAGAIN`` at the
high-water mark) is handed back to the core, which turns it into "client gone" or
"rank unreachable".
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
from controlplane.core import DispatcherCore, Send, ToClient
from controlplane.loop_router import LoopRouter
from controlplane.protocol import (
    MAX_BATCH_ITEMS, Channel, Chunk, Dispatched, Finish, FrameError, Reject, Replies,
    agent_message_channel, client_request_channel, encode, report_channel,
)
from controlplane.ratelimited_log import RateLimitedLog
from controlplane.socket_pump import SocketPump

TICK_S = 0.05
BUSY_WINDOW_S = 1.0  # the event loop's busy share is smoothed over about this long
LOG_INTERVAL_S = 10.0
#: how long closing waits for the last answers of a drain (ShuttingDown, aborts) to leave
FINAL_SEND_LINGER_MS = 1000
BATCHED_REPLY_TYPES = frozenset((Dispatched, Chunk, Finish, Reject))
SEND_MORE = zmq.SNDMORE | zmq.NOBLOCK
#: a loop-served socket bounds a connection's unsent bytes at ``send_hwm`` messages of
#: this size (libzmq's mark counts messages)
HWM_MESSAGE_BYTES = 4096
#: the identity of the client in this process (:meth:`Daemon.attach_local`); ZMQ reserves
#: identities that start with a zero byte and makes its own 5 bytes long, so no peer has it
LOCAL_CLIENT = b"\x00local"


class LoopBusy:
    """The share of wall time the calling thread spent on the CPU, smoothed over about
    ``window_s`` (an exponential average of the shares between samples)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.share = 0.0
        self._last: tuple[float, float] | None = None

    def sample(self, wall_s: float, cpu_s: float) -> float:
        last, self._last = self._last, (wall_s, cpu_s)
        if last is not None and wall_s > last[0]:
            elapsed = wall_s - last[0]
            share = min(1.0, max(0.0, (cpu_s - last[1]) / elapsed))
            self.share += (share - self.share) * min(1.0, elapsed / self.window_s)
        return self.share


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
        self._sync_context = zmq.Context.shadow(self._context.underlying)
        self._client_batches: dict[bytes, list[ToClient]] = {}
        self._local_reply: Callable[[object], None] | None = None
        self._sent_on: set[zmq.Socket] = set()  # sockets sent on since the last flush
        self._flush_scheduled = False
        self._in_pass = False  # a socket pump's pass is handing messages over: it flushes at its end
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pumps: list[SocketPump] = []
        self._rank_pump: SocketPump | None = None
        self._drain_requested = asyncio.Event()
        self._ready = asyncio.Event()
        self._sockets: list[zmq.Socket] = []
        self._client_channel = client_request_channel(config.max_frame_bytes)
        self._agent_channel = agent_message_channel(config.max_frame_bytes)
        self.client_socket: zmq.Socket | None = None
        self.client_router: LoopRouter | None = None
        self.rank_socket: zmq.Socket | None = None
        self.rank_router: LoopRouter | None = None
        try:
            if config.routers_on_loop:
                self.client_router = self._loop_router(
                    config.client_address, self._parts_receiver(self._client_channel, self.core.on_client, "client"),
                    handover=False)
                self.rank_router = self._loop_router(
                    config.rank_address, self._parts_receiver(self._agent_channel, self.core.on_agent, "agent"),
                    handover=True)
            else:
                self.client_socket = self._socket(zmq.ROUTER, config.client_address)
                self.rank_socket = self._socket(zmq.ROUTER, config.rank_address, handover=True)
            self.report_socket = self._socket(zmq.PULL, config.report_address)
        except OSError:
            self._close()
            raise

    def _loop_router(self, address: str, on_message: Callable[[bytes, list], None], *,
                     handover: bool) -> LoopRouter:
        try:
            return LoopRouter(address, on_message, self._end_pass, handover=handover,
                              max_frame_bytes=self.config.max_frame_bytes,
                              send_high_water_bytes=self.config.send_hwm * HWM_MESSAGE_BYTES)
        except OSError as error:
            raise OSError(f"cannot bind {address}: {error.strerror or error}") from None

    @property
    def _routers(self) -> list[LoopRouter]:
        return [router for router in (self.client_router, self.rank_router) if router is not None]

    def _close(self, linger_ms: int = 0) -> None:
        self._local_reply = None  # the local client's sends raise ConnectionError from now on
        for router in self._routers:
            router.close(flush=linger_ms > 0)
        for socket in self._sockets:
            socket.close(linger=linger_ms)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    def _socket(self, kind: int, address: str, *, handover: bool = False) -> zmq.Socket:
        socket = self._sync_context.socket(kind)
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
                      curve=self.config.curve, transport="loop" if self._routers else "zmq")
        self._loop = asyncio.get_running_loop()
        self._pumps = [SocketPump(self.report_socket, self._on_report_frames(report_channel()), self._end_pass)]
        if self.client_socket is not None and self.rank_socket is not None:
            self._rank_pump = SocketPump(
                self.rank_socket, self._receiver(self._agent_channel, self.core.on_agent, "agent"), self._end_pass)
            self._pumps += [
                SocketPump(self.client_socket, self._receiver(self._client_channel, self.core.on_client, "client"),
                           self._end_pass),
                self._rank_pump,
            ]
        try:
            async with asyncio.TaskGroup() as tasks:
                for router in self._routers:
                    await router.start()
                for pump in self._pumps:
                    pump.start()
                workers = [tasks.create_task(self._tick())]
                tasks.create_task(self._drain_watcher(workers))
                self._ready.set()
        finally:
            for pump in self._pumps:
                pump.stop()
            self._close(FINAL_SEND_LINGER_MS if self._drain_requested.is_set() else 0)
            self.log.info("daemon stopped", counters=dict(self.core.counters),
                          log_lines_suppressed=self.rare_log.suppressed())

    def attach_local(self, on_reply: Callable[[object], None]) -> Callable[[object], None]:
        """Serve a client in this process without a socket (the embedded gateway's SDK):
        the daemon hands ``on_reply`` each message it would send that client, at the end of
        the loop pass as on the socket, and the returned function takes the client's
        messages. They are checked as frames from a socket are (a message the channel
        refuses is dropped and counted); once the daemon has stopped the function raises
        ``ConnectionError``. Call it once :attr:`ready` is set."""
        if self._loop is None:
            raise RuntimeError("attach_local before the daemon serves")
        if self._local_reply is not None:
            raise RuntimeError("a local client is already attached")
        self._local_reply = on_reply
        channel = client_request_channel(self.config.max_frame_bytes)

        def receive(message: object) -> None:
            if self._local_reply is None:
                raise ConnectionError("the daemon has stopped")
            try:
                checked = channel.decode(encode(message))
            except FrameError as error:
                self._drop("client", LOCAL_CLIENT, error)
                return
            self._deliver(self._handled("client", self.core.on_client, LOCAL_CLIENT, checked))
        return receive

    # ------------------------------------------------------------------ plumbing
    def _deliver(self, sends: list[Send]) -> None:
        """Send what the core returned: to agents at once, to clients at the end of the pass."""
        batches = self._client_batches
        while sends:
            answers: list[Send] = []  # the core's answers to failed sends, delivered after
            for send in sends:
                if type(send) is ToClient:
                    identity = send.identity
                    if type(send.message) in BATCHED_REPLY_TYPES or identity == LOCAL_CLIENT:
                        batch = batches.get(identity)
                        if batch is None:
                            batch = batches[identity] = []
                        batch.append(send)
                        if len(batch) >= MAX_BATCH_ITEMS:
                            answers += self._flush_client(identity)
                        continue
                    answers += self._flush_client(identity)  # what was said before goes first
                    if not self._send_to_client(identity, send.message):
                        answers += self._handled("send_failed", self.core.on_send_failed, send)
                elif not self._send_to_agent(send.identity, send.message):
                    answers += self._handled("send_failed", self.core.on_send_failed, send)
            sends = answers
        if (batches or self._sent_on) and not (self._flush_scheduled or self._in_pass) and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _end_pass(self) -> None:
        """A socket pump's pass is over: what it produced leaves now (no callback of its own)."""
        self._in_pass = False
        if self._client_batches or self._sent_on:
            self._flush()

    def _flush(self) -> None:
        """Each client's replies of this pass as one message; then read what the sends may
        have left unsignalled on the sockets sent on."""
        self._flush_scheduled = False
        while self._client_batches:
            failed: list[Send] = []
            for identity in list(self._client_batches):
                failed += self._flush_client(identity)
            if failed:
                self._deliver(failed)
        if self._sent_on:
            for pump in self._pumps:
                if pump.socket in self._sent_on:
                    pump.poke()
            self._sent_on.clear()

    def _flush_client(self, identity: bytes) -> list[Send]:
        """Send ``identity``'s waiting replies; what the core answers to their failure."""
        batch = self._client_batches.pop(identity, None)
        if not batch:
            return []
        if identity == LOCAL_CLIENT:
            reply = self._local_reply
            if reply is None:  # the daemon stopped: nobody to tell
                return []
            messages = [send.message for send in batch]
            if len(messages) > 1 and all(type(message) in BATCHED_REPLY_TYPES for message in messages):
                reply(Replies(messages))  # as on the socket: one call for the pass's replies
            else:
                for message in messages:
                    reply(message)
            return []
        message = batch[0].message if len(batch) == 1 else Replies([send.message for send in batch])
        if self._send_to_client(identity, message):
            return []
        answers: list[Send] = []
        for send in batch:
            answers += self._handled("send_failed", self.core.on_send_failed, send)
        return answers

    def _drop(self, where: str, peer: bytes | None, error: FrameError) -> None:
        self.core.counters[f"frames_dropped_{error.kind}"] += 1
        self.rare_log.warning(f"frame_dropped:{where}:{error.kind}", "frame dropped", socket=where,
                              kind=error.kind, detail=error.detail[:200],
                              peer=peer.decode(errors="replace") if peer is not None else None)

    def _receiver(self, channel: Channel, handle: Callable[[bytes, object, float], list[Send]],
                  where: str) -> Callable[[list], None]:
        """:meth:`_parts_receiver` for a libzmq ROUTER's frames: the routing id, then the parts."""
        receive = self._parts_receiver(channel, handle, where)

        def from_frames(frames: list) -> None:
            receive(frames[0].bytes, [frame.buffer for frame in frames[1:]])
        return from_frames

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

    def _send_to_client(self, identity: bytes, message: object) -> bool:
        if self.client_router is None:
            return self._send(self.client_socket, identity, message)
        return self._send_on_loop(self.client_router, identity, message)

    def _send_to_agent(self, identity: bytes, message: object) -> bool:
        if self.rank_router is None:
            return self._send(self.rank_socket, identity, message)
        return self._send_on_loop(self.rank_router, identity, message)

    def _send_on_loop(self, router: LoopRouter, identity: bytes, message: object) -> bool:
        """As :meth:`_send`, on a loop-served socket."""
        if router.send(identity, encode(message)):
            return True
        failure = "no connection" if identity not in router.peers else "high-water mark"
        self.rare_log.info(f"send_failed:{failure}", "send failed", peer=identity.decode(errors="replace"),
                           message=type(message).__name__, error=failure)
        return False

    def _parts_receiver(self, channel: Channel, handle: Callable[[bytes, object, float], list[Send]],
                        where: str) -> Callable[[bytes, list], None]:
        """Hands a message, its sender's routing id and its parts, to the core's ``handle``;
        anything but one part the channel accepts is dropped and counted."""
        def receive(peer: bytes, parts: list) -> None:
            self._in_pass = True
            if len(parts) != 1:
                self._drop(where, peer, FrameError("bad_framing", f"{len(parts)} payload frames, expected 1"))
                return
            try:
                message = channel.decode(parts[0])
            except FrameError as error:
                self._drop(where, peer, error)
                return
            self._deliver(self._handled(where, handle, peer, message))
        return receive

    def _rank_socket_unread(self) -> bool:
        """Whether agents' messages wait unread (the loop is behind them)."""
        if self.rank_router is not None:
            return self.rank_router.unread()
        if self.rank_socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._rank_pump.poke()  # reading the events may have eaten the socket's edge
            return True
        return False

    def _send(self, socket: zmq.Socket, identity: bytes, message: object) -> bool:
        """Whether the message was queued; a peer gone or at its high-water mark is False."""
        payload = encode(message)  # before the first part: a failure leaves no part sent
        self._sent_on.add(socket)
        try:
            # two sends, as send_multipart makes them, without its per-part checks
            socket.send(identity, SEND_MORE)
            socket.send(payload, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as error:
            if error.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            self.rare_log.info(f"send_failed:{error.errno}", "send failed",
                               peer=identity.decode(errors="replace"),
                               message=type(message).__name__, error=error.strerror)
            return False
        return True

    def _on_report_frames(self, channel: Channel) -> Callable[[list], None]:
        def receive(frames: list) -> None:
            self._in_pass = True
            if len(frames) != 1:
                self._drop("report", None, FrameError("bad_framing", f"{len(frames)} frames, expected 1"))
                return
            try:
                report = channel.decode(frames[0].buffer)
            except FrameError as error:
                self._drop("report", None, error)
                return
            self._deliver(self._handled("report", self.core.on_report, report))
        return receive

    async def _tick(self) -> None:
        known: set[str] = set()
        busy = LoopBusy(BUSY_WINDOW_S)
        agents_read_at = time.monotonic()  # the rank socket was last seen empty
        while True:
            await asyncio.sleep(TICK_S)
            saturated = busy.sample(time.monotonic(), time.thread_time()) >= self.config.max_loop_busy
            if saturated != self.core.saturated:
                self.core.counters["saturated_on" if saturated else "saturated_off"] += 1
                self.rare_log.warning(f"saturated:{saturated}", "event loop saturation changed",
                                      saturated=saturated, busy=round(busy.share, 3))
                self.core.saturated = saturated
            if self._rank_socket_unread():
                read_until: float | None = agents_read_at
            else:
                agents_read_at, read_until = time.monotonic(), None  # None: read up to now
            self._deliver(self._handled("tick", self._on_tick, read_until))
            ranks = {state.rank for state in self.core.registry.ranks()}
            for rank in sorted(ranks - known):
                self.log.info("rank joined", rank=rank)
            for rank in sorted(known - ranks):
                self.log.warning("rank gone", rank=rank)
            known = ranks

    def _on_tick(self, agents_read_until: float | None, now: float) -> list[Send]:
        return self.core.on_tick(now, agents_read_until=agents_read_until)

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
        self._flush()
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
