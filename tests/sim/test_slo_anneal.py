"""SLO-aware annealing (seed ``slo_aware_annealing.txt``): its planner model and objective,
Algorithm 1's moves and stop, the step formation under the plan, and engine runs."""

from __future__ import annotations

import math
import random

import pytest
from sim_helpers import drive_search, llama, make_policy, synthetic_requests

from sglang_ext.policy.output_length import OutputEstimate
from sglang_ext.policy.policies import PolicySettingError
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_model import StepCoefficients
from sglang_ext.policy.view import RequestView
from sglang_ext.sim.competitors.slo_anneal import (
    DELAY,
    SQUEEZE,
    SWAP,
    AnnealSettings,
    Objective,
    Planner,
    PlanRequest,
    Running,
    acceptance_probability,
    anneal,
    change_bp,
    draw_output,
    full_batches,
    propose,
)
from sglang_ext.sim.engine import SimEngine
from sglang_ext.sim.fitting.tuning import tune
from sglang_ext.sim.runner import PolicySpecError, parse_policy

CHAT = Slo.from_ms(2000, 50)
CODE = Slo.end_to_end_ms(14000)
#: every step 10 ms whatever it computes: predictions are step counts x 10 ms
FLAT = StepCoefficients(0.01, 0.0, 0.0)


def request(key, prompt=100, output=11, waited=0.0, slo=CHAT, seq=None) -> PlanRequest:
    return PlanRequest(key, prompt, output, waited, slo, key if seq is None else seq)


# ------------------------------------------------------------------ the planner model
def test_sequential_batches_waiting_ttft_tpot_and_e2e():
    planner = Planner([request(0), request(1, waited=0.5)], FLAT, 8192)
    together, apart = planner.predict([[0, 1]]), planner.predict([[0], [1]])
    # one prefill step (10 ms), then 10 decode steps
    assert together[0].ttft_s == pytest.approx(0.01)
    assert together[0].e2e_s == pytest.approx(0.11)
    assert together[0].tpot_s == pytest.approx(0.01)
    assert together[1].e2e_s == pytest.approx(0.5 + 0.11)  # waited since arrival counts
    # apart: batch 2 waits for batch 1's prefill and decode (the paper's eq. 11)
    assert apart[1].ttft_s == pytest.approx(0.5 + 0.11 + 0.01)
    assert apart[1].e2e_s == pytest.approx(0.5 + 0.22)


def test_objective_is_attainment_over_mean_latency():
    planner = Planner([request(0), request(1)], FLAT, 8192)
    objective = planner.evaluate([[0], [1]])
    assert objective.met == 2 and objective.planned == 2
    assert objective.latency_sum_s == pytest.approx(0.11 + 0.22)
    assert objective.g == pytest.approx(objective.attainment / objective.mean_latency_s)
    assert objective.g == pytest.approx(1.0 / ((0.11 + 0.22) / 2))


def test_a_plan_meeting_every_slo_beats_one_that_misses():
    strict = Slo.from_ms(50, 50)  # first token within 50 ms
    loose = Slo.end_to_end_ms(10_000)
    planner = Planner([request(0, slo=loose), request(1, slo=strict)], FLAT, 8192)
    strict_first, strict_last = planner.evaluate([[1], [0]]), planner.evaluate([[0], [1]])
    assert (strict_first.met, strict_last.met) == (2, 1)
    assert strict_first.g > strict_last.g
    assert change_bp(strict_last, strict_first) > 0


def test_kinds_are_judged_by_their_own_targets():
    # an e2e request is judged by e2e alone (its envelope's TTFT / TPOT are not targets)
    slow_tpot = Slo.from_ms(2000, 5)  # 5 ms TPOT: a 10 ms step misses
    e2e = Slo.end_to_end_ms(1000, ttft_ms=1)  # its envelope's TTFT of 1 ms is no target
    planner = Planner([request(0, slo=slow_tpot), request(1, slo=e2e)], FLAT, 8192)
    assert [p.met for p in planner.predict([[0, 1]])] == [False, True]
    late = Planner([request(0, waited=0.95, slo=e2e)], FLAT, 8192)
    assert late.predict([[0]])[0].met is False  # 0.95 s waited + 0.11 s > 1 s


