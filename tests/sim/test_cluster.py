"""The cluster simulator: N ranks behind the control plane's balancer and PAB ledger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sim_helpers import CATALOG, llama, synthetic_workload

from controlplane.balancer import BALANCERS
from sglang_ext.policy.slo import Slo, SloCatalog
from sglang_ext.sim.commands import main
from sglang_ext.sim.cluster import (
    ClusterConfig,
    ClusterConfigError,
    ClusterSimulation,
    simulate_cluster,
)
from sglang_ext.sim.runner import PolicySpec, Scenario, parse_policy, simulate
from sglang_ext.sim.workloads import TraceRequest, Workload

TIGHT = SloCatalog.single(Slo.from_ms(200, 50), "tight")  # PAB of an idle rank ~ 9k tokens


def scenario(workload: Workload, catalog: SloCatalog = CATALOG, drain_s: float = 120.0) -> Scenario:
    return Scenario(workload=workload, profile=llama(), catalog=catalog, drain_s=drain_s)


def burst(count: int, prompt: int, output: int = 20, gap_s: float = 1e-4) -> Workload:
    return Workload(
        tuple(TraceRequest(i * gap_s, prompt, output) for i in range(count)), "burst"
    )


def run(
    workload: Workload, ranks: int, balancer: str, *, policy: str = "fb-anchor-margin",
    catalog: SloCatalog = CATALOG, rate: float | None = None, **config,
) -> ClusterSimulation:
    simulation = ClusterSimulation(
        scenario(workload, catalog), parse_policy(policy), ClusterConfig(ranks, balancer, **config)
    )
    simulation.run(rate or workload.mean_rate)
    return simulation


def check_conservation(simulation: ClusterSimulation, count: int) -> None:
    by_rank = [set(rank.engine.records) for rank in simulation.ranks]
    rejected = set(simulation.rejected_by_dispatcher)
    seen = [*rejected]
    for ids in by_rank:
        seen.extend(ids)
    assert sorted(seen) == list(range(count)), "every request exactly once"
    assert set(simulation.placement) == set().union(*by_rank)
    for index, rank in simulation.placement.items():
        assert index in by_rank[rank]
    for record in simulation.records.values():
        assert record.rejected or record.aborted or record.finished
    counters = simulation.counters
    assert counters["queue_timeout"] + counters["overloaded"] + counters["no_budget"] == len(rejected)
    assert [rank.dispatched for rank in simulation.ranks] == [len(ids) for ids in by_rank]
    for rank in simulation.ranks:
        assert simulation.ledger.outstanding_dispatches(rank.name) == 0, "debits reconciled"


@pytest.mark.parametrize("balancer", BALANCERS)
def test_every_request_finishes_or_is_rejected_exactly_once(balancer: str) -> None:
    workload = synthetic_workload(60)
    simulation = run(workload, 3, balancer, rate=40.0)
    check_conservation(simulation, len(workload))
    assert sum(rank.dispatched for rank in simulation.ranks) == len(workload)
    assert all(rank.dispatched > 0 for rank in simulation.ranks)


def test_pab_queues_times_out_and_overflows_without_losing_a_request() -> None:
    workload = burst(40, prompt=3000, output=30)
    simulation = run(
        workload, 2, "pab", policy="fb-anchor-margin-pab", catalog=TIGHT,
        queue_ttl_s=0.3, max_queued=12,
    )
    check_conservation(simulation, len(workload))
    counters = simulation.counters
    assert counters["queued"] > 0
    assert counters["dispatched_from_queue"] > 0
    assert counters["queue_timeout"] > 0
    assert counters["overloaded"] > 0
    load = simulation.load(workload.mean_rate)
    assert load["rejected"] >= load["rejected_by_dispatcher"] > 0
    assert load["attainment"] < 1.0


def test_a_queued_request_waits_at_most_its_ttft_target_as_in_the_daemon() -> None:
    workload = burst(40, prompt=3000, output=30)
    simulation = run(workload, 2, "pab", policy="fb-anchor-margin-pab", catalog=TIGHT, queue_ttl_s=5.0)
    check_conservation(simulation, len(workload))
    ttft_s = TIGHT.default.ttft_s
    assert simulation.counters["queue_timeout"] > 0
    assert max(simulation.queue_waits_s) <= ttft_s  # not queue_ttl_s: it would miss its SLO anyway


def test_the_head_of_the_queue_does_not_hold_back_a_request_that_fits() -> None:
    big = [TraceRequest(i * 1e-4, 6000, 30) for i in range(6)]
    small = [TraceRequest(0.001 + i * 1e-4, 300, 30) for i in range(6)]
    workload = Workload(tuple(big + small), "big then small")
    simulation = run(workload, 1, "pab", policy="fb-anchor-margin-pab", catalog=TIGHT, queue_ttl_s=5.0)
    check_conservation(simulation, len(workload))
    order = list(simulation.placement)  # dispatch order
    later_bigs = [order.index(index) for index in range(1, len(big)) if index in simulation.placement]
    first_smalls = [order.index(index) for index in range(len(big), len(big) + 5)]
    assert max(first_smalls) < min(later_bigs, default=len(order))  # a FIFO queue sent them last


def test_pab_never_dispatches_a_prompt_the_effective_budget_cannot_cover() -> None:
    workload = burst(40, prompt=3000, output=30)
    simulation = ClusterSimulation(
        scenario(workload, TIGHT), parse_policy("fb-anchor-margin"), ClusterConfig(3, "pab")
    )
    choose = simulation.balancer.choose
    chosen_budgets: list[tuple[float, int]] = []

    def recording_choose(views, prompt_tokens, slo_class=None):
        rank = choose(views, prompt_tokens, slo_class)
        if rank is not None:
            budget = next(view.budget(slo_class) for view in views if view.rank == rank)
            chosen_budgets.append((budget, prompt_tokens))
        return rank

    simulation.balancer.choose = recording_choose
    simulation.run(workload.mean_rate)
    assert chosen_budgets and all(budget >= prompt for budget, prompt in chosen_budgets)
    assert simulation.counters["queued"] > 0


@pytest.mark.parametrize("on_no_budget", ["reject", "spill"])
def test_no_covering_budget_rejects_or_spills_instead_of_queueing(on_no_budget: str) -> None:
    workload = burst(40, prompt=3000, output=30)
    simulation = run(workload, 3, "pab_least_loaded", catalog=TIGHT, on_no_budget=on_no_budget)
    check_conservation(simulation, len(workload))
    counters = simulation.counters
    assert counters["queued"] == 0
    if on_no_budget == "reject":
        assert counters["no_budget"] > 0 and counters["spilled"] == 0
        assert len(simulation.placement) == len(workload) - counters["no_budget"]
    else:
        assert counters["spilled"] > 0 and counters["no_budget"] == 0
        assert len(simulation.placement) == len(workload)
        assert sorted(rank.dispatched for rank in simulation.ranks)[0] >= 12  # still spread


def resubmitting(workload: Workload, **config) -> tuple[ClusterSimulation, dict[int, tuple[float, int]]]:
    """A run whose dispatches are recorded: request -> (when, on which submission)."""
    simulation = ClusterSimulation(scenario(workload, TIGHT), parse_policy("fb-anchor-margin"),
                                   ClusterConfig(3, "pab_least_loaded", client_retries=3, **config))
    dispatched: dict[int, tuple[float, int]] = {}
    dispatch = simulation._dispatch

    def recording(now, queued, rank) -> None:
        dispatched[queued.index] = (now, queued.attempts)
        dispatch(now, queued, rank)

    simulation._dispatch = recording
    simulation.run(workload.mean_rate)
    check_conservation(simulation, len(workload))
    return simulation, dispatched


def test_a_refused_request_is_resubmitted_as_the_gateway_sdk_does() -> None:
    workload = burst(40, prompt=3000, output=30)
    once = run(workload, 3, "pab_least_loaded", catalog=TIGHT, on_no_budget="reject")
    retried, dispatched = resubmitting(workload, on_no_budget="reject")
    counters = retried.counters
    assert len(retried.placement) > len(once.placement)
    assert counters["no_budget"] < once.counters["no_budget"]
    # a request refused for good was submitted 1 + 3 times; a placed one at most that often
    assert 3 * counters["no_budget"] <= counters["retries"] <= 3 * len(workload)
    late = {index: at for index, at in dispatched.items() if at[1] > 1}
    assert late
    for index, (now, attempts) in late.items():
        assert attempts <= 4
        waited = now - workload.requests[index].arrival_s
        assert waited >= (attempts - 1) * retried.cluster.retry_after_s
    again, _ = resubmitting(workload, on_no_budget="reject")
    assert again.placement == retried.placement  # the jitter is the run's seed's


def test_a_resubmitted_request_is_never_queued_past_its_ttft_target() -> None:
    workload = burst(40, prompt=3000, output=30)
    simulation, _ = resubmitting(workload, on_no_budget="queue", queue_ttl_s=5.0)
    counters = simulation.counters
    assert counters["retries"] > 0 and counters["queue_timeout"] > 0
    assert counters["queued"] <= len(workload)  # a timed-out request is refused at once
    assert max(simulation.queue_waits_s) <= TIGHT.default.ttft_s


def test_pab_spreads_a_burst_across_ranks_between_reports() -> None:
    # 16 arrivals within 1.6 ms: no report reaches the dispatcher before the last one,
    # so only the ledger's debits can spread them.
    simulation = run(burst(16, prompt=2000), 4, "pab")
    assert [rank.dispatched for rank in simulation.ranks] == [4, 4, 4, 4]
    assert simulation.counters["queued"] == 0


def test_round_robin_takes_turns() -> None:
    simulation = run(burst(10, prompt=500), 4, "round_robin")
    assert [rank.dispatched for rank in simulation.ranks] == [3, 3, 2, 2]
    assert [simulation.placement[i] for i in range(5)] == [0, 1, 2, 3, 0]


@pytest.mark.parametrize("balancer", ["round_robin", "request_count", "pab"])
def test_one_rank_equals_a_single_engine_run(balancer: str) -> None:
    workload = synthetic_workload(50)
    rate = 6.0
    single = simulate(scenario(workload), PolicySpec("fb-anchor-margin"), rate).load
    cluster = simulate_cluster(
        scenario(workload), PolicySpec("fb-anchor-margin"), rate, ClusterConfig(1, balancer)
    ).load
    assert cluster["queued"] == 0
    for key in (
        "requests", "attainment", "effective_rps", "envelope_attainment", "ttft_attainment",
        "tpot_attainment", "rejected", "aborted", "unfinished", "preemptions",
        "recomputed_tokens", "output_tokens_per_s", "ttft_ms", "tpot_ms", "mean_tpot_ms",
        "max_tbt_ms", "steps",
    ):
        assert cluster[key] == single[key], key


def test_report_delay_only_changes_when_the_dispatcher_learns() -> None:
    workload = synthetic_workload(40)
    for delay in (0.0, 0.05):
        simulation = run(workload, 2, "request_count", rate=20.0, report_delay_s=delay)
        check_conservation(simulation, len(workload))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"ranks": 0, "balancer": "pab"}, "ranks must be >= 1"),
        ({"ranks": 2, "balancer": "nope"}, "unknown balancer 'nope'; expected one of pab"),
        ({"ranks": 2, "balancer": "pab", "report_delay_s": -1.0}, "report delay"),
        ({"ranks": 2, "balancer": "pab", "queue_ttl_s": 0.0}, "queue TTL"),
        ({"ranks": 2, "balancer": "pab", "max_queued": 0}, "max queued"),
        ({"ranks": 2, "balancer": "pab", "on_no_budget": "drop"},
         "unknown on_no_budget 'drop'; expected one of reject, queue, spill"),
        ({"ranks": 2, "balancer": "pab", "client_retries": -1}, "client retries must be >= 0"),
        ({"ranks": 2, "balancer": "pab", "retry_after_s": float("nan")}, "retry_after_s"),
    ],
)
def test_config_errors_say_what_is_wrong(fields: dict, message: str) -> None:
    with pytest.raises(ClusterConfigError, match=message):
        ClusterConfig(**fields)


# ------------------------------------------------------------------ CLI
def test_cluster_command_writes_a_results_document(tmp_path: Path, capsys) -> None:
    code = main([
        "cluster", "--ranks", "3", "--balancer", "request_count", "--policy", "sarathi@512",
        "--rate", "20", "--head-seconds", "15", "--out", str(tmp_path),
    ])
    assert code == 0
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["cluster"]["ranks"] == 3
    assert document["cluster"]["balancer"] == "request_count"
    label = "sarathi@512 + request_count"
    assert document["requested"] == [label]
    (load,) = document["policies"][label]["loads"]
    assert load["rate"] == 20.0
    assert len(load["dispatched_per_rank"]) == 3
    assert sum(load["dispatched_per_rank"]) == load["requests"]
    assert label in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ranks", "0"], "--ranks: expected an integer >= 1"),
        (["--ranks", "two"], "--ranks: expected an integer"),
        (["--balancer", "least"], "invalid choice: 'least'"),
        (["--report-delay-ms", "-5"], "--report-delay-ms: expected a number >= 0"),
        (["--queue-ttl", "0"], "--queue-ttl: expected a number > 0"),
        (["--client-retries", "-1"], "--client-retries: expected an integer >= 0"),
    ],
)
def test_cluster_command_rejects_bad_flags(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["cluster", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cluster_command_reports_a_bad_policy_in_one_line(capsys) -> None:
    assert main(["cluster", "--policy", "fb@12", "--head-seconds", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: policy 'fb' takes no token budget")
    assert "Traceback" not in err


THREE_CLASSES = SloCatalog("standard", {
    "interactive": Slo.from_ms(300, 50), "standard": Slo.from_ms(2000, 50),
    "relaxed": Slo.from_ms(8000, 200),
})


@pytest.mark.parametrize("balancer", ["pab", "pab_least_loaded"])
def test_pab_balancers_judge_each_request_by_its_own_class_budget(balancer: str) -> None:
    names = ("interactive", "standard", "relaxed", None)
    workload = Workload(tuple(
        TraceRequest(i * 0.01, 2500, 20, names[i % 4]) for i in range(120)
    ), "mixed")
    simulation = ClusterSimulation(
        scenario(workload, THREE_CLASSES), parse_policy("fb-anchor-margin"),
        ClusterConfig(2, balancer),
    )
    choose = simulation.balancer.choose
    calls: list[tuple[str | None, float, float, int]] = []

    def recording_choose(views, prompt_tokens, slo_class=None):
        assert all(set(view.class_budgets) == set(THREE_CLASSES.classes) for view in views)
        rank = choose(views, prompt_tokens, slo_class)
        if rank is not None:
            view = next(v for v in views if v.rank == rank)
            calls.append((slo_class, view.budget(slo_class), view.pab_tokens, prompt_tokens))
        return rank

    simulation.balancer.choose = recording_choose
    simulation.run(workload.mean_rate)
    check_conservation(simulation, len(workload.requests))
    assert {slo_class for slo_class, _, _, _ in calls} == set(names)
    assert all(budget >= prompt for _, budget, _, prompt in calls)
    tight = [(budget, default) for slo_class, budget, default, _ in calls if slo_class == "interactive"]
    assert any(budget < default for budget, default in tight)  # judged by its own, smaller budget


def test_non_pab_balancers_ask_for_no_class_budgets() -> None:
    simulation = run(burst(4, 500), 2, "round_robin", catalog=THREE_CLASSES)
    assert all(rank.last_report.class_budgets == {} for rank in simulation.ranks)


def test_cluster_command_routes_a_class_mix(tmp_path: Path) -> None:
    code = main([
        "cluster", "--ranks", "2", "--balancer", "pab_least_loaded", "--policy", "fb-anchor-margin",
        "--rate", "30", "--head-seconds", "20", "--out", str(tmp_path),
        "--class-mix", "interactive:0.2,standard:0.5,relaxed:0.3", "--on-no-budget", "reject",
        "--client-retries", "3",
    ])
    assert code == 0
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["cluster"]["client_retries"] == 3
    (load,) = document["policies"]["fb-anchor-margin + pab_least_loaded"]["loads"]
    assert min(load["dispatched_per_rank"]) > 0
    assert sum(load["dispatched_per_rank"]) + load["rejected_by_dispatcher"] == load["requests"]
