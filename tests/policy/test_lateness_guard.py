"""The lateness guard (``batch_former`` module docstring): a late request, or one whose
TPOT no rank can honour, does not set the time budget; it is served best-effort.

Coefficients as in ``policy_helpers``: a = 5 ms, b = 0.1 ms/token, so the smallest step
is 5.1 ms and the smallest serviceable TPOT 10.2 ms.
"""

from __future__ import annotations

import pytest
from policy_helpers import COEF, NOW, SLO, request

from sglang_ext.policy.batch_former import (
    ServiceFloor, form_batch, min_serviceable_tpot_s, triage, unserviceable_slo_reason,
)
import sglang_ext.policy.variants  # noqa: F401  (registers the variants)
from sglang_ext.policy.policies import POLICIES, PolicyContext
from sglang_ext.policy.slo import Slo

FLOOR = ServiceFloor.of(COEF, SLO.tpot_s)
HOSTILE = Slo(ttft_s=0.1, tpot_s=0.004)


def test_floor_is_twice_the_smallest_step() -> None:
    assert min_serviceable_tpot_s(COEF) == pytest.approx(2 * (0.005 + 0.0001))
    assert FLOOR.fallback_budget_s == pytest.approx(SLO.tpot_s)
    assert ServiceFloor.of(COEF, 0.001).fallback_budget_s == pytest.approx(0.0102)


def test_door_refuses_a_tpot_below_the_floor_and_says_why() -> None:
    reason = unserviceable_slo_reason(HOSTILE, COEF)
    assert reason is not None and "tpot_ms 4 is below" in reason and "10.2 ms" in reason
    assert unserviceable_slo_reason(Slo(1.0, 0.0102), COEF) is None


def test_door_words_an_e2e_refusal_by_its_target_and_expected_length() -> None:
    tight = Slo.end_to_end_ms(1000, expected_output_tokens=200)  # 750 ms over 199 tokens
    reason = unserviceable_slo_reason(tight, COEF)
    assert reason is not None and "e2e_ms 1000 paces its expected output at 3.8 ms" in reason
    assert unserviceable_slo_reason(tight.with_expected_output(50), COEF) is None


def test_a_late_prefill_no_longer_sets_the_budget_for_everyone() -> None:
    late = request("late", -0.5, prefill=400)
    fresh = request("fresh", 0.8, prefill=400)
    decode = request("d", 0.3)
    paper = triage([late, fresh, decode], NOW)
    guarded = triage([late, fresh, decode], NOW, floor=FLOOR)
    assert paper.init_time_budget_s == pytest.approx(0.05)  # min TPOT, for good
    assert guarded.init_time_budget_s == pytest.approx(0.3)  # from the in-time requests
    assert [r.req_id for _, r in guarded.late_prefills] == ["late"]


def test_an_unserviceable_tpot_does_not_starve_other_prefills() -> None:
    """The reproduced case: one TPOT-4 ms request; in the printed algorithm the budget is
    4 ms, below the 5 ms fixed cost, and no prefill fits at all."""
    hostile = request("hostile", -0.01, prefill=8000, slo=HOSTILE, arrival_seq=0)
    others = [request(f"o{i}", 1.5, prefill=1000, arrival_seq=i + 1) for i in range(3)]
    paper = triage([hostile, *others], NOW)
    assert paper.init_time_budget_s == pytest.approx(0.004)
    decision = form_batch([hostile, *others], NOW, COEF)
    chunked = dict(decision.prefill_chunks)
    assert set(chunked) >= {"o0", "o1", "o2"}  # a 1.5 s budget: every in-time prompt whole
    assert all(chunked[f"o{i}"] == 1000 for i in range(3))
    assert chunked.get("hostile", 0) > 0  # served from what is left, not dropped


def test_late_decodes_ride_every_step_and_pace_it_at_their_tpot() -> None:
    late = request("late", -2.0, context=100, slo=Slo(ttft_s=0.1, tpot_s=0.03))
    prefill = request("p", 0.4, prefill=20_000)
    decision = form_batch([late, prefill], NOW, COEF)
    assert decision.decode_ids == ("late",)
    assert decision.time_budget_s == pytest.approx(0.03)  # its TPOT, not the prefill's 0.4 s slack
    assert dict(decision.prefill_chunks)["p"] > 200


def test_an_unserviceable_late_decode_paces_the_step_no_faster_than_the_floor() -> None:
    late = request("late", -2.0, context=100, slo=HOSTILE)
    prefill = request("p", 0.4, prefill=20_000)
    decision = form_batch([late, prefill], NOW, COEF)
    assert decision.decode_ids == ("late",)
    assert decision.time_budget_s == pytest.approx(FLOOR.min_serviceable_tpot_s)
    assert dict(decision.prefill_chunks)["p"] > 0  # the prompt still moves


