"""The policies beyond the paper (``sglang_ext.policy.variants``): fb-anchor, fb-margin,
fb-kairos and fb-anchor-margin, each checked against plain ``fb`` on hand-built states."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from policy_helpers import A, B, C, COEF, NOW, SLO, measured_step, request
from sglang_ext.policy.batch_former import smooth_step, triage
from sglang_ext.policy.policies import POLICIES, BatchPolicy, FairBatching, PolicyContext
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_model import StepCoefficients
from sglang_ext.policy.variants import (
    DEADLINE_GUARD_STEPS,
    MAX_GUARD_SHARE,
    MARGIN_WARMUP_STEPS,
    MAX_MARGIN,
    THROUGHPUT_EWMA,
    FairBatchingKairosPrefills,
    FairBatchingVariant,
    Step,
    kairos_order,
)
from sglang_ext.policy.view import BatchDecision, RequestView

VARIANTS = ("fb-anchor", "fb-margin", "fb-kairos", "fb-anchor-margin", "fb-smooth", "fb-steady")
CONTEXT = PolicyContext(global_slo=SLO, initial_step_model=COEF)


def make(name: str, context: PolicyContext = CONTEXT) -> BatchPolicy:
    return POLICIES.get(name)(context)


def decoded(req_id, slack: float, first_token_after: float | None, **kwargs) -> RequestView:
    """A decode with envelope slack ``slack`` whose first token came ``first_token_after``
    seconds after arrival (None: not recorded)."""
    view = request(req_id, slack, **kwargs)
    if first_token_after is None:
        return view
    return dataclasses.replace(view, first_token_time=view.arrival + first_token_after)


def feed(policies: list[BatchPolicy], steps: int, ratio: float) -> None:
    """Observe ``steps`` steps on every policy, each measured at ``ratio`` x the first
    policy's prediction just before it (so every relative error is 1 - 1/ratio)."""
    for k in range(steps):
        new_tokens, context = 50 + 37 * k, 1_000 + 900 * k
        predicted = policies[0].step_model.coefficients.predict(new_tokens, context)
        for policy in policies:
            policy.observe_step(measured_step(new_tokens, context, new_tokens - 20), ratio * predicted)


# --------------------------------------------------------------------------- registry


def test_all_variants_registered_and_build_from_a_context() -> None:
    names = POLICIES.names()
    for name in VARIANTS:
        assert name in names
        policy = make(name)
        expected = FairBatchingKairosPrefills if name == "fb-kairos" else FairBatchingVariant
        assert isinstance(policy, expected)
        assert name == "fb-kairos" or policy.variant.name == name
        assert isinstance(policy, FairBatching) and policy.name == name
        assert policy.step_model.coefficients == COEF
        assert make(name).form_batch([], NOW) == BatchDecision.make_empty()


# --------------------------------------------------------------------------- fb-anchor


def decode_slacks(groups) -> list[float]:
    return [slack for slack, _ in groups.urgent_decodes + groups.deferrable_decodes]


def test_anchored_slack_counts_from_the_first_token() -> None:
    # j = 10, arrival = 100 + 1.0 - 1.0 - 0.05*10 = 99.5, first token at 99.55:
    # envelope slack 99.5 + 1 + 0.5 - 100 = 1.0; anchored 99.55 + 0.05*10 - 100 = 0.05
    early = decoded("early", 1.0, 0.05, next_output_index=10)
    paper = triage([early], NOW)
    anchored = triage([early], NOW, anchored=True)
    assert decode_slacks(paper) == [pytest.approx(1.0)]
    assert decode_slacks(anchored) == [pytest.approx(0.05)]
    # budget max(min slack, min tpot): 1.0 on the envelope, max(0.05, 0.05) anchored
    assert paper.init_time_budget_s == pytest.approx(1.0)
    assert anchored.init_time_budget_s == pytest.approx(0.05)


def test_anchored_slack_can_exceed_the_envelope_when_the_first_token_was_late() -> None:
    # arrival 99.5, first token at 100.8 (0.3 s past its TTFT):
    # anchored 100.8 + 0.05*10 - 100 = 1.3 vs envelope 1.0
    late = decoded("late", 1.0, 1.3, next_output_index=10)
    assert decode_slacks(triage([late], NOW, anchored=True)) == [pytest.approx(1.3)]


