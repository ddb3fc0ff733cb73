"""Prefill Admission Budget (FairBatching §3.4, Appendix A).

Global SLO: TTFT 1 s, TPOT 50 ms. Coefficients a = 5 ms, b = 0.1 ms, c = 0.001 ms,
so one prefill token costs b + c = 0.101 ms.
"""

from __future__ import annotations

import random

import pytest

from policy_helpers import COEF, NOW, SLO, A, B, C, request
from sglang_ext.policy.pab import prefill_admission_budget
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_model import StepCoefficients
from sglang_ext.policy.view import RequestState

PER_TOKEN = B + C  # 1.01e-4 s
EMPTY_PAB = (1.0 - 0.005) / 1.01e-4  # (TTFT - a) / (b + c) = 9851.485...


def pab(requests, slo: Slo = SLO, coef: StepCoefficients = COEF, now: float = NOW) -> float:
    return prefill_admission_budget(requests, now, coef, slo)


def test_empty_rank() -> None:
    assert pab([]) == pytest.approx(EMPTY_PAB)
    assert pab([]) == pytest.approx(9851.485, abs=1e-3)


def test_hand_computed_example() -> None:
    requests = [
        request("d1", 0.2, context=1000),
        request("d2", 0.6, context=3000),
        request("p", 0.9, prefill=500),
    ]
    # batches  = (1 - 0.2) / 0.05 + 1 = 17          -> 17 * 5 ms            = 85.0 ms
    # d1: (1 - 0.2) / 0.05 = 16 steps * (0.1 + 1.0 ms)                       = 17.6 ms
    # d2: (1 - 0.6) / 0.05 =  8 steps * (0.1 + 3.0 ms)                       = 24.8 ms
    # p:  (1 - 0.9) / 0.05 =  2 steps * (0.1 + 0.5 ms)  (KV = 0 + 500 after prefill) = 1.2 ms
    # PAB = (1000 - 128.6 ms) / 0.101 ms - 500 queued = 8627.72 - 500 = 8127.72
    assert pab(requests) == pytest.approx(0.8714 / 1.01e-4 - 500)
    assert pab(requests) == pytest.approx(8127.72, abs=0.01)


def test_queued_prefill_outside_the_window_lowers_pab_one_for_one() -> None:
    # A relaxed request (own TTFT 5 s) with slack 4.9 s > global TTFT: it needs no decode
    # step inside the window, so each queued prompt token costs exactly one token of PAB.
    relaxed = Slo(5.0, 0.2)
    for pending in (1, 100, 4321):
        assert pab([request("p", 4.9, prefill=pending, slo=relaxed)]) == pytest.approx(
            EMPTY_PAB - pending
        )


def test_queued_prefill_inside_the_window() -> None:
    # Slack 0.9: batches = (1 - 0.9)/0.05 + 1 = 3 (15 ms of a); the request will decode
    # 2 steps inside the window with KV = pending, so each pending token costs
    # 1 + 2 * c / (b + c) = 1.0198 tokens of PAB.
    def with_pending(n: int) -> float:
        return pab([request("p", 0.9, prefill=n)])

    assert with_pending(1) - with_pending(1001) == pytest.approx(1000 * (1 + 2 * C / PER_TOKEN))
    # pending 100: (1 - 0.015 - 2 * (0.1 + 0.1) ms) / 0.101 ms - 100
    assert with_pending(100) == pytest.approx((1 - 0.015 - 0.0004) / PER_TOKEN - 100)


def test_more_queued_prompt_tokens_lower_pab() -> None:
    base = [request("d", 0.5, context=2000)]
    values = [pab(base + [request("p", 0.9, prefill=n)]) for n in (10, 100, 1000, 10_000)]
    assert values == sorted(values, reverse=True)


