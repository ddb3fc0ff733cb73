"""Tuning baselines to an interior best (``sglang_ext.sim.fitting.tuning``) and the admission
baselines it tunes."""

from __future__ import annotations

import math

import pytest
from sim_helpers import SLO, context_for, llama, make_policy, drive_search as drive

from sglang_ext.policy.view import RequestView
from sglang_ext.sim.engine import SimEngine
from sglang_ext.sim.runner import PolicySpecError, parse_policy
from sglang_ext.sim.fitting.tuning import REFINE_STEP, Axis, best_value, tune


def peaked(best: float, width: float = 1.0):
    """A score with one interior maximum at ``best`` (log-scale bump)."""
    return lambda value: (math.exp(-((math.log(value) - math.log(best)) / width) ** 2), 0.0)


def test_budget_search_finds_an_interior_best_refined_to_a_quarter() -> None:
    score = peaked(700)
    result = drive(tune("sarathi", context_for(llama()), None),
                   lambda spec: score(spec.token_budget))
    budgets = sorted(parse_policy(label).token_budget for label in result.tried)
    best = parse_policy(result.best).token_budget
    assert result.edge == []
    assert {32, 8192} <= set(budgets)  # the whole default grid was run
    index = budgets.index(best)
    assert best - budgets[index - 1] <= REFINE_STEP * best
    assert budgets[index + 1] - best <= REFINE_STEP * best
    assert 560 <= best <= 870


def test_a_best_at_the_bound_is_an_edge_and_never_widened() -> None:
    result = drive(tune("sarathi", context_for(llama()), None),
                   lambda spec: (float(spec.token_budget), 0.0))
    assert result.best == "sarathi@8192" and result.edge == ["budget"]
    assert max(parse_policy(label).token_budget for label in result.tried) == 8192


def test_explicit_budgets_are_searched_exactly() -> None:
    result = drive(tune("fb-fb", context_for(llama()), (100, 300)),
                   lambda spec: peaked(200)(spec.token_budget))
    assert sorted(result.tried) == ["fb-fb@100", "fb-fb@300"]
    assert result.edge == ["budget"]


def test_tie_rule_prefers_higher_mean_then_the_smaller_value() -> None:
    assert best_value({256: (10.0, 5.0), 512: (10.0, 6.0)}) == 512
    assert best_value({256: (10.0, 6.0), 512: (10.0, 6.0)}) == 256


def test_axis_expands_past_a_grid_edge_inside_its_bounds() -> None:
    axis = Axis("cap", (100.0, 200.0), (10.0, 1000.0), integer=True)
    assert axis.next_values({100.0: (2.0, 0.0), 200.0: (1.0, 0.0)}) == [50.0]
    assert axis.next_values({50.0: (3.0, 0.0), 100.0: (2.0, 0.0)}) == [25.0]


def test_two_axis_family_tunes_both_to_interior() -> None:
    context = context_for(llama())
    budget_score, cap_score = peaked(1500), peaked(40_000)
    result = drive(
        tune("sarathi-queue-cap", context, None),
        lambda spec: (budget_score(spec.token_budget)[0] * cap_score(dict(spec.settings)["cap"])[0], 0.0),
    )
    best = parse_policy(result.best)
    assert result.edge == []
    assert 1150 <= best.token_budget <= 1950
    assert 30_000 <= dict(best.settings)["cap"] <= 52_000


def test_a_setting_family_stuck_where_all_tie_is_freed_by_its_start_budget() -> None:
    """The H20 case: every budget above 192 fails its worst group (score 0) while its overall
    capacity grows with the budget, so a search that starts at 512 climbs away from the small
    budgets; started at plain Sarathi's best, it finds them."""
    def score(spec):
        budget = spec.token_budget
        return (0.0, budget / 10_000) if budget > 192 else (peaked(160)(budget)[0], 1.0)

    context = context_for(llama())
    stuck = parse_policy(drive(tune("sarathi-queue-timeout", context, None), score).best)
    freed = drive(tune("sarathi-queue-timeout", context, None, start_budget=160), score)
    assert stuck.token_budget >= 256
    assert 120 <= parse_policy(freed.best).token_budget <= 192
    assert "budget" not in freed.edge


