"""The daemon's state machine, driven with real protocol messages and a fake clock."""

from __future__ import annotations

import pytest

from controlplane.config import DaemonConfig
from controlplane.core import UNKNOWN_AGENT, UNKNOWN_RANK, DispatcherCore, ToAgent, ToClient
from controlplane.protocol import (
    PROTOCOL_VERSION,
    Abort, Cancel, Chunk, Dispatch, Dispatched, Done, DrainRank, DrainReply, Draining, Fenced, Finish,
    FinishReason, Goodbye,
    Heartbeat, Hello, Output, Ping, Pong, Prompt, RankOutputs, Reject, RejectReason, Report,
    SamplingParams,
    StatusRequest, StatusReply, Submit, Welcome, ClassBudget, SloSpec, ChatMessage,
)

CLIENT = b"client-1"


CORES: list[DispatcherCore] = []


@pytest.fixture(autouse=True)
def integrity_checked():
    """Every core a test made is consistent when the test ends."""
    CORES.clear()
    yield
    for core in CORES:
        core.check_integrity()


def make_core(**overrides) -> DispatcherCore:
    overrides.setdefault("policy", "pab")
    core = DispatcherCore(DaemonConfig(**overrides), "daemon-A", started_at=0.0)
    CORES.append(core)
    return core


def join(core: DispatcherCore, rank: str, *, agent: str | None = None, epoch: int = 1,
         pab: float = 10_000.0, now: float = 0.0, echo: int = 0, seq: int = 1) -> None:
    agent = agent or f"agent-{rank}"
    sends = core.on_agent(agent.encode(), Hello(agent, rank, epoch, protocol=PROTOCOL_VERSION), now)
    assert any(isinstance(s.message, Welcome) for s in sends)
    report(core, rank, pab, epoch=epoch, seq=seq, echo=echo, now=now)


def report(core: DispatcherCore, rank: str, pab: float, *, epoch: int = 1, seq: int, echo: int = 0,
           now: float = 0.0, waiting: int = 0, running: int = 0) -> list:
    return core.on_report(Report(rank, epoch, seq, pab, running, waiting, 0, 100_000, echo, 0.01, now), now)


def submit(core: DispatcherCore, request_id: str, tokens: int = 100, now: float = 0.0, client: bytes = CLIENT,
           token: int = 1, **fields) -> list:
    """Submit a prompt of ``tokens`` copies of ``token`` (prompts of one token share a prefix
    in the prefix-tree policies' eyes)."""
    fields.setdefault("protocol", PROTOCOL_VERSION)
    message = Submit(request_id, Prompt(token_ids=[token] * tokens), SamplingParams(max_new_tokens=4), **fields)
    return core.on_client(client, message, now)


def dispatches(sends) -> list[Dispatch]:
    return [s.message for s in sends if isinstance(s, ToAgent) and isinstance(s.message, Dispatch)]


def replies(sends, kind):
    return [s.message for s in sends if isinstance(s, ToClient) and isinstance(s.message, kind)]


def test_submit_dispatches_to_the_largest_covering_budget_and_debits_it():
    core = make_core()
    join(core, "r0", pab=5_000)
    join(core, "r1", pab=8_000)
    sends = submit(core, "a", tokens=3_000)
    (dispatch,) = dispatches(sends)
    assert (dispatch.rank, dispatch.dispatch_seq) == ("r1", 1)
    assert replies(sends, Dispatched) == [Dispatched("a", "r1", 1)]
    assert core.ledger.effective_budget("r1") == 5_000
    (second,) = dispatches(submit(core, "b", tokens=3_000))
    assert second.rank in {"r0", "r1"} and core.in_flight == 2


def test_no_budget_rejects_with_retry_after_and_frees_the_id():
    core = make_core(retry_after_s=0.5)
    join(core, "r0", pab=1_000)
    (reject,) = replies(submit(core, "a", tokens=2_000), Reject)
    assert (reject.reason, reject.retryable, reject.retry_after_s) == (RejectReason.NO_BUDGET, True, 0.5)
    assert core.in_flight == 0 and core.idle
    report(core, "r0", 5_000, seq=2)
    assert dispatches(submit(core, "a", tokens=2_000))  # the same id again is not a duplicate


def test_no_budget_queues_until_a_report_covers_it_or_the_ttl_passes():
    core = make_core(on_no_budget="queue", queue_ttl_s=1.0)
    join(core, "r0", pab=1_000)
    assert submit(core, "a", tokens=2_000) == [] and core.queued == 1
    assert submit(core, "b", tokens=2_000, now=0.1) == []
    (dispatch,) = dispatches(report(core, "r0", 2_500, seq=2, now=0.5))
    assert dispatch.request_id == "a" and core.queued == 1
    sends = core.on_tick(1.2)
    (reject,) = replies(sends, Reject)
    assert (reject.request_id, reject.reason) == ("b", RejectReason.QUEUE_TIMEOUT) and core.queued == 0


def test_no_budget_spills_to_the_policys_choice_with_budgets_ignored():
    core = make_core(policy="pab_least_loaded", on_no_budget="spill")
    join(core, "r0", pab=1_000)
    join(core, "r1", pab=500)
    report(core, "r0", 1_000, seq=2, running=5)
    (dispatch,) = dispatches(submit(core, "a", tokens=2_000))
    assert dispatch.rank == "r1" and core.queued == 0  # the lighter load, though no budget covers
    assert core.counters["spilled"] == 1 and core.ledger.effective_budget("r1") == -1_500
    (covered,) = dispatches(submit(core, "b", tokens=800))
    assert covered.rank == "r0" and core.counters["spilled"] == 1


def test_a_spilled_request_a_rank_refuses_spills_once_to_each_other_rank():
    core = make_core(on_no_budget="spill")
    join(core, "r0", pab=1_000)
    join(core, "r1", pab=500)
    (first,) = dispatches(submit(core, "a", tokens=2_000))
    assert first.rank == "r0"
    refused = Done("r0", 1, "a", FinishReason.ERROR, error="r0 admission refused", no_budget=True,
                   dispatch_seq=first.dispatch_seq)
    (second,) = dispatches(core.on_agent(b"agent-r0", refused, 0.1))
    assert second.rank == "r1" and core.counters["spilled"] == 2
    refused = Done("r1", 1, "a", FinishReason.ERROR, error="r1 admission refused", no_budget=True,
                   dispatch_seq=second.dispatch_seq)
    (reject,) = replies(core.on_agent(b"agent-r1", refused, 0.2), Reject)
    assert (reject.reason, reject.detail) == (RejectReason.NO_BUDGET, "r1 admission refused")
    assert core.idle