def test_anchored_keeps_the_envelope_for_the_first_token_and_without_a_first_token_time() -> None:
    # j = 0 keeps arrival + ttft even if a first_token_time is (oddly) set
    prefill = dataclasses.replace(request("p", 0.7, prefill=100), first_token_time=NOW - 5.0)
    # j = 5 but no first token time recorded: the envelope, arrival + 1 + 0.25 - now = 0.4
    unknown = decoded("u", 0.4, None)
    groups = triage([prefill, unknown], NOW, anchored=True)
    assert groups.prefills[0][0] == pytest.approx(0.7)
    assert decode_slacks(groups) == [pytest.approx(0.4)]
    assert groups == triage([prefill, unknown], NOW)  # identical to the paper's triage


def test_anchored_recompute_prefill_uses_the_anchor() -> None:
    # a preempted request recomputing (pending prefill, j = 10) after an early first token:
    # 99.5 + 0.05 + 0.5 - 100 = 0.05 (it sits in the prefill group)
    view = dataclasses.replace(decoded("r", 1.0, 0.05, next_output_index=10), pending_prefill=300)
    assert triage([view], NOW, anchored=True).prefills[0][0] == pytest.approx(0.05)
    assert triage([view], NOW).prefills[0][0] == pytest.approx(1.0)


def anchor_state() -> list[RequestView]:
    # D: decode j = 10, arrival 99.5, first token at 99.55 (envelope slack 1.0, anchored 0.05),
    #    context 1550. P: prefill of 8000 tokens arriving at 99.9 (slack 0.9).
    return [
        decoded("D", 1.0, 0.05, next_output_index=10, context=1550),
        request("P", 0.9, prefill=8000),
    ]


def test_fb_anchor_chunks_the_prefill_that_fb_packs_whole() -> None:
    state = anchor_state()
    fb = make("fb").form_batch(state, NOW)
    anchor = make("fb-anchor").form_batch(state, NOW)
    # fb: budget min slack 0.9; D (1.0 >= 0.9 + 0.05) deferrable.
    # time left 0.9 - a = 0.895 >= P's 8000 * 1e-4 = 0.8, so P goes whole; D then costs
    # 1e-4 + 1550e-6 = 0.00165 -> predicted 0.005 + 0.8 + 0.00165 = 0.80665, 16x D's real
    # 0.05 s to its next token.
    assert fb.time_budget_s == pytest.approx(0.9)
    assert fb.prefill_chunks == (("P", 8000),) and fb.decode_ids == ("D",)
    assert fb.predicted_step_s == pytest.approx(0.80665)
    # fb-anchor: budget max(0.05, 0.05) = 0.05, D urgent (0.05 < 0.1).
    # time left 0.05 - 0.005 - 0.00165 = 0.04335 -> floor(433.5) = 433 tokens;
    # predicted 0.005 + 0.00165 + 0.0433 = 0.04995 <= 0.05
    assert anchor.time_budget_s == pytest.approx(0.05)
    assert anchor.decode_ids == ("D",)
    assert anchor.prefill_chunks == (("P", 433),)
    assert anchor.predicted_step_s == pytest.approx(0.04995)
    assert anchor.predicted_step_s <= anchor.time_budget_s
    assert anchor.predicted_step_s < fb.predicted_step_s / 10


def test_fb_anchor_only_urgent_decodes_overflow_its_budget() -> None:
    # 30 early-first-token decodes each anchored at 0.05: urgent cost 30 * (1e-4 + 0.01) = 0.303
    # over the 0.05 budget; the prefill gets nothing (only urgent decodes may overflow)
    state = [decoded(i, 1.0, 0.05, next_output_index=10, context=10_000) for i in range(30)]
    state.append(request("P", 0.9, prefill=8000))
    decision = make("fb-anchor").form_batch(state, NOW)
    assert decision.prefill_chunks == ()
    assert len(decision.decode_ids) == 30
    assert decision.predicted_step_s == pytest.approx(A + 30 * (B + C * 10_000))
    fb = make("fb").form_batch(state, NOW)
    assert fb.prefill_chunks == (("P", 8000),)  # plain fb still packs it whole (budget 0.9)


# --------------------------------------------------------------------------- fb-margin


