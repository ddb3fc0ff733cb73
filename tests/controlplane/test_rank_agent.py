"""RankAgent against a scripted daemon (a real ROUTER driven by the test), the simulated
rank serving through it, and both against the real daemon."""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import signal
import sys
import time
from contextlib import asynccontextmanager

import pytest
import zmq
import zmq.asyncio
from live import start_thread_daemon

from benchmarks.controlplane.live_daemon import loopback_config
from benchmarks.support.paths import REPO
from benchmarks.support.ports import free_ports
from controlplane import protocol as p
from controlplane.rank_agent import InvalidRequest, OutputSink, RankAgent
from sglang_ext.policy.slo import SloCatalog
from sglang_ext.sim.rank import (
    build_sim_ranks,
    fake_token_ids,
    load_named_profile,
    make_policy,
    serve,
)
from sglang_ext.sim.rank import main as sim_rank_main

AGENT_MESSAGES = p.agent_message_channel()
REPORTS = p.report_channel()
EPOCH = 7
_ids = itertools.count()


def run(coroutine, timeout_s: float = 15.0):
    return asyncio.run(asyncio.wait_for(coroutine, timeout_s))


async def until(condition, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


class ScriptedDaemon:
    """The daemon side of the agent protocol, scripted by the test."""

    def __init__(self, address: str | None = None) -> None:
        self.socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if address is None:
            address = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        else:
            self.socket.bind(address)
        self.address = address
        self.received: list[tuple[float, p.Struct]] = []  # every message, in order
        self.frames: list[p.Struct] = []  # every message as it crossed (batches whole)
        self._backlog: collections.deque[tuple[bytes, p.Struct]] = collections.deque()

    async def _next(self, deadline: float) -> tuple[bytes, p.Struct] | None:
        """The next message, a batch's items one by one; None at the deadline."""
        if not self._backlog:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await self.socket.poll(remaining * 1e3):
                return None
            identity, frame = await self.socket.recv_multipart()
            message = AGENT_MESSAGES.decode(frame)
            self.frames.append(message)
            self._backlog.extend((identity, item) for item in p.unbatched(message))
        identity, message = self._backlog.popleft()
        self.received.append((time.monotonic(), message))
        return identity, message

    async def receive(self, *kinds: type, timeout_s: float = 3.0):
        """The next message of one of ``kinds`` (others are kept in ``received`` only)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = await self._next(deadline)
            assert got is not None, f"no {kinds}"
            if isinstance(got[1], kinds):
                return got

    async def collect(self, seconds: float) -> list:
        deadline = time.monotonic() + seconds
        messages = []
        while (got := await self._next(deadline)) is not None:
            messages.append(got[1])
        return messages

    async def send(self, identity: bytes, message) -> None:
        await self.socket.send_multipart([identity, p.encode(message)])

    async def welcome(self, identity: bytes, rank: str, daemon_id: str = "d1", heartbeat_s: float = 10.0,
                      report_address: str = "tcp://127.0.0.1:1") -> None:
        await self.send(identity, p.Welcome(rank, EPOCH, daemon_id, report_address, heartbeat_s))

    async def join(self, agent: RankAgent, **welcome) -> bytes:
        """Answer the first Hello of each of the agent's ranks."""
        pending = set(agent.ranks)
        while pending:
            identity, hello = await self.receive(p.Hello)
            assert (identity, hello.agent, hello.epoch) == (agent.agent_id.encode(), agent.agent_id, EPOCH)
            if hello.rank in pending:
                pending.discard(hello.rank)
                await self.welcome(identity, hello.rank, **welcome)
        await until(lambda: agent.welcomed == frozenset(agent.ranks))
        return identity

    def close(self) -> None:
        self.socket.close()


def dispatch(request_id: str, rank: str = "r0", seq: int = 1, max_new_tokens: int = 3, **fields) -> p.Dispatch:
    fields.setdefault("prompt", p.Prompt(token_ids=[1, 2, 3, 4]))
    return p.Dispatch(request_id, rank, fields.pop("epoch", EPOCH), seq,
                      sampling=p.SamplingParams(max_new_tokens=max_new_tokens), **fields)


class ScriptedEngine:
    """Behaves by request id prefix: ok (3 tokens), slow (3 tokens over 0.3 s), hang (until
    cancelled), boom (raises), bad (invalid), lazy (returns without finishing)."""

    def __init__(self) -> None:
        self.welcomes: list[p.Welcome] = []
        self.started: list[str] = []
        self.released: list[str] = []

    def welcomed(self, welcome: p.Welcome) -> None:
        self.welcomes.append(welcome)

    async def serve(self, dispatch: p.Dispatch, sink: OutputSink) -> None:
        request_id = dispatch.request_id
        self.started.append(request_id)
        try:
            if request_id.startswith(("ok", "slow")):
                for index in range(3):
                    await sink.emit([index], f"t{index}")
                    if request_id.startswith("slow"):
                        await asyncio.sleep(0.1)
                await sink.finish(p.FinishReason.LENGTH, prompt_tokens=4, ttft_s=0.01, latency_s=0.02)
            elif request_id.startswith("hang"):
                await sink.emit([9], "x")
                await asyncio.Event().wait()
            elif request_id.startswith("boom"):
                raise RuntimeError("the GPU caught fire")
            elif request_id.startswith("bad"):
                raise InvalidRequest("prompt too long")
        finally:
            self.released.append(request_id)


@asynccontextmanager
async def agent_on(daemon: ScriptedDaemon, engine=None, ranks=("r0",), **options):
    agent = RankAgent(daemon.address, f"agent-{next(_ids)}", ranks, engine or ScriptedEngine(),
                      epoch=EPOCH, hello_retry_s=0.1, close_timeout_s=0.5, **options)
    task = asyncio.create_task(agent.run())
    try:
        yield agent
    finally:
        await agent.close()
        await task


@asynccontextmanager
async def scripted():
    daemon = ScriptedDaemon()
    try:
        yield daemon
    finally:
        daemon.close()


def dones(messages, request_id: str) -> list[p.Done]:
    return [m for m in messages if isinstance(m, p.Done) and m.request_id == request_id]


# ------------------------------------------------------------------ joining
def test_hello_is_retried_until_welcomed_then_heartbeats_follow_the_welcome_interval():
    async def scenario():
        async with scripted() as daemon, agent_on(daemon, ranks=("r0", "r1")) as agent:
            early = await daemon.collect(0.35)
            hellos = [m for m in early if isinstance(m, p.Hello)]
            assert {m.rank for m in hellos} == {"r0", "r1"} and len(hellos) >= 4  # retried
            assert not any(isinstance(m, p.Heartbeat) for m in early)
            identity = agent.agent_id.encode()
            await daemon.welcome(identity, "r0", heartbeat_s=0.05)
            await until(lambda: agent.welcomed == {"r0"})
            later = await daemon.collect(0.5)
            assert {m.rank for m in later if isinstance(m, p.Hello)} == {"r1"}
            beats = [m for m in later if isinstance(m, p.Heartbeat)]
            assert all(m.agent == agent.agent_id for m in beats) and 5 <= len(beats) <= 12
            assert agent.daemon_id == "d1" and agent.heartbeat_interval_s == 0.05
    run(scenario())


def test_the_engine_learns_where_reports_go():
    async def scenario():
        engine = ScriptedEngine()
        async with scripted() as daemon, agent_on(daemon, engine) as agent:
            await daemon.join(agent, report_address="tcp://127.0.0.1:9999")
            assert [(w.rank, w.epoch, w.report_address) for w in engine.welcomes] == [
                ("r0", EPOCH, "tcp://127.0.0.1:9999")]
    run(scenario())


def test_an_agent_started_before_the_daemon_joins_when_it_comes():
    async def scenario():
        (port,) = free_ports(1)
        address = f"tcp://127.0.0.1:{port}"
        agent = RankAgent(address, "early", ["r0"], ScriptedEngine(), epoch=EPOCH, hello_retry_s=0.05)
        task = asyncio.create_task(agent.run())
        await asyncio.sleep(0.2)
        daemon = ScriptedDaemon(address)
        try:
            await daemon.join(agent)
        finally:
            await agent.close()
            await task
            daemon.close()
    run(scenario())


# ------------------------------------------------------------------ requests
def test_a_request_streams_then_ends_with_one_done():
    async def scenario():
        async with scripted() as daemon, agent_on(daemon) as agent:
            identity = await daemon.join(agent)
            await daemon.send(identity, dispatch("ok-1"))
            _, done = await daemon.receive(p.Done)
            outputs = [m for _, m in daemon.received if isinstance(m, p.Output)]
            assert [(o.token_ids, o.text, o.completion_tokens) for o in outputs] == [
                ([0], "t0", 1), ([1], "t1", 2), ([2], "t2", 3)]
            assert all((o.rank, o.epoch, o.request_id) == ("r0", EPOCH, "ok-1") for o in outputs)
            assert (done.reason, done.prompt_tokens, done.completion_tokens, done.ttft_s) == (
                p.FinishReason.LENGTH, 4, 3, 0.01)
            assert not dones(await daemon.collect(0.1), "ok-1")
            assert agent.running == frozenset()
    run(scenario())


def test_a_duplicate_dispatch_is_dropped_and_an_abort_ends_it_with_one_cancelled_done():
    async def scenario():
        engine = ScriptedEngine()
        async with scripted() as daemon, agent_on(daemon, engine) as agent:
            identity = await daemon.join(agent)
            await daemon.send(identity, dispatch("hang-1"))
            await daemon.send(identity, dispatch("hang-1", seq=2))
            await daemon.receive(p.Output)
            await until(lambda: agent.counters["duplicate_dispatches"] == 1)
            assert engine.started == ["hang-1"]
            await daemon.send(identity, p.Abort("r0", EPOCH, "hang-1"))
            await daemon.send(identity, p.Abort("r0", EPOCH, "hang-1"))  # a second abort: nothing more
            _, done = await daemon.receive(p.Done)
            assert (done.request_id, done.reason, done.completion_tokens) == ("hang-1", p.FinishReason.CANCELLED, 1)
            assert not dones(await daemon.collect(0.2), "hang-1")
            assert engine.released == ["hang-1"] and agent.running == frozenset()
            # the id is free again: a retry of it is served
            await daemon.send(identity, dispatch("hang-1", seq=3))
            await until(lambda: engine.started == ["hang-1", "hang-1"])
    run(scenario())


@pytest.mark.parametrize(("request_id", "error", "invalid"), [
    ("boom-1", "RuntimeError: the GPU caught fire", False),
    ("bad-1", "prompt too long", True),
    ("lazy-1", "the engine returned without finishing", False),
])
def test_an_engine_failure_ends_the_request_with_one_error_done(request_id, error, invalid):
    async def scenario():
        async with scripted() as daemon, agent_on(daemon) as agent:
            identity = await daemon.join(agent)
            await daemon.send(identity, dispatch(request_id))
            _, done = await daemon.receive(p.Done)
            assert (done.request_id, done.reason, done.error, done.invalid) == (
                request_id, p.FinishReason.ERROR, error, invalid)
            assert not dones(await daemon.collect(0.1), request_id)
    run(scenario())


def test_messages_for_another_epoch_or_rank_and_bad_frames_are_ignored():
    async def scenario():
        engine = ScriptedEngine()
        async with scripted() as daemon, agent_on(daemon, engine) as agent:
            identity = await daemon.join(agent)
            await daemon.send(identity, dispatch("ok-old", epoch=EPOCH - 1))
            await daemon.send(identity, dispatch("ok-else", rank="r9"))
            await daemon.socket.send_multipart([identity, b"\xfb\x01\xc1"])
            await daemon.socket.send_multipart([identity, p.encode(p.Ping(1))])  # not a daemon message
            await daemon.send(identity, dispatch("ok-1"))
            _, done = await daemon.receive(p.Done)
            assert done.request_id == "ok-1" and engine.started == ["ok-1"]
            assert agent.counters["stale_dispatch"] == 2
            assert agent.counters["frames_dropped_malformed"] == 1
            assert agent.counters["frames_dropped_invalid"] == 1
    run(scenario())


# ------------------------------------------------------------------ the daemon forgets or fences
def test_a_welcome_from_a_restarted_daemon_drops_running_requests_without_done():
    async def scenario():
        engine = ScriptedEngine()
        async with scripted() as daemon, agent_on(daemon, engine, ranks=("r0", "r1")) as agent:
            identity = await daemon.join(agent)
            await daemon.send(identity, dispatch("hang-a"))
            await daemon.send(identity, dispatch("hang-b", rank="r1", seq=1))
            await until(lambda: len(agent.running) == 2)
            await daemon.welcome(identity, "r0", daemon_id="d2")
            rehello = await daemon.collect(0.3)
            assert agent.running == frozenset() and sorted(engine.released) == ["hang-a", "hang-b"]
            assert not [m for m in rehello if isinstance(m, p.Done)]
            assert {m.rank for m in rehello if isinstance(m, p.Hello)} == {"r1"}
            assert agent.daemon_id == "d2" and agent.counters["daemon_restarts"] == 1
            await daemon.send(identity, dispatch("hang-a"))  # the new daemon may send it again
            await until(lambda: engine.started.count("hang-a") == 2)
    run(scenario())


def test_a_dropped_daemon_connection_ends_running_requests_then_says_goodbye_and_hello_again():
    async def scenario():
        engine = ScriptedEngine()
        first = ScriptedDaemon()
        address = first.address
        async with agent_on(first, engine, ranks=("r0", "r1")) as agent:
            identity = await first.join(agent)
            await first.send(identity, dispatch("hang-a"))
            await until(lambda: len(agent.running) == 1)
            first.close()  # the daemon process dies: its end of the connection closes
            await until(lambda: agent.counters["daemon_disconnects"] == 1)
            assert agent.running == frozenset() and engine.released == ["hang-a"]
            assert agent.welcomed == frozenset()
            second = ScriptedDaemon(address)
            try:
                joined = await second.collect(0.5)
                kinds = [(type(m).__name__, m.rank) for m in joined if isinstance(m, (p.Goodbye, p.Hello))]
                goodbyes = [kind for kind in kinds if kind[0] == "Goodbye"]
                assert sorted(goodbyes) == [("Goodbye", "r0"), ("Goodbye", "r1")]
                assert kinds.index(("Hello", "r0")) > kinds.index(("Goodbye", "r0"))
                assert not [m for m in joined if isinstance(m, (p.Done, p.Output, p.RankOutputs))]
                await second.send(identity, dispatch("ok-early", seq=2))  # not welcomed yet
                await until(lambda: agent.counters["dispatches_before_welcome"] == 1)
                await second.welcome(identity, "r0")
                await until(lambda: "r0" in agent.welcomed)
                await second.send(identity, dispatch("ok-1", seq=3))
                _, done = await second.receive(p.Done)
                assert done.request_id == "ok-1" and "ok-early" not in engine.started
            finally:
                second.close()
    run(scenario())


def test_an_unknown_rank_fence_rejoins_that_rank_with_the_same_epoch():
    async def scenario():
        engine = ScriptedEngine()
        async with scripted() as daemon, agent_on(daemon, engine, ranks=("r0", "r1")) as agent:
            identity = await daemon.join(agent)
            await daemon.send(identity, dispatch("hang-a"))
            await daemon.send(identity, dispatch("hang-b", rank="r1"))
            await until(lambda: len(agent.running) == 2)
            await daemon.send(identity, p.Fenced("r0", EPOCH, "unknown rank"))
            _, hello = await daemon.receive(p.Hello)
            assert hello == p.Hello(agent.agent_id, "r0", EPOCH, protocol=p.PROTOCOL_VERSION)
            assert agent.running == frozenset({("r1", "hang-b")}) and agent.welcomed == {"r1"}
            await daemon.welcome(identity, "r0")
            await until(lambda: agent.welcomed == {"r0", "r1"})
    run(scenario())


def test_an_unknown_agent_fence_rejoins_every_rank():
    async def scenario():
        async with scripted() as daemon, agent_on(daemon, ranks=("r0", "r1")) as agent:
            identity = await daemon.join(agent, heartbeat_s=0.05)
            await daemon.receive(p.Heartbeat)
            await daemon.send(identity, p.Fenced("", 0, "unknown agent"))
            hellos = {m.rank for m in await daemon.collect(0.2) if isinstance(m, p.Hello)}
            assert hellos == {"r0", "r1"} and agent.welcomed == frozenset()
    run(scenario())


def test_a_newer_epoch_fence_stops_serving_the_rank_and_the_last_one_ends_the_run():
    async def scenario():
        engine = ScriptedEngine()
        async with scripted() as daemon:
            agent = RankAgent(daemon.address, "fenced", ["r0", "r1"], engine, epoch=EPOCH, close_timeout_s=0.5)
            task = asyncio.create_task(agent.run())
            identity = await daemon.join(agent)
            await daemon.send(identity, dispatch("hang-a"))
            await until(lambda: agent.running)
            await daemon.send(identity, p.Fenced("r0", EPOCH, f"rank r0 is in epoch {EPOCH + 1}"))
            await until(lambda: agent.serving == {"r1"})
            assert agent.running == frozenset() and engine.released == ["hang-a"]
            assert not task.done()
            await daemon.send(identity, p.Fenced("r1", EPOCH, "epoch 7 is older than the rank's epoch 9"))
            await asyncio.wait_for(task, 2.0)
            await agent.close()
            assert not [m for _, m in daemon.received if isinstance(m, (p.Done, p.Goodbye))]
    run(scenario())


def test_close_says_goodbye_for_every_rank_and_running_requests_get_no_done():
    async def scenario():
        engine = ScriptedEngine()
        async with scripted() as daemon:
            agent = RankAgent(daemon.address, "leaving", ["r0", "r1"], engine, epoch=EPOCH)
            task = asyncio.create_task(agent.run())
            identity = await daemon.join(agent)
            await daemon.send(identity, dispatch("hang-a"))
            await daemon.receive(p.Output)
            await agent.close()
            await task
            messages = [m for _, m in daemon.received] + await daemon.collect(0.3)
            assert {m.rank for m in messages if isinstance(m, p.Goodbye)} == {"r0", "r1"}
            assert not dones(messages, "hang-a") and engine.released == ["hang-a"]
    run(scenario())


def test_drain_says_draining_lets_running_requests_finish_then_says_goodbye():
    async def scenario():
        engine = ScriptedEngine()
        async with scripted() as daemon:
            agent = RankAgent(daemon.address, "drainer", ["r0", "r1"], engine, epoch=EPOCH)
            task = asyncio.create_task(agent.run())
            identity = await daemon.join(agent)
            await daemon.send(identity, dispatch("slow-a"))
            await daemon.receive(p.Output)
            agent.drain()
            drained = set()
            while drained != {"r0", "r1"}:
                _, draining = await daemon.receive(p.Draining)
                drained.add(draining.rank)
            await daemon.welcome(identity, "r1", daemon_id="d1")  # a rejoin hears it again
            _, again = await daemon.receive(p.Draining)
            assert again == p.Draining("r1", EPOCH)
            await asyncio.wait_for(task, 2.0)  # stopped by itself once idle
            await agent.close()
            messages = [m for _, m in daemon.received] + await daemon.collect(0.2)
            (done,) = dones(messages, "slow-a")
            assert (done.reason, done.completion_tokens) == (p.FinishReason.LENGTH, 3)
            assert {m.rank for m in messages if isinstance(m, p.Goodbye)} == {"r0", "r1"}
            goodbye_at = next(i for i, m in enumerate(messages) if isinstance(m, p.Goodbye))
            assert messages.index(done) < goodbye_at
    run(scenario())


def test_a_drain_that_times_out_leaves_without_done_for_what_still_runs():
    async def scenario():
        engine = ScriptedEngine()
        async with scripted() as daemon:
            agent = RankAgent(daemon.address, "stuck", ["r0"], engine, epoch=EPOCH, close_timeout_s=0.5)
            task = asyncio.create_task(agent.run())
            identity = await daemon.join(agent)
            await daemon.send(identity, dispatch("hang-a"))
            await daemon.receive(p.Output)
            started = time.monotonic()
            agent.drain(timeout_s=0.3)
            await asyncio.wait_for(task, 3.0)
            assert 0.25 <= time.monotonic() - started < 2.0
            await agent.close()
            messages = [m for _, m in daemon.received] + await daemon.collect(0.2)
            assert not dones(messages, "hang-a") and engine.released == ["hang-a"]
            assert any(isinstance(m, p.Goodbye) for m in messages)
            assert agent.counters["drain_timeouts"] == 1
    run(scenario())


def test_an_idle_agent_stops_at_once_on_drain():
    async def scenario():
        async with scripted() as daemon:
            agent = RankAgent(daemon.address, "idle", ["r0"], ScriptedEngine(), epoch=EPOCH)
            task = asyncio.create_task(agent.run())
            await daemon.join(agent)
            agent.drain()
            await asyncio.wait_for(task, 2.0)
            await agent.close()
            kinds = [type(m) for _, m in daemon.received] + [type(m) for m in await daemon.collect(0.2)]
            assert kinds.index(p.Draining) < kinds.index(p.Goodbye)
    run(scenario())


def test_invalid_names_are_refused_before_anything_is_sent():
    with pytest.raises(ValueError, match="agent"):
        RankAgent("tcp://127.0.0.1:1", "has space", ["r0"], ScriptedEngine())
    with pytest.raises(ValueError, match="rank"):
        RankAgent("tcp://127.0.0.1:1", "a", ["x" * 65], ScriptedEngine())
    with pytest.raises(ValueError, match="distinct"):
        RankAgent("tcp://127.0.0.1:1", "a", ["r0", "r0"], ScriptedEngine())
    assert RankAgent("tcp://127.0.0.1:1", "a", ["r0"], ScriptedEngine()).epoch >= time.time_ns() - 10**9


@pytest.mark.parametrize("coalesce_s", [-0.001, math.nan, math.inf])
def test_a_negative_or_infinite_coalescing_window_is_refused(coalesce_s):
    with pytest.raises(ValueError, match="coalesce_s"):
        RankAgent("tcp://127.0.0.1:1", "a", ["r0"], ScriptedEngine(), coalesce_s=coalesce_s)
    assert RankAgent("tcp://127.0.0.1:1", "a", ["r0"], ScriptedEngine()).coalesce_s == 0.0


# ------------------------------------------------------------------ the simulated rank
CATALOG = SloCatalog.from_toml(REPO / "configs" / "slo.toml")


def sim_ranks(names=("r0",), time_scale: float = 0.2, **options):
    return build_sim_ranks(list(names), profile=load_named_profile("llama3.1-8b-h100"),
                           policy="fb-anchor-margin", catalog=CATALOG, time_scale=time_scale, **options)


@asynccontextmanager
async def sim_agent(daemon: ScriptedDaemon, sims, ranks=("r0",)):
    stepping = asyncio.create_task(sims.run())
    try:
        async with agent_on(daemon, sims, ranks=ranks) as agent:
            yield agent
    finally:
        stepping.cancel()
        await asyncio.gather(stepping, return_exceptions=True)


@pytest.fixture
def report_pull():
    socket = zmq.Context.instance().socket(zmq.PULL)
    socket.setsockopt(zmq.LINGER, 0)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    yield socket, f"tcp://127.0.0.1:{port}"
    socket.close()


def test_the_sim_rank_serves_exactly_max_new_tokens_then_one_done_in_real_time(report_pull):
    pull, report_address = report_pull

    async def scenario():
        sims = sim_ranks(time_scale=0.5)
        async with scripted() as daemon, sim_agent(daemon, sims) as agent:
            identity = await daemon.join(agent, report_address=report_address)
            await daemon.send(identity, dispatch("sim-1", seq=5, max_new_tokens=16))
            _, done = await daemon.receive(p.Done)
            outputs = [m for _, m in daemon.received if isinstance(m, p.Output)]
            assert [t for o in outputs for t in o.token_ids] == fake_token_ids("sim-1", 0, 16)
            assert "".join(o.text for o in outputs) == " tok" * 16
            assert outputs[-1].completion_tokens == 16
            assert (done.reason, done.prompt_tokens, done.completion_tokens) == (p.FinishReason.LENGTH, 4, 16)
            # 16 steps of at least a_s (5 ms simulated) each, at half speed: no running ahead
            assert done.latency_s >= 16 * 0.005 * 0.5 * 0.9 and 0 < done.ttft_s < done.latency_s
            assert not dones(await daemon.collect(0.1), "sim-1")
            engine = sims.ranks["r0"].engine
            assert (engine.kv_used, engine.has_work, engine.records) == (0, False, {})
        reports = []
        # the agent's last reports may still be in ZeroMQ's queues when it has closed
        while pull.poll(200 if reports else 5000):
            reports.append(REPORTS.decode(pull.recv()))
        assert reports and {(r.rank, r.epoch) for r in reports} == {("r0", EPOCH)}
        assert [r.seq for r in reports] == sorted(r.seq for r in reports)
        assert reports[-1].echoed_dispatch_seq == 5 and reports[-1].running == reports[-1].waiting == 0
        busy = [r for r in reports if r.running]
        assert busy and all(r.free_kv_tokens < engine.kv_capacity and r.step_time_s > 0 for r in busy)
        ttfts = {name: slo.ttft_s for name, slo in CATALOG.classes.items()}
        assert all({n: b.ttft_s for n, b in r.class_budgets.items()} == ttfts for r in reports)
    run(scenario())


def test_the_sim_rank_estimates_text_prompts_and_refuses_bad_slos_and_oversized_requests():
    async def scenario():
        sims = sim_ranks(time_scale=0.05)
        capacity = sims.ranks["r0"].engine.kv_capacity
        async with scripted() as daemon, sim_agent(daemon, sims) as agent:
            identity = await daemon.join(agent)
            await daemon.send(identity, dispatch("text", prompt=p.Prompt(text="é" * 9), max_new_tokens=2,
                                                 slo=p.SloSpec(slo_class="interactive")))
            _, done = await daemon.receive(p.Done)
            assert (done.reason, done.prompt_tokens, done.completion_tokens) == (
                p.FinishReason.LENGTH, math.ceil(18 / 4), 2)
            await daemon.send(identity, dispatch("no-class", seq=2, slo=p.SloSpec(slo_class="platinum")))
            _, done = await daemon.receive(p.Done)
            assert done.invalid and "platinum" in done.error
            await daemon.send(identity, dispatch("huge", seq=3, max_new_tokens=capacity))
            _, done = await daemon.receive(p.Done)
            assert done.invalid and "KV capacity" in done.error
            assert sims.ranks["r0"].echoed_dispatch_seq == 3
    run(scenario())


def test_a_sim_rank_whose_admission_refuses_a_prompt_answers_no_budget():
    async def scenario():
        sims = sim_ranks()
        sims.ranks["r0"].engine.policy = make_policy("fb-pab", load_named_profile("llama3.1-8b-h100"),
                                                     CATALOG)
        async with scripted() as daemon, sim_agent(daemon, sims) as agent:
            identity = await daemon.join(agent)
            await daemon.send(identity, dispatch("long", prompt=p.Prompt(text="x" * 200_000),
                                                 slo=p.SloSpec(slo_class="interactive")))
            _, done = await daemon.receive(p.Done)
            assert done.no_budget and not done.invalid and "admission budget" in done.error
            assert sims.ranks["r0"].engine.records == {}
    run(scenario())


def test_an_aborted_sim_request_releases_its_kv_once_and_ends_cancelled():
    async def scenario():
        sims = sim_ranks(names=("a/0", "a/1"), time_scale=1.0)
        async with scripted() as daemon, sim_agent(daemon, sims, ranks=("a/0", "a/1")) as agent:
            identity = await daemon.join(agent)
            await daemon.send(identity, dispatch("long", rank="a/1", max_new_tokens=10_000))
            await daemon.receive(p.Output)
            engine = sims.ranks["a/1"].engine
            assert engine.kv_used > 0 and not sims.ranks["a/0"].engine.has_work
            await daemon.send(identity, p.Abort("a/1", EPOCH, "long"))
            _, done = await daemon.receive(p.Done)
            assert (done.reason, done.rank) == (p.FinishReason.CANCELLED, "a/1")
            assert 0 < done.completion_tokens < 10_000
            await until(lambda: not engine.has_work)
            assert engine.kv_used == 0 and engine.records == {}
            engine.check_integrity()
    run(scenario())


def test_the_sim_rank_echoes_the_numbering_of_the_daemon_it_serves_now():
    async def scenario():
        sims = sim_ranks(time_scale=0.05)
        rank = sims.ranks["r0"]
        async with scripted() as daemon, sim_agent(daemon, sims) as agent:
            identity = await daemon.join(agent)
            await daemon.send(identity, dispatch("first", seq=41, max_new_tokens=1))
            await daemon.receive(p.Done)
            assert rank.echoed_dispatch_seq == 41
            await daemon.welcome(identity, "r0", daemon_id="d2")  # it restarted: numbering from 1
            await until(lambda: rank.echoed_dispatch_seq == 0)
            await daemon.send(identity, dispatch("again", seq=1, max_new_tokens=1))
            await daemon.receive(p.Done)
            assert rank.echoed_dispatch_seq == 1
    run(scenario())


def test_sim_engine_abort_releases_kv_exactly_once():
    sims = sim_ranks()
    engine = sims.ranks["r0"].engine
    slo = CATALOG.default
    assert engine.submit("a", 0.0, 500, 50, slo) and engine.submit("b", 0.0, 300, 2, slo)
    engine.advance_to(0.2)
    assert not engine.abort("b")  # finished: already released
    held = engine.kv_used
    assert held > 0 and engine.abort("a")
    assert engine.kv_used == 0 and engine.records["a"].aborted and not engine.has_work
    assert not engine.abort("a") and not engine.abort("never")
    engine.check_integrity()


@pytest.mark.slow
def test_the_sim_rank_process_drains_says_goodbye_and_exits_0_on_sigterm():
    async def scenario():
        async with scripted() as daemon:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "sglang_ext.sim.rank", "--daemon", daemon.address,
                "--agent-id", "proc", "--ranks", "2", "--log-level", "warning",
                cwd=REPO, stderr=asyncio.subprocess.PIPE)
            try:
                epoch = 0
                for _ in range(2):
                    identity, hello = await daemon.receive(p.Hello, timeout_s=20.0)
                    epoch = hello.epoch
                    await daemon.send(identity, p.Welcome(hello.rank, hello.epoch, "d1",
                                                          "tcp://127.0.0.1:1", 10.0))
                await daemon.collect(0.2)
                await daemon.send(identity, p.Dispatch(
                    "long", "proc/0", epoch, 1, p.Prompt(token_ids=[1] * 64),
                    p.SamplingParams(max_new_tokens=60, ignore_eos=True)))
                await daemon.receive(p.Output, timeout_s=10.0)
                process.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(process.wait(), 20.0) == 0
                messages = [m for _, m in daemon.received] + await daemon.collect(0.2)
                (done,) = dones(messages, "long")
                assert (done.reason, done.completion_tokens) == (p.FinishReason.LENGTH, 60)
                assert {m.rank for m in messages if isinstance(m, p.Draining)} == {"proc/0", "proc/1"}
                assert {m.rank for m in messages if isinstance(m, p.Goodbye)} == {"proc/0", "proc/1"}
                assert messages.index(done) < next(i for i, m in enumerate(messages) if isinstance(m, p.Goodbye))
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
    run(scenario(), timeout_s=40.0)