def test_duplicate_in_flight_id_is_refused_but_a_finished_one_may_return():
    core = make_core()
    join(core, "r0")
    (dispatch,) = dispatches(submit(core, "a"))
    (reject,) = replies(submit(core, "a"), Reject)
    assert (reject.reason, reject.retryable) == (RejectReason.DUPLICATE, False)
    core.on_agent(b"agent-r0", Done("r0", 1, "a", FinishReason.LENGTH, 100, 4), 0.1)
    assert dispatches(submit(core, "a"))


def test_report_reconciles_debits_it_includes_and_keeps_those_it_does_not():
    core = make_core()
    join(core, "r0", pab=10_000)
    submit(core, "a", tokens=1_000)  # seq 1
    submit(core, "b", tokens=2_000)  # seq 2
    assert core.ledger.effective_budget("r0") == 7_000
    report(core, "r0", 9_000, seq=2, echo=1)  # taken after a, before b
    assert core.ledger.effective_budget("r0") == 7_000
    report(core, "r0", 7_000, seq=3, echo=2)
    assert core.ledger.effective_budget("r0") == 7_000 and core.ledger.outstanding_dispatches("r0") == 0


def test_reports_are_ordered_per_rank_and_gaps_counted():
    core = make_core()
    join(core, "r0", pab=1_000)
    join(core, "r1", pab=1_000, seq=7)
    report(core, "r0", 5_000, seq=4)
    report(core, "r0", 9_000, seq=3)  # older: dropped
    assert core.ledger.effective_budget("r0") == 5_000
    assert core.registry.get("r0").seq_gaps == 2 and core.registry.get("r1").seq_gaps == 0
    assert core.counters["reports_out_of_order"] == 1


def test_output_streams_to_the_client_and_done_finishes_exactly_once():
    core = make_core()
    join(core, "r0")
    submit(core, "a")
    sends = core.on_agent(b"agent-r0", Output("r0", 1, "a", [5, 6], "hi", 2), 0.1)
    assert replies(sends, Chunk) == [Chunk("a", [5, 6], "hi", 2)]
    done = Done("r0", 1, "a", FinishReason.LENGTH, 100, 4, ttft_s=0.05, latency_s=0.2)
    (finish,) = replies(core.on_agent(b"agent-r0", done, 0.2), Finish)
    assert (finish.reason, finish.completion_tokens, finish.ttft_s) == (FinishReason.LENGTH, 4, 0.05)
    assert core.on_agent(b"agent-r0", done, 0.3) == [] and core.counters["late_messages"] == 1
    assert core.registry.get("r0").in_flight == set() and core.idle


def test_non_streamed_output_is_accumulated_into_the_finish():
    core = make_core()
    join(core, "r0")
    submit(core, "a", stream=False)
    assert core.on_agent(b"agent-r0", Output("r0", 1, "a", [5], "a", 1), 0.1) == []
    core.on_agent(b"agent-r0", Output("r0", 1, "a", [6], "b", 2), 0.1)
    (finish,) = replies(core.on_agent(b"agent-r0", Done("r0", 1, "a", FinishReason.LENGTH, 1, 2), 0.2), Finish)
    assert (finish.text, finish.token_ids) == ("ab", [5, 6])


def test_rank_refusing_a_request_as_invalid_becomes_a_non_retryable_reject():
    core = make_core()
    join(core, "r0")
    submit(core, "a")
    done = Done("r0", 1, "a", FinishReason.ERROR, error="unknown SLO class 'gold'", invalid=True)
    (reject,) = replies(core.on_agent(b"agent-r0", done, 0.1), Reject)
    assert (reject.reason, reject.retryable, reject.detail) == (RejectReason.INVALID, False, "unknown SLO class 'gold'")


def test_rank_admission_refusal_becomes_a_retryable_no_budget_reject():
    core = make_core()
    join(core, "r0")
    submit(core, "a")
    done = Done("r0", 1, "a", FinishReason.ERROR, error="admission refused", no_budget=True)
    (reject,) = replies(core.on_agent(b"agent-r0", done, 0.1), Reject)
    assert (reject.reason, reject.retryable, reject.detail) == (RejectReason.NO_BUDGET, True, "admission refused")
    assert reject.retry_after_s is not None and core.idle


def test_a_rank_refusal_is_placed_on_a_rank_not_yet_tried_then_answered_no_budget():
    core = make_core()
    join(core, "r0", pab=10_000)
    join(core, "r1", pab=5_000)
    (first,) = dispatches(submit(core, "a"))
    assert first.rank == "r0"
    refused = Done("r0", 1, "a", FinishReason.ERROR, error="r0 admission refused", no_budget=True,
                   dispatch_seq=first.dispatch_seq)
    (second,) = dispatches(core.on_agent(b"agent-r0", refused, 0.1))
    assert second.rank == "r1" and core.counters["replaced_after_rank_refusal"] == 1
    # r0 no longer holds it: a late message from r0 about it is ignored
    assert core.on_agent(b"agent-r0", Done("r0", 1, "a", FinishReason.LENGTH, 1, 2), 0.15) == []
    refused = Done("r1", 1, "a", FinishReason.ERROR, error="r1 admission refused", no_budget=True,
                   dispatch_seq=second.dispatch_seq)
    (reject,) = replies(core.on_agent(b"agent-r1", refused, 0.2), Reject)
    assert (reject.reason, reject.detail) == (RejectReason.NO_BUDGET, "r1 admission refused")
    assert core.idle


def test_cancel_aborts_at_the_rank_and_only_the_owner_may_cancel():
    core = make_core()
    join(core, "r0")
    submit(core, "a")
    assert core.on_client(b"someone-else", Cancel("a"), 0.1) == []
    sends = core.on_client(CLIENT, Cancel("a"), 0.1)
    assert [s.message for s in sends if isinstance(s, ToAgent)] == [Abort("r0", 1, "a")]
    assert replies(sends, Finish)[0].reason == FinishReason.CANCELLED
    assert core.on_client(CLIENT, Cancel("a"), 0.2) == [] and core.idle