def test_running_requests_are_background_decode_load():
    model = StepCoefficients(0.005, 1e-4, 0.0)  # each decode in a step costs 0.1 ms
    alone = Planner([request(0)], model, 8192).predict([[0]])[0]
    # 20 running decodes with 100 tokens to go: in all 11 steps (1 prefill, 10 decode)
    busy = Planner([request(0)], model, 8192, [Running(0, 1000, 100)] * 20).predict([[0]])[0]
    assert busy.e2e_s == pytest.approx(alone.e2e_s + 11 * 20 * 1e-4)
    # ... with 1 token to go: only in the prefill step
    ending = Planner([request(0)], model, 8192, [Running(0, 1000, 1)] * 20).predict([[0]])[0]
    assert ending.ttft_s == pytest.approx(alone.ttft_s + 20 * 1e-4)
    assert ending.e2e_s == pytest.approx(alone.e2e_s + 20 * 1e-4)
    backlog = Planner([request(0)], FLAT, 8192, [Running(300, 0, 1)])
    assert backlog.backlog_s == pytest.approx(0.01)  # a started prefill runs first
    assert backlog.predict([[0]])[0].ttft_s == pytest.approx(0.02)


def test_prefill_phase_is_chunked_at_the_budget():
    planner = Planner([request(0, prompt=250, output=1)], FLAT, 100)
    assert planner.predict([[0]])[0].ttft_s == pytest.approx(0.03)  # 3 chunks of <= 100


# ------------------------------------------------------------------ moves
def test_squeeze_never_from_the_first_batch_nor_into_a_full_one():
    plan = [[0, 1], [2], [3]]
    assert propose(plan, SQUEEZE, 0, 0, cap=2) is None  # first batch
    assert propose(plan, SQUEEZE, 1, 0, cap=2) is None  # previous batch full
    assert propose(plan, SQUEEZE, 2, 0, cap=2) == [[0, 1], [2, 3]]  # emptied batch removed
    assert propose(plan, SQUEEZE, 1, 0, cap=3) == [[0, 1, 2], [3]]
    assert plan == [[0, 1], [2], [3]]  # the input is not mutated


def test_delay_only_into_a_next_batch_with_room():
    plan = [[0, 1], [2, 3], [4]]
    assert propose(plan, DELAY, 0, 1, cap=2) is None  # next batch full
    assert propose(plan, DELAY, 1, 1, cap=2) == [[0, 1], [2], [3, 4]]  # to the next's front
    assert propose(plan, DELAY, 2, 0, cap=2) is None  # alone in the last batch
    assert propose([[0, 1]], DELAY, 0, 0, cap=2) == [[1], [0]]  # a new last batch


def test_swap_exchanges_two_positions():
    plan = [[0, 1], [2]]
    assert propose(plan, SWAP, 0, 0, cap=2, other=(1, 0)) == [[2, 1], [0]]
    assert propose(plan, SWAP, 0, 1, cap=2, other=(0, 1)) is None  # the same position
    with pytest.raises(ValueError, match="unknown move"):
        propose(plan, "shuffle", 0, 0, cap=2)


def test_annealed_plans_respect_the_cap():
    rng = random.Random(3)
    requests = [request(i, prompt=rng.randint(10, 500), output=rng.randint(1, 40),
                        slo=Slo.from_ms(rng.choice((30, 200)), 50)) for i in range(9)]
    result = anneal(Planner(requests, FLAT, 8192), AnnealSettings(batch=3, iters=20),
                    random.Random(0))
    assert max(len(b) for b in result.plan) <= 3
    assert sorted(i for b in result.plan for i in b) == list(range(9))


# ------------------------------------------------------------------ Algorithm 1
def test_stops_when_the_latency_ordered_start_meets_every_slo():
    requests = [request(0, output=30), request(1, output=5)]
    planner = Planner(requests, FLAT, 8192)
    result = anneal(planner, AnnealSettings(batch=1), random.Random(0))
    assert result.stopped_early and result.evaluations == 2  # the two starts only
    assert result.plan == [[1], [0]]  # shortest predicted e2e first