def test_margin_is_zero_during_warmup_then_the_p95_relative_error() -> None:
    policy = make("fb-margin")
    assert policy.margin == 0.0
    # measured = 1.2 x predicted -> relative error (1.2p - p) / 1.2p = 1/6 every step
    feed([policy], MARGIN_WARMUP_STEPS - 1, 1.2)
    assert policy.step_model.error.samples == 19
    assert policy.margin == 0.0
    feed([policy], 1, 1.2)
    error = policy.step_model.error
    assert error.samples == 20
    assert error.p95_abs_relative == pytest.approx(1 / 6)
    assert policy.margin == pytest.approx(1 / 6)
    assert policy.margin == error.p95_abs_relative


def test_margin_is_capped() -> None:
    policy = make("fb-margin")
    # measured = 3 x predicted -> relative error 2/3 > 0.5
    feed([policy], 20, 3.0)
    assert policy.step_model.error.p95_abs_relative == pytest.approx(2 / 3)
    assert policy.margin == MAX_MARGIN == 0.5


def margin_state() -> list[RequestView]:
    # decode with slack 0.6 (context 2000) and a 9000-token prefill with slack 0.8
    return [request("d", 0.6, context=2_000), request("p", 0.8, prefill=9_000)]


def test_margin_shrinks_the_time_budget_and_the_prefill() -> None:
    margin, fb = make("fb-margin"), make("fb")
    feed([margin, fb], 20, 3.0)  # same observations -> same step model state
    coef = margin.step_model.coefficients
    assert coef == fb.step_model.coefficients
    assert margin.margin == 0.5
    state = margin_state()
    init = triage(state, NOW).init_time_budget_s  # max(min slack 0.6, tpot 0.05) = 0.6
    assert init == pytest.approx(0.6)
    # every token planned min(2 x margin, 1/2) x TPOT = 0.025 s early: min slack 0.575
    guard = min(DEADLINE_GUARD_STEPS * 0.5, MAX_GUARD_SHARE) * 0.05
    guarded = triage(state, NOW, deadline_guard_s=guard)
    assert guarded.init_time_budget_s == pytest.approx(0.575)
    ours, theirs = margin.form_batch(state, NOW), fb.form_batch(state, NOW)
    assert ours.time_budget_s == pytest.approx(0.575 / 1.5)  # and shrunk by (1 + 0.5)
    assert theirs.time_budget_s == init
    # d (0.6 < 0.65) is urgent in both; prefill chunk = floor((budget - a - d's cost) / b)
    a, b, c = coef.a_s, coef.b_s_per_token, coef.c_s_per_context_token
    urgent = b + c * 2_000
    assert ours.decode_ids == theirs.decode_ids == ("d",)
    ours_chunk = min(9_000, math.floor((ours.time_budget_s - a - urgent) / b))
    theirs_chunk = min(9_000, math.floor((0.6 - a - urgent) / b))
    assert ours.prefill_chunks == (("p", ours_chunk),)
    assert theirs.prefill_chunks[0][0] == "p"
    assert abs(theirs.prefill_chunks[0][1] - theirs_chunk) <= 1
    assert ours_chunk < theirs.prefill_chunks[0][1]
    assert ours.predicted_step_s <= ours.time_budget_s


def test_margin_equals_fb_before_warmup() -> None:
    margin, fb = make("fb-margin"), make("fb")
    feed([margin, fb], 5, 3.0)
    state = margin_state()
    assert margin.form_batch(state, NOW) == fb.form_batch(state, NOW)


def test_margin_with_uncapped_error() -> None:
    margin, fb = make("fb-margin"), make("fb")
    feed([margin, fb], 25, 1.2)
    state = margin_state()
    ours, theirs = margin.form_batch(state, NOW), fb.form_batch(state, NOW)
    # 0.6 / (1 + 1/6) = 0.514285...
    guard = DEADLINE_GUARD_STEPS * (1 / 6) * 0.05  # tokens planned this much early
    assert ours.time_budget_s == pytest.approx((0.6 - guard) / (1 + 1 / 6))
    assert ours.new_tokens < theirs.new_tokens


# --------------------------------------------------------------------------- fb-kairos


def queued(req_id, arrival: float, pending: int, seq: int, *, prompt: int | None = None,
           ttft: float = 5.0) -> tuple[float, RequestView]:
    slo = Slo(ttft, 0.05)
    view = RequestView(req_id, arrival, slo, 0, pending, (prompt or pending) - pending,
                       prompt or pending, seq)
    return (arrival + ttft - NOW, view)


def ids(pairs) -> list:
    return [r.req_id for _, r in pairs]


