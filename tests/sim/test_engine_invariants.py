"""SimEngine invariants, for every registered policy, with and without memory pressure.

The engine is stepped by hand (the same loop as ``advance_to``) so that every step can
be checked against the state just before it: clock, KV accounting, which requests
emitted a token and why, and the record counters.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
from sim_helpers import ALL_POLICIES, Req, llama, make_policy, small_kv_profile, synthetic_requests

from sglang_ext.policy.policies import POLICIES
from sglang_ext.sim.engine import SimEngine, SimRequest
from sglang_ext.sim.metrics import summarize

TINY_KV = 4000
# what a policy may read of a request (the RequestState protocol), and nothing more
STATE_FIELDS = {
    "req_id", "arrival", "slo", "next_output_index", "pending_prefill", "context",
    "prompt_tokens", "arrival_seq", "first_token_time",
    "task", "output_estimate",  # learnt from finished requests, never this one's length
}
MAX_STEPS = 200_000


class CheckedRun:
    """Drives one engine step by step and checks every step; collects token events."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.events: dict = defaultdict(list)  # req_id -> [(index, time)]
        self.retractions: dict = defaultdict(list)  # req_id -> [(next_output_index, pending)]
        self.decisions = 0
        self._wrap_policy()
        self._spy_retractions()

    # -- instrumentation -------------------------------------------------------------
    def _wrap_policy(self) -> None:
        policy = self.engine.policy
        inner = policy.form_batch

        def form_batch(requests, now):
            assert now == self.engine.now
            decision = inner(requests, now)
            live = {r.req_id: r for r in requests}
            for req_id in decision.decode_ids:
                assert live[req_id].pending_prefill == 0, f"decode of prefilling {live[req_id]!r}"
            for req_id, tokens in decision.prefill_chunks:
                assert 1 <= tokens <= live[req_id].pending_prefill, (req_id, tokens)
            self.decisions += 1
            return decision

        policy.form_batch = form_batch

    def _spy_retractions(self) -> None:
        engine = self.engine
        inner = engine._retract

        def retract(request: SimRequest) -> None:
            self.retractions[request.req_id].append(
                (request.next_output_index, request.pending_prefill)
            )
            inner(request)

        engine._retract = retract

    # -- driving ---------------------------------------------------------------------
    def step(self) -> None:
        engine = self.engine
        before = {
            r.req_id: (r.next_output_index, r.pending_prefill, r.context)
            for r in engine.active_requests
        }
        counters = {req_id: _counters(engine.records[req_id]) for req_id in before}
        retracted_before = {req_id: len(self.retractions[req_id]) for req_id in before}
        start = engine.now
        engine.step()
        assert engine.now > start, "the clock must move on every step"
        assert 0 <= engine.kv_used <= engine.kv_capacity
        assert engine.kv_used == sum(r.context for r in engine.active_requests)

        emitted = {}
        for event in engine.drain_tokens():
            assert event.req_id in before, "a token of a request that was not running"
            assert event.req_id not in emitted, "two tokens of one request in one step"
            assert event.time_s == engine.now, "tokens are emitted when their step ends"
            emitted[event.req_id] = event
            self.events[event.req_id].append((event.index, event.time_s))

        after = {r.req_id: r for r in engine.active_requests}
        for req_id, (next_index, pending, context) in before.items():
            record = engine.records[req_id]
            old_emitted, old_completions, old_decodes = counters[req_id]
            decoded = record.decode_steps - old_decodes
            completed = record.prefill_completions - old_completions
            assert decoded in (0, 1) and completed in (0, 1)
            assert record.tokens_emitted - old_emitted == decoded + completed
            assert (req_id in emitted) == (decoded + completed == 1)
            if decoded:
                # no decode before the prefill (or its recompute) has ended
                assert pending == 0, f"{req_id} decoded with {pending} prompt tokens pending"
            if completed:
                assert pending > 0
            if req_id in emitted:
                assert emitted[req_id].index == next_index
                assert emitted[req_id].finished == (req_id not in after)
                if req_id in after:
                    assert after[req_id].pending_prefill == 0
                    assert after[req_id].next_output_index == next_index + 1
                    if decoded:
                        assert after[req_id].context == context + 1
            elif req_id in after:
                current = after[req_id]
                assert current.next_output_index == next_index
                if len(self.retractions[req_id]) == retracted_before[req_id]:
                    # not retracted: a prefill chunk moves tokens from pending into the KV
                    moved = current.context - context
                    assert moved == pending - current.pending_prefill >= 0

    def submit(self, req: Req) -> bool:
        return self.engine.submit(req.req_id, req.arrival, req.prompt, req.output, req.slo)

    def run(self, requests: list[Req]) -> None:
        engine = self.engine
        steps = 0
        for req in sorted(requests, key=lambda r: r.arrival):
            while engine.has_work and engine.now < req.arrival:
                self.step()
                steps += 1
                assert steps < MAX_STEPS
            engine.advance_to(req.arrival)  # idle: jumps exactly to the arrival
            assert engine.now >= req.arrival
            self.submit(req)
        while engine.has_work:
            self.step()
            steps += 1
            assert steps < MAX_STEPS, "the engine does not drain"


