"""The daemon on real loopback sockets: the protocol flow, bad frames from every peer, drain."""

from __future__ import annotations

import collections
import functools
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane import protocol as p

from live import thread_daemon

CLIENT_REPLIES = p.client_reply_channel()
SUBMIT = functools.partial(p.Submit, protocol=p.PROTOCOL_VERSION)  # as the SDK states it
AGENT_INBOX = p.daemon_to_agent_channel()


class Peer:
    """A raw DEALER (client or agent) speaking the wire protocol."""

    def __init__(self, address: str, identity: bytes | None = None) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.socket.setsockopt(zmq.ROUTING_ID, identity)
        self.socket.connect(address)
        self.backlog: collections.deque = collections.deque()

    def send(self, message) -> None:
        self.socket.send(p.encode(message))

    def send_raw(self, *frames: bytes) -> None:
        self.socket.send_multipart(list(frames))

    def receive(self, channel, timeout_s: float = 5.0):
        """The next message; a batch's (``Replies``, ``RankOutputs``) items one by one."""
        if not self.backlog:
            assert self.socket.poll(int(timeout_s * 1000)), "no reply"
            self.backlog.extend(p.unbatched(channel.decode(self.socket.recv())))
        return self.backlog.popleft()

    def close(self) -> None:
        self.socket.close()


def pusher(address: str) -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket


@pytest.fixture(scope="module", params=["loop", "zmq"])
def daemon(request):
    """The daemon with its client and rank sockets on each transport (``transport``)."""
    with thread_daemon(stale_after_s=30.0, lost_after_s=60.0, heartbeat_interval_s=0.5,
                       transport=request.param) as running:
        assert (running.daemon.rank_router is not None) is (request.param == "loop")
        yield running


def test_request_flows_client_to_rank_and_back(daemon):
    config = daemon.config
    agent = Peer(config.rank_address, b"agent-flow")
    client = Peer(config.client_address)
    reports = pusher(config.report_address)
    try:
        agent.send(p.Hello("agent-flow", "flow-0", 11, protocol=p.PROTOCOL_VERSION))
        welcome = agent.receive(AGENT_INBOX)
        assert welcome == p.Welcome("flow-0", 11, daemon.daemon.daemon_id, config.report_address, 0.5)
        reports.send(p.encode(p.Report("flow-0", 11, 1, 50_000.0, 0, 0, 0, 100_000, 0, 0.01, 0.0)))
        time.sleep(0.2)
        client.send(SUBMIT("flow-a", p.Prompt(token_ids=[1, 2, 3]), p.SamplingParams(max_new_tokens=2),
                             p.SloSpec(slo_class="tight")))
        dispatch = agent.receive(AGENT_INBOX)
        assert (dispatch.request_id, dispatch.rank, dispatch.epoch) == ("flow-a", "flow-0", 11)
        assert dispatch.dispatch_seq > time.time_ns() // 1000 - 60_000_000  # numbered from the daemon's start
        assert dispatch.slo == p.SloSpec(slo_class="tight")
        assert client.receive(CLIENT_REPLIES) == p.Dispatched("flow-a", "flow-0", dispatch.dispatch_seq)
        agent.send(p.Output("flow-0", 11, "flow-a", [7], "x", 1))
        agent.send(p.Done("flow-0", 11, "flow-a", p.FinishReason.LENGTH, 3, 2, 0.01, 0.02))
        assert client.receive(CLIENT_REPLIES) == p.Chunk("flow-a", [7], "x", 1)
        finish = client.receive(CLIENT_REPLIES)
        assert (finish.reason, finish.prompt_tokens, finish.completion_tokens) == (p.FinishReason.LENGTH, 3, 2)
        client.send(p.StatusRequest())
        status = client.receive(CLIENT_REPLIES)
        (rank,) = [r for r in status.ranks if r.rank == "flow-0"]
        assert (rank.in_flight, rank.pab_tokens, rank.dispatched) == (0, 50_000.0 - 3, 1)
    finally:
        agent.send(p.Goodbye("flow-0", 11))
        for peer in (agent, client):
            peer.close()
        reports.close()


