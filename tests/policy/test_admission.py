"""The admission model (sglang_ext.policy.admission) and its use by the FairBatching family."""

from __future__ import annotations

import pytest

from policy_helpers import COEF, NOW, SLO, request
from sglang_ext.policy.admission import (
    AdmissionError, AdmissionMode, AdmissionRule, AdmissionSettings, GiveUp, KvOutlook, budget_for,
    class_budgets, forecast, prefill_rate,
)
from sglang_ext.policy.policies import POLICIES, PolicyContext
from sglang_ext.policy.slo import Slo
import sglang_ext.policy.variants  # noqa: F401  (registers the variants)

TPOT = SLO.tpot_s


def make(name: str, **admission) -> object:
    settings = AdmissionSettings(**admission) if admission else AdmissionSettings()
    return POLICIES.get(name)(PolicyContext(SLO, COEF, admission=settings))


def test_prefill_rate_is_what_decodes_and_step_costs_leave():
    # empty rank: (1 - a / tpot) / b = (1 - 0.1) / 1e-4
    assert prefill_rate([], COEF, TPOT) == pytest.approx(9000.0)
    decoding = [request("d", 0.03, context=1000)]
    # one decode: (b + c * 1000) / tpot = 1.1e-3 / 0.05 = 0.022 of every second
    assert prefill_rate(decoding, COEF, TPOT) == pytest.approx((1 - 0.1 - 0.022) / 1e-4)
    # a queued prefill counts as the decode it becomes (context = its prompt)
    queued = [request("p", 0.5, prefill=1000)]
    assert prefill_rate(queued, COEF, TPOT) == pytest.approx((1 - 0.1 - 0.022) / 1e-4)
    assert prefill_rate([], COEF, TPOT, headroom=0.5) == pytest.approx(4500.0)


def test_rate_is_never_negative():
    crowd = [request(i, 0.03, context=100_000) for i in range(50)]
    assert prefill_rate(crowd, COEF, TPOT) == 0.0


def test_budget_on_an_empty_rank_is_rate_times_ttft():
    queue = forecast([], NOW, COEF, TPOT, headroom=0.0)
    assert queue.budget(1.0) == pytest.approx(9000.0)
    assert queue.budget(2.0) == pytest.approx(18000.0)
    assert not queue.hopeless


def test_queued_work_due_first_is_subtracted():
    queued = [request("p", 0.5, prefill=3000)]  # due in 0.5 s
    rate = prefill_rate(queued, COEF, TPOT)
    queue = forecast(queued, NOW, COEF, TPOT, headroom=0.0)
    assert queue.budget(1.0) == pytest.approx(rate * 1.0 - 3000)


def test_a_newcomer_may_not_make_an_admitted_request_late():
    # due in 1.0 s with 6000 tokens: rate (1 - 0.1 - 0.122) / 1e-4 = 7780, spare 1780
    queued = [request("p", 1.0, prefill=6000, slo=Slo(1.0, 0.05))]
    queue = forecast(queued, NOW, COEF, TPOT, headroom=0.0)
    assert queue.rate == pytest.approx(7780.0)
    # a tighter request (due in 0.5 s) is served first: it may only take the spare
    assert queue.budget(0.5) == pytest.approx(1780.0)
    assert queue.rate * 0.5 > 1780.0


def test_infeasible_prefills_are_hopeless_and_their_work_is_not_counted():
    queued = [
        request("soon", 0.1, prefill=5000, arrival_seq=0),  # 5000 > 0.1 s of prefill
        request("later", 0.9, prefill=1000, arrival_seq=1),
    ]
    queue = forecast(queued, NOW, COEF, TPOT, headroom=0.0)
    assert queue.hopeless == {"soon"}
    assert queue.budget(1.0) == pytest.approx(queue.rate - 1000)


def test_late_prefills_are_hopeless():
    queue = forecast([request("late", -0.2, prefill=10)], NOW, COEF, TPOT)
    assert queue.hopeless == {"late"}


