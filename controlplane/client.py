"""The client SDK: a DEALER socket to the daemon's client ROUTER (``docs/controlplane.md``).

:class:`AsyncClient` owns one socket, read by a callback on the event loop
(:class:`controlplane.socket_pump.SocketPump`: every message waiting per wake-up, no
future per message), which routes every reply to its request's bounded inbox by request
id (pings by nonce, status replies in order); a :class:`~controlplane.protocol.Replies`
is unpacked into its items, in order. :class:`Client` runs an :class:`AsyncClient` on a
private event-loop thread. It speaks protocol version 5 and refuses an older daemon
(:class:`InvalidRequest` naming both versions) before it sends a request.

Promises:

- A request keeps its id on every retry. It is resubmitted (at most ``max_retries``
  times, after ``retry_after_s`` or an exponential backoff, with jitter, never past its
  deadline) when the daemon refused it before dispatch (``no_budget``, ``overloaded``,
  ``queue_timeout``, ``no_ranks``), when its rank was lost or the daemon failed handling
  it (``internal``) before any output reached the client, or when the daemon connection
  was lost (a disconnect, a Pong from another ``daemon_id``, or no Pong within
  ``connect_timeout_s`` after ``daemon_timeout_s`` of silence) before any output reached
  the client. After output, those raise :class:`RankLost` / :class:`InternalError` /
  :class:`DaemonUnavailable`. Nothing else is retried.
- Several daemons (``AsyncClient([address, ...])``, active-active): the client holds one
  connection at a time, to an address it picks at random at first (so that many clients
  spread over the daemons), and moves to the next address when that connection is lost
  or its daemon does not answer a ping. A request whose daemon was lost before any
  output reached the client is submitted to the next daemon with the same id, at most
  once; a second loss raises :class:`DaemonUnavailable`.
- No wait is unbounded: a silent request pings the daemon every ``daemon_timeout_s``;
  a deadline bounds the whole call (the daemon is given what is left of it).
- A request that ends on the client's side (deadline, break, exception, task
  cancellation, close) is cancelled at the daemon.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from controlplane.curve import CurvePeer
from controlplane.errors import (
    Cancelled, ControlPlaneError, DaemonUnavailable, RequestFailed, SlowConsumer, from_reject,
    rejected,
)
from controlplane.protocol import (
    BATCH_PROTOCOL_VERSION, DEFAULT_MAX_FRAME_BYTES, PROTOCOL_VERSION, Cancel, ChatMessage, Chunk,
    Dispatched, DrainRank, DrainReply, Finish, FinishReason, FrameError, Ping, Pong, Prompt, RejectReason,
    Replies, SamplingParams, SloSpec, StatusReply, StatusRequest, Submit, as_slo_spec, client_reply_channel,
    client_request_channel, encode, retryable,
)
from controlplane.ratelimited_log import RateLimitedLog
from controlplane.retry import DEFAULT_MAX_RETRIES, DEFAULT_RETRY_BACKOFF_S, retry_delay
from controlplane.socket_pump import SocketPump

DEFAULT_ADDRESS = "tcp://127.0.0.1:5560"
log = logging.getLogger(__name__)
LOG_INTERVAL_S = 10.0
T = TypeVar("T")


class StreamChunk(msgspec.Struct, frozen=True):
    """Output a stream received since its previous chunk."""

    token_ids: tuple[int, ...]  # new since the previous chunk
    text: str  # new since the previous chunk
    completion_tokens: int  # running total
    rank: str | None = None  # the rank serving the request


@dataclass(frozen=True, slots=True)
class Result:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None  # measured at the rank: its receipt to the first token
    latency_s: float  # measured here: the call to the finish, retries included
    rank_latency_s: float | None  # measured at the rank
    rank: str | None
    attempts: int  # submits sent, the first one included


@dataclass(frozen=True, slots=True)
class _Lost:
    """The daemon connection under the outstanding attempt was lost."""

    why: str


@dataclass(frozen=True, slots=True)
class _Stop:
    error: ControlPlaneError
    cancel_sent: bool = False


class _Inbox:
    """One request's replies, bounded. A marker always fits; a stop discards what waits."""

    __slots__ = ("items", "limit", "waiter", "incarnation", "stopped", "due", "timer", "timer_at", "take")

    def __init__(self, limit: int) -> None:
        self.items: deque[object] = deque()
        self.limit = limit
        self.waiter: asyncio.Future[None] | None = None  # the reader's, while it waits
        self.incarnation: int | None = None  # the connection the outstanding attempt went to
        self.stopped = False  # a stop waits: later replies are dropped
        self.due = 0.0  # loop time at which the current wait times out
        self.timer: asyncio.TimerHandle | None = None  # at most one, kept across waits
        self.timer_at = 0.0  # the loop time ``timer`` was set for
        self.take: Callable[[Chunk], bool] | None = None  # takes a chunk at once (True) or not

    def put(self, message: object) -> bool:
        if self.stopped:
            return True
        if not self.items and self.take is not None and type(message) is Chunk and self.take(message):
            return True
        if len(self.items) >= self.limit:
            return False
        self.items.append(message)
        self._wake()
        return True

    def interrupt(self, marker: _Lost | _Stop) -> None:
        self.incarnation = None
        if isinstance(marker, _Stop):
            self.items.clear()
            self.stopped = True
        self.items.append(marker)
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self, timeout: float) -> object | None:
        """The next item, or None after ``timeout`` seconds without one (a future while it
        waits; no task). One timer serves many waits: a wait that ends before the timer
        leaves it set, and a later wait due after it sets it again when it fires, so a
        stream's steps cost no timer each."""
        if not self.items:
            loop = asyncio.get_running_loop()
            waiter = self.waiter = loop.create_future()
            due = self.due = loop.time() + max(timeout, 0.0)
            timer = self.timer
            if timer is None or self.timer_at > due:
                if timer is not None:
                    timer.cancel()
                self.timer_at = due
                self.timer = loop.call_at(due, self._expire)
            try:
                await waiter
            finally:
                self.waiter = None
            if not self.items:
                return None
        return self.items.popleft()

    def _expire(self) -> None:
        self.timer = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return  # no wait now: the next one sets a timer
        if self.timer_at >= self.due:
            waiter.set_result(None)  # the current wait's own timeout
        else:  # set for an earlier wait, which ended in time: on to this one's
            self.timer_at = self.due
            self.timer = waiter.get_loop().call_at(self.due, self._expire)

    def close(self) -> None:
        """The request is over: its timer goes."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class _Output:
    """A request's output so far, as the chunks it received said."""

    __slots__ = ("texts", "token_ids", "completion_tokens", "rank", "streamed")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.completion_tokens = 0
        self.rank: str | None = None
        self.streamed = False  # a chunk reached the consumer: no retry from here on

    def chunk(self, message: Chunk) -> StreamChunk:
        return StreamChunk(tuple(message.token_ids), message.text, message.completion_tokens, self.rank)

    def add(self, message: Chunk, chunk: StreamChunk | None = None) -> StreamChunk:
        self.streamed = True
        self.texts.append(message.text)
        self.token_ids.extend(message.token_ids)
        self.completion_tokens = message.completion_tokens
        return chunk if chunk is not None else self.chunk(message)


