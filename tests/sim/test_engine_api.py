"""The steppable SimEngine API: submit / advance_to / drain_tokens / prefill_admission_budget,
rejections, policy-decision validation and the memory-blocked fallback."""

from __future__ import annotations

import itertools

import pytest
from sim_helpers import SLO, llama, make_policy, small_kv_profile, synthetic_requests

from sglang_ext.policy.policies import BatchPolicy
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.view import BatchDecision
from sglang_ext.sim.engine import IDLE_TICK_S, SimEngine
from sglang_ext.sim.metrics import summarize


def engine(policy_name: str = "fb", profile=None, **kwargs) -> SimEngine:
    profile = profile or llama()
    return SimEngine(profile, make_policy(policy_name, profile), **kwargs)


# ------------------------------------------------------------------ advance_to
def test_advance_to_jumps_exactly_when_idle():
    eng = engine()
    eng.advance_to(3.25)
    assert eng.now == 3.25 and eng.steps == 0 and not eng.has_work
    eng.advance_to(1.0)  # the past: nothing happens
    assert eng.now == 3.25


def test_advance_to_finishes_the_step_in_flight():
    eng = engine(record_steps=True)
    assert eng.submit("a", 0.0, 2000, 50, SLO)
    eng.advance_to(1e-6)
    # the prefill step started at 0 and ran to completion past the target
    assert eng.steps == 1 and eng.now > 1e-6
    first = eng.step_log[0]
    assert first.start_s == 0.0 and eng.now == pytest.approx(first.duration_s)
    assert first.prefill_tokens == 2000 and first.decodes == 0
    target = eng.now + 0.05
    eng.advance_to(target)
    assert eng.now >= target
    # every step that *started* before the target ran, and no other
    assert all(s.start_s < target for s in eng.step_log)
    assert eng.step_log[-1].start_s + eng.step_log[-1].duration_s == pytest.approx(eng.now)


def test_advance_to_stops_exactly_at_target_once_work_runs_out():
    eng = engine(record_tokens=True)
    eng.submit("a", 0.0, 100, 3, SLO)
    eng.advance_to(5.0)
    assert not eng.has_work and eng.now == 5.0
    assert eng.records["a"].finished and eng.records["a"].finish_s < 5.0


def test_submit_with_a_future_arrival_advances_the_clock_first():
    eng = engine(record_tokens=True)
    eng.submit("early", 0.0, 500, 200, SLO)
    assert eng.submit("late", 0.4, 300, 5, SLO)
    assert eng.now >= 0.4  # the work before 0.4 ran first
    eng.run_until_idle(60.0)
    late = eng.records["late"]
    assert late.first_token_s > 0.4 and late.ttft_s > 0


def test_steps_are_contiguous_in_time():
    eng = engine(record_steps=True)
    for i, req in enumerate(synthetic_requests(20, 20.0, seed=5)):
        eng.advance_to(req.arrival)
        eng.submit(i, req.arrival, req.prompt, req.output, SLO)
    eng.run_until_idle(1e6)
    log = eng.step_log
    assert len(log) == eng.steps > 20
    for prev, cur in itertools.pairwise(log):
        assert cur.start_s >= prev.start_s + prev.duration_s - 1e-12
        assert cur.duration_s > 0
    assert eng.busy_s == pytest.approx(sum(s.duration_s for s in log))


def test_run_until_idle_respects_the_deadline_and_unfinished_is_violated():
    eng = engine()
    eng.submit("a", 0.0, 500, 10_000, SLO)
    eng.run_until_idle(0.5)
    assert eng.has_work and 0.5 <= eng.now < 0.6
    record = eng.records["a"]
    assert not record.finished and not record.slo_met
    summary = summarize(eng.records.values(), 1.0, eng.now)
    assert summary["unfinished"] == 1 and summary["attainment"] == 0.0


# ------------------------------------------------------------------ drain_tokens
def test_drain_tokens_returns_each_event_once():
    eng = engine(record_tokens=True)
    eng.submit("a", 0.0, 100, 4, SLO)
    eng.step()  # prefill: emits token 0
    first = eng.drain_tokens()
    assert [(e.req_id, e.index, e.finished) for e in first] == [("a", 0, False)]
    assert first[0].time_s == eng.now
    assert eng.drain_tokens() == []
    eng.run_until_idle(10.0)
    rest = eng.drain_tokens()
    assert [e.index for e in rest] == [1, 2, 3]
    assert [e.finished for e in rest] == [False, False, True]
    assert rest[-1].time_s == eng.records["a"].finish_s


def test_no_token_events_without_record_tokens():
    eng = engine()
    eng.submit("a", 0.0, 100, 4, SLO)
    eng.run_until_idle(10.0)
    assert eng.records["a"].finished and eng.drain_tokens() == []


