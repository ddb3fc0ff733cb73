from __future__ import annotations

from collections import Counter
from typing import get_args

import pytest

from controlplane.balancer import BALANCERS, RankView, least_in_flight, make_balancer, routing_class
from controlplane.config import PolicyName


def view(
    rank: str, pab: float | None = None, running: int = 0, waiting: int = 0,
    total_tokens: int = 0, in_flight: int = 0,
) -> RankView:
    return RankView(rank, pab, running, waiting, total_tokens, in_flight)


def test_the_names_are_the_configs_policies() -> None:
    assert BALANCERS == (
        "pab", "pab_least_loaded", "pab_cache_aware", "cache_aware", "round_robin",
        "request_count", "total_tokens", "power_of_two",
    )
    assert set(BALANCERS) == set(get_args(PolicyName))
    for name in BALANCERS:
        assert make_balancer(name).name == name


def test_only_the_pab_policies_route_on_budget() -> None:
    routes = {name for name in BALANCERS if make_balancer(name).routes_on_budget}
    assert routes == {"pab", "pab_least_loaded", "pab_cache_aware"}
    empty_budgets = [view("a", pab=10.0), view("b", pab=5.0)]
    for name in BALANCERS:
        declined = make_balancer(name).choose(empty_budgets, 100) is None
        assert declined == (name in routes), name


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown balancer 'least_loaded'") as error:
        make_balancer("least_loaded")
    for name in BALANCERS:
        assert name in str(error.value)


@pytest.mark.parametrize("name", BALANCERS)
def test_no_ranks_means_no_choice(name: str) -> None:
    assert make_balancer(name).choose([], 100) is None


@pytest.mark.parametrize("name", BALANCERS)
def test_a_single_rank_that_can_take_it_is_chosen(name: str) -> None:
    assert make_balancer(name).choose([view("only", pab=1000)], 100) == "only"


# ---------------------------------------------------------------- pab
def test_pab_takes_the_largest_covering_budget() -> None:
    ranks = [view("a", pab=500), view("b", pab=3000), view("c", pab=1200)]
    assert make_balancer("pab").choose(ranks, 1000) == "b"


def test_pab_declines_when_no_budget_covers_the_prompt() -> None:
    ranks = [view("a", pab=999), view("b", pab=-50), view("c", pab=None)]
    assert make_balancer("pab").choose(ranks, 1000) is None


def test_pab_budget_equal_to_the_prompt_covers_it() -> None:
    assert make_balancer("pab").choose([view("a", pab=1000)], 1000) == "a"


def test_pab_skips_ranks_that_never_reported() -> None:
    ranks = [view("a", pab=None), view("b", pab=100)]
    assert make_balancer("pab").choose(ranks, 50) == "b"


def test_pab_ties_go_to_the_first_given() -> None:
    ranks = [view("c", pab=800), view("a", pab=800), view("b", pab=800)]
    assert make_balancer("pab").choose(ranks, 100) == "c"
    assert make_balancer("pab").choose(ranks[::-1], 100) == "b"


def test_pab_ignores_the_other_load_signals() -> None:
    ranks = [view("busy", pab=5000, running=90, waiting=40, in_flight=130), view("idle", pab=4000)]
    assert make_balancer("pab").choose(ranks, 100) == "busy"


# ---------------------------------------------------------------- pab, least loaded
def test_pab_least_loaded_filters_by_budget_then_takes_the_least_loaded() -> None:
    balancer = make_balancer("pab_least_loaded")
    # scores (waiting*4 + running): big 0, idle 0 -- but neither covers 1000 tokens;
    # among the covering ones, b (1*4 + 1 = 5) beats a (0*4 + 7 = 7) and c (2*4 + 0 = 8),
    # though c has by far the largest budget (pab's choice).
    ranks = [
        view("big", pab=999), view("idle", pab=None),
        view("a", pab=1000, running=7), view("b", pab=1500, running=1, waiting=1),
        view("c", pab=90_000, waiting=2),
    ]
    assert {balancer.choose(ranks, 1000) for _ in range(len(ranks) * 2)} == {"b"}
    assert make_balancer("pab").choose(ranks, 1000) == "c"


def test_pab_least_loaded_declines_when_no_budget_covers_the_prompt() -> None:
    balancer = make_balancer("pab_least_loaded")
    ranks = [view("a", pab=999), view("b", pab=-50), view("c", pab=None, running=0)]
    assert [balancer.choose(ranks, 1000) for _ in range(4)] == [None] * 4
    assert balancer.choose(ranks, 999) == "a"  # a budget equal to the prompt covers it