def test_the_sim_rank_process_exits_1_once_every_rank_is_fenced():
    async def scenario():
        async with scripted() as daemon:
            sims = sim_ranks(names=("f/0",))
            agent = RankAgent(daemon.address, "f", ["f/0"], sims, epoch=EPOCH)
            serving = asyncio.create_task(serve(agent, sims))
            identity = await daemon.join(agent)
            await daemon.send(identity, p.Fenced("f/0", EPOCH, "rank f/0 is in epoch 8"))
            assert await asyncio.wait_for(serving, 5.0) == 1
    run(scenario())


@pytest.mark.parametrize("argv", [["--policy", "nope"], ["--profile", "nope"], ["--agent-id", "a b"],
                                  ["--daemon", "nowhere"], ["--slo-file", "/nonexistent.toml"]])
def test_the_sim_rank_process_refuses_bad_arguments_with_exit_2(argv, capsys):
    assert sim_rank_main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and "\n" not in error


def test_the_sim_rank_process_hands_its_coalescing_window_to_the_agent(monkeypatch):
    import sglang_ext.sim.rank as sim_rank_module

    served = []

    async def serve_nothing(agents, sims, drain_timeout_s=30.0):
        served.append(agents)
        return 0

    monkeypatch.setattr(sim_rank_module, "serve", serve_nothing)
    daemon = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    assert sim_rank_main(["--daemon", daemon, "--coalesce-ms", "5"]) == 0
    assert sim_rank_main(["--daemon", daemon]) == 0
    assert [agent.coalesce_s for (agent,) in served] == [pytest.approx(0.005), 0.0]