def test_anneals_when_the_latency_order_misses_and_finds_the_better_order():
    # the short request's loose SLO and the long one's strict TTFT: latency order (short
    # first) misses the strict one; the search puts the strict one first
    strict_long = request(0, output=30, slo=Slo.from_ms(50, 50))
    loose_short = request(1, output=5, slo=Slo.end_to_end_ms(10_000))
    planner = Planner([strict_long, loose_short], FLAT, 8192)
    result = anneal(planner, AnnealSettings(batch=1, iters=10), random.Random(0))
    assert not result.stopped_early and result.evaluations > 2
    assert result.plan == [[0], [1]] and result.objective.met == 2


def test_acceptance_probability_grows_with_temperature():
    assert acceptance_probability(5.0, 1.0) == 1.0
    probabilities = [acceptance_probability(-100.0, t) for t in (1, 20, 100, 500, 5000)]
    assert probabilities == sorted(probabilities) and probabilities[0] < probabilities[-1] < 1
    # the normalisation: a plan 1% worse (-100 bp) at the paper's T0 = 500 and threshold 20
    assert acceptance_probability(-100.0, 500) == pytest.approx(math.exp(-0.2))
    assert acceptance_probability(-100.0, 20) == pytest.approx(math.exp(-5))


def test_change_in_basis_points_and_the_flat_zero_objective():
    base = Objective(0.5, 1, 2, 4.0)
    assert change_bp(base, Objective(0.55, 1, 2, 3.6)) == pytest.approx(1000)
    none = Objective(0.0, 0, 2, 4.0)
    assert change_bp(none, base) == math.inf  # any met beats none
    assert change_bp(none, Objective(0.0, 0, 2, 3.0)) == pytest.approx(2500)  # lower latency


def test_the_paper_hyperparameters_are_the_defaults():
    settings = AnnealSettings()
    paper = (settings.temp, settings.stop_temp, settings.iters, settings.decay)
    assert paper == (500, 20, 100, 0.95)
    assert settings.levels == 63
    assert AnnealSettings(temp=100, stop_temp=50, decay=0.5).levels == 2  # 100, 50


def test_the_short_variant_is_the_other_reading_a_tenth_of_the_search():
    full = make_policy("slo-anneal", llama()).settings
    short = make_policy("slo-anneal-short", llama()).settings
    assert (short.temp, short.stop_temp, short.iters, short.decay) == (500, 100, 20, 0.95)
    assert short.batch == full.batch and short.window == full.window
    assert short.levels * short.iters == 32 * 20
    assert short.levels * short.iters < full.levels * full.iters / 9


def test_annealing_runs_levels_times_iters_proposals():
    strict_long = request(0, output=30, slo=Slo.from_ms(50, 50))
    loose_short = request(1, output=5, slo=Slo.end_to_end_ms(10_000))
    settings = AnnealSettings(batch=1, temp=100, stop_temp=50, decay=0.5, iters=7)
    proposals = []

    class Counting(random.Random):
        def randrange(self, *args):
            if args == (3,):
                proposals.append(1)  # one move kind drawn per proposal
            return super().randrange(*args)

    anneal(Planner([strict_long, loose_short], FLAT, 8192), settings, Counting(0))
    assert len(proposals) == settings.levels * settings.iters == 14


# ------------------------------------------------------------------ output lengths
def test_output_draw_is_seeded_clipped_and_once_per_request():
    estimate = OutputEstimate(200.0, 80.0, 10)
    draws = [draw_output(estimate, 1, key) for key in range(200)]
    assert draws == [draw_output(estimate, 1, key) for key in range(200)]
    assert draws != [draw_output(estimate, 2, key) for key in range(200)]
    assert min(draws) >= 1 and 150 < sum(draws) / len(draws) < 250
    assert draw_output(OutputEstimate(-50.0, 1.0, 3), 1, "x") == 1  # clipped
    assert draw_output(OutputEstimate(41.6, 0.0, 3), 1, "x") == 42  # no spread: the mean
    assert draw_output(None, 1, "x") == 256  # the prior
    policy = make_policy("slo-anneal", llama())
    view = waiting_view(0)
    assert policy.predicted_output(view) == policy.predicted_output(view) == 256