def test_decode_with_slack_beyond_ttft_costs_nothing() -> None:
    # A decode 1.5 s ahead of its deadline needs no step inside the 1 s window; it does
    # not raise the step count above 1 either (min slack is clamped at TTFT).
    ahead = request("ahead", 1.5, context=50_000)
    assert pab([ahead]) == pytest.approx(EMPTY_PAB)
    hand = [request("d1", 0.2, context=1000)]
    assert pab(hand + [ahead]) == pytest.approx(pab(hand))


def test_a_late_request_counts_as_due_now() -> None:
    """The lateness guard: however late, a request costs what one due now costs, so a
    single late (or hostile) request cannot drive the budget ever lower."""
    due_now = pab([request("d", 0.0, context=4000)])
    assert pab([request("d", -0.1, context=4000)]) == pytest.approx(due_now)
    assert pab([request("d", -1000.0, context=4000)]) == pytest.approx(due_now)


def test_decode_exactly_at_ttft_costs_no_decode_step() -> None:
    # slack 1.0 = TTFT: (TTFT - slack)/TPOT = 0 steps -> just the one step's a
    assert pab([request("d", 1.0, context=10_000)]) == pytest.approx(EMPTY_PAB, rel=1e-6)


def test_less_slack_means_less_budget() -> None:
    values = [pab([request("d", s, context=4000)]) for s in (0.9, 0.6, 0.3, 0.0)]
    assert values == sorted(values, reverse=True)
    assert len(set(values)) == len(values)
    # slack 0.5: 11 batches (55 ms) + 10 steps * 4.1 ms = 96 ms -> (1 - 0.096) / 0.101 ms
    assert pab([request("d", 0.5, context=4000)]) == pytest.approx(0.904 / PER_TOKEN)


def test_longer_context_means_less_budget() -> None:
    short = pab([request("d", 0.5, context=100)])
    long = pab([request("d", 0.5, context=100_000)])
    # 10 steps * 99_900 extra context * 0.001 ms = 99.9 ms = 989.1 tokens
    assert short - long == pytest.approx(10 * 99_900 * C / PER_TOKEN)


def test_pab_can_go_negative() -> None:
    crowd = [request(i, 0.0, context=20_000) for i in range(50)]
    assert pab(crowd) < 0


def test_own_slo_sets_slack_global_slo_sets_window() -> None:
    # The request's slack comes from its own SLO; steps are counted with the global TPOT.
    own = Slo(0.3, 0.02)
    r = request("d", 0.5, context=1000, slo=own, next_output_index=10)
    # global window: (1 - 0.5) / 0.05 = 10 steps, 11 batches
    assert pab([r]) == pytest.approx((1 - 11 * A - 10 * (B + 1000 * C)) / PER_TOKEN)


# --------------------------------------------------------------------------- brute force


def brute_force_pab(
    requests: list[RequestState], now: float, coef: StepCoefficients, slo: Slo
) -> float:
    """Simulate the worst case of Appendix A step by step.

    Relative to ``now``, request i's next token is due at its slack s_i and every TPOT
    (global) after that. Every decode is deferred as long as possible: a step happens
    when the most urgent outstanding token is due, and it serves every request whose
    next token is due before the following step (which comes one TPOT later), i.e. one
    step per TPOT per request once its slack has run out. Only tokens due within the
    TTFT window must be produced in it (Appendix A.3: request i runs steps "within
    TTFT if TTFT > slack_i"); a late request (s_i < 0) counts as due now (the lateness
    guard's deviation from the paper). A step costs
    a + sum over the requests it serves of (b + c * KV_i), KV_i = context + pending
    prompt. With no decode step in the window the new prefill still needs one step
    (one a). The rest of the TTFT window becomes prefill tokens at (b + c) each, minus
    the prompt tokens already queued.
    """
    a, b, c = coef.a_s, coef.b_s_per_token, coef.c_s_per_context_token
    window, period = slo.ttft_s, slo.tpot_s
    due: dict = {}
    kv: dict = {}
    for r in requests:
        slack = max(0.0, r.slo.token_deadline(r.arrival, r.next_output_index) - now)
        if slack <= window:
            due[r.req_id] = slack
        kv[r.req_id] = r.context + r.pending_prefill
    used, steps = 0.0, 0
    while due:
        t = min(due.values())  # the most urgent outstanding token is due now
        served = [rid for rid, d in due.items() if d < t + period]
        used += a + sum(b + c * kv[rid] for rid in served)
        steps += 1
        for rid in served:
            due[rid] += period
            if due[rid] > window:
                del due[rid]
    if steps == 0:
        used += a
    return (window - used) / (b + c) - sum(r.pending_prefill for r in requests)