# ------------------------------------------------------------------ submit
def test_duplicate_request_id_raises():
    eng = engine()
    eng.submit("a", 0.0, 100, 4, SLO)
    with pytest.raises(ValueError, match="already submitted"):
        eng.submit("a", 0.1, 100, 4, SLO)


def test_duplicate_of_a_rejected_id_raises_too():
    profile = small_kv_profile(1000)
    eng = engine(profile=profile)
    assert not eng.submit("a", 0.0, 2000, 4, SLO)
    with pytest.raises(ValueError):
        eng.submit("a", 0.0, 10, 4, SLO)


@pytest.mark.parametrize("prompt, output", [(0, 5), (5, 0), (-1, 5)])
def test_empty_prompt_or_output_raises(prompt, output):
    with pytest.raises(ValueError, match=">= 1"):
        engine().submit("a", 0.0, prompt, output, SLO)


def test_request_larger_than_kv_is_rejected_and_recorded():
    profile = small_kv_profile(1000)
    eng = engine(profile=profile)
    assert not eng.submit("big", 0.0, 1001, 1, SLO)  # the prompt alone does not fit
    assert not eng.submit("grows", 0.0, 900, 200, SLO)  # prompt + output does not fit
    assert eng.submit("fits", 0.0, 900, 100, SLO)
    assert [r.req_id for r in eng.active_requests] == ["fits"]
    eng.run_until_idle(60.0)
    records = eng.records
    assert records["big"].rejected and records["grows"].rejected
    assert records["big"].tokens_emitted == 0 and not records["big"].slo_met
    assert records["fits"].finished and records["fits"].slo_met
    summary = summarize(records.values(), 1.0, eng.now)
    assert summary["rejected"] == 2 and summary["attainment"] == pytest.approx(1 / 3)


# ------------------------------------------------------------------ PAB
def _idle_pab(eng: SimEngine) -> float:
    coefficients = eng.policy.step_model.coefficients
    a, b, c = coefficients.a_s, coefficients.b_s_per_token, coefficients.c_s_per_context_token
    return (eng.policy.context.global_slo.ttft_s - a) / (b + c)


def test_pab_falls_by_each_queued_prompt_and_recovers():
    eng = engine("fb")
    idle = eng.prefill_admission_budget()
    assert idle == pytest.approx(_idle_pab(eng))
    budgets = [idle]
    for i, prompt in enumerate((12_000, 8_000, 5_000)):
        assert eng.submit(i, 0.0, prompt, 20, SLO)
        budgets.append(eng.prefill_admission_budget())
        # fresh arrivals cost nothing inside the TTFT window but their own prompt
        assert budgets[-2] - budgets[-1] == pytest.approx(prompt)
    assert eng.prefill_admission_budget() == pytest.approx(
        eng.policy.prefill_admission_budget(eng.active_requests, eng.now)
    )
    # as the prefills run, the budget comes back (time passing alone would lower it)
    eng.step()
    assert eng.prefill_admission_budget() > budgets[-1]
    eng.run_until_idle(60.0)
    assert not eng.has_work
    recovered = eng.prefill_admission_budget()
    assert recovered == pytest.approx(_idle_pab(eng))  # the online model has moved on
    assert recovered - budgets[-1] > 0.75 * (12_000 + 8_000 + 5_000)  # most of it comes back


def test_fb_pab_rejects_a_prompt_over_the_budget():
    eng = engine("fb-pab")
    assert eng.submit("first", 0.0, 30_000, 10, SLO)
    pab = eng.prefill_admission_budget()
    assert 1_000 < pab < 100_000
    assert not eng.submit("over", 0.0, int(pab) + 1, 10, SLO)
    assert eng.records["over"].rejected
    assert eng.submit("under", 0.0, int(pab), 10, SLO)
    assert not eng.records["under"].rejected
    # the queue is now at the budget: anything more is turned away
    assert eng.prefill_admission_budget() < 1
    assert not eng.submit("more", 0.0, 1, 10, SLO)
    eng.run_until_idle(60.0)
    summary = summarize(eng.records.values(), 1.0, eng.now)
    assert summary["rejected"] == 2
    assert not eng.records["over"].slo_met
    assert summary["attainment"] <= 0.5


def test_fb_does_not_reject_what_fb_pab_rejects():
    eng = engine("fb")
    eng.submit("first", 0.0, 30_000, 10, SLO)
    pab = eng.prefill_admission_budget()
    assert eng.submit("over", 0.0, int(pab) + 1, 10, SLO)