def test_lost_rank_fails_only_its_requests_once_retryable_only_before_output():
    core = make_core(lost_after_s=1.0, heartbeat_interval_s=0.2, stale_after_s=10.0)
    join(core, "r0", pab=10_000)
    join(core, "r1", pab=5_000)
    submit(core, "a", tokens=100)  # r0
    submit(core, "b", tokens=100)  # r0 (9_900 > 5_000)
    core.on_agent(b"agent-r0", Output("r0", 1, "b", [1], "x", 1), 0.5)
    core.on_agent(b"agent-r1", Heartbeat("agent-r1"), 1.4)
    sends = core.on_tick(1.6)
    rejects = {r.request_id: r for r in replies(sends, Reject)}
    assert set(rejects) == {"a", "b"}
    assert rejects["a"].retryable and rejects["a"].reason == RejectReason.RANK_LOST
    assert not rejects["b"].retryable
    assert "r0" not in core.registry and "r1" in core.registry
    assert core.on_tick(1.7) == [] and core.counters["rank_lost_requests"] == 2


def test_restarted_rank_fences_its_old_epoch():
    core = make_core()
    join(core, "r0", epoch=5)
    submit(core, "a")
    sends = core.on_agent(b"agent-r0", Hello("agent-r0", "r0", 6, protocol=PROTOCOL_VERSION), 1.0)
    assert replies(sends, Reject)[0].reason == RejectReason.RANK_LOST
    late = core.on_agent(b"agent-r0", Output("r0", 5, "a", [1], "x", 1), 1.1)
    assert isinstance(late[0].message, Fenced)
    old_hello = core.on_agent(b"agent-r0", Hello("agent-r0", "r0", 4, protocol=PROTOCOL_VERSION), 1.2)
    assert isinstance(old_hello[0].message, Fenced)
    report(core, "r0", 99_999, epoch=5, seq=9)
    assert core.counters["reports_fenced"] == 1
    assert core.ledger.effective_budget("r0") is None  # the new epoch has not reported yet


def test_unknown_agent_and_rank_are_told_so_after_a_daemon_restart():
    core = make_core()
    (fenced,) = core.on_agent(b"agent-x", Heartbeat("agent-x"), 0.0)
    assert fenced.message.detail == UNKNOWN_AGENT
    (fenced,) = core.on_agent(b"agent-x", Output("r9", 3, "zz", [], "", 0), 0.0)
    assert fenced.message.detail == UNKNOWN_RANK


def test_identity_must_match_the_agent_named_in_the_message():
    core = make_core()
    assert core.on_agent(b"mallory", Hello("agent-r0", "r0", 1, protocol=PROTOCOL_VERSION), 0.0) == []
    join(core, "r0")
    submit(core, "a")
    assert isinstance(core.on_agent(b"mallory", Done("r0", 1, "a", FinishReason.LENGTH), 0.1)[0].message, Fenced)
    assert core.in_flight == 1


def test_stale_ranks_are_unknown_and_local_accounting_caps_in_flight():
    core = make_core(stale_after_s=1.0, local_inflight_cap=2, lost_after_s=100.0)
    join(core, "r0", pab=0.0)
    join(core, "r1", pab=0.0)
    (reject,) = replies(submit(core, "a", now=0.5), Reject)
    assert reject.reason == RejectReason.NO_BUDGET  # fresh reports: budgets are known and empty
    ranks = [dispatches(submit(core, f"s{i}", now=5.0))[0].rank for i in range(4)]
    assert sorted(ranks) == ["r0", "r0", "r1", "r1"]
    (reject,) = replies(submit(core, "s4", now=5.0), Reject)
    assert reject.reason == RejectReason.OVERLOADED and core.counters["dispatched_local_accounting"] == 4


def test_a_fresh_rank_is_preferred_over_stale_ones():
    core = make_core(stale_after_s=1.0, lost_after_s=100.0)
    join(core, "r0", pab=50_000, now=0.0)
    join(core, "r1", pab=1_000, now=4.5)
    assert dispatches(submit(core, "a", tokens=500, now=5.0))[0].rank == "r1"


def test_deadline_aborts_at_the_rank():
    core = make_core()
    join(core, "r0")
    submit(core, "a", deadline_s=1.0)
    assert core.on_tick(0.5) == []
    sends = core.on_tick(1.5)
    assert replies(sends, Reject)[0].reason == RejectReason.DEADLINE
    assert [s.message for s in sends if isinstance(s, ToAgent)] == [Abort("r0", 1, "a")]


def test_client_gone_releases_and_aborts_once():
    core = make_core()
    join(core, "r0")
    submit(core, "a")
    chunk = core.on_agent(b"agent-r0", Output("r0", 1, "a", [1], "x", 1), 0.1)[0]
    sends = core.on_send_failed(chunk, 0.1)
    assert [s.message for s in sends] == [Abort("r0", 1, "a")]
    assert core.on_send_failed(chunk, 0.2) == [] and core.idle and core.counters["client_gone"] == 1


def test_undelivered_dispatch_is_undone_and_placed_elsewhere():
    core = make_core()
    join(core, "r0", pab=9_000)
    join(core, "r1", pab=8_000)
    sends = submit(core, "a", tokens=1_000)
    failed = next(s for s in sends if isinstance(s, ToAgent))
    resent = core.on_send_failed(failed, 0.0)
    assert dispatches(resent)[0].rank == "r1"
    assert core.ledger.effective_budget("r0") == 9_000 and core.registry.get("r0").in_flight == set()
    core.on_agent(b"agent-r0", Heartbeat("agent-r0"), 0.1)
    assert not core.registry.get("r0").unreachable


def test_goodbye_fails_in_flight_and_no_ranks_rejects_retryably():
    core = make_core()
    join(core, "r0")
    submit(core, "a")
    sends = core.on_agent(b"agent-r0", Goodbye("r0", 1), 0.1)
    assert replies(sends, Reject)[0].reason == RejectReason.RANK_LOST
    (reject,) = replies(submit(core, "b"), Reject)
    assert (reject.reason, reject.retryable) == (RejectReason.NO_RANKS, True)


def test_drain_rejects_new_and_queued_then_aborts_the_rest():
    core = make_core(on_no_budget="queue")
    join(core, "r0", pab=1_000)
    submit(core, "big", tokens=5_000)
    submit(core, "a", tokens=10)
    sends = core.begin_drain()
    assert [(r.request_id, r.reason) for r in replies(sends, Reject)] == [("big", RejectReason.SHUTTING_DOWN)]
    assert replies(submit(core, "c"), Reject)[0].reason == RejectReason.SHUTTING_DOWN
    sends = core.abort_all("stopping")
    assert replies(sends, Reject)[0].request_id == "a" and core.idle