def test_brute_force_on_a_hand_case() -> None:
    # One decode, slack 0.52 s, context 1000 (a decode step: 0.1 + 1.0 = 1.1 ms).
    # Brute force: tokens due 0.52, 0.57, ..., 0.97 (10 tokens; 1.02 is past the
    # window) -> 10 steps of 5 + 1.1 = 6.1 ms = 61 ms.
    # Formula: (1 - 0.52)/0.05 = 9.6 decode steps and 10.6 batches
    #          -> 10.6 * 5 + 9.6 * 1.1 = 63.56 ms.
    r = [request("d", 0.52, context=1000, now=0.0)]
    brute = brute_force_pab(r, 0.0, COEF, SLO)
    assert brute == pytest.approx((1 - 0.061) / PER_TOKEN)
    assert pab(r, now=0.0) == pytest.approx((1 - 0.06356) / PER_TOKEN)
    assert brute_force_pab([], 0.0, COEF, SLO) == pytest.approx(EMPTY_PAB)


def test_formula_matches_brute_force_on_random_ranks() -> None:
    """prefill_admission_budget vs the step-by-step worst case over 250 random ranks.

    Tolerance: the formula counts steps continuously, (TTFT - s)/TPOT, where the
    simulation counts integer steps. The number of batches differs by less than one
    (at most one a), and each request inside the window runs at most one step more in
    the simulation (floor(x) + 1 vs x). So, in prefill tokens,

        -a / (b + c)  <=  PAB_formula - PAB_brute  <=  sum_{i: s_i <= TTFT} (b + c * KV_i) / (b + c)

    which lies inside the symmetric bound (a + sum_i (b + c * KV_i)) / (b + c), plus
    1e-6 relative for rounding. KV_i = context_i + pending prefill_i, as in pab.py.
    """
    rng = random.Random(0xFA1B)
    widest = 0.0
    for _ in range(250):
        slo = Slo(rng.uniform(0.5, 2.0), rng.uniform(0.02, 0.1))
        coef = StepCoefficients(
            rng.uniform(0.002, 0.02), rng.uniform(2e-5, 2e-4), rng.uniform(0.0, 1e-7)
        )
        requests = [
            request(
                i,
                rng.uniform(-0.1, 3.0),
                prefill=rng.randint(1, 8000) if rng.random() < 0.3 else 0,
                context=rng.randint(0, 32_000),
                slo=slo,
                now=0.0,
            )
            for i in range(rng.randint(0, 200))
        ]
        a, b, c = coef.a_s, coef.b_s_per_token, coef.c_s_per_context_token
        formula = prefill_admission_budget(requests, 0.0, coef, slo)
        brute = brute_force_pab(requests, 0.0, coef, slo)
        in_window = [
            r for r in requests if r.slo.token_deadline(r.arrival, r.next_output_index) <= slo.ttft_s
        ]
        upper = sum(b + c * (r.context + r.pending_prefill) for r in in_window) / (b + c)
        lower = a / (b + c)
        symmetric = (a + sum(b + c * (r.context + r.pending_prefill) for r in requests)) / (b + c)
        slack_tol = 1e-6 * max(1.0, abs(brute))
        difference = formula - brute
        assert -lower - slack_tol <= difference <= upper + slack_tol, (difference, lower, upper)
        assert abs(difference) <= symmetric * (1 + 1e-6) + 1e-6
        widest = max(widest, difference / upper if difference > 0 else -difference / lower)
    # the bound is nearly attained, so the comparison is not vacuous
    assert widest > 0.5