# ------------------------------------------------------------------ validation
class Scripted(BatchPolicy):
    """Returns whatever decision the test hands it."""

    name = "scripted-stub"

    def __init__(self, context, decide):
        super().__init__(context)
        self.decide = decide

    def form_batch(self, requests, now):
        return self.decide({r.req_id: r for r in requests})


def _scripted(decide) -> SimEngine:
    profile = llama()
    policy = Scripted(make_policy("fb", profile).context, decide)
    return SimEngine(profile, policy)


@pytest.mark.parametrize(
    "decision",
    [
        BatchDecision(("p",), ()),  # decode of a request still prefilling
        BatchDecision((), (("p", 501),)),  # chunk larger than what is pending
        BatchDecision((), (("p", 0),)),  # empty chunk
        BatchDecision((), (("ghost", 10),)),  # unknown request
        BatchDecision(("ghost",), ()),
        BatchDecision((), (("p", 10), ("p", 10))),  # the same request twice
    ],
    ids=["decode-prefilling", "chunk-too-big", "chunk-zero", "unknown-chunk", "unknown-decode",
         "twice"],
)
def test_invalid_decision_raises_naming_the_policy(decision):
    eng = _scripted(lambda live: decision)
    eng.submit("p", 0.0, 500, 10, SLO)
    with pytest.raises(RuntimeError, match="scripted-stub"):
        eng.step()


def test_decode_and_chunk_of_one_request_raises():
    def decide(live):
        return BatchDecision(("d",), (("d", 1),))

    eng = _scripted(lambda live: BatchDecision((), (("d", 100),)))
    eng.submit("d", 0.0, 100, 10, SLO)
    eng.step()  # prefill completes; "d" now decodes
    eng.policy.decide = decide
    with pytest.raises(RuntimeError, match="scripted-stub"):
        eng.step()


def test_empty_decision_with_only_prefills_idles_one_tick():
    eng = _scripted(lambda live: BatchDecision.make_empty())
    eng.submit("p", 0.0, 100, 10, SLO)
    eng.step()
    assert eng.now == IDLE_TICK_S and eng.idle_ticks == 1 and eng.steps == 0


def test_empty_decision_with_decodes_runs_every_decode():
    def prefill_all(live):
        return BatchDecision((), tuple((k, r.pending_prefill) for k, r in live.items()))

    eng = _scripted(prefill_all)
    eng.submit("a", 0.0, 100, 10, SLO)
    eng.submit("b", 0.0, 100, 10, SLO)
    eng.step()
    eng.policy.decide = lambda live: BatchDecision.make_empty()
    eng.step()
    assert eng.records["a"].decode_steps == 1 and eng.records["b"].decode_steps == 1
    assert eng.idle_ticks == 0


# ------------------------------------------------------------------ memory
def test_blocked_prefill_yields_the_step_to_decodes():
    """sglang-default wants a prefill-only step, but the prompt does not fit beside the
    decoding request: the step runs the decode instead of idling."""
    profile = small_kv_profile(4000)
    eng = engine("sglang-default", profile=profile, record_steps=True, check_invariants=True)
    eng.submit("a", 0.0, 2000, 300, SLO)
    eng.step()  # a's prefill
    eng.submit("b", eng.now, 2500, 50, SLO)  # 2000 + 2500 > 4000
    decision = eng.policy.form_batch(eng.active_requests, eng.now)
    assert decision.decode_ids == () and decision.prefill_chunks == (("b", 2500),)
    eng.step()
    last = eng.step_log[-1]
    assert (last.decodes, last.prefill_tokens) == (1, 0)
    eng.run_until_idle(60.0)
    a, b = eng.records["a"], eng.records["b"]
    assert a.finished and b.finished and eng.idle_ticks == 0
    assert a.decode_steps == 299 and a.preemptions == 0
    # b never fits beside a: it starts once a has released its KV
    assert b.first_token_s > a.finish_s


@pytest.mark.parametrize("kv", [3500, 5000])
def test_sglang_default_completes_under_memory_pressure(kv):
    """Long outputs outgrow the share of them the prefill admission reserves: decodes
    find the pool full, retract, and every request still finishes."""
    profile = small_kv_profile(kv)
    eng = engine("sglang-default", profile=profile, check_invariants=True)
    requests = synthetic_requests(40, 20.0, seed=11, prompt=(10, 1000), output=(200, 1200))
    for req in requests:
        eng.advance_to(req.arrival)
        eng.submit(req.req_id, req.arrival, req.prompt, req.output, SLO)
    # a bounded drain: an engine spinning on idle ticks fails here instead of hanging
    eng.run_until_idle(requests[-1].arrival + 300.0)
    assert not eng.has_work
    records = list(eng.records.values())
    assert all(r.finished for r in records if not r.rejected)
    assert sum(r.preemptions for r in records) > 0
    assert eng.idle_ticks == 0