def test_client_gone_mid_stream_aborts_at_the_rank(daemon):
    config = daemon.config
    agent = Peer(config.rank_address, b"agent-gone")
    reports = pusher(config.report_address)
    try:
        agent.send(p.Hello("agent-gone", "gone-0", 5, protocol=p.PROTOCOL_VERSION))
        agent.receive(AGENT_INBOX)
        reports.send(p.encode(p.Report("gone-0", 5, 1, 1e9, 0, 0, 0, 100_000, 0, 0.01, 0.0)))
        time.sleep(0.2)
        client = Peer(config.client_address, b"short-lived-client")
        client.send(SUBMIT("gone-a", p.Prompt(text="hello"), p.SamplingParams(max_new_tokens=50)))
        dispatch = agent.receive(AGENT_INBOX)
        assert dispatch.rank in ("gone-0", "flow-0")
        client.close()
        time.sleep(0.3)
        agent.send(p.Output(dispatch.rank, dispatch.epoch, "gone-a", [1], "x", 1))
        abort = agent.receive(AGENT_INBOX)
        assert abort == p.Abort(dispatch.rank, dispatch.epoch, "gone-a")
        assert daemon.counters()["client_gone"] >= 1
    finally:
        agent.send(p.Goodbye("gone-0", 5))
        agent.close()
        reports.close()


GARBAGE = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda body: p.HEADER + body, st.binary(max_size=300)),
    st.builds(lambda doc: p.HEADER + msgspec.msgpack.encode(doc),
              st.dictionaries(st.sampled_from(["type", "request_id", "rank", "epoch", "prompt", "seq", "agent"]),
                              st.one_of(st.text(max_size=10), st.integers(-5, 2**40), st.none(),
                                        st.sampled_from(["submit", "hello", "output", "done", "report", "cancel"])),
                              max_size=6)),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(GARBAGE, min_size=1, max_size=3), target=st.sampled_from(["client", "rank", "report"]))
def test_live_daemon_survives_random_frames(daemon, frames, target):
    config = daemon.config
    if target == "report":
        socket = pusher(config.report_address)
        socket.send_multipart(frames)
        socket.close()
    else:
        peer = Peer(config.client_address if target == "client" else config.rank_address, b"fuzzer")
        peer.send_raw(*frames)
        peer.close()


def test_bad_frames_were_dropped_counted_and_the_daemon_still_answers(daemon):
    config = daemon.config
    client = Peer(config.client_address)
    try:
        client.send_raw(b"\xfb\x09\x80")
        client.send_raw(b"\xfb\x01" + b"\x00" * (config.max_frame_bytes + 10))
        client.send_raw(p.encode(p.Ping(1)), p.encode(p.Ping(2)))
        client.send(p.Ping(3))
        assert client.receive(CLIENT_REPLIES).nonce == 3
        counters = daemon.counters()
        for kind in ("wrong_version", "oversized", "bad_framing"):
            assert counters.get(f"frames_dropped_{kind}", 0) >= 1, kind
        assert counters.get("internal_errors", 0) == 0
        assert daemon.thread.is_alive()
    finally:
        client.close()


def test_drain_on_request_rejects_new_work_and_stops():
    with thread_daemon(drain_timeout_s=0.5) as running:
        config = running.config
        agent = Peer(config.rank_address, b"agent-drain")
        client = Peer(config.client_address)
        reports = pusher(config.report_address)
        try:
            agent.send(p.Hello("agent-drain", "drain-0", 1, protocol=p.PROTOCOL_VERSION))
            agent.receive(AGENT_INBOX)
            reports.send(p.encode(p.Report("drain-0", 1, 1, 1e9, 0, 0, 0, 100_000, 0, 0.01, 0.0)))
            time.sleep(0.2)
            client.send(SUBMIT("drain-a", p.Prompt(text="hi")))
            assert isinstance(agent.receive(AGENT_INBOX), p.Dispatch)
            assert isinstance(client.receive(CLIENT_REPLIES), p.Dispatched)
            running.loop.call_soon_threadsafe(running.daemon.request_drain)
            time.sleep(0.1)
            client.send(SUBMIT("drain-b", p.Prompt(text="hi")))
            refused = client.receive(CLIENT_REPLIES)
            assert (refused.request_id, refused.reason) == ("drain-b", p.RejectReason.SHUTTING_DOWN)
            aborted = client.receive(CLIENT_REPLIES)
            assert (aborted.request_id, aborted.reason) == ("drain-a", p.RejectReason.SHUTTING_DOWN)
            assert agent.receive(AGENT_INBOX) == p.Abort("drain-0", 1, "drain-a")
            running.thread.join(5)
            assert not running.thread.is_alive()
        finally:
            for peer in (agent, client):
                peer.close()
            reports.close()


