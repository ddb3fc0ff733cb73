"""The client SDK against a scripted ROUTER (protocol conformance) and against the real daemon."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import threading
import time
from collections.abc import Awaitable, Callable, Sequence

import pytest
import zmq
import zmq.asyncio
from live import ThreadDaemon, start_thread_daemon

from benchmarks.controlplane.live_daemon import loopback_config
from benchmarks.support.ports import free_ports
from controlplane import errors
from controlplane.client import AsyncClient, Client, Result, StreamChunk
from controlplane.config import DaemonConfig
from controlplane.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    ChatMessage,
    Chunk,
    Dispatch,
    Dispatched,
    Done,
    Fenced,
    Finish,
    FinishReason,
    Heartbeat,
    Hello,
    Output,
    Ping,
    Pong,
    Reject,
    RejectReason,
    Report,
    SamplingParams,
    SloSpec,
    StatusReply,
    StatusRequest,
    Submit,
    Welcome,
    client_request_channel,
    daemon_to_agent_channel,
    encode,
)

FAST = dict(connect_timeout_s=0.3, daemon_timeout_s=0.3, retry_backoff_s=0.01)


def run_in_loop(test):
    """Run an async test in a fresh event loop, bounded so that a bug cannot hang the suite."""
    @functools.wraps(test)
    def run(*args, **kwargs) -> None:
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), 15.0))
    return run


Script = Callable[["FakeDaemon", bytes, Submit], Awaitable[None]]


class FakeDaemon:
    """A ROUTER that answers pings and status requests and runs ``script`` for each Submit."""

    def __init__(self, address: str, script: Script | None = None, daemon_id: str = "fake-A",
                 protocol: int = PROTOCOL_VERSION) -> None:
        self.address = address
        self.script = script
        self.daemon_id = daemon_id
        self.protocol = protocol  # 0: a daemon older than 4, whose Pong has no version
        self.answer_pings = True
        self.received: list[object] = []
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: set[asyncio.Task] = set()
        self._receiver: asyncio.Task | None = None

    @property
    def submits(self) -> list[Submit]:
        return [m for m in self.received if isinstance(m, Submit)]

    @property
    def cancels(self) -> list[Cancel]:
        return [m for m in self.received if isinstance(m, Cancel)]

    async def start(self) -> FakeDaemon:
        sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        for _ in range(100):  # a just-closed listener may hold the port for a moment
            try:
                sock.bind(self.address)
                break
            except zmq.ZMQError:
                await asyncio.sleep(0.02)
        else:
            raise RuntimeError(f"cannot bind {self.address}")
        self._socket = sock
        self._receiver = asyncio.create_task(self._receive())
        return self

    async def stop(self) -> None:
        tasks = [*self._tasks, self._receiver]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._socket.close(linger=0)

    async def restart(self, daemon_id: str) -> None:
        await self.stop()
        self.daemon_id = daemon_id
        self._tasks = set()
        await self.start()

    def send(self, identity: bytes, message) -> None:
        self._socket.send_multipart([identity, encode(message)], flags=zmq.NOBLOCK)

    def send_raw(self, identity: bytes, frame: bytes) -> None:
        self._socket.send_multipart([identity, frame], flags=zmq.NOBLOCK)

    async def _receive(self) -> None:
        channel = client_request_channel()
        while True:
            identity, frame = await self._socket.recv_multipart()
            message = channel.decode(frame)
            self.received.append(message)
            if isinstance(message, Ping) and self.answer_pings:
                self.send(identity, Pong(message.nonce, self.daemon_id, protocol=self.protocol))
            elif isinstance(message, StatusRequest):
                self.send(identity, StatusReply(self.daemon_id, "pab", 1.0, False, 0, 0, [], {"submits": 1}))
            elif isinstance(message, Submit) and self.script is not None:
                task = asyncio.create_task(self.script(self, identity, message))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)


def finish(request_id: str, text: str = "hello", **fields) -> Finish:
    return Finish(request_id, FinishReason.LENGTH, prompt_tokens=3, completion_tokens=2, ttft_s=0.01,
                  latency_s=0.02, text=text, token_ids=[7, 8], **fields)


async def serve_ok(daemon: FakeDaemon, identity: bytes, submit: Submit) -> None:
    daemon.send(identity, Dispatched(submit.request_id, "rank-0", 1))
    if submit.stream:
        daemon.send(identity, Chunk(submit.request_id, [7], "hel", 1))
        daemon.send(identity, Chunk(submit.request_id, [8], "lo", 2))
        daemon.send(identity, Finish(submit.request_id, FinishReason.STOP, 3, 2, 0.01, 0.02))
    else:
        daemon.send(identity, finish(submit.request_id))


def rejecting(*reasons: RejectReason, then: Script = serve_ok, retry_after_s: float | None = 0.01) -> Script:
    """Reject the first submits with ``reasons`` (in order), then run ``then``."""
    async def script(daemon: FakeDaemon, identity: bytes, submit: Submit) -> None:
        attempt = len(daemon.submits) - 1
        if attempt < len(reasons):
            daemon.send(identity, Reject(submit.request_id, reasons[attempt], "scripted", retry_after_s,
                                         retryable=reasons[attempt] in {RejectReason.NO_BUDGET}))
        else:
            await then(daemon, identity, submit)
    return script


async def hang(daemon: FakeDaemon, identity: bytes, submit: Submit) -> None:
    daemon.send(identity, Dispatched(submit.request_id, "rank-0", 1))


async def chunk_then_hang(daemon: FakeDaemon, identity: bytes, submit: Submit) -> None:
    daemon.send(identity, Dispatched(submit.request_id, "rank-0", 1))
    daemon.send(identity, Chunk(submit.request_id, [7], "hel", 1))


@pytest.fixture
def address() -> str:
    return f"tcp://127.0.0.1:{free_ports(1)[0]}"


async def eventually(condition: Callable[[], bool], timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------------- happy paths
@run_in_loop
async def test_generate_returns_the_result(address: str) -> None:
    daemon = await FakeDaemon(address, serve_ok).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            result = await client.generate("Hi there", max_new_tokens=8, slo="tight", request_id="r-1")
        assert result == Result("r-1", "hello", (7, 8), FinishReason.LENGTH, 3, 2, 0.01, result.latency_s,
                                0.02, "rank-0", 1)
        assert result.latency_s > 0
        (submit,) = daemon.submits
        assert submit.stream is False and submit.deadline_s is None
        assert submit.sampling.max_new_tokens == 8 and submit.slo.slo_class == "tight"
        assert isinstance(daemon.received[0], Ping)  # learns the daemon id before submitting
    finally:
        await daemon.stop()


@run_in_loop
async def test_stream_yields_chunks_then_exposes_the_result(address: str) -> None:
    daemon = await FakeDaemon(address, serve_ok).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            async with client.stream([1, 2, 3], slo={"ttft_ms": 500}, deadline_s=5) as stream:
                chunks = [chunk async for chunk in stream]
        assert chunks == [StreamChunk((7,), "hel", 1, "rank-0"), StreamChunk((8,), "lo", 2, "rank-0")]
        assert stream.result.text == "hello" and stream.result.token_ids == (7, 8)
        assert stream.result.completion_tokens == 2 and stream.result.finish_reason is FinishReason.STOP
        (submit,) = daemon.submits
        assert submit.stream is True and submit.prompt.token_ids == [1, 2, 3]
        assert 4.5 < submit.deadline_s <= 5 and submit.slo.ttft_ms == 500
        assert not daemon.cancels and len(submit.request_id) == 32
    finally:
        await daemon.stop()


@run_in_loop
async def test_a_pushed_stream_hands_chunks_to_its_sink_until_it_refuses_one(address: str) -> None:
    sink_ready = asyncio.Event()

    async def script(daemon: FakeDaemon, identity: bytes, submit: Submit) -> None:
        daemon.send(identity, Dispatched(submit.request_id, "rank-0", 1))
        daemon.send(identity, Chunk(submit.request_id, [7], "hel", 1))
        await sink_ready.wait()
        for token, text, total in (([8], "lo", 2), ([9], " wor", 3), ([10], "ld", 4)):
            daemon.send(identity, Chunk(submit.request_id, token, text, total))
            await asyncio.sleep(0.02)  # one message each
        daemon.send(identity, Finish(submit.request_id, FinishReason.STOP, 3, 4, 0.01, 0.02))

    pushed: list[StreamChunk] = []

    def sink(chunk: StreamChunk) -> bool:
        if chunk.text == " wor":
            return False
        pushed.append(chunk)
        return True

    daemon = await FakeDaemon(address, script).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            async with client.stream("Hi") as stream:
                read = [await anext(stream)]
                stream.push_chunks(sink)
                sink_ready.set()
                read += [chunk async for chunk in stream]
        # the refused chunk is read; the next one, arriving after, is pushed again
        assert read == [StreamChunk((7,), "hel", 1, "rank-0"), StreamChunk((9,), " wor", 3, "rank-0")]
        assert pushed == [StreamChunk((8,), "lo", 2, "rank-0"), StreamChunk((10,), "ld", 4, "rank-0")]
        assert stream.result.text == "hello world" and stream.result.token_ids == (7, 8, 9, 10)
        assert stream.result.completion_tokens == 4
    finally:
        await daemon.stop()


@run_in_loop
async def test_a_pushed_chunk_is_output_seen_so_a_lost_rank_is_not_retried(address: str) -> None:
    sink_ready = asyncio.Event()

    async def script(daemon: FakeDaemon, identity: bytes, submit: Submit) -> None:
        daemon.send(identity, Dispatched(submit.request_id, "rank-0", 1))
        await sink_ready.wait()
        daemon.send(identity, Chunk(submit.request_id, [7], "hel", 1))
        await asyncio.sleep(0.02)
        daemon.send(identity, Reject(submit.request_id, RejectReason.RANK_LOST, "gone"))

    pushed: list[StreamChunk] = []

    async def consume(stream) -> None:
        async for _ in stream:
            raise AssertionError("every chunk was pushed")

    daemon = await FakeDaemon(address, script).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            with pytest.raises(errors.RankLost):
                async with client.stream("Hi", request_id="pushed-1") as stream:
                    stream.push_chunks(lambda chunk: pushed.append(chunk) is None)
                    reading = asyncio.create_task(consume(stream))
                    # the Dispatched is read and the stream waits: the chunk will find it idle
                    await eventually(lambda: (inbox := client._inboxes.get("pushed-1")) is not None
                                     and inbox.waiter is not None and not inbox.items)
                    sink_ready.set()
                    await reading
        assert [chunk.text for chunk in pushed] == ["hel"] and len(daemon.submits) == 1
    finally:
        await daemon.stop()


@run_in_loop
async def test_status_and_ping(address: str) -> None:
    daemon = await FakeDaemon(address).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            assert (await client.ping()).daemon_id == "fake-A"
            status = await client.status()
            assert status.daemon_id == "fake-A" and status.counters == {"submits": 1}
            assert client.daemon_id == "fake-A"
    finally:
        await daemon.stop()


# ---------------------------------------------------------------------- retries
@run_in_loop
async def test_retryable_rejects_are_resubmitted_with_the_same_id(address: str) -> None:
    daemon = await FakeDaemon(address, rejecting(RejectReason.NO_BUDGET, RejectReason.NO_RANKS)).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            result = await client.generate("Hi")
        assert result.attempts == 3
        assert {s.request_id for s in daemon.submits} == {result.request_id}
    finally:
        await daemon.stop()


@run_in_loop
async def test_retries_stop_at_max_retries(address: str) -> None:
    daemon = await FakeDaemon(address, rejecting(*[RejectReason.OVERLOADED] * 5)).start()
    try:
        async with AsyncClient(address, max_retries=2, **FAST) as client:
            with pytest.raises(errors.Overloaded) as caught:
                await client.generate("Hi")
        assert len(daemon.submits) == 3 and caught.value.request_id == daemon.submits[0].request_id
    finally:
        await daemon.stop()


@run_in_loop
async def test_a_retry_never_goes_past_the_deadline(address: str) -> None:
    daemon = await FakeDaemon(address, rejecting(RejectReason.NO_BUDGET, retry_after_s=5.0)).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            started = time.monotonic()
            with pytest.raises(errors.NoBudget) as caught:
                await client.generate("Hi", deadline_s=1.0)
        assert time.monotonic() - started < 0.9 and len(daemon.submits) == 1  # no wait for 1 s
        assert caught.value.retry_after_s == 5.0
    finally:
        await daemon.stop()


@pytest.mark.parametrize(("reason", "error"), [
    (RejectReason.INVALID, errors.InvalidRequest),
    (RejectReason.DUPLICATE, errors.DuplicateRequest),
    (RejectReason.DEADLINE, errors.DeadlineExceeded),
    (RejectReason.SHUTTING_DOWN, errors.ShuttingDown),
])
@run_in_loop
async def test_final_rejects_are_not_retried(address: str, reason: RejectReason, error: type) -> None:
    daemon = await FakeDaemon(address, rejecting(reason)).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            with pytest.raises(error):
                await client.generate("Hi")
        assert len(daemon.submits) == 1
    finally:
        await daemon.stop()


@run_in_loop
async def test_rank_lost_before_output_is_retried(address: str) -> None:
    daemon = await FakeDaemon(address, rejecting(RejectReason.RANK_LOST)).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            chunks = [chunk async for chunk in client.stream("Hi")]
        assert len(chunks) == 2 and len(daemon.submits) == 2
    finally:
        await daemon.stop()


@run_in_loop
async def test_rank_lost_after_streamed_output_raises(address: str) -> None:
    async def script(daemon: FakeDaemon, identity: bytes, submit: Submit) -> None:
        await chunk_then_hang(daemon, identity, submit)
        daemon.send(identity, Reject(submit.request_id, RejectReason.RANK_LOST, "gone"))

    daemon = await FakeDaemon(address, script).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            received = []
            with pytest.raises(errors.RankLost):
                async with client.stream("Hi") as stream:
                    async for chunk in stream:
                        received.append(chunk)
        assert len(received) == 1 and len(daemon.submits) == 1 and stream.result is None
    finally:
        await daemon.stop()


@run_in_loop
async def test_an_internal_error_before_output_is_retried_then_raised_typed(address: str) -> None:
    daemon = await FakeDaemon(address, rejecting(*[RejectReason.INTERNAL] * 5)).start()
    try:
        async with AsyncClient(address, max_retries=2, **FAST) as client:
            with pytest.raises(errors.InternalError) as caught:
                await client.generate("Hi")
            daemon.script = rejecting(RejectReason.INTERNAL)
            daemon.received.clear()
            assert (await client.generate("Hi")).attempts == 2
        assert isinstance(caught.value, errors.RequestRejected)
        assert caught.value.reason is RejectReason.INTERNAL
        assert caught.value.detail == "scripted"
    finally:
        await daemon.stop()


@run_in_loop
async def test_an_internal_error_after_streamed_output_raises_at_once(address: str) -> None:
    async def script(daemon: FakeDaemon, identity: bytes, submit: Submit) -> None:
        await chunk_then_hang(daemon, identity, submit)
        daemon.send(identity, Reject(submit.request_id, RejectReason.INTERNAL, "bug", retryable=False))

    daemon = await FakeDaemon(address, script).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            received = []
            with pytest.raises(errors.InternalError):
                async with client.stream("Hi") as stream:
                    async for chunk in stream:
                        received.append(chunk)
        assert len(received) == 1 and len(daemon.submits) == 1 and not daemon.cancels
    finally:
        await daemon.stop()


# ---------------------------------------------------------------------- cancellation and deadlines
@pytest.mark.parametrize("how", ["break", "exception", "task_cancelled", "dropped"])
@run_in_loop
async def test_leaving_a_stream_early_cancels_it(address: str, how: str) -> None:
    daemon = await FakeDaemon(address, chunk_then_hang).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            if how == "break":
                async with client.stream("Hi") as stream:
                    async for _ in stream:
                        break
            elif how == "exception":
                with pytest.raises(KeyError):
                    async with client.stream("Hi") as stream:
                        async for _ in stream:
                            raise KeyError("consumer failed")
            elif how == "task_cancelled":
                async def consume() -> None:
                    async with client.stream("Hi") as stream:
                        async for _ in stream:
                            await asyncio.sleep(10)
                task = asyncio.create_task(consume())
                await eventually(lambda: bool(daemon.submits))
                await asyncio.sleep(0.05)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:  # a plain `async for` left with break; the stream is garbage-collected
                async for _ in client.stream("Hi"):
                    break
                gc.collect()
            await eventually(lambda: bool(daemon.cancels))
        assert [c.request_id for c in daemon.cancels] == [daemon.submits[0].request_id]
    finally:
        await daemon.stop()


@run_in_loop
async def test_a_stream_read_too_slowly_fails_and_is_cancelled(address: str) -> None:
    async def script(daemon: FakeDaemon, identity: bytes, submit: Submit) -> None:
        for n in range(1, 6):
            daemon.send(identity, Chunk(submit.request_id, [n], "x", n))

    daemon = await FakeDaemon(address, script).start()
    try:
        async with AsyncClient(address, stream_buffer=2, **FAST) as client:
            async with client.stream("Hi") as stream:
                with pytest.raises(errors.SlowConsumer):  # the burst may overflow before the first read
                    async for _ in stream:
                        await eventually(lambda: bool(daemon.cancels))
            await eventually(lambda: bool(daemon.cancels))
        assert len(daemon.cancels) == 1
    finally:
        await daemon.stop()


@run_in_loop
async def test_deadline_raises_and_cancels(address: str) -> None:
    daemon = await FakeDaemon(address, hang).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            started = time.monotonic()
            with pytest.raises(errors.DeadlineExceeded):
                await client.generate("Hi", deadline_s=0.5)
            assert 0.45 < time.monotonic() - started < 1.5
            await eventually(lambda: bool(daemon.cancels))
        assert daemon.submits[0].deadline_s <= 0.5
    finally:
        await daemon.stop()


@run_in_loop
async def test_cancel_stops_a_pending_generate(address: str) -> None:
    daemon = await FakeDaemon(address, hang).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            task = asyncio.create_task(client.generate("Hi", request_id="r-9"))
            await eventually(lambda: bool(daemon.submits))
            await client.cancel("r-9")
            with pytest.raises(errors.Cancelled):
                await task
            await eventually(lambda: bool(daemon.cancels))
            await asyncio.sleep(0.05)
        assert len(daemon.cancels) == 1
    finally:
        await daemon.stop()


@run_in_loop
async def test_close_cancels_outstanding_requests(address: str) -> None:
    daemon = await FakeDaemon(address, hang).start()
    try:
        client = AsyncClient(address, **FAST)
        task = asyncio.create_task(client.generate("Hi"))
        await eventually(lambda: bool(daemon.submits))
        await client.close()
        with pytest.raises(errors.Cancelled):
            await task
        await eventually(lambda: bool(daemon.cancels))
    finally:
        await daemon.stop()


@run_in_loop
async def test_a_finish_reason_cancelled_or_error_raises(address: str) -> None:
    async def script(daemon: FakeDaemon, identity: bytes, submit: Submit) -> None:
        reason = FinishReason.ERROR if submit.request_id == "err" else FinishReason.CANCELLED
        daemon.send(identity, Finish(submit.request_id, reason, error="boom"))

    daemon = await FakeDaemon(address, script).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            with pytest.raises(errors.RequestFailed, match="boom"):
                await client.generate("Hi", request_id="err")
            with pytest.raises(errors.Cancelled):
                await client.generate("Hi", request_id="other")
    finally:
        await daemon.stop()


# ---------------------------------------------------------------------- invalid input and frames
@pytest.mark.parametrize("call", [
    dict(prompt=""),
    dict(prompt=[]),
    dict(prompt="x", max_new_tokens=0),
    dict(prompt="x", request_id="has space"),
    dict(prompt="x", sampling=SamplingParams(top_p=2.0)),
    dict(prompt="x", slo={"nonsense": 1}),
    dict(prompt="x", slo={"e2e_ms": 20_000, "tpot_ms": 50}),
    dict(prompt="x", slo={"e2e_ms": 500, "ttft_ms": 500}),
    dict(prompt="x", slo={"e2e_ms": 0}),
    dict(prompt="x", deadline_s=0),
])
@run_in_loop
async def test_invalid_requests_are_refused_locally(address: str, call: dict) -> None:
    daemon = await FakeDaemon(address, serve_ok).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            with pytest.raises(errors.InvalidRequest):
                await client.generate(**call)
        assert not daemon.submits
    finally:
        await daemon.stop()


@run_in_loop
async def test_bad_frames_from_the_daemon_are_dropped(address: str) -> None:
    async def script(daemon: FakeDaemon, identity: bytes, submit: Submit) -> None:
        daemon.send_raw(identity, b"\x00garbage")
        daemon.send_raw(identity, encode(Ping(1)))  # a message not allowed on this channel
        await serve_ok(daemon, identity, submit)

    daemon = await FakeDaemon(address, script).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            assert (await client.generate("Hi")).text == "hello"
            assert client.frames_dropped == 2
    finally:
        await daemon.stop()


def test_every_reject_reason_maps_to_its_error() -> None:
    for reason in RejectReason:
        error = errors.from_reject(Reject("r", reason, "why", 0.5, True))
        assert isinstance(error, errors.RequestRejected) and type(error) is not errors.RequestRejected
        assert (error.reason, error.detail, error.retry_after_s, error.retryable, error.request_id) == \
            (reason, "why", 0.5, True, "r")
    assert isinstance(errors.rejected(RejectReason.INVALID), ValueError)


# ---------------------------------------------------------------------- daemon loss
@run_in_loop
async def test_an_unreachable_daemon_raises_daemon_unavailable(address: str) -> None:
    async with AsyncClient(address, **FAST) as client:
        started = time.monotonic()
        with pytest.raises(errors.DaemonUnavailable):
            await client.generate("Hi")
        with pytest.raises(errors.DaemonUnavailable):
            await client.status()
        assert time.monotonic() - started < 2.0  # two connect timeouts: 0.6 s


@pytest.mark.parametrize("new_id", ["fake-B", "fake-A"])  # a fixed daemon_id in its config
@run_in_loop
async def test_a_restarted_daemon_gets_the_request_again_with_the_same_id(address: str, new_id: str) -> None:
    daemon = await FakeDaemon(address, hang).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            task = asyncio.create_task(client.generate("Hi"))
            await eventually(lambda: bool(daemon.submits))
            first_id = daemon.submits[0].request_id
            daemon.script = serve_ok
            await daemon.restart(new_id)
            result = await asyncio.wait_for(task, 3.0)
            assert client.daemon_id == new_id
        assert result.request_id == first_id and result.attempts == 2
        assert [s.request_id for s in daemon.submits] == [first_id, first_id]  # one per daemon
    finally:
        await daemon.stop()


@run_in_loop
async def test_a_restart_after_streamed_output_raises(address: str) -> None:
    daemon = await FakeDaemon(address, chunk_then_hang).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            stream = client.stream("Hi")
            await anext(stream)
            await daemon.restart("fake-B")
            with pytest.raises(errors.DaemonUnavailable, match="after output"):
                await asyncio.wait_for(anext(stream), 3.0)
            assert len(daemon.submits) == 1
    finally:
        await daemon.stop()


@run_in_loop
async def test_a_pong_from_another_daemon_id_resubmits(address: str) -> None:
    daemon = await FakeDaemon(address, hang).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            task = asyncio.create_task(client.generate("Hi"))
            await eventually(lambda: bool(daemon.submits))
            daemon.daemon_id, daemon.script = "fake-B", serve_ok  # no disconnect: only the id tells
            result = await asyncio.wait_for(task, 3.0)
        assert result.attempts == 2 and len(daemon.submits) == 2
    finally:
        await daemon.stop()


@run_in_loop
async def test_a_duplicate_after_a_lost_connection_is_retried(address: str) -> None:
    async def script(daemon: FakeDaemon, identity: bytes, submit: Submit) -> None:
        attempt = len(daemon.submits)
        if attempt == 1:
            await hang(daemon, identity, submit)
            daemon.daemon_id = "fake-B"
        elif attempt == 2:  # the first attempt is still known there
            daemon.send(identity, Reject(submit.request_id, RejectReason.DUPLICATE, "in flight"))
        else:
            await serve_ok(daemon, identity, submit)

    daemon = await FakeDaemon(address, script).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            assert (await client.generate("Hi")).attempts == 3
    finally:
        await daemon.stop()


@run_in_loop
async def test_a_silent_daemon_ends_in_daemon_unavailable(address: str) -> None:
    daemon = await FakeDaemon(address, hang).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            task = asyncio.create_task(client.generate("Hi"))
            await eventually(lambda: bool(daemon.submits))
            daemon.answer_pings = False
            started = time.monotonic()
            with pytest.raises(errors.DaemonUnavailable):
                await asyncio.wait_for(task, 3.0)
            assert time.monotonic() - started < 2.5  # silence + ping + one more ping: 0.9 s
    finally:
        await daemon.stop()


# ---------------------------------------------------------------------- two daemons
@pytest.fixture
def two_addresses() -> tuple[str, str]:
    return tuple(f"tcp://127.0.0.1:{port}" for port in free_ports(2))


@contextlib.asynccontextmanager
async def hanging_daemons(addresses: Sequence[str]):
    """A FakeDaemon that holds every request on each address, stopped at the end."""
    daemons = [await FakeDaemon(a, hang, daemon_id=f"fake-{i}").start() for i, a in enumerate(addresses)]
    try:
        yield daemons
    finally:
        for daemon in daemons:
            await daemon.stop()  # idempotent: a test may have stopped it


async def one_submitted(*daemons: FakeDaemon) -> tuple[FakeDaemon, list[FakeDaemon]]:
    """The daemon that received the first submit, and the others."""
    await eventually(lambda: any(d.submits for d in daemons))
    first = next(d for d in daemons if d.submits)
    return first, [d for d in daemons if d is not first]


def test_several_addresses_must_be_distinct() -> None:
    with pytest.raises(ValueError, match="distinct daemon addresses"):
        AsyncClient(["tcp://127.0.0.1:1", "tcp://127.0.0.1:1"])
    with pytest.raises(ValueError, match="distinct daemon addresses"):
        AsyncClient([])


@run_in_loop
async def test_a_request_whose_daemon_dies_is_submitted_to_the_other_with_the_same_id(two_addresses) -> None:
    async with hanging_daemons(two_addresses) as daemons, AsyncClient(two_addresses, **FAST) as client:
        task = asyncio.create_task(client.generate("Hi", request_id="survivor"))
        dead, (other,) = await one_submitted(*daemons)
        other.script = serve_ok
        await dead.stop()  # its end of the connection closes, as a killed process's does
        result = await asyncio.wait_for(task, 3.0)
        assert (result.request_id, result.attempts) == ("survivor", 2)
        assert [s.request_id for s in other.submits] == ["survivor"]
        assert client.address == other.address and client.daemon_id == other.daemon_id
        assert (await client.generate("again")).attempts == 1  # it stays on the live one


@run_in_loop
async def test_a_request_that_loses_both_daemons_raises_daemon_unavailable(two_addresses) -> None:
    async with hanging_daemons(two_addresses) as daemons, \
            AsyncClient(two_addresses, max_retries=5, **FAST) as client:
        task = asyncio.create_task(client.generate("Hi"))
        first, (second,) = await one_submitted(*daemons)
        await first.stop()
        await eventually(lambda: bool(second.submits))
        await second.stop()
        with pytest.raises(errors.DaemonUnavailable, match="already lost one daemon"):
            await asyncio.wait_for(task, 3.0)


@run_in_loop
async def test_a_daemon_gone_silent_is_left_for_the_other_and_its_request_resubmitted(two_addresses) -> None:
    async with hanging_daemons(two_addresses) as daemons, AsyncClient(two_addresses, **FAST) as client:
        task = asyncio.create_task(client.generate("Hi", request_id="patient"))
        silent, (other,) = await one_submitted(*daemons)
        other.script = serve_ok
        silent.answer_pings = False  # alive and connected, but it answers nothing
        result = await asyncio.wait_for(task, 5.0)
        assert (result.request_id, result.attempts) == ("patient", 2)
        assert client.address == other.address
        silent.answer_pings, other.answer_pings = True, False
        with pytest.raises(errors.DaemonUnavailable):
            await client.ping()
        assert client.address == silent.address  # a health check that fails moves it too


@run_in_loop
async def test_a_client_that_starts_on_an_unreachable_daemon_moves_to_the_next(two_addresses) -> None:
    dead_address, live_address = two_addresses
    daemon = await FakeDaemon(live_address, serve_ok).start()
    try:
        for _ in range(64):  # the first address is picked at random: until it is the dead one
            client = AsyncClient(two_addresses, **FAST)
            if client.address == dead_address:
                break
            await client.close()
        assert client.address == dead_address
        async with client:
            result = await client.generate("Hi")
            assert result.attempts == 1 and client.address == live_address
    finally:
        await daemon.stop()


# ---------------------------------------------------------------------- the synchronous client
def test_sync_client(address: str) -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(5)

    async def start(script: Script) -> FakeDaemon:
        return await FakeDaemon(address, script).start()

    daemon = on_loop(start(serve_ok))
    try:
        with Client(address, **FAST) as client:
            assert client.generate("Hi").text == "hello"
            with client.stream("Hi") as stream:
                assert [c.text for c in stream] == ["hel", "lo"]
            assert stream.result.text == "hello"
            assert client.chat([{"role": "user", "content": "Hi"}]).text == "hello"
            with client.chat_stream([ChatMessage("user", "Hi")]) as stream:
                assert [c.text for c in stream] == ["hel", "lo"]
            assert client.ping().daemon_id == "fake-A" and client.status().policy == "pab"
            daemon.script = chunk_then_hang
            for _ in client.stream("Hi"):
                break
            deadline = time.monotonic() + 2
            while not daemon.cancels and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(daemon.cancels) == 1
    finally:
        on_loop(daemon.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


# ---------------------------------------------------------------------- the real daemon
class FakeAgent:
    """A rank agent for one rank: Hello (again whenever fenced), heartbeats, one report per
    Welcome, and two tokens of output per Dispatch unless ``hold``."""

    def __init__(self, config: DaemonConfig, rank: str = "rank-0", epoch: int = 1) -> None:
        self.config, self.rank, self.epoch, self.agent = config, rank, epoch, f"agent-{rank}"
        self.hold = False
        self.dispatched: list[Dispatch] = []
        self.welcomes: list[Welcome] = []
        self._task: asyncio.Task | None = None
        # Python 3.11's wait_for may swallow a cancel that meets a message: _run also
        # checks this flag, so that __aexit__ cannot wait forever on it
        self._stopping = False

    async def __aenter__(self) -> FakeAgent:
        context = zmq.asyncio.Context.instance()
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.ROUTING_ID, self.agent.encode())
        self._reports = context.socket(zmq.PUSH)
        for sock, address in ((self._socket, self.config.rank_address), (self._reports, self.config.report_address)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        self._task = asyncio.create_task(self._run())
        await eventually(lambda: bool(self.welcomes))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._stopping = True
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._socket.close(linger=0)
        self._reports.close(linger=0)

    def _send(self, message) -> None:
        self._socket.send(encode(message), zmq.NOBLOCK)

    async def _run(self) -> None:
        channel, seq = daemon_to_agent_channel(), 0
        self._send(Hello(self.agent, self.rank, self.epoch, protocol=PROTOCOL_VERSION))
        while not self._stopping:
            try:
                message = channel.decode(await asyncio.wait_for(self._socket.recv(), 0.1))
            except TimeoutError:
                self._send(Heartbeat(self.agent))
                continue
            if isinstance(message, Welcome):
                self.welcomes.append(message)
                seq += 1
                self._reports.send(encode(Report(self.rank, self.epoch, seq, 1e6, 0, 0, 0, 1_000_000, 0,
                                                 0.01, time.monotonic())), zmq.NOBLOCK)
            elif isinstance(message, Fenced):
                self._send(Hello(self.agent, self.rank, self.epoch, protocol=PROTOCOL_VERSION))
            elif isinstance(message, Dispatch):
                self.dispatched.append(message)
                if not self.hold:
                    self._send(Output(self.rank, self.epoch, message.request_id, [7], "hel", 1))
                    self._send(Output(self.rank, self.epoch, message.request_id, [8], "lo", 2))
                    self._send(Done(self.rank, self.epoch, message.request_id, FinishReason.LENGTH,
                                    3, 2, 0.01, 0.02))


def live_config(**overrides) -> DaemonConfig:
    return loopback_config(stale_after_s=30.0, lost_after_s=60.0, retry_after_s=0.05, drain_timeout_s=0.0,
                           **overrides)


def crash(running: ThreadDaemon) -> None:
    """Stop the daemon without a drain: nothing is said to clients or agents."""
    def cancel_everything() -> None:
        for task in asyncio.all_tasks(running.loop):
            task.cancel()
    running.loop.call_soon_threadsafe(cancel_everything)
    running.thread.join(5)
    assert not running.thread.is_alive()


@run_in_loop
async def test_against_the_daemon_generate_stream_and_status() -> None:
    running = start_thread_daemon(live_config())
    try:
        async with FakeAgent(running.config), AsyncClient(running.config.client_address, **FAST) as client:
            result = await client.generate("Hello world", max_new_tokens=2, slo="tight")
            assert (result.text, result.token_ids, result.rank, result.attempts) == ("hello", (7, 8), "rank-0", 1)
            async with client.stream([1, 2, 3], deadline_s=5) as stream:
                assert [c.text async for c in stream] == ["hel", "lo"]
            assert stream.result.completion_tokens == 2
            status = await client.status()
            assert status.daemon_id == running.daemon.daemon_id and [r.rank for r in status.ranks] == ["rank-0"]
            assert status.counters["dispatched"] == 2 and status.in_flight == 0
    finally:
        running.stop()


@run_in_loop
async def test_against_the_daemon_no_ranks_is_retried_then_raised() -> None:
    running = start_thread_daemon(live_config())
    try:
        async with AsyncClient(running.config.client_address, max_retries=2, **FAST) as client:
            with pytest.raises(errors.NoRanks):
                await client.generate("Hi", request_id="lonely")
        assert running.counters()["rejected_no_ranks"] == 3
    finally:
        running.stop()


@run_in_loop
async def test_against_the_daemon_a_drain_is_not_retried() -> None:
    running = start_thread_daemon(live_config())
    try:
        async with FakeAgent(running.config) as agent, AsyncClient(running.config.client_address, **FAST) as client:
            agent.hold = True
            task = asyncio.create_task(client.generate("Hi"))
            await eventually(lambda: bool(agent.dispatched))
            running.loop.call_soon_threadsafe(running.daemon.request_drain)
            with pytest.raises(errors.ShuttingDown):
                await task
        running.thread.join(5)
    finally:
        if running.thread.is_alive():
            running.stop()


@run_in_loop
async def test_against_the_daemon_a_crash_and_restart_on_the_same_address() -> None:
    config = live_config()
    running = start_thread_daemon(config)
    try:
        async with FakeAgent(config) as agent, AsyncClient(config.client_address, max_retries=5, **FAST) as client:
            agent.hold = True
            task = asyncio.create_task(client.generate("Hi", request_id="survivor"))
            await eventually(lambda: bool(agent.dispatched))
            old_id = running.daemon.daemon_id
            crash(running)
            agent.hold = False
            running = await asyncio.to_thread(start_thread_daemon, config)
            result = await asyncio.wait_for(task, 5.0)
            assert (result.request_id, result.text) == ("survivor", "hello") and result.attempts >= 2
            assert client.daemon_id == running.daemon.daemon_id != old_id
            assert [d.request_id for d in agent.dispatched] == ["survivor", "survivor"]
            # welcomed by the old daemon, then by the new one (a re-Hello while the new
            # one starts may be welcomed twice: the count is not the contract)
            assert agent.welcomes[0].daemon_id == old_id
            assert {w.daemon_id for w in agent.welcomes[1:]} == {running.daemon.daemon_id}
    finally:
        if running.thread.is_alive():
            running.stop()


@run_in_loop
async def test_against_the_daemon_a_handler_failure_is_an_internal_error(monkeypatch) -> None:
    running = start_thread_daemon(live_config())
    try:
        core = running.daemon.core
        original = core._submit

        def failing(identity: bytes, submit: Submit, now: float) -> list:
            if submit.request_id == "unlucky":
                raise RuntimeError("injected failure")
            return original(identity, submit, now)

        monkeypatch.setattr(core, "_submit", failing)
        # The daemon logs each failure with its traceback, in this process's thread: on a
        # busy machine that takes longer than FAST's 0.3 s, and the retry's ping must wait.
        patient = {**FAST, "connect_timeout_s": 10.0, "daemon_timeout_s": 10.0}
        async with FakeAgent(running.config), AsyncClient(running.config.client_address, max_retries=1,
                                                          **patient) as client:
            with pytest.raises(errors.InternalError) as caught:
                await client.generate("Hi", request_id="unlucky")
            assert caught.value.retryable and caught.value.request_id == "unlucky"
            assert (await client.generate("Hi")).text == "hello"
            status = await client.status()
        assert status.counters["internal_errors"] == 2 and status.counters["rejected_internal"] == 2
        assert status.in_flight == 0 and status.ranks[0].in_flight == 0
    finally:
        running.stop()


@run_in_loop
async def test_a_contradictory_e2e_slo_is_refused_locally_saying_why(address: str) -> None:
    daemon = await FakeDaemon(address, serve_ok).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            with pytest.raises(errors.InvalidRequest, match="give e2e_ms .* or tpot_ms, not both"):
                await client.generate("x", slo={"e2e_ms": 20_000, "tpot_ms": 50})
            result = await client.generate("x", slo={"class": "code", "e2e_ms": 20_000})
            assert result.finish_reason is not None
        assert [s.slo for s in daemon.submits] == [SloSpec("code", e2e_ms=20_000)]
    finally:
        await daemon.stop()


# ---------------------------------------------------------------------- chat
@run_in_loop
async def test_chat_sends_the_conversation_and_returns_the_reply(address: str) -> None:
    daemon = await FakeDaemon(address, serve_ok).start()
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "ann"}]
    try:
        async with AsyncClient(address, **FAST) as client:
            result = await client.chat(conversation, max_new_tokens=8, slo="tight", request_id="c-1")
            async with client.chat_stream([ChatMessage("user", "Again")]) as stream:
                chunks = [chunk.text async for chunk in stream]
        assert (result.request_id, result.text, chunks) == ("c-1", "hello", ["hel", "lo"])
        first, second = daemon.submits
        assert first.prompt.messages == [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi", "ann")]
        assert (first.prompt.text, first.prompt.token_ids, first.stream) == (None, None, False)
        assert first.sampling.max_new_tokens == 8 and first.slo.slo_class == "tight"
        assert second.prompt.messages == [ChatMessage("user", "Again")] and second.stream
    finally:
        await daemon.stop()


@run_in_loop
async def test_a_daemon_older_than_protocol_5_is_refused_before_sending(address: str) -> None:
    for protocol, named in ((0, "a version older than 4"), (4, "version 4")):
        daemon = await FakeDaemon(address, serve_ok, protocol=protocol).start()
        try:
            async with AsyncClient(address, **FAST) as client:
                with pytest.raises(errors.InvalidRequest, match=f"speaks protocol {named}, this client "
                                   "speaks version 5.*upgrade the daemon"):
                    await client.chat([{"role": "user", "content": "Hi"}])
                with pytest.raises(errors.InvalidRequest, match="unsupported protocol.*upgrade the daemon"):
                    await client.generate("plain text")
            assert daemon.submits == []
        finally:
            await daemon.stop()


@pytest.mark.parametrize(("messages", "fragment"), [
    ([], "messages must not be empty"),
    ([{"role": "robot", "content": "x"}], "role"),
    ([{"role": "user"}], "content"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "content"),
    ("Hi", "a list of messages"),
])
@run_in_loop
async def test_malformed_conversations_are_refused_locally(address: str, messages, fragment: str) -> None:
    daemon = await FakeDaemon(address, serve_ok).start()
    try:
        async with AsyncClient(address, **FAST) as client:
            with pytest.raises(errors.InvalidRequest, match=fragment):
                await client.chat(messages)
        assert not daemon.submits
    finally:
        await daemon.stop()


# ---------------------------------------------------------------------- the inbox's timer
@run_in_loop
async def test_an_inbox_keeps_one_timer_across_waits_and_still_times_out_on_time() -> None:
    from controlplane.client import _Inbox

    loop = asyncio.get_running_loop()
    inbox = _Inbox(8)
    loop.call_later(0.01, inbox.put, 0)
    assert await inbox.get(0.2) == 0
    timer = inbox.timer
    for item in range(1, 5):  # waits that end before the timer leave it as it is
        loop.call_later(0.01, inbox.put, item)
        assert await inbox.get(0.2) == item
        assert inbox.timer is timer
    started = loop.time()  # the timer, set for an earlier wait, fires and is set again
    assert await inbox.get(0.3) is None
    assert 0.29 <= loop.time() - started < 1.0
    loop.call_later(0.01, inbox.put, 5)
    assert await inbox.get(5.0) == 5
    started = loop.time()  # a shorter wait than the timer left: set earlier
    assert await inbox.get(0.05) is None
    assert 0.04 <= loop.time() - started < 1.0
    inbox.close()
    assert inbox.timer is None