def test_ping_and_status():
    core = make_core()
    join(core, "r0", pab=4_000)
    submit(core, "a", tokens=1_000)
    assert core.on_client(CLIENT, Ping(7), 0.0)[0].message == Pong(7, "daemon-A", protocol=PROTOCOL_VERSION)
    (status,) = replies(core.on_client(CLIENT, StatusRequest(), 0.5), StatusReply)
    (rank,) = status.ranks
    assert (rank.rank, rank.pab_tokens, rank.reported_pab_tokens, rank.in_flight) == ("r0", 3_000, 4_000, 1)
    assert rank.report_age_s == pytest.approx(0.5) and not rank.stale
    assert status.in_flight == 1 and status.counters["dispatched"] == 1


def test_output_of_an_earlier_dispatch_of_the_same_id_is_not_taken_for_the_current_one():
    core = make_core()
    join(core, "r0")
    (first,) = dispatches(submit(core, "a"))
    core.on_client(CLIENT, Cancel("a"), 0.1)  # the rank's cancelled Done is still on its way
    (second,) = dispatches(submit(core, "a", now=0.2))
    late = Done("r0", 1, "a", FinishReason.CANCELLED, completion_tokens=3, dispatch_seq=first.dispatch_seq)
    assert core.on_agent(b"agent-r0", late, 0.3) == [] and core.in_flight == 1
    done = Done("r0", 1, "a", FinishReason.LENGTH, completion_tokens=4, dispatch_seq=second.dispatch_seq)
    assert replies(core.on_agent(b"agent-r0", done, 0.4), Finish)[0].completion_tokens == 4


def test_a_restarted_daemon_numbers_dispatches_above_what_ranks_still_echo():
    old = DispatcherCore(DaemonConfig(), "old", 0.0, first_dispatch_seq=1_000)
    join(old, "r0")
    (dispatch,) = dispatches(submit(old, "a", tokens=500))
    new = DispatcherCore(DaemonConfig(), "new", 0.0, first_dispatch_seq=2_000)
    join(new, "r0", pab=10_000, echo=dispatch.dispatch_seq)  # the rank still echoes the old number
    submit(new, "b", tokens=500)
    report(new, "r0", 10_000, seq=2, echo=dispatch.dispatch_seq)
    assert new.ledger.effective_budget("r0") == 9_500  # b's debit survives the stale echo


def test_a_request_the_rank_refused_releases_its_debit():
    core = make_core()
    join(core, "r0", pab=10_000)
    submit(core, "a", tokens=700)
    core.on_agent(b"agent-r0", Done("r0", 1, "a", FinishReason.ERROR, invalid=True), 0.1)
    assert core.ledger.effective_budget("r0") == 10_000


def test_a_draining_rank_gets_nothing_new_while_its_requests_finish():
    core = make_core()
    join(core, "r0", pab=50_000)
    join(core, "r1", pab=5_000)
    (first,) = dispatches(submit(core, "a"))
    assert first.rank == "r0"
    assert core.on_agent(b"agent-r0", Draining("r0", 1), 0.1) == []
    assert core.counters["ranks_drained"] == 1
    (second,) = dispatches(submit(core, "b", now=0.2))
    assert second.rank == "r1"
    assert core.on_agent(b"agent-r0", Output("r0", 1, "a", [7], "x", 1), 0.3)
    (finish,) = replies(core.on_agent(b"agent-r0", Done("r0", 1, "a", FinishReason.LENGTH, 100, 4), 0.4), Finish)
    assert finish.reason == FinishReason.LENGTH
    (r0, _) = core.status(0.5).ranks
    assert (r0.rank, r0.draining, r0.in_flight) == ("r0", True, 0)


def test_with_every_rank_draining_a_submit_is_refused_retryably():
    core = make_core(on_no_budget="queue")
    join(core, "r0")
    core.on_agent(b"agent-r0", Draining("r0", 1), 0.0)
    (reject,) = replies(submit(core, "a"), Reject)
    assert (reject.reason, reject.retryable) == (RejectReason.NO_RANKS, True)
    assert core.idle


def test_draining_from_another_agent_or_epoch_is_fenced():
    core = make_core()
    join(core, "r0", epoch=5)
    (fenced,) = [s.message for s in core.on_agent(b"agent-r0", Draining("r0", 4), 0.0)]
    assert isinstance(fenced, Fenced)
    assert core.on_agent(b"intruder", Draining("r0", 5), 0.0)
    assert not core.registry.get("r0").draining


def test_operator_drain_and_resume_and_an_unknown_rank():
    core = make_core(on_no_budget="queue")
    join(core, "r0", pab=1_000)
    assert submit(core, "big", tokens=2_000) == [] and core.queued == 1
    (reply,) = replies(core.on_client(CLIENT, DrainRank("r0"), 0.1), DrainReply)
    assert reply == DrainReply("r0", True, True, 0)
    assert dispatches(report(core, "r0", 5_000, seq=2, now=0.2)) == []  # budget, but draining
    sends = core.on_client(CLIENT, DrainRank("r0", drain=False), 0.3)
    assert replies(sends, DrainReply) == [DrainReply("r0", True, False, 0)]
    (dispatch,) = dispatches(sends)  # resuming pumps the queue
    assert dispatch.request_id == "big"
    assert replies(core.on_client(CLIENT, DrainRank("nope"), 0.4), DrainReply) == [DrainReply("nope", False)]
    assert (core.counters["ranks_drained"], core.counters["ranks_resumed"]) == (1, 1)


def test_a_drain_survives_a_same_epoch_rejoin_but_not_a_new_epoch():
    core = make_core()
    join(core, "r0", epoch=1)
    core.on_agent(b"agent-r0", Draining("r0", 1), 0.0)
    core.on_agent(b"agent-r0", Hello("agent-r0", "r0", 1, protocol=PROTOCOL_VERSION), 0.1)
    assert core.registry.get("r0").draining
    core.on_agent(b"agent-r0", Hello("agent-r0", "r0", 2, protocol=PROTOCOL_VERSION), 0.2)
    assert not core.registry.get("r0").draining


# ---------------------------------------------------------------------- handler failures
class Boom(RuntimeError):
    pass


def failing_once(original, when=lambda *args: True, *, after: bool = False):
    """``original``, except that the first call for which ``when(*args)`` holds raises
    (``after``: once ``original`` has run, so its changes stay and its sends are lost)."""
    state = {"armed": True}

    def call(*args, **kwargs):
        if state["armed"] and when(*args):
            state["armed"] = False
            if after:
                original(*args, **kwargs)
            raise Boom("injected")
        return original(*args, **kwargs)

    return call