def test_kairos_order_short_later_requests_overtake_a_long_early_one() -> None:
    # 1000 tokens/s from now = 100, ttft 5:
    # L (99.0, 2000): finish 102.0, urgency (5 - 3.0)/5 = 0.4,  score 0.4/2000 = 0.0002
    # S1 (99.5, 100): finish 102.1, urgency (5 - 2.6)/5 = 0.48, score 0.48/100 = 0.0048
    # S2 (99.8, 200): finish 102.3, urgency (5 - 2.5)/5 = 0.5,  score 0.5/200 = 0.0025
    L, S1, S2 = queued("L", 99.0, 2000, 0), queued("S1", 99.5, 100, 1), queued("S2", 99.8, 200, 2)
    ordered = kairos_order([S2, L, S1], NOW, 1000.0)
    assert ids(ordered) == ["S1", "S2", "L"]
    assert ordered[2] is L  # the (slack, request) pairs pass through untouched


def test_kairos_order_uses_pending_for_finish_and_prompt_for_length() -> None:
    # L: 4000-token prompt, 100 left: finish 100 + 0.1 = 100.1, urgency (5 - 1.1)/5 = 0.78,
    #    score 0.78/4000 = 0.000195 (0.78/100 = 0.0078 if it divided by what is pending)
    # S (99.5, 200): finish 100.3, urgency (5 - 0.8)/5 = 0.84, score 0.84/200 = 0.0042
    L, S = queued("L", 99.0, 100, 0, prompt=4000), queued("S", 99.5, 200, 1)
    assert ids(kairos_order([L, S], NOW, 1000.0)) == ["S", "L"]


def test_kairos_order_mixed_ttft_classes() -> None:
    # 1000 tokens/s; the cursor advances by what is pending (L: 100 of a 4000 prompt):
    # L  (99.0, ttft 5): finish 100.1, urgency (5 - 1.1)/5 = 0.78, score 0.78/4000 = 0.000195
    # S1 (99.5, ttft 5, 200): finish 100.3, urgency (5 - 0.8)/5 = 0.84, score 0.0042
    # S2 (99.6, ttft 1, 200): finish 100.5, urgency (1 - 0.9)/1 = 0.1, score 0.0005
    # (advancing by the prompt, L 104.0 -> 0, S2 104.4 -> -0.019, would put L before S2;
    #  so would an unnormalised slack: L 3.9/4000 = 0.000975 > S2 0.1/200)
    L = queued("L", 99.0, 100, 0, prompt=4000)
    S1 = queued("S1", 99.5, 200, 1)
    S2 = queued("S2", 99.6, 200, 2, ttft=1.0)
    assert ids(kairos_order([S2, S1, L], NOW, 1000.0)) == ["S1", "S2", "L"]


def test_kairos_order_late_requests_keep_kairos_sign_behaviour() -> None:
    # ttft 1: L finish 102.0, urgency (1 - 3)/1 = -2, score -0.001;
    # S (99.5, 100): finish 102.1, urgency (1 - 2.6) = -1.6, score -0.016 -> L first
    # (Kairos's formula: a negative urgency divided by a long length is nearer zero)
    L, S = queued("L", 99.0, 2000, 0, ttft=1.0), queued("S", 99.5, 100, 1, ttft=1.0)
    assert ids(kairos_order([S, L], NOW, 1000.0)) == ["L", "S"]


def test_kairos_order_ties_keep_fcfs() -> None:
    # A (99.0, 1000): finish 101.0, urgency (5 - 2)/5 = 0.6, score 0.0006
    # B (100.0, 1000): finish 102.0, urgency (5 - 2)/5 = 0.6, score 0.0006 -> tie, FCFS
    A_, B_ = queued("A", 99.0, 1000, 0), queued("B", 100.0, 1000, 1)
    assert ids(kairos_order([B_, A_], NOW, 1000.0)) == ["A", "B"]
    assert ids(kairos_order([A_, B_], NOW, 1000.0)) == ["A", "B"]
    # FCFS is by arrival_seq: the same two with their sequence numbers swapped
    A2 = (A_[0], dataclasses.replace(A_[1], arrival_seq=1))
    B2 = (B_[0], dataclasses.replace(B_[1], arrival_seq=0))
    # now B runs first: B finish 101, urgency (5-1)/5 = 0.8 -> 0.0008;
    # A finish 102, urgency (5-3)/5 = 0.4 -> 0.0004
    assert ids(kairos_order([A2, B2], NOW, 1000.0)) == ["B", "A"]