def test_parse_policy_settings() -> None:
    spec = parse_policy("sarathi-queue-cap@1024,cap=32768")
    assert spec.token_budget == 1024 and spec.settings == (("cap", 32768.0),)
    assert spec.label == "sarathi-queue-cap@1024,cap=32768"
    assert parse_policy("sarathi-queue-timeout@256,timeout=1.5").label == (
        "sarathi-queue-timeout@256,timeout=1.5"
    )
    assert parse_policy("sarathi-queue-cap").is_tunable
    assert not parse_policy("sarathi@512").is_tunable
    assert parse_policy("fb+defer:latest").label == "fb+defer:latest"
    assert parse_policy("fb+defer:longest").label == "fb+defer"  # the default
    assert parse_policy("fb+reject:pab").label == "fb+reject:pab"
    assert parse_policy("fb+defer:0.25").label == "fb+defer:0.25"
    assert parse_policy("fb+defer:0.25").admission.length_weight == 0.25
    assert parse_policy("fb+defer:1").label == "fb+defer"  # the weight of "longest"
    assert parse_policy("fb+defer:max_defer=0.5").admission.max_defer_s == 0.5
    assert parse_policy("fb+defer:fair:max_defer=0.5").label == "fb+defer:fair:max_defer=0.5"
    assert parse_policy("fb+defer:max_defer=2").label == "fb+defer"  # the default
    assert parse_policy("fb+defer:headroom=0.2").admission.headroom == 0.2
    assert parse_policy("fb+defer:max_defer=0.1:headroom=0.2").label == (
        "fb+defer:max_defer=0.1:headroom=0.2")
    assert parse_policy("fb+reject:headroom=0.3").label == "fb+reject:headroom=0.3"
    assert parse_policy("fb+defer:headroom=0.1").label == "fb+defer"  # the default
    for bad in ("sarathi@512,cap=3", "sarathi-queue-cap@512,cap=-1", "fb@512",
                "sarathi-queue-cap@512,cap=x", "sarathi-queue-cap@cap=5,512",
                "fb+reject:latest", "fb+defer:latest:longest", "fb+defer:oldest",
                "fb+defer:1.5", "fb+defer:-0.5", "fb+defer:nan", "fb+reject:0.5",
                "fb+defer:max_defer=0", "fb+defer:max_defer=x", "fb+defer:wait=1",
                "fb+defer:max_defer=1:max_defer=2", "fb+reject:max_defer=1",
                "fb+defer:headroom=1", "fb+defer:headroom=-0.1", "fb+defer:headroom=x"):
        with pytest.raises(PolicySpecError):
            parse_policy(bad)


def test_queue_cap_default_is_ttft_times_prefill_throughput() -> None:
    policy = make_policy("sarathi-queue-cap", llama(), token_budget=1024)
    model = policy.context.initial_step_model
    assert policy.cap == pytest.approx(SLO.ttft_s * 1024 / model.predict(1024, 0))


def view(req_id: str, prompt: int, pending: int, arrival: float = 0.0, seq: int = 0) -> RequestView:
    context = prompt - pending
    return RequestView(req_id, arrival, SLO, 0, pending, context, prompt, seq)


def test_queue_cap_rejects_while_prefill_tokens_exceed_the_cap() -> None:
    policy = make_policy("sarathi-queue-cap", llama(), token_budget=512, settings=(("cap", 1000.0),))
    half_done = view("a", 800, 100)  # counted whole: 800
    assert policy.admit([half_done], 0.0, 5000, SLO)  # 800 <= 1000: admitted, whatever its size
    assert not policy.admit([half_done, view("b", 300, 300)], 0.0, 1, SLO)  # 1100 > 1000
    decoding = RequestView("c", 0.0, SLO, 3, 0, 5000, 5000, 0)
    assert policy.admit([half_done, decoding], 0.0, 1, SLO)  # decodes do not count


def test_queue_timeout_aborts_only_requests_never_started() -> None:
    profile = llama()
    policy = make_policy("sarathi-queue-timeout", profile, token_budget=256,
                         settings=(("timeout", 0.05),))
    engine = SimEngine(profile, policy, record_steps=True, check_invariants=True)
    for index in range(40):
        engine.submit(index, 0.0, 2000, 4, SLO)
    engine.run_until_idle(30.0)
    records = engine.records.values()
    aborted = [r for r in records if r.aborted]
    assert aborted and all(r.prefill_tokens_computed == 0 for r in aborted)
    assert all(r.finished for r in records if not r.aborted)
    assert sum(r.finished for r in records) >= 1
