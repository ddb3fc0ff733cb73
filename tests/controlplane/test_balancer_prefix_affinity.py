from __future__ import annotations

import random

import pytest

from controlplane.balancer import (
    BALANCERS,
    CacheAwareSettings,
    RankView,
    make_balancer,
)
from controlplane.prefix_affinity import PrefixAffinity

SYSTEM = "You are a helpful assistant. " * 20  # 580 characters


def view(rank: str, pab: float | None = 10_000, running: int = 0, waiting: int = 0,
         in_flight: int = 0, class_pab: dict[str, float] | None = None) -> RankView:
    return RankView(rank, pab, running, waiting, 0, in_flight, class_pab or {})


# ---------------------------------------------------------------- the tree
def test_match_is_the_longest_held_prefix_per_rank_in_whole_blocks() -> None:
    tree = PrefixAffinity(block_size=4)
    tree.record("a", "abcdefghij")  # blocks abcd efgh (ij dropped)
    tree.record("b", "abcdxxxx")
    match = tree.match("abcdefghzz")
    assert match.matched_units == {"a": 8, "b": 4}
    assert match.prompt_units == 10
    assert match.ratio("a") == pytest.approx(0.8)
    assert match.ratio("c") == 0.0


def test_a_prompt_shorter_than_a_block_matches_nothing() -> None:
    tree = PrefixAffinity(block_size=4)
    tree.record("a", "abc")
    assert tree.match("abc").matched_units == {}
    assert tree.indexed_blocks == 0


def test_a_different_first_block_breaks_the_chain() -> None:
    tree = PrefixAffinity(block_size=2)
    tree.record("a", "xxbbcc")
    assert tree.match("yybbcc").matched_units == {}


def test_token_ids_are_prompts_too() -> None:
    tree = PrefixAffinity(block_size=2)
    tree.record("a", [1, 2, 3, 4, 5, 6])
    tree.record("b", (1, 2, 9, 9))
    assert tree.match((1, 2, 3, 4, 7, 7)).matched_units == {"a": 4, "b": 2}


def test_the_bound_evicts_least_recently_used_leaves_first() -> None:
    tree = PrefixAffinity(block_size=1, max_blocks_per_rank=4)
    tree.record("a", "abc")
    tree.record("a", "xy")
    assert tree.held_blocks("a") == 4  # a, ab, abc, x, xy: abc (the oldest leaf) went
    assert tree.match("abc").matched_units == {"a": 2}
    assert tree.match("xy").matched_units == {"a": 2}
    tree.record("a", "ab")  # touched: now more recent than x, xy
    tree.record("a", "pq")
    assert tree.match("ab").matched_units == {"a": 2}
    assert tree.match("xy").matched_units == {}


def _linear_match(tree: PrefixAffinity, prompt: str) -> dict[str, int]:
    """Each rank's matched units by the definition: the leading blocks it holds, walked one
    by one until the first it does not."""
    names = tree.blocks(prompt).names
    matched = {}
    for rank in {r for held in tree._holders.values() for r in held}:
        depth = 0
        while depth < len(names) and rank in tree._holders.get(names[depth], ()):
            depth += 1
        if depth:
            matched[rank] = depth * tree.block_size
    return matched


def test_bisection_finds_what_a_walk_block_by_block_finds_under_eviction() -> None:
    """What a rank holds stays closed under ancestors through records and evictions, so
    bisecting each rank's depth gives the linear walk's answer."""
    rng = random.Random(7)
    tree = PrefixAffinity(block_size=2, max_blocks_per_rank=40)
    stems = ["".join(rng.choices("abc", k=12)) for _ in range(6)]
    for step in range(600):
        prompt = rng.choice(stems)[:rng.randint(0, 12)] + "".join(rng.choices("abcd", k=rng.randint(0, 10)))
        if step % 3:
            tree.record(rng.choice("xyz"), prompt)
        assert tree.match(prompt).matched_units == _linear_match(tree, prompt), (step, prompt)


def test_memory_stays_bounded_under_many_distinct_prompts() -> None:
    tree = PrefixAffinity(block_size=8, max_blocks_per_rank=100)
    for i in range(2_000):
        tree.record(str(i % 4), SYSTEM[: 64] + f"user {i:06d} " * 8)
    assert all(tree.held_blocks(str(r)) <= 100 for r in range(4))
    assert tree.indexed_blocks <= 400
    assert tree.match(SYSTEM[:64]).matched_units == {str(r): 64 for r in range(4)}


def test_forget_drops_a_rank_and_its_index_entries() -> None:
    tree = PrefixAffinity(block_size=2)
    tree.record("a", "aabb")
    tree.record("b", "aacc")
    tree.forget("a")
    assert tree.match("aabb").matched_units == {"b": 2}
    assert tree.held_blocks("a") == 0
    assert tree.indexed_blocks == 2


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        PrefixAffinity(block_size=0)
    with pytest.raises(ValueError):
        PrefixAffinity(max_blocks_per_rank=0)