def final_answers(sends) -> dict[str, list]:
    """Each request's final answers (Finish or Reject) among ``sends``."""
    answers: dict[str, list] = {}
    for message in replies(sends, (Finish, Reject)):
        answers.setdefault(message.request_id, []).append(message)
    return answers


def test_a_submit_handler_failure_after_the_debit_rejects_internal_retryably_and_releases_it(monkeypatch):
    core = make_core()
    join(core, "r0", pab=10_000)
    monkeypatch.setattr(core, "_dispatch", failing_once(core._dispatch, after=True))
    sends = submit(core, "a", tokens=700)
    (reject,) = final_answers(sends)["a"]
    assert (reject.reason, reject.retryable) == (RejectReason.INTERNAL, True)
    assert reject.retry_after_s == core.config.retry_after_s
    assert [s for s in sends if isinstance(s, ToAgent)] == []  # the Dispatch never left: no Abort
    assert core.ledger.effective_budget("r0") == 10_000 and core.idle
    assert core.registry.get("r0").in_flight == set()
    assert (core.counters["internal_errors"], core.counters["rejected_internal"]) == (1, 1)
    core.check_integrity()
    (dispatch,) = dispatches(submit(core, "a", tokens=700))  # the retry, and the daemon serves on
    assert dispatch.request_id == "a" and core.ledger.effective_budget("r0") == 9_300


def test_a_submit_that_fails_before_entering_the_table_is_still_answered(monkeypatch):
    core = make_core()
    join(core, "r0")
    monkeypatch.setattr(core, "_refusal", failing_once(core._refusal))
    (reject,) = replies(submit(core, "a"), Reject)
    assert (reject.request_id, reject.reason, reject.retryable) == ("a", RejectReason.INTERNAL, True)
    assert core.idle


def test_an_output_handler_failure_ends_only_its_request_at_the_rank_and_client(monkeypatch):
    core = make_core()
    join(core, "r0", pab=10_000)
    submit(core, "a", tokens=100)
    submit(core, "b", tokens=200)
    assert replies(core.on_agent(b"agent-r0", Output("r0", 1, "a", [1], "x", 1), 0.1), Chunk)
    monkeypatch.setattr(core, "_rank_output", failing_once(core._rank_output))
    sends = core.on_agent(b"agent-r0", Output("r0", 1, "a", [2], "y", 2), 0.2)
    (reject,) = final_answers(sends)["a"]
    assert (reject.reason, reject.retryable, reject.retry_after_s) == (RejectReason.INTERNAL, False, None)
    assert [s.message for s in sends if isinstance(s, ToAgent)] == [Abort("r0", 1, "a")]
    assert core.ledger.effective_budget("r0") == 10_000 - 200  # a's debit released, b's kept
    assert core.registry.get("r0").in_flight == {"b"} and core.in_flight == 1
    assert core.on_agent(b"agent-r0", Done("r0", 1, "a", FinishReason.CANCELLED), 0.3) == []
    done = Done("r0", 1, "b", FinishReason.LENGTH, 200, 4)
    assert final_answers(core.on_agent(b"agent-r0", done, 0.4))["b"][0].reason == FinishReason.LENGTH
    core.check_integrity()


def test_a_done_handler_failure_before_any_output_is_retryable(monkeypatch):
    core = make_core()
    join(core, "r0")
    submit(core, "a", stream=False)
    core.on_agent(b"agent-r0", Output("r0", 1, "a", [1], "x", 1), 0.1)  # accumulated, not sent
    monkeypatch.setattr(core, "_rank_output", failing_once(core._rank_output))
    (reject,) = replies(core.on_agent(b"agent-r0", Done("r0", 1, "a", FinishReason.LENGTH), 0.2), Reject)
    assert (reject.reason, reject.retryable) == (RejectReason.INTERNAL, True) and core.idle


def test_a_failing_message_from_another_agent_or_dispatch_ends_nothing(monkeypatch):
    core = make_core()
    join(core, "r0")
    (first,) = dispatches(submit(core, "a"))
    monkeypatch.setattr(core, "_rank_output", failing_once(core._rank_output))
    assert core.on_agent(b"mallory", Output("r0", 1, "a", [1], "x", 1), 0.1) == []
    monkeypatch.setattr(core, "_rank_output", failing_once(core._rank_output))
    late = Output("r0", 1, "a", [1], "x", 1, dispatch_seq=first.dispatch_seq + 5)
    assert core.on_agent(b"agent-r0", late, 0.2) == []
    assert core.in_flight == 1 and core.counters["internal_errors"] == 2
    core.check_integrity()


def test_a_goodbye_that_fails_half_way_answers_every_request_of_the_rank_once(monkeypatch):
    core = make_core()
    join(core, "r0", pab=50_000)
    for request_id in ("a", "b", "c"):
        submit(core, request_id)
    join(core, "r1", pab=100_000)
    assert dispatches(submit(core, "d"))[0].rank == "r1"
    only_b = lambda request_id, *rest: request_id == "b"  # noqa: E731
    monkeypatch.setattr(core, "_reject", failing_once(core._reject, only_b))
    answers = final_answers(core.on_agent(b"agent-r0", Goodbye("r0", 1), 0.1))
    assert {request_id: [a.reason for a in answer] for request_id, answer in answers.items()} == {
        "a": [RejectReason.RANK_LOST],  # closed before the failure: its answer is kept
        "b": [RejectReason.INTERNAL], "c": [RejectReason.INTERNAL]}
    assert "r0" not in core.registry and core.in_flight == 1
    core.check_integrity()


def test_a_report_whose_queue_pump_fails_ends_the_request_it_was_on_and_requeues_the_rest(monkeypatch):
    core = make_core(on_no_budget="queue", queue_ttl_s=10.0)
    join(core, "r0", pab=100)
    assert submit(core, "a", tokens=1_000) == [] and submit(core, "b", tokens=1_000) == []
    monkeypatch.setattr(core, "_dispatch", failing_once(core._dispatch, after=True))
    sends = report(core, "r0", 5_000, seq=2, now=0.5)
    (reject,) = final_answers(sends)["a"]
    assert reject.reason == RejectReason.INTERNAL and "b" not in final_answers(sends)
    assert core.queued == 1 and core.ledger.effective_budget("r0") == 5_000
    core.check_integrity()
    (dispatch,) = dispatches(report(core, "r0", 5_000, seq=3, now=0.6))
    assert dispatch.request_id == "b"