def test_defer_keeps_the_most_prefills_on_time_by_dropping_the_longest():
    # rate 7540 tokens/s: "long" fits by its deadline (4524), not with "short1" (5278)
    queued = [
        request("long", 0.6, prefill=4000, arrival_seq=0),
        request("short1", 0.7, prefill=1500, arrival_seq=1),
        request("short2", 0.8, prefill=1500, arrival_seq=2),
    ]
    plain = forecast(queued, NOW, COEF, TPOT, headroom=0.0)
    assert plain.rate == pytest.approx(7540.0)
    assert plain.hopeless == {"short1"}  # the entry that does not fit
    evicting = forecast(queued, NOW, COEF, TPOT, headroom=0.0, length_weight=1.0)
    assert evicting.hopeless == {"long"}  # two on time instead of one
    assert evicting.work_through == (1500, 3000)


def test_fair_defer_draws_its_victim_blind_to_length():
    from sglang_ext.policy.admission import _drawn

    def queue(long_seq: int, short_seq: int) -> list:
        return [request("long", 0.6, prefill=4000, arrival_seq=long_seq),
                request("short1", 0.7, prefill=1500, arrival_seq=short_seq),
                request("short2", 0.8, prefill=1500, arrival_seq=2)]

    # one of "long" and "short1" must go; fairly, the one drawn later in the fixed order
    for long_seq, short_seq in ((0, 1), (1, 0)):
        fair = forecast(queue(long_seq, short_seq), NOW, COEF, TPOT, headroom=0.0,
                        length_weight=0.0)
        drawn = "long" if _drawn(long_seq, 0) > _drawn(short_seq, 0) else "short1"
        assert fair.hopeless == {drawn}
    # the order is fixed per request and blind to length, and both lengths lose
    assert _drawn(7, 10) == _drawn(7, 99999)
    assert {"long", "short1"} == {
        next(iter(forecast(queue(a, b), NOW, COEF, TPOT, headroom=0.0, length_weight=0.0).hopeless))
        for a, b in ((0, 1), (1, 0))}
    settings = AdmissionSettings(AdmissionMode.DEFER, give_up=GiveUp.FAIR)
    assert settings.length_weight == 0.0
    assert settings.label == "defer:fair"


def test_the_length_weight_moves_what_defer_gives_up_from_the_longest_to_blind():
    import random

    rng = random.Random(40)
    weights = (1.0, 0.75, 0.5, 0.25, 0.0)
    given_up_tokens = dict.fromkeys(weights, 0)
    given_up = dict.fromkeys(weights, 0)
    for trial in range(200):
        queued = [request(f"r{i}", rng.uniform(0.05, 1.5), prefill=rng.choice([200, 800, 4000]),
                          arrival_seq=trial * 100 + i) for i in range(12)]
        prompts = {r.req_id: r.pending_prefill for r in queued}
        lost = {w: forecast(queued, NOW, COEF, TPOT, headroom=0.0, length_weight=w).hopeless
                for w in weights}
        for w in weights:  # Moore-Hodgson's longest-first keeps the most on time
            assert len(lost[1.0]) <= len(lost[w])
            given_up[w] += len(lost[w])
            given_up_tokens[w] += sum(prompts[r] for r in lost[w])
    mean_prompt = [given_up_tokens[w] / given_up[w] for w in weights]
    assert mean_prompt == sorted(mean_prompt, reverse=True)  # less weight, shorter victims
    assert mean_prompt[0] > 1.5 * mean_prompt[-1]
    assert forecast(queued, NOW, COEF, TPOT, length_weight=0.5).hopeless == forecast(
        queued, NOW, COEF, TPOT, length_weight=0.5).hopeless  # the draw is fixed per request