# ------------------------------------------------------------------ the policy's steps
def waiting_view(i, prompt=100, arrival=None, slo=CHAT) -> RequestView:
    arrival = -0.1 + 0.01 * i if arrival is None else arrival
    return RequestView(i, arrival, slo, 0, prompt, 0, prompt, i)


def started_view(view: RequestView) -> RequestView:
    """``view`` after its whole prompt was prefilled and its first token emitted."""
    return RequestView(view.req_id, view.arrival, view.slo, 1, 0, view.prompt_tokens,
                       view.prompt_tokens, view.arrival_seq, 0.0)


def test_step_formation_starts_one_planned_batch_per_step_in_plan_order():
    policy = make_policy("slo-anneal", llama(), settings=(("batch", 2.0),))
    views = [waiting_view(i, prompt=50 + 10 * i) for i in range(5)]
    decision = policy.form_batch(views, 0.0)
    plan = [list(b) for b in policy.plan]
    assert max(len(b) for b in plan) <= 2 and sorted(k for b in plan for k in b) == list(range(5))
    # only the head batch starts, in plan order, although the budget has room for all
    assert [k for k, _ in decision.prefill_chunks] == plan[0]
    assert decision.decode_ids == ()
    # once they are seen started, the next batch: no re-plan without an arrival
    state = [started_view(v) if v.req_id in plan[0] else v for v in views]
    decision = policy.form_batch(state, 0.02)
    assert policy.plans == 1
    assert [k for k, _ in decision.prefill_chunks] == plan[1]
    assert set(decision.decode_ids) == set(plan[0])


def test_a_partly_started_prefill_continues_before_the_next_batch():
    policy = make_policy("slo-anneal", llama(), token_budget=300, settings=(("batch", 2.0),))
    views = [waiting_view(i, prompt=200) for i in range(4)]
    first = policy.form_batch(views, 0.0)
    head, second = policy.plan[0], policy.plan[1]
    assert [(k, n) for k, n in first.prefill_chunks] == [(head[0], 200), (head[1], 100)]
    # head[1] got 100 of its 200 tokens: it continues first, then the next batch (every
    # member of the head batch has started), in the 300 - 1 decode - 100 tokens left
    state = [started_view(v) if v.req_id == head[0] else v for v in views]
    state = [RequestView(v.req_id, v.arrival, v.slo, 0, 100, 100, 200, v.arrival_seq)
             if v.req_id == head[1] else v for v in state]
    decision = policy.form_batch(state, 0.02)
    assert decision.prefill_chunks == ((head[1], 100), (second[0], 199))
    assert decision.decode_ids == (head[0],)
    assert policy.plan[0] == second and policy.plans == 1


def test_replans_on_arrival_and_when_the_annealed_part_has_started():
    policy = make_policy("slo-anneal", llama(), settings=(("batch", 1.0), ("window", 2.0)))
    views = [waiting_view(i) for i in range(3)]
    policy.form_batch(views, 0.0)
    assert policy.plans == 1
    assert policy.plan[-1] == [2]  # beyond the window: after the annealed batches
    first = policy.plan[0]
    state = [started_view(v) if v.req_id == first[0] else v for v in views]
    policy.form_batch(state, 0.01)
    assert policy.plans == 1  # following the plan
    state = state + [waiting_view(3, arrival=0.015)]
    policy.form_batch(state, 0.02)
    assert policy.plans == 2  # an arrival
    annealed = [k for b in policy.plan for k in b if k in policy._annealed]
    state = [started_view(v) if v.req_id in annealed else v for v in state]
    policy.form_batch(state, 0.03)
    assert policy.plans == 3  # the annealed part has all started while others wait