class _Push:
    """Where a stream's chunks go as they arrive, if anywhere (:meth:`Stream.push_chunks`)."""

    __slots__ = ("sink",)

    def __init__(self) -> None:
        self.sink: Callable[[StreamChunk], bool] | None = None


def _push_chunk(push: _Push, output: _Output, message: Chunk) -> bool:
    """Hand ``message`` to the consumer's sink at once; False (it waits in the inbox) when
    there is none or it does not take the chunk now. A sink that raises is dropped."""
    sink = push.sink
    if sink is None:
        return False
    chunk = output.chunk(message)
    try:
        taken = sink(chunk)
    except Exception:
        log.exception("a stream's chunk sink failed; its chunks are queued from now on")
        push.sink = None
        return False
    if taken:
        output.add(message, chunk)
    return taken


class AsyncClient:
    """Use as ``async with AsyncClient(...) as client`` (or call :meth:`close`). The socket
    connects lazily on first use, on the running event loop, which it then stays on."""

    def __init__(
        self,
        address: str | Sequence[str] = DEFAULT_ADDRESS,
        *,
        max_retries: int = DEFAULT_MAX_RETRIES,
        connect_timeout_s: float = 5.0,
        daemon_timeout_s: float = 10.0,
        retry_backoff_s: float = DEFAULT_RETRY_BACKOFF_S,
        stream_buffer: int = 4096,
        hwm: int = 10_000,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        curve: CurvePeer | None = None,
    ) -> None:
        if max_retries < 0 or stream_buffer < 1 or hwm < 1:
            raise ValueError("max_retries must be >= 0, stream_buffer and hwm >= 1")
        if min(connect_timeout_s, daemon_timeout_s) <= 0 or retry_backoff_s < 0:
            raise ValueError("timeouts must be > 0 and retry_backoff_s >= 0")
        addresses = (address,) if isinstance(address, str) else tuple(address)
        if not addresses or len(set(addresses)) != len(addresses):
            raise ValueError(f"give one or more distinct daemon addresses, got {list(addresses)!r}")
        self.addresses = addresses
        self._current = random.randrange(len(addresses))
        self.curve = curve  # the daemon's public key and ours, when it serves CURVE
        self.max_retries = max_retries
        self.connect_timeout_s = connect_timeout_s  # a ping's or status request's reply
        self.daemon_timeout_s = daemon_timeout_s  # silence on a request before a ping
        self.retry_backoff_s = retry_backoff_s
        self.stream_buffer = stream_buffer
        self.hwm = hwm
        self.frames_dropped = 0
        self._rare_log = RateLimitedLog(log, LOG_INTERVAL_S)
        self._requests = client_request_channel(max_frame_bytes)
        self._replies = client_reply_channel(max_frame_bytes)
        self._socket: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._pumps: list[SocketPump] = []
        self._inboxes: dict[str, _Inbox] = {}
        self._pings: dict[int, asyncio.Future[Pong]] = {}
        self._statuses: deque[asyncio.Future[StatusReply]] = deque()
        self._drains: deque[tuple[str, asyncio.Future[DrainReply]]] = deque()
        self._nonces = itertools.count(1)
        self._daemon_id: str | None = None  # None: not yet known on this connection
        self._daemon_protocol: int | None = None  # from its latest Pong on this connection
        self._incarnation = 0  # bumped on a disconnect or a new daemon id
        self._failure: ControlPlaneError | None = None
        self._closed = False

    @property
    def daemon_id(self) -> str | None:
        return self._daemon_id

    @property
    def address(self) -> str:
        """The address of the daemon this client uses now."""
        return self.addresses[self._current]

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ public calls
    async def generate(
        self,
        prompt: str | Sequence[int] | Prompt,
        *,
        sampling: SamplingParams | None = None,
        max_new_tokens: int | None = None,
        slo: SloSpec | str | dict | None = None,
        deadline_s: float | None = None,
        request_id: str | None = None,
    ) -> Result:
        """Submit one request (unstreamed) and wait for its result.

        Raises a :class:`RequestRejected` subclass (:class:`InvalidRequest` before sending
        anything), :class:`DaemonUnavailable`, :class:`Cancelled` or :class:`RequestFailed`."""
        submit = self._submit(lambda: _text_or_ids(prompt), sampling, max_new_tokens, slo, request_id,
                              stream=False)
        return await self._complete(submit, deadline_s)

    async def chat(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        *,
        sampling: SamplingParams | None = None,
        max_new_tokens: int | None = None,
        slo: SloSpec | str | dict | None = None,
        deadline_s: float | None = None,
        request_id: str | None = None,
    ) -> Result:
        """:meth:`generate` for a conversation: ``messages`` are :class:`ChatMessage` objects or
        ``{"role", "content"[, "name"]}`` dicts (roles system, developer, user, assistant;
        text content). The rank renders them with its model's chat template and the
        result is the assistant's reply. Needs a daemon of protocol version 4 or later:
        an older one raises :class:`InvalidRequest` before anything is sent."""
        submit = self._submit(lambda: _messages(messages), sampling, max_new_tokens, slo, request_id,
                              stream=False)
        return await self._complete(submit, deadline_s)

    def chat_stream(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        *,
        sampling: SamplingParams | None = None,
        max_new_tokens: int | None = None,
        slo: SloSpec | str | dict | None = None,
        deadline_s: float | None = None,
        request_id: str | None = None,
    ) -> Stream:
        """:meth:`stream` for a conversation (as :meth:`chat`)."""
        submit = self._submit(lambda: _messages(messages), sampling, max_new_tokens, slo, request_id,
                              stream=True)
        return Stream(submit.request_id, self._exchange(submit, deadline_s))

    async def _complete(self, submit: Submit, deadline_s: float | None) -> Result:
        exchange = self._exchange(submit, deadline_s)
        try:
            async for item in exchange:
                if isinstance(item, Result):
                    return item
        finally:
            await exchange.aclose()
        raise AssertionError("an exchange ends with a Result or an error")

    def stream(
        self,
        prompt: str | Sequence[int] | Prompt,
        *,
        sampling: SamplingParams | None = None,
        max_new_tokens: int | None = None,
        slo: SloSpec | str | dict | None = None,
        deadline_s: float | None = None,
        request_id: str | None = None,
    ) -> Stream:
        """A streamed request, submitted on the first iteration::

            async with client.stream("Hello", max_new_tokens=16) as stream:
                async for chunk in stream:      # StreamChunk
                    ...
            stream.result                       # Result, once iteration ended normally

        Leaving early (break, an exception, task cancellation) cancels the request at the
        daemon: at once inside ``async with`` or on :meth:`Stream.aclose`, else when the
        stream is garbage-collected. Errors are raised by the iteration, as in :meth:`generate`."""
        submit = self._submit(lambda: _text_or_ids(prompt), sampling, max_new_tokens, slo, request_id,
                              stream=True)
        push = _Push()
        return Stream(submit.request_id, self._exchange(submit, deadline_s, push), push)

    async def cancel(self, request_id: str) -> None:
        """Cancel a request of this client; its call raises :class:`Cancelled`."""
        self._start()
        inbox = self._inboxes.get(request_id)
        self._send(Cancel(request_id))
        if inbox is not None:
            inbox.interrupt(_Stop(Cancelled("cancelled by the client", request_id=request_id),
                                  cancel_sent=True))

    async def ping(self, timeout_s: float | None = None) -> Pong:
        """The current daemon's ``Pong``. With several daemons, one that does not answer
        in time is left for the next address (the error is still raised)."""
        self._start()
        nonce = next(self._nonces)
        reply: asyncio.Future[Pong] = asyncio.get_running_loop().create_future()
        self._pings[nonce] = reply
        incarnation = self._incarnation
        try:
            self._send(Ping(nonce))
            return await self._reply(reply, timeout_s)
        except DaemonUnavailable as error:
            if len(self.addresses) > 1 and self._incarnation == incarnation:  # not moved meanwhile
                self._next_daemon(str(error))
            raise
        finally:
            self._pings.pop(nonce, None)

    async def status(self, timeout_s: float | None = None) -> StatusReply:
        self._start()
        reply: asyncio.Future[StatusReply] = asyncio.get_running_loop().create_future()
        self._statuses.append(reply)
        try:
            self._send(StatusRequest())
            return await self._reply(reply, timeout_s)
        finally:
            reply.cancel()

    async def drain_rank(self, rank: str, drain: bool = True, timeout_s: float | None = None) -> DrainReply:
        """Stop (``drain``) or resume dispatching to ``rank``; its in-flight requests run on.
        ``known`` is false in the reply when the daemon has no rank of that name."""
        self._start()
        reply: asyncio.Future[DrainReply] = asyncio.get_running_loop().create_future()
        self._drains.append((rank, reply))
        try:
            self._send(DrainRank(rank, drain))
            return await self._reply(reply, timeout_s)
        finally:
            reply.cancel()

    async def close(self) -> None:
        """Cancel every outstanding request (their calls raise :class:`Cancelled`), stop the
        receiver and close the socket. Idempotent."""
        if self._closed:
            return
        for request_id, inbox in list(self._inboxes.items()):
            sent = inbox.incarnation is not None and self._try_send(Cancel(request_id))
            inbox.interrupt(_Stop(Cancelled("the client was closed", request_id=request_id), sent))
        self._closed = True
        self._fail_waiters(Cancelled("the client was closed"))
        for pump in self._pumps:
            pump.stop()
        if self._socket is not None:
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._socket.close(linger=0)

    # ------------------------------------------------------------------ one request
    def _submit(self, prompt: Callable[[], Prompt], sampling: SamplingParams | None,
                max_new_tokens: int | None, slo: SloSpec | str | dict | None,
                request_id: str | None, *, stream: bool) -> Submit:
        """The request, checked as the daemon will check it (it drops, unanswered, a frame
        it cannot decode)."""
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        try:
            body = prompt()
            sampling = sampling if sampling is not None else SamplingParams()
            if max_new_tokens is not None:
                sampling = msgspec.structs.replace(sampling, max_new_tokens=max_new_tokens)
            submit = Submit(request_id, body, sampling, as_slo_spec(slo), None, stream, PROTOCOL_VERSION)
            self._requests.decode(encode(submit))
        except (FrameError, msgspec.ValidationError, TypeError, ValueError) as error:
            raise rejected(RejectReason.INVALID, str(error), request_id=request_id) from None
        return submit

    async def _exchange(self, submit: Submit, deadline_s: float | None,
                        push: _Push | None = None) -> AsyncIterator[StreamChunk | Result]:
        """Yields the chunks, then the Result; raises on failure. Its ``finally`` cancels
        an attempt still outstanding at the daemon. A chunk that ``push.sink`` takes as it
        arrives is not yielded."""
        request_id = submit.request_id
        if deadline_s is not None and not deadline_s > 0:
            raise rejected(RejectReason.INVALID, f"deadline_s must be > 0, got {deadline_s}", request_id=request_id)
        self._start()
        if request_id in self._inboxes:
            raise rejected(RejectReason.DUPLICATE, "this request id is in flight on this client",
                           request_id=request_id)
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline_at = started + deadline_s if deadline_s is not None else None
        # uvloop's loop.time() is cached per iteration in milliseconds: a fine clock for the
        # deadline's timers, too coarse for a latency (a fast answer read 0.0 s)
        started_perf = time.perf_counter()
        inbox = self._inboxes[request_id] = _Inbox(self.stream_buffer)
        attempts, outstanding, recovering, losses = 0, False, False, 0
        output = _Output()
        if push is not None:
            inbox.take = functools.partial(_push_chunk, push, output)
        try:
            while True:
                attempts += 1
                if inbox.items and isinstance(stop := inbox.items[0], _Stop):
                    raise stop.error  # cancelled or closed during the backoff
                await self._ensure_daemon(deadline_at, request_id, chat=submit.prompt.messages is not None)
                self._send(msgspec.structs.replace(submit, deadline_s=_time_left(deadline_at, request_id)))
                inbox.incarnation, outstanding = self._incarnation, True
                while True:
                    message = await self._next(inbox, deadline_at, request_id)
                    if isinstance(message, Dispatched):
                        output.rank = message.rank
                    elif isinstance(message, Chunk):
                        yield output.add(message)
                    else:
                        break
                outstanding = False
                inbox.incarnation = None
                if isinstance(message, Finish):
                    yield self._result(message, output, attempts, time.perf_counter() - started_perf)
                    return
                if isinstance(message, _Stop):
                    outstanding = not message.cancel_sent
                    raise message.error
                if isinstance(message, _Lost):
                    if output.streamed:
                        raise DaemonUnavailable(f"{message.why} after output was received; the "
                                                "request's fate is unknown", request_id=request_id)
                    error: ControlPlaneError = DaemonUnavailable(message.why, request_id=request_id)
                    losses += 1
                    if len(self.addresses) > 1 and losses > 1:
                        raise DaemonUnavailable(f"{message.why}; the request already lost one daemon "
                                                "and is not retried again", request_id=request_id)
                    retry_after, recovering = None, True
                else:
                    error = from_reject(message)
                    reason = message.reason
                    # a duplicate after a lost connection: the old attempt is still known there
                    may_retry = retryable(reason) or (recovering and reason is RejectReason.DUPLICATE)
                    if not may_retry or output.streamed:  # the consumer has seen part of the output
                        raise error
                    retry_after, recovering = message.retry_after_s, reason is RejectReason.DUPLICATE
                if attempts > self.max_retries:
                    raise error
                delay = retry_delay(attempts, retry_after, self.retry_backoff_s, random.random())
                if deadline_at is not None and loop.time() + delay >= deadline_at:
                    raise error
                await asyncio.sleep(delay)
        finally:
            inbox.close()
            if self._inboxes.get(request_id) is inbox:
                del self._inboxes[request_id]
            if outstanding:
                self._try_send(Cancel(request_id))

    @staticmethod
    def _result(finish: Finish, output: _Output, attempts: int, latency_s: float) -> Result:
        request_id = finish.request_id
        if finish.reason is FinishReason.CANCELLED:
            raise Cancelled("the request was cancelled", request_id=request_id)
        if finish.reason is FinishReason.ERROR:
            raise RequestFailed(finish.error or "the rank failed the request", request_id=request_id)
        return Result(
            request_id=request_id, text=finish.text or "".join(output.texts),
            token_ids=tuple(finish.token_ids or output.token_ids), finish_reason=finish.reason,
            prompt_tokens=finish.prompt_tokens,
            completion_tokens=finish.completion_tokens or output.completion_tokens, ttft_s=finish.ttft_s,
            latency_s=latency_s, rank_latency_s=finish.latency_s, rank=output.rank, attempts=attempts,
        )

    async def _next(self, inbox: _Inbox, deadline_at: float | None, request_id: str) -> object:
        """The next reply or marker; a ping after each ``daemon_timeout_s`` of silence."""
        while True:
            message = await inbox.get(_bounded(self.daemon_timeout_s, _time_left(deadline_at, request_id)))
            if message is not None:
                return message
            try:
                await self.ping(_bounded(self.connect_timeout_s, _time_left(deadline_at, request_id)))
            except DaemonUnavailable as error:
                _time_left(deadline_at, request_id)  # a deadline that passed meanwhile wins
                if len(self.addresses) > 1:
                    continue  # the move to the next daemon left this request a _Lost
                self._daemon_id = None
                return _Lost(str(error))

    async def _ensure_daemon(self, deadline_at: float | None, request_id: str, *, chat: bool = False) -> None:
        """Know the daemon id and protocol version of this connection before submitting
        (one ping when unknown), and that the daemon speaks version 5: an older one would
        send replies this client cannot read, or drop its requests unanswered."""
        tried = 0
        while self._daemon_id is None or self._daemon_protocol is None:
            try:
                await self.ping(_bounded(self.connect_timeout_s, _time_left(deadline_at, request_id)))
            except DaemonUnavailable as error:
                _time_left(deadline_at, request_id)
                tried += 1  # with several daemons, the ping moved to the next one
                if tried >= len(self.addresses):
                    error.request_id = request_id
                    raise
        protocol = self._daemon_protocol
        if protocol is not None and protocol < BATCH_PROTOCOL_VERSION:
            older = f"version {protocol}" if protocol else "a version older than 4"
            raise rejected(RejectReason.INVALID, f"unsupported protocol: the daemon at {self.address} "
                           f"speaks protocol {older}, this client speaks version {PROTOCOL_VERSION} "
                           f"(coalesced replies since {BATCH_PROTOCOL_VERSION}"
                           f"{', chat messages since 4' if chat else ''}); upgrade the daemon",
                           request_id=request_id)

    # ------------------------------------------------------------------ the socket
    def _start(self) -> None:
        if self._closed:
            raise ControlPlaneError("the client is closed")
        if self._failure is not None:
            raise self._failure
        self._connect()

    def _connect(self) -> None:
        """The socket to the current daemon, connected once (again after a move)."""
        if self._socket is not None:
            return
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, self.hwm)
        socket.setsockopt(zmq.RCVHWM, self.hwm)
        socket.setsockopt(zmq.RECONNECT_IVL, 100)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if self.curve is not None:
            self.curve.apply(socket)
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            socket.connect(self.address)
        except zmq.ZMQError as error:
            socket.disable_monitor()
            monitor.close(linger=0)
            socket.close(linger=0)
            raise ValueError(f"cannot connect to {self.address!r}: {error}") from None
        self._socket, self._monitor = socket, monitor
        self._pumps = [SocketPump(socket, self._guarded(self._route)),
                       SocketPump(monitor, self._guarded(self._on_monitor))]
        for pump in self._pumps:
            pump.start()

    def _send(self, message: msgspec.Struct) -> None:
        if self._closed or self._socket is None:
            raise ControlPlaneError("the client is closed")
        try:
            self._socket.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            raise DaemonUnavailable(f"the send queue to {self.address} is full (is the daemon up?)") from None
        self._pumps[0].poke()

    def _try_send(self, message: msgspec.Struct) -> bool:
        try:
            self._send(message)
        except ControlPlaneError:
            return False
        return True

    async def _reply(self, reply: asyncio.Future[T], timeout_s: float | None) -> T:
        timeout_s = self.connect_timeout_s if timeout_s is None else timeout_s
        try:
            return await asyncio.wait_for(reply, max(timeout_s, 0.0))
        except TimeoutError:
            raise DaemonUnavailable(f"no reply from the daemon at {self.address} "
                                    f"within {timeout_s:.3g} s") from None

    def _guarded(self, handle: Callable[[T], None]) -> Callable[[T], None]:
        """``handle`` for a pump: a bug in it fails the client, as a dead receiver would."""
        def guarded(received: T) -> None:
            if self._failure is not None:
                return
            try:
                handle(received)
            except Exception as error:
                log.exception("controlplane client receiver failed")
                self._failure = ControlPlaneError(f"the client's receiver failed: {error!r}")
                self._fail_waiters(self._failure)
                for inbox in self._inboxes.values():
                    inbox.interrupt(_Stop(self._failure))
        return guarded

    def _on_monitor(self, frames: list[zmq.Frame]) -> None:
        if parse_monitor_message([frame.bytes for frame in frames])["event"] == zmq.EVENT_DISCONNECTED:
            self._pumps[0].read_now()  # the daemon's last answers came before the drop
            why = f"the connection to {self.address} dropped"
            if len(self.addresses) > 1:
                self._next_daemon(why)
            else:
                self._new_incarnation(why, None)

    def _next_daemon(self, why: str) -> None:
        """Leave the current daemon for the next address: what waits on this connection
        (requests, pings, status and drain replies) learns it is lost, and the next use
        connects to the next address. The old sockets close once this loop pass is over
        (this may run in one of their pumps)."""
        old = (self._socket, self._monitor)
        for pump in self._pumps:
            pump.stop()
        self._socket, self._monitor, self._pumps = None, None, []
        if old[0] is not None:
            asyncio.get_running_loop().call_soon(_close_sockets, *old)
        self._rare_log.warning(f"daemon_moved:{self.address}", "moving to the next daemon",
                               daemon=self.address, why=why)
        self._current = (self._current + 1) % len(self.addresses)
        self._fail_waiters(DaemonUnavailable(why))
        self._new_incarnation(why, None)

    def _route(self, frames: list[zmq.Frame]) -> None:
        try:
            if len(frames) != 1:
                raise FrameError("bad_framing", f"{len(frames)} frames, expected 1")
            message = self._replies.decode(frames[0].buffer)
        except FrameError as error:
            self.frames_dropped += 1
            self._rare_log.warning(f"frame_dropped:{error.kind}", "dropped a frame from the daemon",
                                   daemon=self.address, error=str(error)[:200])
            return
        self._on_message(message)

    def _on_message(self, message: object) -> None:
        if type(message) is Chunk:  # the most frequent by far
            self._to_request(message)
        elif isinstance(message, Replies):
            for item in message.items:
                self._to_request(item)
        elif isinstance(message, Pong):
            self._saw_daemon(message.daemon_id)
            self._daemon_protocol = message.protocol
            waiter = self._pings.get(message.nonce)
            if waiter is not None and not waiter.done():
                waiter.set_result(message)
        elif isinstance(message, StatusReply):
            self._saw_daemon(message.daemon_id)
            while self._statuses:
                waiter = self._statuses.popleft()
                if not waiter.done():
                    waiter.set_result(message)
                    break
        elif isinstance(message, DrainReply):
            for rank, waiter in list(self._drains):
                if rank == message.rank:
                    self._drains.remove((rank, waiter))
                    if not waiter.done():
                        waiter.set_result(message)
                        break
        else:
            self._to_request(message)

    def _to_request(self, message: Dispatched | Chunk | Finish | Any) -> None:
        inbox = self._inboxes.get(message.request_id)
        if inbox is not None and not inbox.put(message):
            sent = self._try_send(Cancel(message.request_id))
            inbox.interrupt(_Stop(SlowConsumer(
                f"{inbox.limit} replies were waiting to be read", request_id=message.request_id), sent))

    def _saw_daemon(self, daemon_id: str) -> None:
        if self._daemon_id is None:
            self._daemon_id = daemon_id
        elif daemon_id != self._daemon_id:
            self._new_incarnation(f"the daemon restarted ({self._daemon_id} -> {daemon_id})", daemon_id)

    def _new_incarnation(self, why: str, daemon_id: str | None) -> None:
        """Every attempt sent before now went to a daemon (or connection) that cannot answer it."""
        self._incarnation += 1
        self._daemon_id = daemon_id
        self._daemon_protocol = None
        for inbox in self._inboxes.values():
            if inbox.incarnation is not None and inbox.incarnation < self._incarnation:
                inbox.interrupt(_Lost(why))

    def _fail_waiters(self, error: ControlPlaneError) -> None:
        for waiter in [*self._pings.values(), *self._statuses, *(w for _, w in self._drains)]:
            if not waiter.done():
                waiter.set_exception(error)
        self._statuses.clear()
        self._drains.clear()