def test_late_prefills_are_served_after_in_time_ones_in_arrival_order() -> None:
    """A tiny TTFT does not jump every queue."""
    jumper = request("jumper", -0.001, prefill=100, slo=Slo(0.001, 0.05), arrival_seq=9)
    older_late = request("older", -0.2, prefill=100, arrival_seq=1)
    in_time = request("in_time", 0.5, prefill=100, arrival_seq=5)
    decision = form_batch([jumper, older_late, in_time], NOW, COEF)
    assert [rid for rid, _ in decision.prefill_chunks] == ["in_time", "older", "jumper"]


def test_serviceability_is_the_doors_whatever_the_online_model_learns() -> None:
    """A class the door admitted stays in time when the online model's smallest step
    grows past half its TPOT; the guard's lower bound follows the online model."""
    slower = COEF.with_weights([0.03, 0.0001, 0.0])  # smallest step 30.1 ms
    floor = ServiceFloor.of(COEF, SLO.tpot_s, slower)
    assert floor.min_serviceable_tpot_s == pytest.approx(0.0102)
    assert floor.min_budget_s == pytest.approx(0.0602)
    decode = request("d", 0.02, context=100)  # TPOT 50 ms: below 2 x 30.1 ms
    groups = triage([decode], NOW, floor=floor)
    assert [r.req_id for _, r in groups.urgent_decodes + groups.deferrable_decodes] == ["d"]
    assert groups.late_decodes == []


def test_a_policy_whose_online_model_drifts_keeps_its_classes_serviceable() -> None:
    from sglang_ext.policy.step_shape import StepShape

    policy = POLICIES.get("fb-smooth")(PolicyContext(global_slo=SLO, initial_step_model=COEF))
    for batch in range(1, 200):
        shape = StepShape(0, 0.0, 0, batch % 8 + 1, 10 * (batch % 8 + 1), 0)
        policy.observe_step(shape, 0.045)  # a device whose decode step is 45 ms
    assert policy.step_model.coefficients.smallest_step_s > SLO.tpot_s / 2
    groups = policy._triage([request("d", 0.02, context=100)], NOW)
    assert groups.late_decodes == [] and groups.min_tpot_s == pytest.approx(SLO.tpot_s)


def test_the_deadline_guard_never_takes_the_budget_below_a_step_worth_running() -> None:
    floor = ServiceFloor.of(COEF, SLO.tpot_s, COEF.with_weights([0.02, 0.0001, 0.0]))
    decode = request("d", 0.5, context=100)
    prefill = request("p", 0.02, prefill=1000)  # the smallest slack: 20 ms
    groups = triage([decode, prefill], NOW, floor=floor, deadline_guard_s=0.03)
    assert groups.init_time_budget_s == pytest.approx(0.0402)  # 2 x 20.1 ms, not 50 - 30 ms
    assert triage([decode, prefill], NOW, floor=FLOOR, deadline_guard_s=0.03
                  ).init_time_budget_s == pytest.approx(0.02)


def test_with_nothing_in_time_the_budget_is_the_fallback() -> None:
    groups = triage([request("a", -1.0, prefill=50), request("b", -0.5)], NOW, floor=FLOOR)
    assert groups.init_time_budget_s == pytest.approx(FLOOR.fallback_budget_s)
    assert groups.urgent_decodes == [] and groups.prefills == []


@pytest.mark.parametrize("name", ["fb", "fb-fb", "fb-tb", "fb-pab", "fb-anchor-margin-pab"])
def test_every_fairbatching_policy_refuses_at_the_door_and_guards(name: str) -> None:
    policy = POLICIES.get(name)(PolicyContext(global_slo=SLO, initial_step_model=COEF))
    assert policy.refusal(HOSTILE) is not None and policy.refusal(SLO) is None
    hostile = request("hostile", -0.01, prefill=8000, slo=HOSTILE, arrival_seq=0)
    other = request("other", 1.5, prefill=1000, arrival_seq=1)
    decision = policy.form_batch([hostile, other], NOW)
    assert decision.prefill_chunks[0] == ("other", 1000)


@pytest.mark.parametrize("name", ["sarathi", "vllm-default", "sglang-default"])
def test_baselines_refuse_nothing_at_the_door(name: str) -> None:
    import sglang_ext.sim.competitors.baselines  # noqa: F401  (registers them)

    policy = POLICIES.get(name)(PolicyContext(global_slo=SLO, initial_step_model=COEF))
    assert policy.refusal(HOSTILE) is None