def test_kairos_throughput_estimate() -> None:
    policy = make("fb-kairos")
    assert policy.prefill_tokens_per_s == pytest.approx(1 / B)  # 10000 tokens/s
    policy.observe_step(measured_step(64, 5_000, 0), 0.02)  # decode-only: unchanged
    assert policy.prefill_tokens_per_s == pytest.approx(10_000)
    assert policy.step_model.error.samples == 1  # but the step model still learned
    # 1000 prefill tokens in 0.5 s -> sample 2000: 10000 + 0.1 * (2000 - 10000) = 9200
    policy.observe_step(measured_step(1_010, 5_000, 1_000), 0.5)
    assert THROUGHPUT_EWMA == 0.1
    assert policy.prefill_tokens_per_s == pytest.approx(9_200)
    # again: 9200 + 0.1 * (2000 - 9200) = 8480
    policy.observe_step(measured_step(1_010, 5_000, 1_000), 0.5)
    assert policy.prefill_tokens_per_s == pytest.approx(8_480)
    policy.observe_step(measured_step(1, 0), 0.01)  # a decode
    assert policy.prefill_tokens_per_s == pytest.approx(8_480)


def test_kairos_throughput_starts_from_usable_coefficients() -> None:
    context = PolicyContext(global_slo=SLO, initial_step_model=StepCoefficients(A, -1.0, C))
    assert make("fb-kairos", context).prefill_tokens_per_s == pytest.approx(1e9)  # b floored 1e-9


def kairos_state() -> list[RequestView]:
    # ttft 5: L (99.0, 4000 tokens, slack 4.0), S (99.5, 200, slack 4.5);
    # d: decode slack 0.3, context 1550
    slo = Slo(5.0, 0.05)
    return [
        request("d", 0.3, context=1550),
        request("L", 4.0, prefill=4000, slo=slo, arrival_seq=0),
        request("S", 4.5, prefill=200, slo=slo, arrival_seq=1),
    ]


def test_fb_kairos_reorders_only_the_prefill_group() -> None:
    state = kairos_state()
    kairos = make("fb-kairos")
    groups = triage(state, NOW)
    reordered = kairos._reorder(groups, NOW)
    # tokens/s 10000: L finish 100.4, urgency (5 - 1.4)/5 = 0.72, score 0.00018;
    # S finish 100.42, urgency (5 - 0.92)/5 = 0.816, score 0.00408 -> S before L
    assert ids(groups.prefills) == ["L", "S"]
    assert ids(reordered.prefills) == ["S", "L"]
    assert reordered.urgent_decodes == groups.urgent_decodes
    assert reordered.deferrable_decodes == groups.deferrable_decodes
    assert reordered.init_time_budget_s == groups.init_time_budget_s
    assert reordered.min_tpot_s == groups.min_tpot_s

    fb = make("fb").form_batch(state, NOW)
    ours = kairos.form_batch(state, NOW)
    # budget 0.3; d urgent (0.3 < 0.35), cost 1e-4 + 1550e-6 = 0.00165
    # time left 0.3 - 0.005 - 0.00165 = 0.29335
    # fb: L first, floor(2933.5) = 2933 tokens, then nothing fits
    # kairos: S whole (0.02), then L floor(0.27335 / 1e-4) = floor(2733.5) = 2733
    assert fb.decode_ids == ours.decode_ids == ("d",)
    assert fb.prefill_chunks == (("L", 2933),)
    assert ours.prefill_chunks == (("S", 200), ("L", 2733))
    assert ours.time_budget_s == fb.time_budget_s == pytest.approx(0.3)
    assert ours.predicted_step_s == pytest.approx(0.005 + 0.00165 + 0.02 + 0.2733)


def test_fb_kairos_equals_fb_with_one_prefill() -> None:
    state = anchor_state()
    assert make("fb-kairos").form_batch(state, NOW) == make("fb").form_batch(state, NOW)


# --------------------------------------------------------------------------- fb-anchor-margin


