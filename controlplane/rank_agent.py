"""The rank side of the agent protocol (docs/controlplane.md, "Ranks"), for asyncio.

One :class:`RankAgent` speaks for one or more ranks over one DEALER socket whose
routing id is the agent id. It joins every rank with one fresh epoch, runs each
dispatched request as a task it owns (an engine's :meth:`RankEngine.serve`) and
guarantees that a request ends with exactly one ``Done`` while its rank stays: finish,
engine error, invalid request or abort. When the rank itself goes (the agent closes,
a newer epoch fences it, the daemon restarted and forgot it) its requests end without
a ``Done``: ``Goodbye`` or the daemon's own loss detection speaks for them, so their
clients see a retryable ``rank_lost`` rather than a ``cancelled`` they never asked for.
:meth:`RankAgent.drain` is the graceful way out: ``Draining`` for every rank, the
requests already running finish with their ``Done``, then the agent stops.

Output is coalesced (protocol version 5): what the engines emit waits in one batch until
the end of the event-loop pass (``coalesce_s`` later, when set) and leaves as one
``RankOutputs``, so an engine step that advances many requests costs one message. A
request that is not streamed sends nothing until its ``Done``, which carries the whole
output. Control messages (``Hello``, ``Heartbeat``, ``Draining``, ``Goodbye``) are sent
at once and never wait behind output: what the socket cannot take (its high-water mark)
waits in a control queue that is always sent before any output. Output that the socket
cannot take waits too, up to ``outbox_size`` messages; beyond that ``emit`` and
``finish`` wait for room (back-pressure on the engine), never drop.

The socket is read without a future per message (:class:`controlplane.socket_pump.SocketPump`).

A dropped daemon connection (the daemon process died, or its host went silent past the
ZMTP heartbeat timeout) ends every request the agent runs, without a ``Done``, and drops
their waiting output: whatever crossed that connection may be lost, and a client of a
daemon that died retries the same id elsewhere. The agent then queues ``Goodbye`` and a
new ``Hello`` for each rank, which leave when a daemon listens again: a daemon that
outlived the drop ends those requests (``rank_lost``) on the ``Goodbye`` and welcomes
the rank afresh; a restarted one just welcomes it. Until that ``Welcome`` a rank takes
no dispatch.

Reports do not pass through the agent: each rank publishes its own
(:class:`controlplane.reporter.ReportPublisher`, to the ``report_address`` that
:meth:`RankEngine.welcomed` hands over).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from zmq.utils.monitor import parse_monitor_message

from controlplane.curve import CurvePeer
from controlplane.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_BATCH_ITEMS,
    PROTOCOL_VERSION,
    Abort,
    AgentMessage,
    Dispatch,
    Done,
    Draining,
    Fenced,
    FinishReason,
    FrameError,
    Goodbye,
    Heartbeat,
    Hello,
    Output,
    RankOutputs,
    Welcome,
    daemon_to_agent_channel,
    encode,
)
from controlplane.ratelimited_log import RateLimitedLog
from controlplane.socket_pump import SocketPump

logger = logging.getLogger(__name__)
LOG_INTERVAL_S = 10.0

HELLO_RETRY_S = 1.0
UNKNOWN_RANK = "unknown rank"  # Fenced.detail: the daemon does not know the rank (any more)
UNKNOWN_AGENT = "unknown agent"  # Fenced.detail answering a Heartbeat: it knows none of ours
MAX_ERROR_CHARS = 4096
BLOCKED_RETRY_S = 0.002  # how soon a send the socket refused (high-water mark) is tried again
MAX_CONTROL_BACKLOG = 1024
#: ZMTP heartbeats on the daemon connection: a daemon host that goes silent (no FIN, no
#: RST) is a disconnect after ``DAEMON_HEARTBEAT_TIMEOUT_MS``
DAEMON_HEARTBEAT_IVL_MS = 1000
DAEMON_HEARTBEAT_TIMEOUT_MS = 5000


class InvalidRequest(ValueError):
    """Raised by an engine that refuses a request as malformed (``Done(invalid=True)``)."""


class NoBudget(Exception):
    """Raised by an engine whose admission control refuses a request before it costs
    anything (``Done(no_budget=True)``; the daemon answers ``no_budget``)."""


class OutputSink:
    """Where an engine streams one request's output; the agent sends it in order. For a
    request that is not streamed (``stream`` false) the output is kept here and crosses
    once, in the ``Done``."""

    def __init__(
        self,
        rank: str,
        epoch: int,
        request_id: str,
        send: Callable[[Output | Done], Awaitable[None]],
        dispatch_seq: int = 0,
        stream: bool = True,
    ) -> None:
        self.rank = rank
        self.epoch = epoch
        self.request_id = request_id
        self.dispatch_seq = dispatch_seq
        self.stream = stream
        self.completion_tokens = 0
        self.finished = False
        self._send = send
        self._silent = False
        self._texts: list[str] = []
        self._token_ids: list[int] = []

    async def emit(self, token_ids: Sequence[int] = (), text: str = "") -> None:
        """New output since the last call; ``completion_tokens`` counts ``token_ids``."""
        if self.finished or self._silent or not (token_ids or text):
            return
        self.completion_tokens += len(token_ids)
        if not self.stream:
            self._token_ids.extend(token_ids)
            self._texts.append(text)
            return
        await self._send(Output(
            rank=self.rank, epoch=self.epoch, request_id=self.request_id,
            token_ids=list(token_ids), text=text, completion_tokens=self.completion_tokens,
            dispatch_seq=self.dispatch_seq,
        ))

    async def finish(
        self,
        reason: FinishReason = FinishReason.LENGTH,
        *,
        prompt_tokens: int = 0,
        ttft_s: float | None = None,
        latency_s: float | None = None,
        error: str = "",
        invalid: bool = False,
        no_budget: bool = False,
    ) -> None:
        """Send the request's ``Done``; later calls do nothing."""
        if self.finished or self._silent:
            return
        await self._send(Done(
            rank=self.rank, epoch=self.epoch, request_id=self.request_id, reason=reason,
            prompt_tokens=prompt_tokens, completion_tokens=self.completion_tokens,
            ttft_s=ttft_s, latency_s=latency_s, text="".join(self._texts),
            token_ids=self._token_ids, error=error[:MAX_ERROR_CHARS], invalid=invalid,
            no_budget=no_budget, dispatch_seq=self.dispatch_seq,
        ))
        self.finished = True  # NOTE: only once queued: a wait for room cancelled midway sends nothing

    def silence(self) -> None:
        """The request ends without a ``Done`` (its rank is gone from the daemon's view)."""
        self._silent = True