def _close_sockets(socket: zmq.Socket, monitor: zmq.Socket) -> None:
    socket.disable_monitor()
    monitor.close(linger=0)
    socket.close(linger=0)


def _text_or_ids(prompt: str | Sequence[int] | Prompt) -> Prompt:
    if isinstance(prompt, Prompt):
        return prompt
    return Prompt(text=prompt) if isinstance(prompt, str) else Prompt(token_ids=[int(t) for t in prompt])


def _messages(messages: Sequence[ChatMessage | Mapping[str, Any]]) -> Prompt:
    if isinstance(messages, (str, bytes, Mapping)):
        raise TypeError("messages must be a list of messages")
    return Prompt(messages=[m if isinstance(m, ChatMessage) else msgspec.convert(m, ChatMessage)
                            for m in messages])


def _time_left(deadline_at: float | None, request_id: str) -> float | None:
    """Seconds to the deadline (None: no deadline); DeadlineExceeded once it has passed."""
    if deadline_at is None:
        return None
    left = deadline_at - asyncio.get_running_loop().time()
    if left <= 0:
        raise rejected(RejectReason.DEADLINE, "the deadline passed (client side)", request_id=request_id)
    return left


def _bounded(timeout_s: float, left: float | None) -> float:
    return timeout_s if left is None else min(timeout_s, left)