def test_give_up_takes_a_name_or_a_length_weight():
    assert AdmissionSettings.parse("defer", give_up="0.5").length_weight == 0.5
    assert AdmissionSettings.parse("defer", give_up=0.25).label == "defer:0.25"
    assert AdmissionSettings.parse("defer", give_up="fair").length_weight == 0.0
    assert AdmissionSettings.parse("defer", give_up="latest").length_weight is None
    assert AdmissionSettings.parse("defer").length_weight == 1.0
    assert AdmissionSettings.parse("reject").length_weight is None
    for bad in ("1.5", -0.1, float("nan"), True, "oldest"):
        with pytest.raises(AdmissionError, match="length weight"):
            AdmissionSettings.parse("defer", give_up=bad)


def test_a_started_prefill_is_not_dropped_for_later_ones():
    started = request("started", 0.6, prefill=4000, context=500, arrival_seq=0)
    queued = [started, request("short1", 0.7, prefill=1500, arrival_seq=1),
              request("short2", 0.8, prefill=1500, arrival_seq=2)]
    evicting = forecast(queued, NOW, COEF, TPOT, headroom=0.0, length_weight=1.0)
    assert evicting.hopeless == {"short1"}
    alone = forecast([request("started", 0.1, prefill=4000, context=500)], NOW, COEF, TPOT,
                     headroom=0.0, length_weight=1.0)
    assert alone.hopeless == {"started"}  # it cannot finish in time itself


def test_defer_serves_the_short_prefills_before_a_long_one_that_would_cost_them_their_ttft():
    queued = [
        request("long", 0.6, prefill=4000, arrival_seq=0),
        request("short1", 0.7, prefill=1500, arrival_seq=1),
        request("short2", 0.8, prefill=1500, arrival_seq=2),
    ]
    deferring = make("fb", mode=AdmissionMode.DEFER, headroom=0.0)
    chunks = deferring.form_batch(queued, NOW).prefill_chunks
    assert [req_id for req_id, _ in chunks][:2] == ["short1", "short2"]
    assert make("fb").form_batch(queued, NOW).prefill_chunks[0][0] == "long"
    # give_up = "latest": the one that does not fit ("short1") is served last instead
    latest = make("fb", mode=AdmissionMode.DEFER, headroom=0.0, give_up=GiveUp.LATEST)
    assert [req_id for req_id, _ in latest.form_batch(queued, NOW).prefill_chunks][:2] == [
        "long", "short2"]


# ------------------------------------------------------------------ KV memory


def test_kv_outlook_counts_releases_by_their_time():
    kv = KvOutlook.of(100, [(NOW + 2.0, 50), (NOW + 1.0, 30)])
    assert kv.available_at(NOW) == 100
    assert kv.available_at(NOW + 1.0) == 130
    assert kv.available_at(NOW + 5.0) == 180


def test_ample_kv_changes_nothing():
    queued = [request("p", 0.5, prefill=3000)]
    plain = forecast(queued, NOW, COEF, TPOT, headroom=0.0)
    roomy = forecast(queued, NOW, COEF, TPOT, headroom=0.0, kv=KvOutlook.of(10**9))
    assert roomy.budget(1.0) == pytest.approx(plain.budget(1.0))
    assert roomy.hopeless == plain.hopeless


def test_an_arrival_needs_its_prompt_and_reserve_in_free_kv():
    # compute allows 9000 tokens in 1 s; memory has 2000 free and a new request reserves 500
    queue = forecast([], NOW, COEF, TPOT, headroom=0.0, kv=KvOutlook.of(2000, new_reserve=500))
    assert queue.budget(1.0) == pytest.approx(1500.0)