def test_pab_least_loaded_rotates_the_tie_break() -> None:
    balancer = make_balancer("pab_least_loaded")
    ranks = [
        view("a", pab=5000, running=2), view("b", pab=800, running=2),
        view("c", pab=5000, running=2), view("d", pab=5000, running=9),
        view("e", pab=10, running=0),  # the least loaded, but its budget does not cover
    ]
    chosen = [balancer.choose(ranks, 500) for _ in range(10)]
    assert set(chosen) == {"a", "b", "c"}  # equal load: the budgets' sizes do not matter
    assert chosen[:3] == ["a", "b", "c"]


def test_pab_least_loaded_counts_dispatches_the_reports_miss() -> None:
    # waiting includes the dispatches since the last report: a burst spreads at once
    balancer = make_balancer("pab_least_loaded")
    ranks = [view("a", pab=50_000, running=3), view("b", pab=40_000, running=3, waiting=1)]
    assert {balancer.choose(ranks, 100) for _ in range(4)} == {"a"}


# ---------------------------------------------------------------- round robin
def test_round_robin_rotates_in_sorted_name_order() -> None:
    balancer = make_balancer("round_robin")
    ranks = [view("c"), view("a"), view("b")]
    assert [balancer.choose(ranks, 1) for _ in range(5)] == ["a", "b", "c", "a", "b"]


def test_round_robin_keeps_its_place_when_the_set_changes() -> None:
    balancer = make_balancer("round_robin")
    assert balancer.choose([view("a"), view("b"), view("c"), view("d")], 1) == "a"
    assert balancer.choose([view("a"), view("b"), view("c"), view("d")], 1) == "b"
    # b went stale and c left: the next name after b is d.
    assert balancer.choose([view("a"), view("d")], 1) == "d"
    assert balancer.choose([view("a"), view("d")], 1) == "a"
    # a new rank between a and d joins the rotation in its place.
    assert balancer.choose([view("a"), view("b"), view("d")], 1) == "b"


def test_round_robin_ignores_load() -> None:
    balancer = make_balancer("round_robin")
    ranks = [view("a", waiting=100, pab=-1), view("b")]
    assert [balancer.choose(ranks, 10**6) for _ in range(2)] == ["a", "b"]


# ---------------------------------------------------------------- request count
def test_request_count_weighs_waiting_four_times_running() -> None:
    balancer = make_balancer("request_count")
    # scores: a = 1*4 + 0 = 4, b = 0*4 + 3 = 3, c = 0*4 + 5 = 5
    ranks = [view("a", waiting=1), view("b", running=3), view("c", running=5)]
    assert balancer.choose(ranks, 100) == "b"


def test_request_count_rotates_the_tie_break() -> None:
    balancer = make_balancer("request_count")
    ranks = [view("a", running=2), view("b", running=2), view("c", running=2), view("d", running=9)]
    chosen = [balancer.choose(ranks, 1) for _ in range(8)]
    assert set(chosen) == {"a", "b", "c"}
    assert chosen[:3] == ["a", "b", "c"]
    # never the worse one, whatever the start index
    assert "d" not in chosen


def test_request_count_lowest_wins_whatever_the_start_index() -> None:
    balancer = make_balancer("request_count")
    ranks = [view("a", running=3), view("b", running=1), view("c", running=2)]
    assert {balancer.choose(ranks, 1) for _ in range(6)} == {"b"}


# ---------------------------------------------------------------- total tokens
def test_total_tokens_picks_the_fewest_tokens_held() -> None:
    balancer = make_balancer("total_tokens")
    ranks = [view("a", total_tokens=9000, running=1), view("b", total_tokens=4000, running=30)]
    assert {balancer.choose(ranks, 1) for _ in range(4)} == {"b"}


def test_total_tokens_rotates_the_tie_break() -> None:
    balancer = make_balancer("total_tokens")
    ranks = [view("a", total_tokens=5), view("b", total_tokens=5)]
    assert [balancer.choose(ranks, 1) for _ in range(4)] == ["a", "b", "a", "b"]


# ---------------------------------------------------------------- power of two
def test_power_of_two_takes_the_fewer_in_flight_of_its_two_draws() -> None:
    balancer = make_balancer("power_of_two", seed=3)
    ranks = [view("a", in_flight=0), view("b", in_flight=10), view("c", in_flight=20)]
    chosen = Counter(balancer.choose(ranks, 1) for _ in range(300))
    # c loses every draw it is in, a wins every draw it is in; b wins only against c.
    assert "c" not in chosen
    assert chosen["a"] > chosen["b"] > 0


def test_power_of_two_with_two_ranks_always_takes_the_lighter() -> None:
    balancer = make_balancer("power_of_two", seed=1)
    ranks = [view("a", in_flight=5), view("b", in_flight=4)]
    assert {balancer.choose(ranks, 1) for _ in range(20)} == {"b"}


def test_power_of_two_is_reproducible_from_its_seed() -> None:
    ranks = [view(str(i)) for i in range(8)]
    first = make_balancer("power_of_two", seed=7)
    second = make_balancer("power_of_two", seed=7)
    other = make_balancer("power_of_two", seed=8)
    draws = [first.choose(ranks, 1) for _ in range(50)]
    assert draws == [second.choose(ranks, 1) for _ in range(50)]
    assert draws != [other.choose(ranks, 1) for _ in range(50)]