# ---------------------------------------------------------------- the balancers
SMALL = CacheAwareSettings(block_size=4)


def test_existing_balancers_take_and_ignore_a_prompt() -> None:
    for name in BALANCERS:
        balancer = make_balancer(name, cache_aware=SMALL)
        chosen = balancer.choose([view("a"), view("b")], 100, None, SYSTEM)
        assert chosen in ("a", "b")
        believed = balancer.record(chosen, SYSTEM, 100)
        assert believed == 0  # nothing recorded before


def test_cache_aware_follows_the_prefix_when_loads_are_balanced() -> None:
    balancer = make_balancer("cache_aware", cache_aware=SMALL)
    ranks = [view("a", in_flight=3), view("b", in_flight=1)]
    assert balancer.record("a", SYSTEM + "first question", 150) == 0
    assert balancer.choose(ranks, 150, None, SYSTEM + "second question") == "a"
    assert balancer.record("a", SYSTEM + "second question", 150) == 146  # 580 of 595 characters of 150 tokens


def test_cache_aware_below_the_threshold_goes_to_the_least_loaded() -> None:
    balancer = make_balancer("cache_aware", cache_aware=SMALL)
    balancer.record("a", "abcd" + "x" * 96, 25)
    ranks = [view("a", in_flight=3), view("b", in_flight=1)]
    assert balancer.choose(ranks, 25, None, "abcd" + "y" * 96) == "b"  # 4% matched


def test_cache_aware_balances_when_in_flight_counts_are_imbalanced() -> None:
    balancer = make_balancer("cache_aware", cache_aware=SMALL)
    balancer.record("a", SYSTEM, 150)
    assert balancer.choose([view("a", in_flight=100), view("b", in_flight=20)], 150, None,
                           SYSTEM) == "b"  # 80 > 64 and 100 > 1.5 x 20
    assert balancer.choose([view("a", in_flight=100), view("b", in_flight=70)], 150, None,
                           SYSTEM) == "a"  # 100 < 1.5 x 70


def test_cache_aware_without_a_prompt_is_least_in_flight() -> None:
    balancer = make_balancer("cache_aware")
    assert balancer.choose([view("a", in_flight=2), view("b", in_flight=1)], 10) == "b"


def test_pab_cache_aware_follows_the_prefix_while_its_budget_covers_the_uncached_part() -> None:
    balancer = make_balancer("pab_cache_aware", cache_aware=SMALL)
    balancer.record("a", SYSTEM, 1000)
    prompt = SYSTEM + "a question of twenty"
    # a's budget covers only the uncached 3% (about 33 tokens), b's the whole prompt
    ranks = [view("a", pab=50, waiting=5), view("b", pab=5000)]
    assert balancer.choose(ranks, 1000, None, prompt) == "a"


def test_pab_cache_aware_leaves_a_cached_rank_that_cannot_meet_the_deadline() -> None:
    balancer = make_balancer("pab_cache_aware", cache_aware=SMALL)
    balancer.record("a", SYSTEM, 1000)
    balancer.record("b", SYSTEM[:300], 1000)
    prompt = SYSTEM + "a question of twenty"
    ranks = [view("a", pab=10), view("b", pab=600), view("c", pab=5000)]
    assert balancer.choose(ranks, 1000, None, prompt) == "b"  # next best match that fits
    ranks = [view("a", pab=10), view("b", pab=100), view("c", pab=5000, waiting=3),
             view("d", pab=5000)]
    # c and d hold none of it: moving it there computes the whole prefix again
    assert balancer.choose(ranks, 1000, None, prompt) is None
    assert balancer.spill(ranks, 1000, None, prompt) == "a"
    unheld = "an unrelated prompt, long enough to fill blocks"
    assert balancer.choose(ranks, 1000, None, unheld) == "d"  # no holder: least loaded by PAB


def test_pab_cache_aware_judges_by_the_requests_class_budget() -> None:
    balancer = make_balancer("pab_cache_aware", cache_aware=SMALL)
    balancer.record("a", SYSTEM, 1000)
    balancer.record("b", SYSTEM[:400], 1000)  # a shorter match, past the threshold
    ranks = [view("a", pab=5000, class_pab={"interactive": 10}), view("b", pab=5000)]
    assert balancer.choose(ranks, 1000, "interactive", SYSTEM + "question") == "b"
    assert balancer.choose(ranks, 1000, "standard", SYSTEM + "question") == "a"


def test_pab_cache_aware_declines_when_no_budget_covers_what_each_rank_must_prefill() -> None:
    balancer = make_balancer("pab_cache_aware", cache_aware=SMALL)
    ranks = [view("a", pab=500), view("b", pab=None)]
    assert balancer.choose(ranks, 1000, None, SYSTEM) is None
    balancer.record("a", SYSTEM, 1000)
    assert balancer.choose(ranks, 1000, None, SYSTEM + "more") == "a"