@pytest.mark.slow
def test_same_seed_same_decisions():
    def decisions(seed):
        policy = make_policy("slo-anneal", llama(), settings=(("seed", float(seed)),))
        engine = SimEngine(llama(), policy, seed=0)
        seen = []
        original = policy.form_batch

        def recording(requests, now):
            decision = original(requests, now)
            seen.append((decision.decode_ids, decision.prefill_chunks))
            return decision

        policy.form_batch = recording
        for r in synthetic_requests(60, 40.0, seed=4):
            engine.submit(r.req_id, r.arrival, r.prompt, r.output,
                          CHAT if r.req_id % 2 else CODE, "chat" if r.req_id % 2 else "code")
        engine.run_until_idle(600.0)
        return seen, policy.plans

    first, again = decisions(7), decisions(7)
    assert first == again and first[1] > 1


# ------------------------------------------------------------------ settings
@pytest.mark.parametrize("spec, message", [
    ("slo-anneal@512,batch=1.5", "batch must be a whole number"),
    ("slo-anneal@512,decay=1.5", r"decay must be in \(0, 1\)"),
    ("slo-anneal@512,temp=10,stop_temp=20", "stop_temp .* must be below temp"),
    ("slo-anneal@512,window=2.5", "window must be a whole number"),
])
def test_bad_settings_are_refused(spec, message):
    parsed = parse_policy(spec)
    with pytest.raises(PolicySettingError, match=message):
        make_policy("slo-anneal", llama(), token_budget=parsed.token_budget,
                    settings=parsed.settings)


def test_unknown_setting_and_defaults():
    with pytest.raises(PolicySpecError, match="no setting 'cool'"):
        parse_policy("slo-anneal@512,cool=2")
    policy = make_policy("slo-anneal", llama())
    assert policy.token_budget == 8192 and policy.settings == AnnealSettings()


def test_a_sweep_tunes_the_budget_and_batch_only():
    policy = make_policy("slo-anneal", llama())

    def score(spec):
        batch = dict(spec.settings)["batch"]
        return (10.0 - abs(batch - 4) - abs(math.log2(spec.token_budget / 1024)), 0.0)

    result = drive_search(tune("slo-anneal", policy.context, None), score)
    assert result.best == "slo-anneal@1024,batch=4"
    assert all(set(dict(parse_policy(label).settings)) == {"batch"} for label in result.tried)
    assert result.edge == []


# ------------------------------------------------------------------ engine runs
@pytest.mark.slow
def test_mixed_chat_and_e2e_workload_runs_to_completion():
    policy = make_policy("slo-anneal", llama(), token_budget=512, settings=(("iters", 20.0),))
    engine = SimEngine(llama(), policy, seed=0, check_invariants=True)
    requests = synthetic_requests(120, 30.0, seed=2)
    for r in requests:
        slo, name = (CODE, "code") if r.req_id % 3 == 0 else (CHAT, "chat")
        assert engine.submit(r.req_id, r.arrival, r.prompt, r.output, slo, slo_class=name)
    engine.run_until_idle(600.0)
    records = engine.records.values()
    assert all(record.finished for record in records)
    assert policy.plans > 1 and policy.evaluations > 2 * policy.plans  # it annealed
    e2e_met = [record.finish_s - record.arrival <= CODE.e2e_s
               for record in records if record.slo_class == "code"]
    assert sum(e2e_met) / len(e2e_met) > 0.9


def test_full_batches_and_the_arrival_start():
    assert full_batches([3, 1, 2, 0, 4], 2) == [[3, 1], [2, 0], [4]]


def test_the_cli_reports_a_bad_setting_as_a_usage_error(tmp_path, capsys):
    from sglang_ext.sim.commands import main

    argv = ["run", "--policy", "slo-anneal@512,decay=2", "--head-seconds", "10",
            "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "decay must be in (0, 1)" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_the_cli_runs_it_on_a_class_mix(tmp_path):
    from sglang_ext.sim.commands import main

    out, slo_file = tmp_path / "out", tmp_path / "slo.toml"
    slo_file.write_text('default_class = "chat"\n[classes.chat]\nttft_ms = 2000\ntpot_ms = 50\n'
                        '[classes.code]\ne2e_ms = 14000\n')
    argv = ["run", "--policy", "slo-anneal@512,iters=10", "--head-seconds", "20", "--rate", "20",
            "--slo-config", str(slo_file), "--class-mix", "chat:0.5,code:0.5", "--out", str(out)]
    assert main(argv) == 0
    assert (out / "results.json").exists()