def test_prompts_that_fit_together_are_prefilled_together():
    """Two 3000-token prompts fit a 7000-token pool together; a third does not."""
    profile = small_kv_profile(7000)
    eng = engine("vllm-default", profile=profile, record_steps=True, check_invariants=True)
    for name, prompt in (("a", 3000), ("b", 3000), ("c", 1001)):
        eng.submit(name, 0.0, prompt, 5, SLO)
    eng.step()
    assert eng.step_log[0].prefill_tokens == 6000
    assert eng.records["a"].tokens_emitted == eng.records["b"].tokens_emitted == 1
    assert eng.records["c"].tokens_emitted == 0
    assert eng.kv_used == 6000


def test_retraction_recomputes_prompt_and_emitted_tokens():
    """Two decoders outgrow a small pool (the prefill admission reserves only a share
    of the running request's outputs): the one with fewer outputs is retracted and later
    recomputed from prompt + emitted tokens."""
    profile = small_kv_profile(2100)
    eng = engine("sarathi", profile=profile, record_tokens=True, check_invariants=True)
    eng.submit("old", 0.0, 1000, 400, SLO)
    while eng.records["old"].tokens_emitted < 10:
        eng.step()
    eng.submit("new", eng.now, 500, 300, SLO)  # 1010 + 800 + 0.7 x 390 fit in 2100
    eng.run_until_idle(60.0)
    old, new = eng.records["old"], eng.records["new"]
    assert old.finished and new.finished
    assert new.preemptions >= 1 and old.preemptions == 0  # fewest outputs goes first
    assert new.recomputed_tokens > 0
    assert new.prefill_tokens_computed == 500 + new.recomputed_tokens
    assert new.prefill_completions == 1 + new.preemptions
    tokens = [e.index for e in eng.drain_tokens() if e.req_id == "new"]
    assert tokens == list(range(300))


def test_blocked_prompt_does_not_starve_a_started_prefill():
    """A new prompt that cannot fit beside a half-done prefill, and a policy (fb) that
    spends each step's whole time budget on the new prompt (in time, while the started
    one is already late): with nothing to decode, the engine continues the started
    prefill instead of idling forever."""
    profile = small_kv_profile(4000)
    eng = engine("fb", profile=profile, record_steps=True, check_invariants=True)
    eng.submit("started", -1.95, 3000, 10, SLO)  # 50 ms of slack: only a chunk fits
    eng.step()
    started = eng.active_requests[0]
    assert 0 < started.pending_prefill < 3000 and started.context > 0
    assert started.arrival + SLO.ttft_s < eng.now  # late: served after in-time prompts
    # in time, 30 ms of slack: a 50 ms budget that its chunk fills
    eng.submit("newcomer", eng.now, 3000, 10, Slo(0.03, SLO.tpot_s))
    decision = eng.policy.form_batch(eng.active_requests, eng.now)
    assert [req_id for req_id, _ in decision.prefill_chunks] == ["newcomer"]  # blocked by memory
    remaining = started.pending_prefill
    eng.step()
    assert eng.idle_ticks == 0
    # the step continued "started" (within the tokens fb asked for) and left "newcomer" queued
    assert eng.step_log[-1].prefill_tokens == remaining <= decision.prefill_chunks[0][1]
    assert started.pending_prefill == 0 and eng.records["started"].tokens_emitted == 1
    assert eng.records["newcomer"].prefill_tokens_computed == 0
    eng.run_until_idle(eng.now + 10.0)
    first, newcomer = eng.records["started"], eng.records["newcomer"]
    assert first.finished and newcomer.finished and eng.idle_ticks == 0
    assert first.first_token_s < newcomer.first_token_s


@pytest.mark.parametrize("policy_name, kv, seed", [("fb-fb", 3500, 1), ("fb-pab", 5000, 13)])
@pytest.mark.slow
def test_memory_pressure_runs_drain_without_idling(policy_name, kv, seed):
    """Runs found by a random search: they drain instead of idling until the drain deadline
    with a blocked prompt queued behind a started prefill and nothing to decode."""
    requests = synthetic_requests(60, rate=16.0, seed=seed)
    eng = engine(policy_name, profile=small_kv_profile(kv), check_invariants=True)
    for req in requests:
        eng.advance_to(req.arrival)
        eng.submit(req.req_id, req.arrival, req.prompt, req.output, SLO)
    eng.run_until_idle(requests[-1].arrival + 60.0)
    assert not eng.has_work and eng.idle_ticks == 0
    assert all(r.finished for r in eng.records.values() if not r.rejected)