def test_pab_cache_aware_without_a_prompt_is_pab_least_loaded() -> None:
    ours = make_balancer("pab_cache_aware")
    theirs = make_balancer("pab_least_loaded")
    ranks = [view("a", pab=500, waiting=2), view("b", pab=5000, running=3), view("c", pab=50)]
    for tokens in (10, 100, 1000, 10_000):
        assert ours.choose(ranks, tokens) == theirs.choose(ranks, tokens)


def test_pab_least_loaded_judges_each_rank_by_what_it_must_prefill() -> None:
    balancer = make_balancer("pab_least_loaded", cache_aware=SMALL)
    ranks = [view("a", pab=500, waiting=2), view("b", pab=500)]
    assert balancer.choose(ranks, 1000, None, SYSTEM) is None  # nobody holds it: 1000 > 500
    assert balancer.record("a", SYSTEM, 1000) == 0
    assert balancer.choose(ranks, 1000, None, SYSTEM + "more") == "a"  # only "a" can take it
    cached = balancer.record("a", SYSTEM + "more", 1000)
    assert 500 < cached < 1000  # the caller debits 1000 - cached
    roomy = [view("a", pab=5000, waiting=2), view("b", pab=5000)]
    assert balancer.choose(roomy, 1000, None, SYSTEM + "again") == "b"  # least loaded, not affinity


def test_pab_least_loaded_uses_the_requests_class_budget_for_the_uncached_part() -> None:
    balancer = make_balancer("pab_least_loaded", cache_aware=SMALL)
    balancer.record("a", SYSTEM, 1000)
    ranks = [view("a", pab=5000, waiting=5, class_pab={"interactive": 100}),
             view("b", pab=5000, class_pab={"interactive": 100})]
    assert balancer.choose(ranks, 1000, "interactive", SYSTEM + "question") == "a"
    assert balancer.choose(ranks, 1000, "standard", SYSTEM + "question") == "b"


def test_bad_threshold_is_refused() -> None:
    with pytest.raises(ValueError):
        CacheAwareSettings(cache_threshold=1.5)


def test_pab_cache_aware_spills_to_the_longest_match_whatever_its_budget() -> None:
    balancer = make_balancer("pab_cache_aware", cache_aware=SMALL)
    balancer.record("a", SYSTEM, 1000)
    prompt = SYSTEM + "a question of twenty"
    ranks = [view("a", pab=10, waiting=5), view("b", pab=20)]
    assert balancer.choose(ranks, 1000, None, prompt) is None
    assert balancer.spill(ranks, 1000, None, prompt) == "a"
    assert balancer.spill(ranks, 1000, None, "an unrelated prompt, long enough") == "b"


def test_pab_cache_aware_founds_a_group_when_a_second_prompt_shares_a_declined_prefix() -> None:
    balancer = make_balancer("pab_cache_aware", cache_aware=SMALL)
    ranks = [view("a", pab=100, in_flight=4), view("b", pab=100, in_flight=2)]
    founder = SYSTEM + "the first question"
    assert balancer.choose(ranks, 1000, None, founder) is None  # no budget covers it
    assert balancer.choose(ranks, 1000, None, founder) is None  # the same prompt again
    follower = SYSTEM + "a second, different question"
    assert balancer.choose(ranks, 1000, None, follower) == "b"  # the least in flight
    balancer.record("b", follower, 1000)
    # the founder is now judged by its uncached part on the rank its group lives on
    assert balancer.choose(ranks, 1000, None, founder) == "b"


def test_pab_cache_aware_never_places_past_the_budgets_prompts_that_share_nothing() -> None:
    balancer = make_balancer("pab_cache_aware", cache_aware=SMALL)
    ranks = [view("a", pab=100), view("b", pab=100)]
    prompts = [f"{index:04d} " + "unrelated words " * 40 for index in range(20)]
    assert [balancer.choose(ranks, 1000, None, prompt) for prompt in prompts] == [None] * 20


def test_pab_least_loaded_founds_no_groups() -> None:
    balancer = make_balancer("pab_least_loaded", cache_aware=SMALL)
    ranks = [view("a", pab=100), view("b", pab=100)]
    assert balancer.choose(ranks, 1000, None, SYSTEM + "the first question") is None
    assert balancer.choose(ranks, 1000, None, SYSTEM + "a second question") is None


def test_pab_cache_aware_spills_to_the_least_in_flight_when_the_ranks_are_imbalanced() -> None:
    balancer = make_balancer("pab_cache_aware", cache_aware=SMALL)
    balancer.record("a", SYSTEM, 1000)
    prompt = SYSTEM + "a question of twenty"
    balanced = [view("a", pab=10, in_flight=100), view("b", pab=20, in_flight=70)]
    assert balancer.spill(balanced, 1000, None, prompt) == "a"  # 100 < 1.5 x 70
    imbalanced = [view("a", pab=10, in_flight=100), view("b", pab=20, in_flight=20)]
    assert balancer.spill(imbalanced, 1000, None, prompt) == "b"  # smg's rule: 80 > 64, 100 > 30