def _counters(record):
    return record.tokens_emitted, record.prefill_completions, record.decode_steps


def _run(policy_name: str, profile, requests: list[Req]) -> CheckedRun:
    engine = SimEngine(
        profile, make_policy(policy_name, profile), seed=0, record_tokens=True,
        check_invariants=True,
    )
    checked = CheckedRun(engine)
    checked.run(requests)
    return checked


def _check_records(checked: CheckedRun, requests: list[Req]) -> None:
    engine = checked.engine
    assert not engine.has_work and engine.kv_used == 0
    for req in requests:
        record = engine.records[req.req_id]
        if record.rejected:
            assert record.tokens_emitted == 0 and req.req_id not in checked.events
            continue
        assert not record.aborted
        assert record.finished, f"request {req.req_id} did not finish"
        events = checked.events[req.req_id]
        # exactly its output length, indices 0..n-1 with no gap, strictly increasing times
        assert [index for index, _ in events] == list(range(req.output))
        times = [t for _, t in events]
        assert all(a < b for a, b in itertools.pairwise(times))
        assert times[0] >= req.arrival
        assert record.first_token_s == times[0] and record.finish_s == times[-1]
        assert record.tokens_emitted == req.output
        # token accounting
        assert record.prefill_tokens_computed == req.prompt + record.recomputed_tokens
        assert record.tokens_emitted == record.prefill_completions + record.decode_steps
        retractions = checked.retractions.get(req.req_id, [])
        assert record.preemptions == len(retractions)
        after_first_token = sum(1 for index, _ in retractions if index > 0)
        assert record.prefill_completions == 1 + after_first_token
        assert record.recomputed_tokens == sum(
            req.prompt + index - pending for index, pending in retractions
        )
        assert (record.recomputed_tokens > 0) == (record.preemptions > 0)


def test_every_registered_policy_is_covered():
    assert set(ALL_POLICIES) <= set(POLICIES.names())


@pytest.mark.parametrize("policy_name", ALL_POLICIES)
def test_invariants_under_load(policy_name):
    requests = synthetic_requests(150, rate=16.0, seed=1)
    checked = _run(policy_name, llama(), requests)
    _check_records(checked, requests)
    records = checked.engine.records.values()
    assert sum(r.preemptions for r in records) == 0  # 400k tokens of KV: no pressure
    if policy_name != "fb-pab":
        assert not any(r.rejected for r in records)
    # the load is real: requests overlap and steps batch several of them
    assert checked.engine.busy_s / checked.engine.now > 0.5
    assert summarize(records, 16.0, checked.engine.now)["unfinished"] == 0


@pytest.mark.parametrize("policy_name", ALL_POLICIES)
@pytest.mark.slow
def test_invariants_under_memory_pressure(policy_name):
    """Long outputs outgrow the share of them the prefill admission reserves."""
    profile = small_kv_profile(TINY_KV)
    requests = synthetic_requests(60, rate=16.0, seed=2, prompt=(10, 1500), output=(100, 1500))
    assert max(r.prompt + r.output for r in requests) <= TINY_KV  # none too long to admit
    checked = _run(policy_name, profile, requests)
    _check_records(checked, requests)
    engine = checked.engine
    preempted = [r for r in engine.records.values() if r.preemptions]
    assert preempted, "a 4000-token KV pool must force preemptions"
    assert any(r.prefill_completions > 1 for r in preempted), "no decode was ever recomputed"
    assert engine.idle_ticks == 0


def test_policy_never_sees_the_output_length():
    """A request with a distinctive output length: no field of what the policy reads
    ever equals it, and the objects have no room for anything else.

    With a one-token prompt, the context the policy can see peaks at ``output - 1``
    (prompt + tokens already decoded), so only a leaked length could equal ``output``."""
    output = 5003
    profile = llama()
    policy = make_policy("fb", profile)
    engine = SimEngine(profile, policy, check_invariants=True)
    seen = {"calls": 0}
    inner_form, inner_admit = policy.form_batch, policy.admit

    def inspect(requests):
        for request in requests:
            assert type(request) is SimRequest and not hasattr(request, "__dict__")
            assert set(SimRequest.__slots__) == STATE_FIELDS
            for slot in SimRequest.__slots__:
                assert getattr(request, slot) != output, slot

    def form_batch(requests, now):
        inspect(requests)
        seen["calls"] += 1
        return inner_form(requests, now)

    def admit(requests, now, prompt_tokens, slo, arrival=None):
        inspect(requests)
        assert prompt_tokens != output
        return inner_admit(requests, now, prompt_tokens, slo, arrival)

    policy.form_batch, policy.admit = form_batch, admit
    engine.submit("long", 0.0, 1, output, policy.context.global_slo)
    engine.submit("short", 0.0, 300, 20, policy.context.global_slo)
    engine.run_until_idle(1e6)
    assert engine.records["long"].tokens_emitted == output
    assert seen["calls"] >= output  # one step per token at least