def test_the_sim_rank_process_serves_each_daemon_named_over_an_agent_of_its_own(monkeypatch, capsys):
    import sglang_ext.sim.rank as sim_rank_module

    served = []

    async def serve_nothing(agents, sims, drain_timeout_s=30.0):
        served.append(agents)
        return 0

    monkeypatch.setattr(sim_rank_module, "serve", serve_nothing)
    first, second = (f"tcp://127.0.0.1:{port}" for port in free_ports(2))
    assert sim_rank_main(["--daemon", first, "--daemon", second, "--ranks", "2"]) == 0
    (agents,) = served
    assert [agent.rank_address for agent in agents] == [first, second]
    assert len({agent.epoch for agent in agents}) == 1 and agents[0].ranks == ("sim/0", "sim/1")
    assert sim_rank_main(["--daemon", first, "--daemon", first]) == 2
    assert "names one daemon twice" in capsys.readouterr().err
    assert sim_rank_main(["--daemon", first, "--daemon", second, "--report-address", first]) == 2
    assert "--report-address applies to one daemon" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "abc", "50.5", "nan"])
def test_the_sim_rank_process_refuses_a_bad_coalescing_window_with_exit_2(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sim_rank_main(["--coalesce-ms", value])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith(f"argument --coalesce-ms: expected milliseconds from 0 to 50, got {value!r} "
                          "(every streamed token may wait that long; above 50 ms the wait alone "
                          "would eat a 50 ms TPOT SLO)")


# ------------------------------------------------------------------ against the real daemon
def submit_and_collect(client: zmq.Socket, request_id: str, max_new_tokens: int, timeout_s: float = 10.0):
    client.send(p.encode(p.Submit(request_id, p.Prompt(token_ids=[1] * 32),
                                  p.SamplingParams(max_new_tokens=max_new_tokens),
                                  protocol=p.PROTOCOL_VERSION)))
    replies = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.poll(100):
            for reply in p.unbatched(p.client_reply_channel().decode(client.recv())):
                replies.append(reply)
                if isinstance(reply, (p.Finish, p.Reject)):
                    return replies
    raise AssertionError(f"no end for {request_id}: {replies}")


def client_socket(address: str) -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket


def test_sim_ranks_serve_through_the_real_daemon_and_rejoin_a_restarted_one():
    config = loopback_config(heartbeat_interval_s=0.1, lost_after_s=2.0, stale_after_s=1.0)

    async def scenario():
        daemon = await asyncio.to_thread(start_thread_daemon, config)
        sims = sim_ranks(names=("live/0", "live/1"), time_scale=0.05)
        stepping = asyncio.create_task(sims.run())
        agent = RankAgent(config.rank_address, "live", ["live/0", "live/1"], sims, hello_retry_s=0.1)
        serving = asyncio.create_task(agent.run())
        client = client_socket(config.client_address)
        try:
            await until(lambda: agent.welcomed == {"live/0", "live/1"})
            first_daemon = agent.daemon_id
            for index in range(4):
                replies = await asyncio.to_thread(submit_and_collect, client, f"req-{index}", 8)
                assert isinstance(replies[0], p.Dispatched), replies
                chunks = [r for r in replies if isinstance(r, p.Chunk)]
                finish = replies[-1]
                assert sum(len(c.token_ids) for c in chunks) == 8
                assert (finish.reason, finish.completion_tokens, finish.prompt_tokens) == (
                    p.FinishReason.LENGTH, 8, 32)
            await asyncio.to_thread(daemon.stop)
            daemon = await asyncio.to_thread(start_thread_daemon, config)
            await until(lambda: agent.daemon_id not in (None, first_daemon)
                        and agent.welcomed == {"live/0", "live/1"}, timeout_s=5.0)
            replies = await asyncio.to_thread(submit_and_collect, client, "after-restart", 4)
            assert replies[-1].completion_tokens == 4, replies
            assert counter(daemon, "ranks_joined") == 2
            await agent.close()
            await until(lambda: counter(daemon, "ranks_left") == 2)  # both Goodbyes arrived
        finally:
            client.close()
            await agent.close()
            await serving
            stepping.cancel()
            await asyncio.gather(stepping, return_exceptions=True)
            if daemon.thread.is_alive():
                await asyncio.to_thread(daemon.stop)
    run(scenario(), timeout_s=40.0)


def counter(daemon, name: str) -> int:
    """A counter of a daemon running in another thread (retried if it changed meanwhile)."""
    while True:
        try:
            return daemon.counters().get(name, 0)
        except RuntimeError:
            continue


# ------------------------------------------------------------------ coalesced output (protocol 5)
class SteppedEngine:
    """Every request emits one token per ``step()``, all in the same event-loop pass, as an
    engine step advances every running request at once; ``steps`` tokens, then its Done."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.step_event = asyncio.Event()
        self.waiting = 0

    def welcomed(self, welcome: p.Welcome) -> None:
        pass

    def step(self) -> None:
        event, self.step_event = self.step_event, asyncio.Event()
        self.waiting = 0  # those waiting on the next step
        event.set()

    async def serve(self, dispatch: p.Dispatch, sink: OutputSink) -> None:
        for index in range(self.steps):
            self.waiting += 1
            await self.step_event.wait()
            await sink.emit([index], f"t{index}")
        await sink.finish(p.FinishReason.LENGTH, prompt_tokens=4)


def test_the_output_of_one_engine_step_crosses_as_one_message_in_order_per_request():
    async def scenario():
        engine = SteppedEngine(steps=5)
        async with scripted() as daemon, agent_on(daemon, engine) as agent:
            identity = await daemon.join(agent)
            ids = [f"step-{i}" for i in range(6)]
            for seq, request_id in enumerate(ids, 1):
                await daemon.send(identity, dispatch(request_id, seq=seq))
            for _ in range(engine.steps):
                await until(lambda: engine.waiting == len(ids))
                engine.step()
            for request_id in ids:
                await daemon.receive(p.Done)
            batches = [m for m in daemon.frames if isinstance(m, p.RankOutputs)]
            assert len(batches) == engine.steps  # one message per step, its last carrying the Dones
            for batch in batches[:-1]:
                assert sorted(item.request_id for item in batch.items) == ids
            for request_id in ids:
                mine = [m for _, m in daemon.received if getattr(m, "request_id", None) == request_id]
                assert [t for m in mine[:-1] for t in m.token_ids] == list(range(5))
                assert isinstance(mine[-1], p.Done) and mine[-1].completion_tokens == 5
    run(scenario())


def test_a_coalescing_window_holds_the_steps_within_it_then_sends_them_as_one_message():
    window_s = 3.0  # long beside a step even on a starved machine; only the first frame waits it out

    async def scenario():
        engine = SteppedEngine(steps=3)
        async with scripted() as daemon, agent_on(daemon, engine, coalesce_s=window_s) as agent:
            identity = await daemon.join(agent)
            ids = [f"held-{i}" for i in range(3)]
            for seq, request_id in enumerate(ids, 1):
                await daemon.send(identity, dispatch(request_id, seq=seq))
            await until(lambda: engine.waiting == len(ids))
            first_step = time.monotonic()
            for step in range(1, engine.steps + 1):
                engine.step()
                held = step * len(ids) + (len(ids) if step == engine.steps else 0)  # + the Dones
                await until(lambda held=held: len(agent._batch) == held)  # held, not sent
                if step < engine.steps:
                    await until(lambda: engine.waiting == len(ids))
            assert agent.counters["output_batches"] == 0
            assert agent._flush_handle is not None and not agent._flush_handle.cancelled()  # armed (asyncio or uvloop)
            for _ in ids:
                await daemon.receive(p.Done, timeout_s=window_s + 5.0)
            batches = [m for m in daemon.frames if isinstance(m, p.RankOutputs)]
            assert len(batches) == 1 and len(batches[0].items) == engine.steps * len(ids) + len(ids)
            arrived = next(at for at, m in daemon.received if isinstance(m, p.Output))
            assert arrived - first_step >= window_s - 0.005  # the whole window, not at once
            for request_id in ids:
                mine = [m for m in batches[0].items if m.request_id == request_id]
                assert [t for m in mine[:-1] for t in m.token_ids] == [0, 1, 2]
                assert isinstance(mine[-1], p.Done) and mine[-1].completion_tokens == 3
            assert agent.counters["output_batches"] == 1
    run(scenario())


def test_an_unstreamed_request_crosses_once_in_its_done():
    async def scenario():
        async with scripted() as daemon, agent_on(daemon) as agent:
            identity = await daemon.join(agent)
            await daemon.send(identity, dispatch("ok-quiet", stream=False))
            _, done = await daemon.receive(p.Done)
            assert not [m for _, m in daemon.received if isinstance(m, p.Output)]
            assert (done.token_ids, done.text, done.completion_tokens) == ([0, 1, 2], "t0t1t2", 3)
            await daemon.send(identity, dispatch("ok-loud", seq=2))
            _, done = await daemon.receive(p.Done)
            outputs = [m for _, m in daemon.received if isinstance(m, p.Output)]
            assert [o.token_ids for o in outputs] == [[0], [1], [2]] and done.text == ""
    run(scenario())


def test_a_refused_protocol_fences_the_rank_and_the_agent_stops():
    async def scenario():
        async with scripted() as daemon, agent_on(daemon) as agent:
            identity, hello = await daemon.receive(p.Hello)
            assert hello.protocol == p.PROTOCOL_VERSION
            await daemon.send(identity, p.Fenced("r0", EPOCH, p.protocol_refusal(4)))
            await until(lambda: not agent.serving)
            assert agent.counters["fenced_ranks"] == 1
    run(scenario())


def test_an_idle_sim_rank_reports_on_the_slow_heartbeat_and_a_change_at_once(report_pull):
    pull, report_address = report_pull

    async def scenario():
        sims = sim_ranks(time_scale=0.5)
        async with scripted() as daemon, sim_agent(daemon, sims) as agent:
            identity = await daemon.join(agent, report_address=report_address)
            await asyncio.sleep(1.0)
            idle = []
            while pull.poll(0):
                idle.append(REPORTS.decode(pull.recv()))
            assert 2 <= len(idle) <= 7, [r.sent_at for r in idle]  # about 4 a second, not 100
            await daemon.send(identity, dispatch("sim-change", seq=9, max_new_tokens=2))
            await daemon.receive(p.Done)
            deadline = time.monotonic() + 3.0
            echoed = None
            while echoed is None and time.monotonic() < deadline:
                if pull.poll(50):
                    report = REPORTS.decode(pull.recv())
                    if report.echoed_dispatch_seq == 9:
                        echoed = report
            assert echoed is not None
    run(scenario())


def test_a_heartbeat_goes_before_output_that_waits_for_a_full_socket_and_is_never_dropped():
    async def scenario():
        engine = SteppedEngine(steps=1)
        async with scripted() as daemon, agent_on(daemon, engine) as agent:
            identity = await daemon.join(agent)
            await daemon.send(identity, dispatch("full-1"))
            await until(lambda: engine.waiting == 1)
            sends = agent._try_send
            agent._try_send = lambda frame: False  # the socket at its high-water mark
            engine.step()
            await until(lambda: agent._blocked_output)  # the output (and Done) wait
            for _ in range(3):
                agent._enqueue(p.Heartbeat(agent.agent_id))
            assert len(agent._blocked_control) == 1  # one waiting heartbeat says it all
            agent._try_send = sends  # room again
            _, beat = await daemon.receive(p.Heartbeat, p.Output, p.Done)
            assert isinstance(beat, p.Heartbeat)
            _, done = await daemon.receive(p.Done)
            assert done.request_id == "full-1" and agent.counters["heartbeat_dropped"] == 0
    run(scenario())