def test_anchor_margin_applies_both() -> None:
    both, margin, anchor = make("fb-anchor-margin"), make("fb-margin"), make("fb-anchor")
    for policy in (both, margin, anchor):
        policy._speed_probe = None  # steps 3x the file's: the speed check would rescale the floor
    feed([both, margin, anchor], 20, 3.0)
    assert both.margin == margin.margin == 0.5
    state = anchor_state()
    anchored_init = triage(state, NOW, anchored=True).init_time_budget_s  # 0.05
    paper_init = triage(state, NOW).init_time_budget_s  # 0.9
    ours = both.form_batch(state, NOW)
    guard = min(DEADLINE_GUARD_STEPS * 0.5, MAX_GUARD_SHARE) * 0.05  # 0.025 s
    # the anchored decode is due now: the budget is the floor, min TPOT less the guard
    assert ours.time_budget_s == pytest.approx((anchored_init - guard) / 1.5)
    assert margin.form_batch(state, NOW).time_budget_s == pytest.approx((paper_init - guard) / 1.5)
    assert anchor.form_batch(state, NOW).time_budget_s == pytest.approx(0.05)
    # the same packing under the smaller budget: chunk = floor((budget - a - d's cost) / b)
    coef = both.step_model.coefficients
    a, b, c = coef.a_s, coef.b_s_per_token, coef.c_s_per_context_token
    left = ours.time_budget_s - a - (b + c * 1550)
    expected = math.floor(left / b)
    if expected >= 1:
        assert ours.prefill_chunks == (("P", expected),)
    else:
        assert ours.prefill_chunks == ()
    assert ours.decode_ids == ("D",)
    assert ours.new_tokens < anchor.form_batch(state, NOW).new_tokens


# --------------------------------------------------------------------------- every variant


SLOS = [Slo(0.5, 0.05), Slo(1.0, 0.05), Slo(2.0, 0.1), Slo(1.0, 0.02)]


def random_state(rng: random.Random) -> list[RequestView]:
    out = []
    for i in range(rng.randint(0, 25)):
        slo = rng.choice(SLOS)
        prefill = rng.randint(1, 6000) if rng.random() < 0.4 else 0
        index = 0 if prefill and rng.random() < 0.8 else rng.randint(1, 200)
        view = request(i, rng.uniform(-0.5, 3.0), prefill=prefill, context=rng.randint(0, 60_000),
                       slo=slo, next_output_index=index, arrival_seq=rng.randint(0, 50))
        if index and rng.random() < 0.8:
            # first token somewhere between arrival and its TTFT (or a little late)
            view = dataclasses.replace(view, first_token_time=view.arrival + rng.uniform(0, 1.3) * slo.ttft_s)
        out.append(view)
    return out


def check_decision(policy: BatchPolicy, state: list[RequestView], decision: BatchDecision) -> None:
    by_id = {r.req_id: r for r in state}
    ids_ = list(decision.decode_ids) + [rid for rid, _ in decision.prefill_chunks]
    assert len(ids_) == len(set(ids_)), "a request appears twice"
    for rid in decision.decode_ids:
        assert by_id[rid].pending_prefill == 0
    partial = 0
    for position, (rid, chunk) in enumerate(decision.prefill_chunks):
        pending = by_id[rid].pending_prefill
        assert 1 <= chunk <= pending
        if chunk < pending:
            partial += 1
            assert position == len(decision.prefill_chunks) - 1, "partial chunk not last"
    assert partial <= 1
    if not state:
        assert decision.is_empty
        return
    coef = policy.step_model.coefficients
    floor = policy._service_floor()
    groups = triage(state, NOW, anchored=getattr(policy, "anchored", False), floor=floor,
                    deadline_guard_s=policy._deadline_guard_s())
    margin = getattr(policy, "margin", 0.0)
    budget = groups.init_time_budget_s / (1 + margin)
    step = policy.variant.step if isinstance(policy, FairBatchingVariant) else Step.PAPER
    if step is not Step.PAPER:
        smooth_budget = policy._guarded(groups.step_tpot_s, policy._margin_guard_s()) / (1 + margin)
        smooth = smooth_step(groups, coef, smooth_budget)
        if smooth is not None:
            groups, budget = smooth, smooth_budget
        elif step is Step.STEADY and math.isfinite(smooth_budget):
            groups = dataclasses.replace(groups, deferrable_decodes=[],
                                         urgent_decodes=groups.urgent_decodes + groups.deferrable_decodes)
            budget = smooth_budget
    a, b, c = coef.a_s, coef.b_s_per_token, coef.c_s_per_context_token
    always = groups.urgent_decodes + groups.late_decodes
    urgent = [r.req_id for _, r in always]
    assert list(decision.decode_ids[: len(urgent)]) == urgent
    cost = a + sum(b + c * by_id[rid].context for rid in decision.decode_ids)
    cost += sum(b * n + c * by_id[rid].context for rid, n in decision.prefill_chunks)
    assert decision.predicted_step_s == pytest.approx(cost, rel=1e-9)
    urgent_cost = a + sum(b + c * r.context for _, r in always)
    assert decision.time_budget_s == pytest.approx(budget)
    assert decision.predicted_step_s <= max(decision.time_budget_s, urgent_cost) + 1e-9
    assert decision.new_tokens <= max(CONTEXT.max_token_budget, len(urgent))