def test_memory_given_back_in_time_counts_with_the_time_left_to_prefill():
    # 4000 tokens come back 0.8 s from now: a prompt started then has 0.2 s (1800 tokens)
    kv = KvOutlook.of(1000, [(NOW + 0.8, 4000)])
    queue = forecast([], NOW, COEF, TPOT, headroom=0.0, kv=kv)
    assert queue.budget(1.0) == pytest.approx(1800.0)
    # memory given back after the deadline does not count
    late = forecast([], NOW, COEF, TPOT, headroom=0.0, kv=KvOutlook.of(1000, [(NOW + 1.5, 4000)]))
    assert late.budget(1.0) == pytest.approx(1000.0)


def test_queued_prefills_take_memory_first_and_one_that_cannot_start_in_time_is_hopeless():
    queued = [
        request("first", 0.5, prefill=800, arrival_seq=0),
        request("blocked", 0.9, prefill=800, arrival_seq=1),  # no memory until 5 s: hopeless
    ]
    kv = KvOutlook.of(1000, [(NOW + 5.0, 10_000)], reserves={"first": 100, "blocked": 100})
    queue = forecast(queued, NOW, COEF, TPOT, headroom=0.0, kv=kv)
    assert queue.hopeless == {"blocked"}
    # an arrival due after "first" has what "first" leaves: 1000 - 900
    assert queue.budget(1.0) == pytest.approx(100.0)
    # one due before "first" may not take the memory "first" needs
    assert queue.budget(0.2) == pytest.approx(100.0)


def test_policies_apply_the_kv_outlook_they_were_given():
    policy = make("fb-anchor-margin", mode=AdmissionMode.REJECT, headroom=0.0)
    assert policy.admit([], NOW, 5000, SLO)
    policy.observe_kv(KvOutlook.of(2000))
    assert not policy.admit([], NOW, 5000, SLO)
    assert policy.class_budgets([], NOW, {"standard": SLO})["standard"] == pytest.approx(2000.0)
    policy.observe_kv(None)
    assert policy.admit([], NOW, 5000, SLO)


def test_defer_marks_prefills_memory_cannot_start_in_time_hopeless():
    blocked = request("blocked", 0.1, prefill=500, arrival_seq=0)
    fits = request("fits", 0.9, prefill=500, arrival_seq=1)
    deferring = make("fb", mode=AdmissionMode.DEFER, headroom=0.0)
    deferring.observe_kv(KvOutlook.of(600, reserves={"blocked": 200, "fits": 0}))
    # "blocked" needs 700 of the 600 free; "fits" needs 500
    assert deferring.form_batch([blocked, fits], NOW).prefill_chunks[0][0] == "fits"


def test_class_budgets_per_rule():
    classes = {"tight": Slo(0.5, 0.05), "loose": Slo(2.0, 0.1)}
    edf = class_budgets(AdmissionRule.EDF, [], NOW, COEF, classes, TPOT, headroom=0.0)
    assert edf["tight"] == pytest.approx(4500.0) and edf["loose"] == pytest.approx(18000.0)
    pab = class_budgets(AdmissionRule.PAB, [], NOW, COEF, classes, TPOT)
    assert pab["tight"] < pab["loose"]


def test_budget_for_a_ttft_between_classes():
    budgets = {0.5: 100.0, 2.0: 900.0}
    assert budget_for(budgets, 2.0, rate=1000) == 900.0
    assert budget_for(budgets, 1.0, rate=1000) == 100.0  # the class below
    assert budget_for(budgets, 0.3, rate=1000) == pytest.approx(-100.0)  # 0.2 s short


@pytest.mark.parametrize("kwargs, fragment", [
    ({"mode": "reject"}, "admission mode"),
    ({"mode": AdmissionMode.DEFER, "rule": AdmissionRule.PAB}, "only rejects"),
    ({"max_defer_s": 0}, "max_defer_s"),
    ({"retry_after_s": float("nan")}, "retry_after_s"),
    ({"headroom": 1.0}, "headroom"),
])
def test_bad_settings_are_refused(kwargs, fragment):
    with pytest.raises(AdmissionError, match=fragment):
        AdmissionSettings(**kwargs)