def test_a_tick_that_fails_on_a_deadline_still_ends_that_request(monkeypatch):
    core = make_core()
    join(core, "r0")
    submit(core, "a", deadline_s=1.0)
    submit(core, "b")
    monkeypatch.setattr(core, "_close", failing_once(core._close))
    sends = core.on_tick(1.5)
    (reject,) = final_answers(sends)["a"]
    assert reject.reason == RejectReason.INTERNAL
    assert [s.message for s in sends if isinstance(s, ToAgent)] == [Abort("r0", 1, "a")]
    assert core.in_flight == 1 and core.on_tick(2.0) == []
    core.check_integrity()


def test_a_failure_in_the_recovery_itself_propagates_to_the_daemons_backstop(monkeypatch):
    core = make_core()
    join(core, "r0")
    monkeypatch.setattr(core, "_dispatch", failing_once(core._dispatch))
    monkeypatch.setattr(core, "_orphans", failing_once(core._orphans))
    with pytest.raises(Boom):
        submit(core, "a")
    with pytest.raises(RuntimeError, match="1 orphaned requests"):
        core.check_integrity()
    CORES.remove(core)


def class_report(core: DispatcherCore, rank: str, pab: float, classes: dict[str, tuple[float, float]], *,
                 seq: int, echo: int = 0, now: float = 0.0, waiting: int = 0) -> list:
    budgets = {name: ClassBudget(ttft_s, tokens) for name, (ttft_s, tokens) in classes.items()}
    return core.on_report(Report(rank, 1, seq, pab, 0, waiting, 0, 100_000, echo, 0.01, now, budgets), now)


@pytest.mark.parametrize("policy", ["pab", "pab_least_loaded"])
def test_a_request_is_routed_and_refused_on_its_slo_class_budget(policy):
    core = make_core(policy=policy)
    join(core, "roomy", pab=20_000)
    join(core, "fit", pab=4_000)
    class_report(core, "roomy", 20_000, {"interactive": (0.5, 200.0), "relaxed": (8.0, 40_000.0)}, seq=2)
    class_report(core, "fit", 4_000, {"interactive": (0.5, 1_500.0), "relaxed": (8.0, 9_000.0)}, seq=2,
                 waiting=3)
    # distinct prompts: nothing is believed cached, every prompt is judged whole
    (tight,) = dispatches(submit(core, "tight", tokens=1_000, token=1, slo=SloSpec(slo_class="interactive")))
    assert tight.rank == "fit"  # though "roomy" has five times its default-class budget
    assert core.ledger.effective_budget("fit", "relaxed") == 8_000  # every class is debited
    (plain,) = dispatches(submit(core, "plain", tokens=1_000, token=2))
    assert plain.rank == "roomy"
    (explicit,) = dispatches(submit(core, "explicit", tokens=400, token=3,
                                    slo=SloSpec(ttft_ms=900, tpot_ms=50)))
    assert explicit.rank == "fit"  # 900 ms: the interactive class (500 ms) is the largest not above it
    (reject,) = replies(submit(core, "late", tokens=200, token=4, slo=SloSpec(slo_class="interactive")),
                        Reject)
    assert reject.reason is RejectReason.NO_BUDGET and "of SLO class interactive" in reject.detail
    ranks = {rank.rank: rank for rank in core.status(0.0).ranks}
    assert ranks["fit"].class_budgets == {"interactive": 100.0, "relaxed": 7_600.0}


def test_an_e2e_request_routes_on_its_first_token_budget():
    core = make_core(policy="pab")
    join(core, "roomy", pab=20_000)
    join(core, "fit", pab=4_000)
    class_report(core, "roomy", 20_000, {"interactive": (0.5, 200.0), "code": (5.0, 40_000.0)}, seq=2)
    class_report(core, "fit", 4_000, {"interactive": (0.5, 9_000.0), "code": (5.0, 9_000.0)}, seq=2)
    routed = {}
    for request_id, slo in (("share", SloSpec(e2e_ms=2_400)),  # a quarter: 600 ms, interactive
                            ("own-ttft", SloSpec(e2e_ms=60_000, ttft_ms=900)),  # interactive
                            ("long", SloSpec(e2e_ms=20_000)),  # 5000 ms: code
                            ("named", SloSpec(slo_class="code"))):
        (dispatch,) = dispatches(submit(core, request_id, tokens=100, slo=slo))
        routed[request_id] = dispatch.rank
        assert dispatch.slo == slo  # passed on as given: the rank resolves and paces it
    assert routed == {"share": "fit", "own-ttft": "fit", "long": "roomy", "named": "roomy"}


def test_a_version_1_agent_is_fenced_at_hello_naming_both_versions():
    core = make_core()
    (fence,) = core.on_agent(b"old", Hello("old", "r0", 3), 0.0)  # no protocol field: version 1
    assert isinstance(fence.message, Fenced) and (fence.message.rank, fence.message.epoch) == ("r0", 3)
    assert "protocol version 1" in fence.message.detail
    assert f"version {PROTOCOL_VERSION}" in fence.message.detail
    assert "r0" not in core.registry and core.counters["protocol_refused"] == 1
    (newer,) = core.on_agent(b"new", Hello("new", "r0", 3, protocol=PROTOCOL_VERSION + 1), 0.0)
    assert "upgrade the daemon" in newer.message.detail
    welcome = core.on_agent(b"cur", Hello("cur", "r0", 3, protocol=PROTOCOL_VERSION), 0.0)
    assert any(isinstance(s.message, Welcome) for s in welcome)


# ---------------------------------------------------------------------- overload: the queue
def test_a_queued_request_waits_at_most_its_own_ttft_target():
    core = make_core(on_no_budget="queue", queue_ttl_s=5.0)
    join(core, "r0", pab=1_000)
    class_report(core, "r0", 1_000, {"interactive": (0.5, 1_000.0), "batch": (30.0, 1_000.0)}, seq=2)
    assert submit(core, "named", tokens=2_000, slo=SloSpec(slo_class="interactive")) == []
    assert submit(core, "explicit", tokens=2_000, slo=SloSpec(ttft_ms=800, tpot_ms=50)) == []
    assert submit(core, "long", tokens=2_000, slo=SloSpec(slo_class="batch")) == []
    assert submit(core, "plain", tokens=2_000) == [] and core.queued == 4
    expired = {}
    for now in (0.6, 0.9, 5.1):
        for reject in replies(core.on_tick(now), Reject):
            assert reject.reason is RejectReason.QUEUE_TIMEOUT and reject.retryable
            assert reject.retry_after_s == core.config.retry_after_s
            expired[reject.request_id] = now
    # its class's TTFT, its own; without one, or one past queue_ttl_s, queue_ttl_s
    assert expired == {"named": 0.6, "explicit": 0.9, "long": 5.1, "plain": 5.1}
    assert core.queued == 0 and core.counters["queue_timeouts"] == 4