def failing_for(original, request_id: str, *, after_calls: int = 0):
    """``original``, except that it raises once, for the message about ``request_id``
    that follows the first ``after_calls`` of them."""
    seen = {"calls": 0}

    def call(*args):
        message = args[1]
        if getattr(message, "request_id", None) == request_id:
            seen["calls"] += 1
            if seen["calls"] == after_calls + 1:
                raise RuntimeError(f"injected failure for {request_id}")
        return original(*args)

    return call


def broken(*args):
    raise RuntimeError("injected failure in the recovery")


def test_a_handler_failure_gets_one_internal_reject_and_the_daemon_serves_on(monkeypatch):
    with thread_daemon(stale_after_s=30.0, lost_after_s=60.0, retry_after_s=0.05) as running:
        config, core = running.config, running.daemon.core
        agent = Peer(config.rank_address, b"agent-bug")
        client = Peer(config.client_address)
        reports = pusher(config.report_address)
        try:
            agent.send(p.Hello("agent-bug", "bug-0", 3, protocol=p.PROTOCOL_VERSION))
            agent.receive(AGENT_INBOX)
            reports.send(p.encode(p.Report("bug-0", 3, 1, 50_000.0, 0, 0, 0, 100_000, 0, 0.01, 0.0)))
            time.sleep(0.2)
            # a rank's Output fails after one chunk went out: not retryable, aborted at the rank
            monkeypatch.setattr(core, "_rank_output", failing_for(core._rank_output, "bug-a", after_calls=1))
            client.send(SUBMIT("bug-a", p.Prompt(token_ids=[1] * 100)))
            dispatch = agent.receive(AGENT_INBOX)
            assert isinstance(client.receive(CLIENT_REPLIES), p.Dispatched)
            agent.send(p.Output("bug-0", 3, "bug-a", [7], "x", 1, dispatch.dispatch_seq))
            assert client.receive(CLIENT_REPLIES) == p.Chunk("bug-a", [7], "x", 1)
            agent.send(p.Output("bug-0", 3, "bug-a", [8], "y", 2, dispatch.dispatch_seq))
            reject = client.receive(CLIENT_REPLIES)
            assert (reject.request_id, reject.reason, reject.retryable) == \
                ("bug-a", p.RejectReason.INTERNAL, False)
            assert agent.receive(AGENT_INBOX) == p.Abort("bug-0", 3, "bug-a")
            agent.send(p.Done("bug-0", 3, "bug-a", p.FinishReason.CANCELLED,
                              dispatch_seq=dispatch.dispatch_seq))
            # (a late Done: the request is over, the daemon drops it)
            # a client's Submit fails: retryable, nothing reaches the rank
            monkeypatch.setattr(core, "_submit", failing_for(core._submit, "bug-b"))
            client.send(SUBMIT("bug-b", p.Prompt(token_ids=[1] * 10)))
            reject = client.receive(CLIENT_REPLIES)
            assert (reject.request_id, reject.reason, reject.retryable) == \
                ("bug-b", p.RejectReason.INTERNAL, True)
            assert not client.socket.poll(200) and not agent.socket.poll(0)  # nothing more for either
            client.send(p.StatusRequest())
            status = client.receive(CLIENT_REPLIES)
            (rank,) = status.ranks
            assert (rank.in_flight, rank.pab_tokens, status.in_flight) == (0, 50_000.0, 0)  # debits released
            assert (status.counters["internal_errors"], status.counters["rejected_internal"]) == (2, 2)
            # the daemon serves the next request as usual
            client.send(SUBMIT("bug-c", p.Prompt(token_ids=[1] * 10)))
            dispatch = agent.receive(AGENT_INBOX)
            assert client.receive(CLIENT_REPLIES) == p.Dispatched("bug-c", "bug-0", dispatch.dispatch_seq)
            agent.send(p.Done("bug-0", 3, "bug-c", p.FinishReason.LENGTH, 10, 1,
                              dispatch_seq=dispatch.dispatch_seq))
            assert client.receive(CLIENT_REPLIES).reason == p.FinishReason.LENGTH
            # a bug in the recovery itself: counted by the daemon, which still answers
            monkeypatch.setattr(core, "_recover", broken)
            monkeypatch.setattr(core, "_submit", failing_for(core._submit, "bug-d"))
            client.send(SUBMIT("bug-d", p.Prompt(token_ids=[1] * 10)))
            client.send(p.Ping(9))
            assert client.receive(CLIENT_REPLIES) == p.Pong(9, running.daemon.daemon_id, protocol=p.PROTOCOL_VERSION)
            assert running.counters()["internal_errors_unrecovered"] == 1
            assert running.counters()["late_messages"] == 1
        finally:
            for peer in (agent, client):
                peer.close()
            reports.close()