class Stream:
    """An async iterator of :class:`StreamChunk`; ``result`` is the :class:`Result` once the
    iteration has ended normally (None before)."""

    def __init__(self, request_id: str, exchange: AsyncIterator[StreamChunk | Result],
                 push: _Push | None = None) -> None:
        self.request_id = request_id
        self.result: Result | None = None
        self._exchange = exchange
        self._push = push

    def push_chunks(self, sink: Callable[[StreamChunk], bool] | None) -> None:
        """From now on, a chunk that arrives while none waits to be read goes to ``sink``
        at once, on the event loop's receiving callback, instead of waiting for
        ``__anext__``; ``sink`` returns False to leave it (and the chunks after it, until
        they have been read) to ``__anext__`` as usual. Errors and the end still come
        through the iteration, so keep iterating. ``sink`` must not block; None stops."""
        if self._push is None:
            raise ValueError("this stream does not push chunks")
        self._push.sink = sink

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> StreamChunk:
        if self.result is not None:
            raise StopAsyncIteration
        item = await anext(self._exchange)
        if isinstance(item, Result):
            self.result = item
            await self.aclose()
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        """Cancel the request at the daemon unless it is over. Idempotent."""
        await self._exchange.aclose()

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class Client:
    """A synchronous :class:`AsyncClient` (same arguments) on a private event-loop thread."""

    def __init__(self, address: str | Sequence[str] = DEFAULT_ADDRESS, **options: Any) -> None:
        self._client = AsyncClient(address, **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="controlplane-client", daemon=True)
        self._thread.start()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def daemon_id(self) -> str | None:
        return self._client.daemon_id

    def generate(self, prompt: str | Sequence[int], **options: Any) -> Result:
        """:meth:`AsyncClient.generate`; interrupting it (KeyboardInterrupt) cancels the request."""
        return self._call(self._client.generate(prompt, **options))

    def stream(self, prompt: str | Sequence[int], **options: Any) -> SyncStream:
        """:meth:`AsyncClient.stream` as a plain iterator (``with client.stream(...) as s:``)."""
        return SyncStream(self, self._client.stream(prompt, **options))

    def chat(self, messages: Sequence[ChatMessage | Mapping[str, Any]], **options: Any) -> Result:
        """:meth:`AsyncClient.chat`; interrupting it (KeyboardInterrupt) cancels the request."""
        return self._call(self._client.chat(messages, **options))

    def chat_stream(self, messages: Sequence[ChatMessage | Mapping[str, Any]], **options: Any) -> SyncStream:
        """:meth:`AsyncClient.chat_stream` as a plain iterator."""
        return SyncStream(self, self._client.chat_stream(messages, **options))

    def cancel(self, request_id: str) -> None:
        self._call(self._client.cancel(request_id))

    def status(self, timeout_s: float | None = None) -> StatusReply:
        return self._call(self._client.status(timeout_s))

    def ping(self, timeout_s: float | None = None) -> Pong:
        return self._call(self._client.ping(timeout_s))

    def drain_rank(self, rank: str, drain: bool = True, timeout_s: float | None = None) -> DrainReply:
        return self._call(self._client.drain_rank(rank, drain, timeout_s))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self._client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coroutine.close()
            raise ControlPlaneError("the client is closed")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise


class SyncStream:
    """Iterate for :class:`StreamChunk`; ``result`` as in :class:`Stream`. Leaving the loop
    early cancels the request (when the iterator is dropped, or at once with ``with``)."""

    def __init__(self, client: Client, stream: Stream) -> None:
        self._client = client
        self._stream = stream

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    @property
    def result(self) -> Result | None:
        return self._stream.result

    def __iter__(self) -> Iterator[StreamChunk]:
        try:
            while (chunk := self._client._call(self._next())) is not None:
                yield chunk
        finally:
            self.close()

    async def _next(self) -> StreamChunk | None:
        try:
            return await anext(self._stream)
        except StopAsyncIteration:
            return None

    def close(self) -> None:
        if not self._client._loop.is_closed():
            self._client._call(self._stream.aclose())

    def __enter__(self) -> SyncStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