def test_parse_names_the_choices():
    assert AdmissionSettings.parse("defer").mode is AdmissionMode.DEFER
    with pytest.raises(AdmissionError, match="'off', 'reject', 'defer'"):
        AdmissionSettings.parse("drop")
    with pytest.raises(AdmissionError, match="'edf', 'pab'"):
        AdmissionSettings.parse("reject", "fifo")


# ------------------------------------------------------------------ the policies


def test_reject_admits_up_to_the_budget_of_the_requests_class():
    policy = make("fb-anchor-margin", mode=AdmissionMode.REJECT, headroom=0.0)
    assert policy.admit([], NOW, 9000, SLO)
    assert not policy.admit([], NOW, 9001, SLO)
    assert policy.admit([], NOW, 18000, Slo(2.0, 0.05))


def test_reject_counts_the_time_the_arrival_already_waited():
    policy = make("fb", mode=AdmissionMode.REJECT, headroom=0.0)
    assert policy.admit([], NOW, 9000, SLO, arrival=NOW)
    assert not policy.admit([], NOW, 9000, SLO, arrival=NOW - 0.1)
    assert policy.admit([], NOW, 8100, SLO, arrival=NOW - 0.1)


def test_off_and_defer_admit_everything():
    for mode in (AdmissionMode.OFF, AdmissionMode.DEFER):
        assert make("fb", mode=mode).admit([], NOW, 10**9, SLO)


def test_pab_names_imply_reject_with_the_pab_rule():
    policy = make("fb-anchor-margin-pab")
    assert (policy.admission.mode, policy.admission.rule) == (AdmissionMode.REJECT, AdmissionRule.PAB)
    assert make("fb-pab", mode=AdmissionMode.REJECT, rule=AdmissionRule.PAB).admission.rule is AdmissionRule.PAB
    with pytest.raises(AdmissionError, match="fb-pab.*defer"):
        make("fb-pab", mode=AdmissionMode.DEFER)
    with pytest.raises(AdmissionError, match="rule 'edf'"):
        make("fb-anchor-margin-pab", mode=AdmissionMode.REJECT)


def test_defer_serves_hopeless_prefills_after_the_feasible_ones():
    hopeless = request("big", 0.1, prefill=5000, arrival_seq=0)
    feasible = request("small", 0.9, prefill=500, arrival_seq=1)
    deferring = make("fb", mode=AdmissionMode.DEFER, headroom=0.0)
    plain = make("fb")
    first = lambda policy: policy.form_batch([hopeless, feasible], NOW).prefill_chunks[0][0]
    assert first(plain) == "big"  # least slack first
    assert first(deferring) == "small"


def test_defer_ends_requests_without_a_first_token_max_defer_s_past_their_ttft():
    stale = request("stale", -5.5, prefill=100)  # 5.5 s past its TTFT deadline
    late = request("late", -4.5, prefill=100)  # 4.5 s past it: still deferred
    fresh = request("fresh", 0.5, prefill=100)
    decoding = request("decoding", -10.0, context=100)  # late, but has its first token
    policy = make("fb", mode=AdmissionMode.DEFER, max_defer_s=5.0)
    decision = policy.form_batch([stale, late, fresh, decoding], NOW)
    assert decision.abort_ids == ("stale",)
    assert "stale" not in {req_id for req_id, _ in decision.prefill_chunks}
    assert make("fb", mode=AdmissionMode.REJECT, max_defer_s=5.0).form_batch(
        [stale, fresh], NOW
    ).abort_ids == ()


def test_admission_budgets_follow_the_configured_rule():
    classes = {"standard": SLO}
    edf = make("fb", mode=AdmissionMode.REJECT, headroom=0.0).class_budgets([], NOW, classes)
    assert edf["standard"] == pytest.approx(9000.0)
    pab = make("fb-pab").class_budgets([], NOW, classes)
    assert pab["standard"] == pytest.approx(9851.485, abs=1e-3)
