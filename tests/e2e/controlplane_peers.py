"""Peers of a real control-plane daemon for the SGLang end-to-end tests: a raw DEALER
client speaking the wire protocol (no SDK: the tests check the daemon's replies
themselves, retries included), and a report tap that records every report the SGLang
schedulers publish before forwarding it to the daemon."""

from __future__ import annotations

import asyncio
import itertools
import threading
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from controlplane import protocol as p


@dataclass
class Outcome:
    """Everything the daemon said about one request."""

    request_id: str
    dispatched: list[p.Dispatched] = field(default_factory=list)
    chunks: list[p.Chunk] = field(default_factory=list)
    finish: p.Finish | None = None
    reject: p.Reject | None = None

    @property
    def rank(self) -> str | None:
        return self.dispatched[-1].rank if self.dispatched else None

    @property
    def token_ids(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.token_ids]

    @property
    def over(self) -> bool:
        return self.finish is not None or self.reject is not None


class RawClient:
    """One DEALER to the daemon's client address; replies are sorted by request id."""

    def __init__(self, address: str) -> None:
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTING_ID, f"e2e-{uuid.uuid4().hex[:8]}".encode())
        self.socket.connect(address)
        self.channel = p.client_reply_channel()
        self.outcomes: dict[str, Outcome] = {}
        self._events: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self._statuses: asyncio.Queue[p.StatusReply] = asyncio.Queue()
        self._receiver: asyncio.Task[None] | None = None
        self._ids = itertools.count()

    async def __aenter__(self) -> RawClient:
        self._receiver = asyncio.create_task(self._receive())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        self.socket.close(linger=0)
        self.context.term()

    async def _receive(self) -> None:
        while True:
            for reply in p.unbatched(self.channel.decode(await self.socket.recv())):
                self._take(reply)

    def _take(self, reply: p.Struct) -> None:
        if isinstance(reply, p.StatusReply):
            self._statuses.put_nowait(reply)
            return
        request_id = getattr(reply, "request_id", None)
        if request_id is None:
            return
        outcome = self.outcomes.setdefault(request_id, Outcome(request_id))
        match reply:
            case p.Dispatched():
                outcome.dispatched.append(reply)
            case p.Chunk():
                outcome.chunks.append(reply)
            case p.Finish():
                outcome.finish = reply
            case p.Reject():
                outcome.reject = reply
        self._events[request_id].set()

    def new_id(self, tag: str) -> str:
        return f"{tag}-{next(self._ids)}"

    async def submit(self, request_id: str, token_ids: list[int], max_new_tokens: int,
                     slo: p.SloSpec | None = None, **sampling) -> None:
        self.outcomes[request_id] = Outcome(request_id)
        submit = p.Submit(request_id=request_id, prompt=p.Prompt(token_ids=token_ids),
                          sampling=p.SamplingParams(max_new_tokens=max_new_tokens, **sampling), slo=slo,
                          protocol=p.PROTOCOL_VERSION)
        await self.socket.send(p.encode(submit))

    async def cancel(self, request_id: str) -> None:
        await self.socket.send(p.encode(p.Cancel(request_id)))

    async def wait(self, request_id: str, timeout: float, until=lambda o: o.over) -> Outcome:
        """Wait until ``until(outcome)`` holds (default: the request is over)."""
        outcome = self.outcomes.setdefault(request_id, Outcome(request_id))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not until(outcome):
            event = self._events[request_id]
            event.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"{request_id}: still waiting after {timeout:.0f} s: {outcome}")
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                pass
        return outcome

    async def status(self, timeout: float = 5.0) -> p.StatusReply:
        while not self._statuses.empty():
            self._statuses.get_nowait()
        await self.socket.send(p.encode(p.StatusRequest()))
        return await asyncio.wait_for(self._statuses.get(), timeout)


class ReportTap:
    """Binds a PULL where the schedulers publish, records each report, forwards it to the
    daemon's report address unchanged."""

    def __init__(self, daemon_report_address: str) -> None:
        self.context = zmq.Context()
        self.pull = self.context.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.push = self.context.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.setsockopt(zmq.SNDHWM, 1000)
        self.push.connect(daemon_report_address)
        self.channel = p.report_channel()
        self._lock = threading.Lock()
        self._reports: list[p.Report] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="report-tap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.pull.poll(100):
                continue
            frame = self.pull.recv()
            try:
                report = self.channel.decode(frame)
            except p.FrameError:
                continue
            with self._lock:
                self._reports.append(report)
            try:
                self.push.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                pass

    def reports(self, rank: str | None = None) -> list[p.Report]:
        with self._lock:
            return [r for r in self._reports if rank is None or r.rank == rank]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pull.close(linger=0)
        self.push.close(linger=0)
        self.context.term()
