"""Prefix-cache routing through a real daemon on loopback: requests sharing a prefix go to the
rank that was sent it, under ``cache_aware`` and ``pab_cache_aware``, unless (``pab_cache_aware``)
that rank's budget cannot cover what it does not hold of the prompt.

The ranks are scripted agents: each answers a ``Dispatch`` with a ``Done`` at once and reports
the budget a test sets, so which rank can take what is exact.
"""

from __future__ import annotations

import functools
import time

import pytest
import zmq

from controlplane import protocol as p

from live import thread_daemon

CLIENT_REPLIES = p.client_reply_channel()
AGENT_INBOX = p.daemon_to_agent_channel()
SUBMIT = functools.partial(p.Submit, protocol=p.PROTOCOL_VERSION)
EPOCH = 1
SHARED = "You are a careful assistant. Answer in one short sentence. " * 60  # 3,480 bytes, 870 tokens


class ScriptedRank:
    """One rank's agent (a DEALER) and reporter (a PUSH): reports what it is told, finishes
    every dispatch at once."""

    def __init__(self, config, rank: str) -> None:
        self.rank = rank
        context = zmq.Context.instance()
        self.agent = context.socket(zmq.DEALER)
        self.agent.setsockopt(zmq.LINGER, 0)
        self.agent.setsockopt(zmq.ROUTING_ID, f"agent-{rank}".encode())
        self.agent.connect(config.rank_address)
        self.reports = context.socket(zmq.PUSH)
        self.reports.setsockopt(zmq.LINGER, 0)
        self.reports.connect(config.report_address)
        self.seq = 0
        self.last_dispatch = 0
        self.agent.send(p.encode(p.Hello(f"agent-{rank}", rank, EPOCH, protocol=p.PROTOCOL_VERSION)))
        assert self.agent.poll(5000), "no Welcome"
        assert isinstance(AGENT_INBOX.decode(self.agent.recv()), p.Welcome)

    def report(self, pab_tokens: float) -> None:
        """A report that accounts for every dispatch so far: the daemon's budget becomes
        ``pab_tokens``."""
        self.seq += 1
        self.reports.send(p.encode(p.Report(self.rank, EPOCH, self.seq, pab_tokens, 0, 0, 0, 100_000,
                                            self.last_dispatch, 0.01, time.monotonic())))

    def finish_dispatched(self) -> None:
        """Answer every dispatch waiting with a Done."""
        while self.agent.poll(0):
            message = AGENT_INBOX.decode(self.agent.recv())
            if isinstance(message, p.Dispatch):
                self.last_dispatch = max(self.last_dispatch, message.dispatch_seq)
                self.agent.send(p.encode(p.Done(self.rank, EPOCH, message.request_id, p.FinishReason.LENGTH,
                                                dispatch_seq=message.dispatch_seq)))

    def close(self) -> None:
        self.agent.send(p.encode(p.Goodbye(self.rank, EPOCH)))
        self.agent.close()
        self.reports.close()


class RawClient:
    def __init__(self, address: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.waiting: list = []

    def request(self, message, ranks: list[ScriptedRank]):
        """Send ``message``; its final answer and the rank it was dispatched to (None)."""
        self.socket.send(p.encode(message))
        rank = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for scripted in ranks:
                scripted.finish_dispatched()
            if not self.socket.poll(10):
                continue
            for reply in p.unbatched(CLIENT_REPLIES.decode(self.socket.recv())):
                if isinstance(reply, p.Dispatched):
                    rank = reply.rank
                elif isinstance(reply, (p.Finish, p.Reject)):
                    return reply, rank
        raise AssertionError(f"no final answer to {message.request_id}")

    def status(self) -> p.StatusReply:
        self.socket.send(p.encode(p.StatusRequest()))
        assert self.socket.poll(5000), "no status"
        return CLIENT_REPLIES.decode(self.socket.recv())

    def wait_for_budgets(self, budgets: dict[str, float]) -> None:
        """Until the daemon's effective budget of each rank is the one given."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen = {rank.rank: rank.pab_tokens for rank in self.status().ranks}
            if all(seen.get(rank) == budget for rank, budget in budgets.items()):
                return
            time.sleep(0.01)
        raise AssertionError(f"budgets {budgets} never applied; last seen {seen}")

    def close(self) -> None:
        self.socket.close()


@pytest.fixture(params=["cache_aware", "pab_cache_aware"])
def two_ranks(request):
    with thread_daemon(policy=request.param, stale_after_s=60.0, lost_after_s=120.0,
                       heartbeat_interval_s=1.0) as daemon:
        ranks = [ScriptedRank(daemon.config, "r0"), ScriptedRank(daemon.config, "r1")]
        client = RawClient(daemon.config.client_address)
        try:
            yield daemon, ranks, client
        finally:
            for rank in ranks:
                rank.close()
            client.close()


def completion(request_id: str, text: str) -> p.Submit:
    return SUBMIT(request_id, p.Prompt(text=text), p.SamplingParams(max_new_tokens=4))


def test_requests_sharing_a_prefix_go_to_the_rank_that_holds_it(two_ranks):
    daemon, ranks, client = two_ranks
    for rank in ranks:
        rank.report(1_000_000)
    client.wait_for_budgets({"r0": 1_000_000, "r1": 1_000_000})
    placed: dict[str, list[str]] = {"shared": [], "other": []}
    for index in range(12):
        for group, prefix in (("shared", SHARED), ("other", "Translate into French, word by word. " * 90)):
            reply, rank = client.request(completion(f"{group}-{index}", f"{prefix}question {index}?"), ranks)
            assert isinstance(reply, p.Finish), reply
            placed[group].append(rank)
    assert len(set(placed["shared"])) == 1 and len(set(placed["other"])) == 1, placed
    assert daemon.counters()["prompt_tokens_believed_cached"] > 20 * 800


@pytest.mark.parametrize("two_ranks", ["pab_cache_aware"], indirect=True)
def test_pab_cache_aware_keeps_a_held_prompt_on_its_holder_while_its_budget_covers_the_rest(two_ranks):
    _, ranks, client = two_ranks
    by_name = {rank.rank: rank for rank in ranks}
    for rank in ranks:
        rank.report(1_000_000)
    client.wait_for_budgets({"r0": 1_000_000, "r1": 1_000_000})
    reply, holder = client.request(completion("first", SHARED + "first?"), ranks)
    assert isinstance(reply, p.Finish)
    other = "r1" if holder == "r0" else "r0"
    by_name[holder].report(200)  # covers the ~10 uncached tokens of a shared-prefix request, not 900
    client.wait_for_budgets({holder: 200})
    reply, rank = client.request(completion("second", SHARED + "second?"), ranks)
    assert isinstance(reply, p.Finish) and rank == holder
    by_name[holder].report(5)  # covers not even the uncached rest now
    client.wait_for_budgets({holder: 5})
    reply, rank = client.request(completion("third", SHARED + "third?"), ranks)
    # the other rank's budget covers all of it, but it holds none of the prefix
    assert isinstance(reply, p.Reject) and reply.reason is p.RejectReason.NO_BUDGET and rank is None
    reply, rank = client.request(completion("unshared", "z" * 2_000), ranks)  # 500 tokens, held nowhere
    assert isinstance(reply, p.Finish) and rank == other