def _join(daemon, agent_id: str, rank: str, epoch: int) -> tuple[Peer, Peer]:
    config = daemon.config
    agent = Peer(config.rank_address, agent_id.encode())
    agent.send(p.Hello(agent_id, rank, epoch, protocol=p.PROTOCOL_VERSION))
    assert isinstance(agent.receive(AGENT_INBOX), p.Welcome)
    reports = pusher(config.report_address)
    reports.send(p.encode(p.Report(rank, epoch, 1, 50_000.0, 0, 0, 0, 100_000, 0, 0.01, 0.0)))
    reports.close(linger=1000)
    client = Peer(config.client_address)
    deadline = time.monotonic() + 5
    while True:  # until the report is in
        client.send(p.StatusRequest())
        status = client.receive(CLIENT_REPLIES)
        if any(r.rank == rank and r.reports for r in status.ranks) or time.monotonic() > deadline:
            return agent, client
        time.sleep(0.02)


def test_one_batch_of_many_requests_tokens_reaches_the_client_in_order_per_request(daemon):
    agent, client = _join(daemon, "agent-batch", "batch-0", 5)
    try:
        ids = [f"batch-{i}" for i in range(5)]
        seqs = {}
        for request_id in ids:
            client.send(SUBMIT(request_id, p.Prompt(token_ids=[1, 2]), p.SamplingParams(max_new_tokens=20)))
            dispatch = agent.receive(AGENT_INBOX)
            seqs[dispatch.request_id] = dispatch.dispatch_seq
        items = [p.Output("batch-0", 5, request_id, [token], f"<{token}>", token + 1, seqs[request_id])
                 for token in range(20) for request_id in ids]  # 20 steps of 5 requests
        items += [p.Done("batch-0", 5, request_id, p.FinishReason.LENGTH, 2, 20, dispatch_seq=seqs[request_id])
                  for request_id in ids]
        agent.send(p.RankOutputs(items))
        frames, replies = 0, []
        while sum(isinstance(r, (p.Finish, p.Reject)) for r in replies) < len(ids):
            assert client.socket.poll(5000), "no reply"
            message = CLIENT_REPLIES.decode(client.socket.recv())
            frames += 1
            replies += p.unbatched(message)
        chunks = [r for r in replies if isinstance(r, p.Chunk)]
        assert frames <= 1 + len(ids), "the 100 chunks and 5 finishes were coalesced"
        for request_id in ids:
            mine = [r for r in replies if getattr(r, "request_id", None) == request_id and not
                    isinstance(r, p.Dispatched)]
            assert [t for c in mine[:-1] for t in c.token_ids] == list(range(20))
            assert [c.completion_tokens for c in mine[:-1]] == list(range(1, 21))
            assert isinstance(mine[-1], p.Finish) and mine[-1].completion_tokens == 20
        assert len(chunks) == 100
    finally:
        agent.send(p.Goodbye("batch-0", 5))
        agent.close()
        client.close()


def test_peers_of_an_older_protocol_are_refused_with_a_clear_reason(daemon):
    config = daemon.config
    agent = Peer(config.rank_address, b"agent-old")
    client = Peer(config.client_address)
    try:
        agent.send(p.Hello("agent-old", "old-0", 3, protocol=4))
        fenced = agent.receive(AGENT_INBOX)
        assert isinstance(fenced, p.Fenced) and fenced.detail.startswith(p.UNSUPPORTED_PROTOCOL)
        assert "rank speaks protocol version 4" in fenced.detail and "upgrade the rank agent" in fenced.detail
        client.send(p.Submit("old-client", p.Prompt(text="hi")))  # a version-4 SDK states no version
        reject = client.receive(CLIENT_REPLIES)
        assert (reject.reason, reject.retryable) == (p.RejectReason.INVALID, False)
        assert "version 4 or older" in reject.detail and "upgrade the client" in reject.detail
    finally:
        agent.close()
        client.close()


def test_an_idle_daemon_never_counts_itself_behind_its_rank_socket():
    with thread_daemon() as running:
        core = running.daemon.core
        ticks: list[float | None] = []
        on_tick = core.on_tick

        def counted(now, *, agents_read_until=None):
            ticks.append(agents_read_until)
            return on_tick(now, agents_read_until=agents_read_until)

        running.loop.call_soon_threadsafe(setattr, core, "on_tick", counted)
        deadline = time.monotonic() + 10.0
        while len(ticks) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(ticks) >= 3, "the daemon never ticked"
        assert ticks[-1] is None and running.counters().get("lost_check_behind", 0) == 0