def test_a_request_past_its_ttft_target_is_refused_at_once_instead_of_queued():
    core = make_core(on_no_budget="queue", queue_ttl_s=5.0)
    join(core, "r0", pab=4_000)
    join(core, "r1", pab=100)
    (dispatch,) = dispatches(submit(core, "a", tokens=2_000, slo=SloSpec(ttft_ms=500, tpot_ms=50)))
    assert dispatch.rank == "r0"
    refusal = Done("r0", 1, "a", FinishReason.ERROR, no_budget=True, error="the rank refused it",
                   dispatch_seq=dispatch.dispatch_seq)
    (reject,) = replies(core.on_agent(b"agent-r0", RankOutputs([refusal]), 0.7), Reject)
    # 0.7 s after its arrival r1's budget does not cover it and its 0.5 s have passed
    assert reject.reason is RejectReason.QUEUE_TIMEOUT and reject.retry_after_s is not None
    assert "TTFT target (0.5 s)" in reject.detail and core.queued == 0 and core.idle


def test_the_head_of_the_queue_does_not_hold_back_a_request_that_fits():
    core = make_core(on_no_budget="queue", queue_ttl_s=5.0)
    join(core, "r0", pab=500)
    assert submit(core, "big", tokens=3_000) == []
    assert submit(core, "small", tokens=800, now=0.1) == [] and core.queued == 2
    (dispatch,) = dispatches(report(core, "r0", 1_000, seq=2, now=0.2))
    assert dispatch.request_id == "small" and core.queued == 1
    (dispatch,) = dispatches(report(core, "r0", 3_000, seq=3, echo=dispatch.dispatch_seq, now=0.3))
    assert dispatch.request_id == "big" and core.queued == 0


def test_a_full_queue_refuses_at_once_with_retry_after():
    core = make_core(on_no_budget="queue", max_queued=2)
    join(core, "r0", pab=100)
    assert submit(core, "a", tokens=1_000) == [] and submit(core, "b", tokens=1_000) == []
    (reject,) = replies(submit(core, "c", tokens=1_000), Reject)
    assert reject.reason is RejectReason.OVERLOADED and reject.retryable
    assert reject.retry_after_s == core.config.retry_after_s and "queue is full" in reject.detail


def test_no_agent_is_judged_silent_on_time_the_daemon_has_not_read_yet():
    core = make_core(lost_after_s=1.0, heartbeat_interval_s=0.5)
    join(core, "r0")
    assert dispatches(submit(core, "a"))
    assert core.on_tick(5.0, agents_read_until=0.5) == []  # the daemon stalled; a heartbeat waits
    assert "r0" in core.registry and core.counters["lost_check_behind"] == 1
    core.on_agent(b"agent-r0", Heartbeat("agent-r0"), 5.01)
    assert core.on_tick(5.05) == [] and "r0" in core.registry
    assert core.on_tick(6.5, agents_read_until=5.9) == []  # read up to 0.89 s after its heartbeat
    (reject,) = replies(core.on_tick(6.5, agents_read_until=6.1), Reject)  # 1.09 s: silent
    assert reject.reason is RejectReason.RANK_LOST and "r0" not in core.registry


# ---------------------------------------------------------------------- cache-aware routing
def text_submit(core: DispatcherCore, request_id: str, text: str, now: float = 0.0, **fields) -> list:
    message = Submit(request_id, Prompt(text=text), SamplingParams(max_new_tokens=4),
                     protocol=PROTOCOL_VERSION, **fields)
    return core.on_client(CLIENT, message, now)


@pytest.mark.parametrize("policy", ["cache_aware", "pab_cache_aware"])
def test_a_shared_prefix_goes_to_the_rank_that_holds_it_and_is_debited_less(policy):
    core = make_core(policy=policy)
    join(core, "r0", pab=100_000)
    join(core, "r1", pab=100_000)
    shared = "You are a helpful assistant. " * 100  # 2,900 characters, 725 tokens
    (first,) = dispatches(text_submit(core, "first", shared + "What is 2+2?"))
    debit = 100_000 - core.ledger.effective_budget(first.rank)
    other = "r1" if first.rank == "r0" else "r0"
    (busy,) = dispatches(text_submit(core, "unrelated", "x" * 3_000))
    assert busy.rank == other  # least loaded
    (second,) = dispatches(text_submit(core, "second", shared + "And 3+3?"))
    assert second.rank == first.rank
    second_debit = 100_000 - debit - core.ledger.effective_budget(first.rank)
    assert second_debit < debit / 10  # only the uncached rest
    assert core.counters["prompt_tokens_believed_cached"] > 600


def test_chat_conversations_sharing_their_first_turns_share_a_rank():
    core = make_core(policy="pab_cache_aware")
    join(core, "r0", pab=100_000)
    join(core, "r1", pab=100_000)
    system = ChatMessage(role="system", content="Answer as a pirate. " * 200)
    ranks = set()
    for request_id, question in (("a", "hi"), ("b", "hello there"), ("c", "ahoy")):
        message = Submit(request_id, Prompt(messages=[system, ChatMessage(role="user", content=question)]),
                         SamplingParams(max_new_tokens=4), protocol=PROTOCOL_VERSION)
        (dispatch,) = dispatches(core.on_client(CLIENT, message, 0.0))
        ranks.add(dispatch.rank)
    assert len(ranks) == 1


def two_ranks_after_a_shared_prefix(policy: str):
    """A core with two ranks of 100,000 tokens of budget, after one request of a 1,000-token
    prefix plus 100 of its own: (core, the prefix, that dispatch, its rank, the other rank)."""
    core = make_core(policy=policy)
    join(core, "r0", pab=100_000)
    join(core, "r1", pab=100_000)
    shared = "s" * 4_000  # 1,000 tokens
    (first,) = dispatches(text_submit(core, "first", shared + "q" * 400))
    return core, shared, first, first.rank, "r1" if first.rank == "r0" else "r0"