# ---------------------------------------------------------------- fallback
def test_least_in_flight_takes_the_fewest_below_the_cap() -> None:
    ranks = [view("a", in_flight=3), view("b", in_flight=1), view("c", in_flight=2)]
    assert least_in_flight(ranks, cap=4) == "b"


def test_least_in_flight_ties_go_to_the_first_given() -> None:
    ranks = [view("b", in_flight=1), view("a", in_flight=1)]
    assert least_in_flight(ranks, cap=4) == "b"


def test_least_in_flight_skips_ranks_at_the_cap() -> None:
    ranks = [view("a", in_flight=4), view("b", in_flight=3)]
    assert least_in_flight(ranks, cap=4) == "b"
    assert least_in_flight(ranks, cap=3) is None
    assert least_in_flight([], cap=4) is None


def test_least_in_flight_ignores_reports() -> None:
    ranks = [view("a", pab=10**6, in_flight=2), view("b", pab=None, waiting=50, in_flight=1)]
    assert least_in_flight(ranks, cap=64) == "b"


def class_view(rank: str, pab: float, classes: dict[str, float], waiting: int = 0) -> RankView:
    return RankView(rank, pab, 0, waiting, 0, 0, classes)


@pytest.mark.parametrize("name", ["pab", "pab_least_loaded"])
def test_a_tight_class_goes_where_its_own_budget_covers_it(name: str) -> None:
    ranks = [class_view("big", 9000, {"interactive": 200, "relaxed": 20_000}),
             class_view("fit", 3000, {"interactive": 1500, "relaxed": 6000}, waiting=5)]
    balancer = make_balancer(name)
    assert balancer.choose(ranks, 1000, "interactive") == "fit"
    assert balancer.choose(ranks, 1000) == "big"
    assert balancer.choose(ranks, 1000, "relaxed") == "big"
    assert balancer.choose(ranks, 2000, "interactive") is None


def test_a_class_a_rank_did_not_report_uses_its_default_budget() -> None:
    ranks = [class_view("old", 4000, {}), class_view("new", 3000, {"interactive": 100})]
    assert make_balancer("pab").choose(ranks, 1000, "interactive") == "old"
    assert ranks[1].budget("unknown") == 3000 and ranks[1].budget(None) == 3000


def test_routing_class_maps_explicit_targets_onto_classes() -> None:
    ttfts = {"interactive": 0.5, "standard": 2.0, "relaxed": 8.0}
    assert routing_class(ttfts, None, None) is None
    assert routing_class(ttfts, "relaxed", None) == "relaxed"
    assert routing_class(ttfts, None, 2.0) == "standard"
    assert routing_class(ttfts, None, 7.9) == "standard"
    assert routing_class(ttfts, None, 60.0) == "relaxed"
    assert routing_class(ttfts, None, 0.1) == "interactive"  # below every class: the tightest
    assert routing_class(ttfts, "relaxed", 1.0) == "interactive"
    assert routing_class({"a": 1.0, "b": 1.0}, "b", 1.0) == "b"  # a tie keeps its own class
    assert routing_class({}, "relaxed", 1.0) is None  # no class known: the default


# ---------------------------------------------------------------- spill
def test_spill_is_choose_for_every_policy_that_routes_on_no_budget() -> None:
    ranks = [view("a", pab=10.0, running=3), view("b", pab=5.0, waiting=1), view("c")]
    for name in BALANCERS:
        if make_balancer(name).routes_on_budget:
            continue
        chosen, spilled = make_balancer(name, seed=3), make_balancer(name, seed=3)
        assert [chosen.choose(ranks, 100) for _ in range(6)] == \
            [spilled.spill(ranks, 100) for _ in range(6)], name


def test_pab_spills_to_the_largest_budget_covering_or_not() -> None:
    ranks = [view("a", pab=999), view("b", pab=-50), view("c", pab=None), view("d", pab=400)]
    balancer = make_balancer("pab")
    assert balancer.choose(ranks, 1000) is None
    assert balancer.spill(ranks, 1000) == "a"
    assert balancer.spill([view("b", pab=-50), view("d", pab=-10)], 1000) == "d"
    assert balancer.spill([view("c", pab=None)], 1000) is None  # never reported


def test_pab_least_loaded_spills_to_the_least_loaded_of_every_rank() -> None:
    balancer = make_balancer("pab_least_loaded")
    ranks = [view("a", pab=999, running=4), view("b", pab=-50, running=1),
             view("c", pab=None, running=2)]
    assert balancer.choose(ranks, 1000) is None
    assert {balancer.spill(ranks, 1000) for _ in range(6)} == {"b"}
    assert balancer.spill([], 1000) is None