def test_every_variant_decides_validly_and_mutates_nothing() -> None:
    rng = random.Random(7)
    policies = [make(name) for name in VARIANTS]
    partial_seen = 0
    for trial in range(400):
        if trial == 200:  # second half: learned step models, margins > 0, moved throughput
            for policy in policies:
                feed([policy], 30, 1.3)
        state = random_state(rng)
        snapshot = [dataclasses.replace(r) for r in state]
        for policy in policies:
            before = (policy.step_model.coefficients, policy.step_model.error,
                      getattr(policy, "prefill_tokens_per_s", None))
            decision = policy.form_batch(state, NOW)
            check_decision(policy, state, decision)
            assert state == snapshot  # same requests, same order, same fields
            assert (policy.step_model.coefficients, policy.step_model.error,
                    getattr(policy, "prefill_tokens_per_s", None)) == before
            assert policy.form_batch(state, NOW) == decision  # no hidden state
            by_id = {r.req_id: r for r in state}
            partial_seen += any(n < by_id[rid].pending_prefill for rid, n in decision.prefill_chunks)
    assert policies[1].margin > 0 and policies[3].margin > 0
    assert policies[2].prefill_tokens_per_s != pytest.approx(1 / B)
    assert partial_seen > 50  # the partial-chunk rule was exercised


def test_anchor_margin_pab_admits_up_to_the_pab_and_packs_like_anchor_margin() -> None:
    context = PolicyContext(global_slo=Slo(2.0, 0.05), initial_step_model=StepCoefficients(0.005, 1e-4, 1e-6))
    guarded = POLICIES.get("fb-anchor-margin-pab")(context)
    plain = POLICIES.get("fb-anchor-margin")(context)
    requests = [RequestView("p", 0.0, Slo(2.0, 0.05), 0, 3000, 0, 3000)]
    budget = guarded.prefill_admission_budget(requests, 0.0)
    assert budget > 0
    slo = Slo(2.0, 0.05)
    assert guarded.admit(requests, 0.0, int(budget), slo)
    assert not guarded.admit(requests, 0.0, int(budget) + 1, slo)
    assert plain.admit(requests, 0.0, int(budget) + 1, slo)
    assert guarded.form_batch(requests, 0.0) == plain.form_batch(requests, 0.0)


# --------------------------------------------------------------------------- fb-smooth


def ahead_decodes_and_a_prompt(prompt_slack: float) -> list[RequestView]:
    """Ten decodes 2 s ahead of their deadlines (1000 context tokens each) and one
    2000-token prompt with ``prompt_slack`` left."""
    decodes = [request(f"d{i}", 2.0, context=1_000) for i in range(10)]
    return [*decodes, request("p", prompt_slack, prefill=2_000)]


def test_fb_smooth_keeps_every_decode_in_one_tpot_when_the_prompt_keeps_its_deadline() -> None:
    requests = ahead_decodes_and_a_prompt(0.9)
    paper = make("fb-anchor-margin").form_batch(requests, NOW)
    assert paper.predicted_step_s > 0.2, "Algorithm 1 stretches the step to the 0.9 s slack"
    smooth = make("fb-smooth").form_batch(requests, NOW)
    assert set(smooth.decode_ids) == {f"d{i}" for i in range(10)}
    # 50 ms - a - 10 decodes x (b + c x 1000) = 34 ms left: 340 prompt tokens at 0.1 ms
    assert smooth.prefill_chunks == (("p", 340),)
    assert smooth.time_budget_s == pytest.approx(SLO.tpot_s)
    assert smooth.predicted_step_s == pytest.approx(SLO.tpot_s)


def test_fb_smooth_spends_slack_when_the_prompt_needs_it() -> None:
    # 2000 tokens at 340 per 50 ms step need 0.29 s plus a step: a 0.2 s slack needs more
    requests = ahead_decodes_and_a_prompt(0.2)
    assert make("fb-smooth").form_batch(requests, NOW) == make("fb-anchor-margin").form_batch(requests, NOW)