def test_pab_cache_aware_does_not_move_a_held_prompt_its_holder_cannot_cover():
    core, shared, first, holder, other = two_ranks_after_a_shared_prefix("pab_cache_aware")
    report(core, holder, 50, seq=2, echo=first.dispatch_seq)  # less than the uncached 100 tokens
    (declined,) = replies(text_submit(core, "second", shared + "r" * 400), Reject)
    assert declined.reason is RejectReason.NO_BUDGET  # the other rank holds none of it
    (unheld,) = dispatches(text_submit(core, "unheld", "u" * 400))
    assert unheld.rank == other
    (reject,) = replies(text_submit(core, "third", "t" * 400_000), Reject)  # nobody's budget covers it
    assert reject.reason is RejectReason.NO_BUDGET and "less what it holds" in reject.detail


def test_pab_least_loaded_admits_and_debits_the_part_of_a_shared_prefix_a_rank_lacks():
    """pab_least_loaded judges and debits a prompt less what the rank holds of it, and still
    chooses by load among the ranks that can take it, so requests sharing a prefix do not all
    go to the rank that holds it."""
    core, shared, first, holder, other = two_ranks_after_a_shared_prefix("pab_least_loaded")
    assert 100_000 - core.ledger.effective_budget(holder) == 1_100  # nothing cached yet: all of it
    (second,) = dispatches(text_submit(core, "second", shared + "r" * 400))
    assert second.rank == other  # both can take it: the less loaded, not the holder
    report(core, holder, 500, seq=2, echo=first.dispatch_seq)  # covers the uncached rest, not 1,100
    report(core, other, 50, seq=2, echo=second.dispatch_seq)
    (third,) = dispatches(text_submit(core, "third", shared + "t" * 400))
    assert third.rank == holder
    assert 500 - core.ledger.effective_budget(holder) < 200  # debited the uncached rest only
    assert core.counters["prompt_tokens_believed_cached"] > 900
    (reject,) = replies(text_submit(core, "fourth", "u" * 4_400), Reject)  # held nowhere
    assert reject.reason is RejectReason.NO_BUDGET and "less what it holds" in reject.detail


def test_a_restarted_rank_is_no_longer_believed_to_hold_its_prefixes():
    core = make_core(policy="cache_aware")
    join(core, "r0", pab=100_000)
    shared = "p" * 4_000
    dispatches(text_submit(core, "first", shared))
    assert core.balancer.affinity.held_blocks("r0") > 0
    join(core, "r0", epoch=2, pab=100_000)
    assert core.balancer.affinity.held_blocks("r0") == 0


def test_a_saturated_daemon_refuses_new_submits_with_retry_after_and_serves_the_rest():
    core = make_core()
    join(core, "r0")
    (dispatch,) = dispatches(submit(core, "before"))
    core.saturated = True
    (reject,) = replies(submit(core, "during"), Reject)
    assert reject.reason is RejectReason.OVERLOADED and reject.retryable
    assert reject.retry_after_s == core.config.retry_after_s and "saturated" in reject.detail
    sends = core.on_agent(b"agent-r0", Done("r0", 1, "before", FinishReason.LENGTH,
                                            dispatch_seq=dispatch.dispatch_seq), 0.1)
    assert replies(sends, Finish)  # what it holds still finishes
    core.saturated = False
    assert dispatches(submit(core, "after"))


def test_a_retry_after_a_queue_timeout_keeps_its_first_arrival():
    core = make_core(on_no_budget="queue", queue_ttl_s=5.0, stale_after_s=100.0, lost_after_s=100.0)
    join(core, "r0", pab=100)
    interactive = SloSpec(ttft_ms=500, tpot_ms=50)
    assert submit(core, "a", tokens=1_000, slo=interactive) == []
    (reject,) = replies(core.on_tick(0.6), Reject)
    assert reject.reason is RejectReason.QUEUE_TIMEOUT
    (again,) = replies(submit(core, "a", tokens=1_000, now=0.9, slo=interactive), Reject)
    assert again.reason is RejectReason.QUEUE_TIMEOUT and core.queued == 0  # not another 0.5 s
    report(core, "r0", 5_000, seq=2, now=1.0)
    assert dispatches(submit(core, "a", tokens=1_000, now=1.2, slo=interactive))  # a budget: it goes
    assert submit(core, "b", tokens=9_000, now=1.3, slo=interactive) == []
    assert replies(core.on_tick(1.9), Reject)
    assert submit(core, "b", tokens=9_000, now=7.0, slo=interactive) == []  # long after: a new request


def test_the_memory_of_timed_out_arrivals_is_bounded():
    core = make_core(on_no_budget="queue", max_queued=3, queue_ttl_s=0.1, stale_after_s=100.0,
                     lost_after_s=100.0)
    join(core, "r0", pab=10)
    for index in range(10):
        assert submit(core, f"r{index}", tokens=100, now=index * 0.2) == []
        assert replies(core.on_tick(index * 0.2 + 0.15), Reject)
    assert list(core._timed_out) == ["r7", "r8", "r9"]


def test_a_step_of_outputs_answers_each_item_as_if_it_came_alone():
    """The streamed outputs of a RankOutputs take the fast path; the unstreamed one, the
    late one (an old epoch) and the Done take the general one, in the message's order."""
    def step(core: DispatcherCore, batched: bool) -> list:
        join(core, "r0")
        submit(core, "s", stream=True)
        submit(core, "u", stream=False)
        items = [Output("r0", 1, "s", [5], "a", 1), Output("r0", 1, "u", [6], "b", 1),
                 Output("r0", 0, "s", [7], "x", 2), Output("r0", 1, "s", [8], "c", 2),
                 Done("r0", 1, "u", FinishReason.LENGTH, 100, 2, ttft_s=0.05, latency_s=0.2)]
        if batched:
            return core.on_agent(b"agent-r0", RankOutputs(items), 0.1)
        return [send for item in items for send in core.on_agent(b"agent-r0", item, 0.1)]

    alone, batched = make_core(), make_core()
    expected = step(alone, batched=False)
    assert step(batched, batched=True) == expected
    assert [type(s.message) for s in expected] == [Chunk, Fenced, Chunk, Finish]
    assert [s.message.text for s in expected if isinstance(s.message, Chunk)] == ["a", "c"]
    assert expected[-1].message.text == "b"  # the unstreamed request's output, in its Finish
    assert batched.counters == alone.counters