class RankEngine(Protocol):
    async def serve(self, dispatch: Dispatch, sink: OutputSink) -> None:
        """Run one request to completion, streaming through ``sink`` and ending with
        ``sink.finish``. The agent runs it as a task it owns; cancelling that task is the
        abort: the engine releases what the request holds (``finally``) and lets
        ``CancelledError`` propagate. Raise :class:`InvalidRequest` for a request it
        refuses as malformed; any other exception ends the request with reason=error."""
        ...

    def welcomed(self, welcome: Welcome) -> None:
        """Called, on the agent's socket task (so it must not block), for every
        ``Welcome`` of one of the agent's ranks, before that rank's first dispatch;
        ``welcome.report_address`` is where its reports go."""
        ...


@dataclass(frozen=True, slots=True)
class _Request:
    task: asyncio.Task[None]
    sink: OutputSink


class RankAgent:
    def __init__(
        self,
        rank_address: str,
        agent_id: str,
        ranks: Sequence[str],
        engine: RankEngine,
        *,
        epoch: int | None = None,
        context: zmq.asyncio.Context | None = None,
        hwm: int = 10_000,
        outbox_size: int = 4096,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        hello_retry_s: float = HELLO_RETRY_S,
        close_timeout_s: float = 1.0,
        curve: CurvePeer | None = None,
        coalesce_s: float = 0.0,
    ) -> None:
        """``outbox_size``: output messages that may wait for the socket before the engines
        wait for room; ``coalesce_s``: how long output waits to share a message (0: until
        the end of the current event-loop pass). Operators set it in milliseconds, at most
        ``controlplane.cli_args.MAX_COALESCE_MS`` (``--coalesce-ms`` of a simulated rank,
        ``FAIRBATCHING_CONTROLPLANE_COALESCE_MS`` of an SGLang server)."""
        if outbox_size < 1 or not (math.isfinite(coalesce_s) and coalesce_s >= 0):
            raise ValueError("outbox_size must be >= 1 and coalesce_s a finite number >= 0")
        if not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"an agent needs distinct rank names, got {list(ranks)!r}")
        self.epoch = time.time_ns() if epoch is None else epoch
        self.agent_id = agent_id
        for rank in ranks:
            _check_hello(self._hello(rank))
        self.rank_address = rank_address
        self.ranks = tuple(ranks)
        self.daemon_id: str | None = None
        self.heartbeat_interval_s: float | None = None
        self.counters: Counter[str] = Counter()
        self._rare_log = RateLimitedLog(logger, LOG_INTERVAL_S)
        self._engine = engine
        self._context = context or zmq.asyncio.Context.instance()
        self._hwm = hwm
        self._channel = daemon_to_agent_channel(max_frame_bytes)
        self._hello_retry_s = hello_retry_s
        self._close_timeout_s = close_timeout_s
        self._curve = curve
        self._serving = set(self.ranks)  # not fenced
        self._welcomed: set[str] = set()
        self._requests: dict[tuple[str, str], _Request] = {}  # (rank, request id) -> running
        self._tasks: set[asyncio.Task[None]] = set()  # every request task not yet finished
        self._outbox_size = outbox_size
        self._coalesce_s = coalesce_s
        self._batch: list[Output | Done] = []  # output of this pass, not yet encoded
        self._blocked_control: deque[tuple[bytes, type]] = deque()  # refused by the socket
        self._blocked_output: deque[tuple[bytes, int]] = deque()  # (frame, messages in it)
        self._blocked_output_count = 0
        self._flush_handle: asyncio.Handle | asyncio.TimerHandle | None = None
        self._room = asyncio.Event()
        self._room.set()
        self._socket: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._pump: SocketPump | None = None
        self._monitor_pump: SocketPump | None = None
        self._stop = asyncio.Event()
        self._draining = False
        self._drain_deadline: float | None = None
        self._wake = asyncio.Event()
        self._finished = asyncio.Event()
        self._started = False

    @property
    def coalesce_s(self) -> float:
        """How long output waits to share a message (0: until the end of the pass)."""
        return self._coalesce_s

    @property
    def serving(self) -> frozenset[str]:
        return frozenset(self._serving)

    @property
    def welcomed(self) -> frozenset[str]:
        return frozenset(self._welcomed)

    @property
    def running(self) -> frozenset[tuple[str, str]]:
        return frozenset(self._requests)

    @property
    def draining(self) -> bool:
        return self._draining

    # ---------------------------------------------------------------- lifecycle
    async def run(self) -> None:
        """Serve until :meth:`stop` or until every rank is fenced. Requests still running
        then end without a ``Done`` (:meth:`close` says ``Goodbye`` for their ranks)."""
        if self._started:
            raise RuntimeError("a RankAgent runs once")
        self._started = True
        try:
            self._socket = self._open_socket()
            await self._serve_until_stopped(self._socket)
        finally:
            await self._end_requests()
            self._finished.set()

    async def _serve_until_stopped(self, socket: zmq.Socket) -> None:
        self._pump = SocketPump(socket, self._on_received, on_writable=self._flush_blocked)
        self._monitor_pump = SocketPump(self._monitor, self._on_monitor)
        self._pump.start()
        self._monitor_pump.start()
        try:
            async with asyncio.TaskGroup() as group:
                keepalive = group.create_task(self._keepalive(), name=f"agent {self.agent_id} keepalive")
                await self._stop.wait()
                keepalive.cancel()
        finally:
            self._monitor_pump.stop()
            self._pump.stop()

    def stop(self) -> None:
        self._stop.set()

    def drain(self, timeout_s: float | None = None) -> None:
        """Leave gracefully: ``Draining`` for every rank (the daemon dispatches nothing new
        to them), let the running requests finish, then stop (``close`` says ``Goodbye``).
        After ``timeout_s`` it stops anyway, and the requests still running end as on
        :meth:`stop`. A dispatch that crossed the ``Draining`` is still served."""
        if self._draining:
            return
        self._draining = True
        if timeout_s is not None:
            self._drain_deadline = asyncio.get_running_loop().time() + timeout_s
        for rank in self._served():
            self._enqueue(Draining(rank=rank, epoch=self.epoch))
        self.counters["drains"] += 1
        logger.info("agent %s: draining %d running requests", self.agent_id, len(self._requests))
        self._stop_when_drained()
        self._wake.set()

    def _stop_when_drained(self) -> None:
        if self._draining and not self._requests:
            self.stop()

    async def close(self, goodbye: bool = True) -> None:
        """Stop, send what is still queued and (``goodbye``) a ``Goodbye`` for every rank
        still served, then close the socket; takes at most about ``close_timeout_s``."""
        self.stop()
        if self._started:
            await self._finished.wait()
        if self._socket is None or self._socket.closed:
            return
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        pending = [frame for frame, _ in self._blocked_control]
        pending += [frame for frame, _ in self._blocked_output]
        pending += [encode(RankOutputs(part)) for part in _parts(self._batch)]
        self._blocked_control.clear()
        self._blocked_output.clear()
        self._batch = []
        if goodbye:
            pending += [encode(Goodbye(rank=rank, epoch=self.epoch)) for rank in self._served()]
        deadline = time.monotonic() + self._close_timeout_s
        sent_count = 0
        for frame in pending:
            if not await self._send_by(frame, deadline):
                break
            sent_count += 1
        if sent_count < len(pending):
            self.counters["unsent_at_close"] += len(pending) - sent_count
            logger.warning("agent %s closing: %d messages not sent (the socket was full)",
                           self.agent_id, len(pending) - sent_count)
        linger_ms = max(0, math.ceil((deadline - time.monotonic()) * 1e3))
        self._close_monitor()
        self._socket.close(linger=linger_ms)  # NOTE: a bounded linger lets Goodbye leave

    def _close_monitor(self) -> None:
        if self._monitor is not None and not self._monitor.closed:
            self._socket.disable_monitor()
            self._monitor.close(linger=0)

    async def _send_by(self, frame: bytes, deadline: float) -> bool:
        while not self._try_send(frame):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(BLOCKED_RETRY_S)
        return True

    def _open_socket(self) -> zmq.Socket:
        socket = zmq.Socket(zmq.Context.shadow(self._context.underlying), zmq.DEALER)
        try:
            socket.setsockopt(zmq.ROUTING_ID, self.agent_id.encode())
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, self._hwm)
            socket.setsockopt(zmq.RCVHWM, self._hwm)
            socket.setsockopt(zmq.HEARTBEAT_IVL, DAEMON_HEARTBEAT_IVL_MS)
            socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, DAEMON_HEARTBEAT_TIMEOUT_MS)
            if self._curve is not None:
                self._curve.apply(socket)
            self._monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            socket.connect(self.rank_address)
        except zmq.ZMQError:
            if self._monitor is not None:
                socket.disable_monitor()
                self._monitor.close(linger=0)
            socket.close(linger=0)
            raise
        return socket

    def _on_monitor(self, frames: list[zmq.Frame]) -> None:
        if parse_monitor_message([frame.bytes for frame in frames])["event"] == zmq.EVENT_DISCONNECTED:
            self._on_daemon_lost()

    def _on_daemon_lost(self) -> None:
        """The connection to the daemon dropped: end what ran over it, leave, join again.
        Ranks not welcomed yet have their ``Hello`` retried by the keepalive already."""
        self._pump.read_now()  # what the daemon said before the drop comes first
        self.counters["daemon_disconnects"] += 1
        joined = [rank for rank in self._served() if rank in self._welcomed]
        if not joined and not self._requests:
            return  # the daemon knew nothing of ours (a handshake that failed, say)
        logger.warning("agent %s: the daemon connection dropped; ending %d running requests and "
                       "joining again", self.agent_id, len(self._requests))
        self._forget(lambda rank: True)
        self._batch = []
        self._blocked_output.clear()
        self._blocked_output_count = 0
        self._room.set()
        self._welcomed.clear()
        for rank in joined:
            self._enqueue(Goodbye(rank=rank, epoch=self.epoch))
        for rank in joined:
            self._enqueue(self._hello(rank))

    async def _end_requests(self) -> None:
        for request in self._requests.values():
            request.sink.silence()
            request.task.cancel()
        self._requests.clear()
        if self._tasks:
            _, stuck = await asyncio.wait(set(self._tasks), timeout=self._close_timeout_s)
            if stuck:
                logger.error("agent %s: %d requests ignored cancellation", self.agent_id,
                             len(stuck))

    # ---------------------------------------------------------------- sending
    def _on_received(self, frames: list[zmq.Frame]) -> None:
        for reply in self._on_frames([frame.buffer for frame in frames]):
            self._enqueue(reply)

    def _enqueue(self, message: AgentMessage) -> None:
        """A control message: sent now, or before any output once the socket takes it."""
        frame = encode(message)
        if not self._blocked_control and self._try_send(frame):
            if self._pump is not None:
                self._pump.poke()  # the send may have eaten the edge of a message waiting
            return
        kind = type(message)
        if kind is Heartbeat and any(queued is Heartbeat for _, queued in self._blocked_control):
            return  # one waiting heartbeat says as much as two
        if len(self._blocked_control) >= MAX_CONTROL_BACKLOG:
            self.counters[f"{kind.__name__.lower()}_dropped"] += 1
            self._rare_log.warning("control_backlog_full", "control backlog full; message dropped",
                                   agent=self.agent_id, message=kind.__name__)
            return
        self._blocked_control.append((frame, kind))
        self._schedule_flush(BLOCKED_RETRY_S)

    async def _send_output(self, message: Output | Done) -> None:
        """Queue one output message in this pass's batch; waits while ``outbox_size``
        messages wait for the socket."""
        while len(self._batch) + self._blocked_output_count >= self._outbox_size:
            self._room.clear()
            self.counters["output_waits"] += 1
            await self._room.wait()
        self._batch.append(message)
        self._schedule_flush(self._coalesce_s if not self._blocked_output else BLOCKED_RETRY_S)

    def _schedule_flush(self, delay_s: float) -> None:
        if self._flush_handle is not None:
            return
        loop = asyncio.get_running_loop()
        self._flush_handle = (loop.call_soon(self._flush) if delay_s <= 0
                              else loop.call_later(delay_s, self._flush))

    def _flush(self) -> None:
        self._flush_handle = None
        if self._socket is None or self._socket.closed or self._pump is None or not self._pump.running:
            return  # close() sends what is left
        if self._batch:
            batch, self._batch = self._batch, []
            for part in _parts(batch):
                self._blocked_output.append((encode(RankOutputs(part)), len(part)))
                self._blocked_output_count += len(part)
            self.counters["output_messages"] += len(batch)
        self._flush_blocked()
        if self._blocked_control or self._blocked_output:
            self._schedule_flush(BLOCKED_RETRY_S)
        self._pump.poke()

    def _flush_blocked(self) -> None:
        """Send what waits, control first; stop at the first send the socket refuses."""
        while self._blocked_control:
            if not self._try_send(self._blocked_control[0][0]):
                return
            self._blocked_control.popleft()
        while self._blocked_output:
            frame, count = self._blocked_output[0]
            if not self._try_send(frame):
                return
            self._blocked_output.popleft()
            self._blocked_output_count -= count
            self.counters["output_batches"] += 1
        if not self._room.is_set():
            self._room.set()

    def _try_send(self, frame: bytes) -> bool:
        if self._socket is None or self._socket.closed:
            return False
        try:
            self._socket.send(frame, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    # ---------------------------------------------------------------- tasks
    async def _keepalive(self) -> None:
        """Hello every ``hello_retry_s`` for each rank not yet welcomed; Heartbeat every
        heartbeat interval once a Welcome gave one."""
        loop = asyncio.get_running_loop()
        next_hello = next_beat = loop.time()
        while not self._stop.is_set():  # NOTE: 3.11's wait_for can swallow a cancel that meets a wake
            now = loop.time()
            if now >= next_hello:
                for rank in self._served():
                    if rank not in self._welcomed:
                        self._enqueue(self._hello(rank))
                next_hello = now + self._hello_retry_s
            if self.heartbeat_interval_s is not None and now >= next_beat:
                self._enqueue(Heartbeat(agent=self.agent_id))
                next_beat = now + self.heartbeat_interval_s
            if self._drain_deadline is not None and now >= self._drain_deadline:
                logger.warning("agent %s: drain timed out with %d requests running", self.agent_id,
                               len(self._requests))
                self.counters["drain_timeouts"] += 1
                self.stop()
            wake_at = next_hello
            if self.heartbeat_interval_s is not None:
                wake_at = min(next_hello, next_beat)
            if self._drain_deadline is not None:
                wake_at = min(wake_at, self._drain_deadline)
            self._wake.clear()
            await _wait(self._wake, max(0.0, wake_at - loop.time()))

    # ---------------------------------------------------------------- daemon messages
    def _on_frames(self, frames: Sequence[bytes | memoryview]) -> list[AgentMessage]:
        if len(frames) != 1:
            self.counters["frames_dropped_multipart"] += 1
            self._rare_log.warning("frame_dropped:multipart", "dropped a multipart message",
                                   agent=self.agent_id, frames=len(frames))
            return []
        try:
            message = self._channel.decode(frames[0])
        except FrameError as error:
            self.counters[f"frames_dropped_{error.kind}"] += 1
            self._rare_log.warning(f"frame_dropped:{error.kind}", "dropped a frame from the daemon",
                                   agent=self.agent_id, error=str(error)[:200])
            return []
        match message:
            case Welcome():
                return self._on_welcome(message)
            case Dispatch():
                return self._on_dispatch(message)
            case Abort():
                return self._on_abort(message)
            case Fenced():
                return self._on_fenced(message)
        return []

    def _ours(self, rank: str, epoch: int, kind: str) -> bool:
        if rank in self._serving and epoch == self.epoch:
            return True
        self.counters[f"stale_{kind}"] += 1
        logger.info("agent %s: ignored %s for rank %s epoch %d", self.agent_id, kind, rank, epoch)
        return False

    def _on_welcome(self, welcome: Welcome) -> list[AgentMessage]:
        if not self._ours(welcome.rank, welcome.epoch, "welcome"):
            return []
        replies: list[AgentMessage] = []
        if self.daemon_id is not None and welcome.daemon_id != self.daemon_id:
            logger.warning(
                "agent %s: daemon restarted (%s -> %s); dropping %d running requests",
                self.agent_id, self.daemon_id, welcome.daemon_id, len(self._requests),
            )
            self.counters["daemon_restarts"] += 1
            self._forget(lambda rank: True)
            self._welcomed.clear()
            replies = [self._hello(rank) for rank in self._served() if rank != welcome.rank]
        self.daemon_id = welcome.daemon_id
        self.heartbeat_interval_s = welcome.heartbeat_interval_s
        self._welcomed.add(welcome.rank)
        if self._draining:  # a restarted daemon, or the rank rejoining, must know it again
            replies.append(Draining(rank=welcome.rank, epoch=self.epoch))
        self._wake.set()
        try:
            self._engine.welcomed(welcome)
        except Exception:
            self.counters["engine_welcome_errors"] += 1
            self._rare_log.error("engine_welcome_error", "the engine failed on Welcome", exc_info=True,
                                 agent=self.agent_id, rank=welcome.rank)
        return replies

    def _on_dispatch(self, dispatch: Dispatch) -> list[AgentMessage]:
        if not self._ours(dispatch.rank, dispatch.epoch, "dispatch"):
            return []
        if dispatch.rank not in self._welcomed:  # sent before a drop the daemon has not seen yet
            self.counters["dispatches_before_welcome"] += 1
            return []
        key = (dispatch.rank, dispatch.request_id)
        if key in self._requests:
            self.counters["duplicate_dispatches"] += 1
            logger.info("agent %s: dropped duplicate dispatch of %s", self.agent_id,
                        dispatch.request_id)
            return []
        sink = OutputSink(dispatch.rank, self.epoch, dispatch.request_id, self._send_output,
                          dispatch.dispatch_seq, dispatch.stream)
        task = asyncio.create_task(self._serve(key, dispatch, sink),
                                   name=f"request {dispatch.request_id}")
        self._requests[key] = _Request(task, sink)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self.counters["dispatches"] += 1
        return []

    def _on_abort(self, abort: Abort) -> list[AgentMessage]:
        if not self._ours(abort.rank, abort.epoch, "abort"):
            return []
        request = self._requests.pop((abort.rank, abort.request_id), None)
        if request is None:
            self.counters["aborts_not_running"] += 1
            return []
        request.task.cancel()  # its Done(cancelled) follows; the id may be dispatched again now
        self.counters["aborts"] += 1
        return []

    def _on_fenced(self, fenced: Fenced) -> list[AgentMessage]:
        if fenced.detail.startswith(UNKNOWN_AGENT):
            return self._rejoin(lambda rank: True)
        if not self._ours(fenced.rank, fenced.epoch, "fenced"):
            return []
        if fenced.detail.startswith(UNKNOWN_RANK):
            return self._rejoin(lambda rank: rank == fenced.rank)
        logger.error(
            "agent %s: rank %s epoch %d fenced (%s); no longer serving it",
            self.agent_id, fenced.rank, fenced.epoch, fenced.detail,
        )
        self.counters["fenced_ranks"] += 1
        self._serving.discard(fenced.rank)
        self._welcomed.discard(fenced.rank)
        self._forget(lambda rank: rank == fenced.rank)
        if not self._serving:
            self.stop()
        return []

    def _rejoin(self, on_rank: Callable[[str], bool]) -> list[AgentMessage]:
        """The daemon forgot these ranks (it restarted, or found them lost) and with them
        their requests, which it failed or never knew: drop those and join again."""
        # A rank not welcomed yet already has a Hello on its way (and retried): a burst of
        # stale messages after a daemon restart must not each send another.
        ranks = [rank for rank in self._served() if on_rank(rank) and rank in self._welcomed]
        if not ranks:
            return []
        logger.warning("agent %s: the daemon does not know %s; joining again", self.agent_id, ranks)
        self.counters["rejoins"] += 1
        self._forget(on_rank)
        self._welcomed.difference_update(ranks)
        return [self._hello(rank) for rank in ranks]

    def _hello(self, rank: str) -> Hello:
        return Hello(agent=self.agent_id, rank=rank, epoch=self.epoch, protocol=PROTOCOL_VERSION)

    def _served(self) -> list[str]:
        return [rank for rank in self.ranks if rank in self._serving]

    def _forget(self, on_rank: Callable[[str], bool]) -> None:
        for key in [key for key in self._requests if on_rank(key[0])]:
            request = self._requests.pop(key)
            request.sink.silence()
            request.task.cancel()

    # ---------------------------------------------------------------- one request
    async def _serve(self, key: tuple[str, str], dispatch: Dispatch, sink: OutputSink) -> None:
        try:
            await self._engine.serve(dispatch, sink)
        except asyncio.CancelledError:
            await sink.finish(FinishReason.CANCELLED)
            raise
        except InvalidRequest as error:
            await sink.finish(FinishReason.ERROR, error=str(error), invalid=True)
        except NoBudget as error:
            await sink.finish(FinishReason.ERROR, error=str(error), no_budget=True)
        except Exception as error:
            logger.exception("agent %s: request %s failed", self.agent_id, dispatch.request_id)
            await sink.finish(FinishReason.ERROR, error=f"{type(error).__name__}: {error}")
        else:
            if asyncio.current_task().cancelling():  # the engine swallowed an abort
                await sink.finish(FinishReason.CANCELLED)
            else:
                await sink.finish(FinishReason.ERROR, error="the engine returned without finishing")
        finally:
            request = self._requests.get(key)
            if request is not None and request.sink is sink:
                del self._requests[key]
            self._stop_when_drained()


def _parts(batch: list[Output | Done]) -> list[list[Output | Done]]:
    return [batch[i:i + MAX_BATCH_ITEMS] for i in range(0, len(batch), MAX_BATCH_ITEMS)]


def _check_hello(hello: Hello) -> None:
    """Agent ids, rank names and epochs must be valid on the wire."""
    try:
        msgspec.msgpack.decode(msgspec.msgpack.encode(hello), type=Hello)
    except msgspec.ValidationError as error:
        field_name = str(error).rpartition("$.")[2].strip("`")
        raise ValueError(
            f"invalid {field_name} {getattr(hello, field_name, '?')!r}: agent ids and rank names "
            "are 1-64 printable ASCII characters without spaces, epochs 1 to 2**63-1"
        ) from None


async def _wait(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether ``event`` was set within ``timeout_s`` (False: the time ran out)."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True