def test_smooth_step_without_prompts_runs_every_decode_and_refuses_an_overfull_step() -> None:
    decodes = [request(f"d{i}", 2.0, context=1_000) for i in range(10)]
    groups = triage(decodes + [request("u", 0.01)], NOW)
    assert groups.deferrable_decodes, "the ten are deferrable under Algorithm 1"
    smooth = smooth_step(groups, COEF, 0.05)
    assert smooth is not None and not smooth.deferrable_decodes
    assert [r.req_id for _, r in smooth.urgent_decodes] == ["u", *(f"d{i}" for i in range(10))]
    crowded = triage(decodes + [request("p", 5.0, prefill=100)], NOW)
    assert smooth_step(crowded, COEF, 0.015) is None, "no time left for the prompt at all"
    assert smooth_step(crowded, COEF, math.inf) is None


def test_delivery_allowance_adds_to_the_deadline_guard_up_to_half_a_tpot() -> None:
    allowance = dataclasses.replace(CONTEXT, delivery_allowance_s=0.005)
    plain, early = make("fb-anchor-margin"), make("fb-anchor-margin", allowance)
    feed([plain, early], 20, 1.2)  # margin 1/6: guard 2 x 1/6 x TPOT
    assert plain._deadline_guard_s() == pytest.approx(2 / 6 * SLO.tpot_s)
    assert early._deadline_guard_s() == pytest.approx(2 / 6 * SLO.tpot_s + 0.005)
    capped = make("fb-anchor-margin", dataclasses.replace(CONTEXT, delivery_allowance_s=1.0))
    assert capped._deadline_guard_s() == pytest.approx(MAX_GUARD_SHARE * SLO.tpot_s)
    # a token planned at its deadline less the guard: the allowance shows in the time budget
    state = margin_state()
    assert early.form_batch(state, NOW).time_budget_s < plain.form_batch(state, NOW).time_budget_s
    with pytest.raises(ValueError, match="takes no delivery allowance"):
        make("fb", allowance)


def test_steady_keeps_every_decode_where_smooth_falls_back_to_algorithm_1() -> None:
    """An in-time prompt that cannot meet its TTFT at one TPOT's pace: fb-smooth spends the
    decodes' slack (a long step, deferrals); fb-steady runs every decode in a step of one
    TPOT and gives the prompt the rest."""
    decodes = [decoded(f"d{i}", 2.0, 0.1, context=500) for i in range(4)]
    prompt = request("p", 0.3, prefill=8000)
    smooth, steady = make("fb-smooth"), make("fb-steady")
    fallback = smooth.form_batch([*decodes, prompt], NOW)
    kept = steady.form_batch([*decodes, prompt], NOW)
    assert fallback.time_budget_s > SLO.tpot_s and len(fallback.decode_ids) < len(decodes)
    assert set(kept.decode_ids) == {d.req_id for d in decodes}
    assert kept.time_budget_s <= SLO.tpot_s
    assert dict(kept.prefill_chunks)["p"] > 0


def test_smooth_keeps_every_decode_when_the_prompts_need_more_kv_than_is_free() -> None:
    """The same state, with the rank's KV outlook: while the in-time prompt's 8,000 tokens
    fit the free memory fb-smooth falls back as before; when they do not, deferring
    decodes would only hold their memory longer, and fb-smooth steps as fb-steady."""
    from sglang_ext.policy.admission import KvOutlook

    decodes = [decoded(f"d{i}", 2.0, 0.1, context=500) for i in range(4)]
    state = [*decodes, request("p", 0.3, prefill=8000)]
    smooth, steady = make("fb-smooth"), make("fb-steady")
    smooth.observe_kv(KvOutlook.of(free_tokens=20_000))
    assert smooth.form_batch(state, NOW) == make("fb-smooth").form_batch(state, NOW)
    assert smooth.form_batch(state, NOW).time_budget_s > SLO.tpot_s
    smooth.observe_kv(KvOutlook.of(free_tokens=7_999, releases=[(NOW + 5.0, 10_000)]))
    assert smooth.form_batch(state, NOW) == steady.form_batch(state, NOW)
    smooth.observe_kv(KvOutlook.of(free_tokens=7_000, new_reserve=500))
    assert smooth.form_batch(state, NOW) == steady.form_batch(state, NOW)
    smooth.observe_kv(KvOutlook.of(free_tokens=8_000))
    assert smooth.form_batch(state, NOW).time_budget_s > SLO.tpot_s
