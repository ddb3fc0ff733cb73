"""Rank choice: the ``pab`` policies and the baselines users run today, pure and stdlib only.

The caller passes only the ranks it considers fresh (stale means unknown, never idle)
as :class:`RankView` values built from the last reports plus its own dispatches since
(see ``docs/controlplane.md``). A balancer may keep a little state of its own (a cursor,
a seeded RNG) but does no I/O. ``choose`` returns a rank name, or None when the policy
declines: no rank given, or (the balancers that route on budget, ``routes_on_budget``:
the ``pab`` policies) no rank's budget covers the prompt (``pab_least_loaded`` and
``pab_cache_aware``: the part of it the rank does not hold). ``spill`` is the choice a
budget policy makes when no budget covers: its own order without the budget filter
(the daemon's ``on_no_budget = "spill"``: the rank's own admission then decides); every
other policy's ``spill`` is its ``choose``.

``slo_class`` names the SLO class whose budget a request is judged by (the ``pab``
policies; :func:`routing_class` maps a request's SLO onto one); None, or a class a
rank did not report, means that rank's default-class budget.

``prompt`` (optional: the prompt's text or token ids) feeds the
:class:`~controlplane.prefix_affinity.PrefixAffinity` of the policies that keep one
(:data:`PREFIX_TREE_POLICIES`: the cache-aware policies route on it, ``pab_least_loaded``
only sizes its budget check with it); the others ignore it. After dispatching a request to
the chosen rank the caller calls ``record(rank, prompt, prompt_tokens)``: a policy with a
prefix tree remembers that the rank now holds the prompt and returns how many of its tokens
it believed the rank held already (every other policy: 0), so the caller debits the rank's
budget with the uncached rest only.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from controlplane.prefix_affinity import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_BLOCKS_PER_RANK,
    AffinityMatch,
    PrefixAffinity,
    Prompt,
    PromptBlocks,
)

BALANCERS: tuple[str, ...] = (
    "pab", "pab_least_loaded", "pab_cache_aware", "cache_aware", "round_robin", "request_count",
    "total_tokens", "power_of_two",
)
# the policies that keep a prefix tree: they want the prompt, and debit only its uncached part
PREFIX_TREE_POLICIES = frozenset({"pab_least_loaded", "pab_cache_aware", "cache_aware"})
_DECLINED = "declined"  # the one holder of PabCacheAwareBalancer's tree of declined prompts


@dataclass(frozen=True, slots=True)
class RankView:
    rank: str
    pab_tokens: float | None  # effective: reported minus unreported debits; None = never reported
    running: int  # last reported running
    waiting: int  # last reported waiting + dispatches the last report does not include yet
    total_tokens: int  # last reported total_tokens + prompt tokens of those dispatches
    in_flight: int  # the daemon's own count of dispatched, unfinished requests
    class_budgets: Mapping[str, float] = field(default_factory=dict)  # effective, per SLO class

    def budget(self, slo_class: str | None = None) -> float | None:
        """The effective budget of ``slo_class`` (None or unreported: the default class's)."""
        if slo_class is None:
            return self.pab_tokens
        return self.class_budgets.get(slo_class, self.pab_tokens)


def routing_class(class_ttfts: Mapping[str, float], slo_class: str | None,
                  ttft_s: float | None) -> str | None:
    """The SLO class whose budget routes a request: its own ``slo_class``; with an
    explicit TTFT target, the class with the largest TTFT not above it (below every
    class: the one with the smallest TTFT; ties: its own class, else the first name);
    None (the default class) when it names neither or no class is known."""
    if ttft_s is None:
        return slo_class
    if not class_ttfts:
        return None
    if slo_class in class_ttfts and class_ttfts[slo_class] == ttft_s:
        return slo_class
    below = [name for name, ttft in class_ttfts.items() if ttft <= ttft_s]
    if below:
        return min(below, key=lambda name: (-class_ttfts[name], name))
    return min(class_ttfts, key=lambda name: (class_ttfts[name], name))


class Balancer(Protocol):
    name: str
    #: Whether a rank is eligible only when its budget covers the prompt (the ``pab``
    #: policies): then ``choose`` declines when no rank's budget does, the dispatcher
    #: answers ``no_budget`` (HTTP 429) or queues the request, and ranks report each SLO
    #: class's budget for it to judge by. False: ``choose`` declines only an empty list.
    routes_on_budget: bool

    def choose(self, ranks: Sequence[RankView], prompt_tokens: int,
               slo_class: str | None = None, prompt: Prompt | None = None) -> str | None: ...

    def spill(self, ranks: Sequence[RankView], prompt_tokens: int,
              slo_class: str | None = None, prompt: Prompt | None = None) -> str | None: ...

    def record(self, rank: str, prompt: Prompt | None, prompt_tokens: int) -> int: ...


class _Spills:
    """``spill`` of a policy that routes on no budget: its ``choose``."""

    def spill(self, ranks: Sequence[RankView], prompt_tokens: int,
              slo_class: str | None = None, prompt: Prompt | None = None) -> str | None:
        return self.choose(ranks, prompt_tokens, slo_class, prompt)  # type: ignore[attr-defined]


class _Oblivious(_Spills):
    """A policy that keeps no record of what it routed where."""

    routes_on_budget = False

    def record(self, rank: str, prompt: Prompt | None, prompt_tokens: int) -> int:
        return 0


class PabBalancer(_Oblivious):
    """The rank whose effective PAB (of the request's class) covers the prompt with the
    most to spare (ties: the first given); None when no rank's budget covers it (the
    caller queues, rejects or spills: then the largest budget, covering or not, of the
    ranks that reported one)."""

    name = "pab"
    routes_on_budget = True

    def choose(self, ranks: Sequence[RankView], prompt_tokens: int,
               slo_class: str | None = None, prompt: Prompt | None = None) -> str | None:
        return self._largest(ranks, slo_class, prompt_tokens)

    def spill(self, ranks: Sequence[RankView], prompt_tokens: int,
              slo_class: str | None = None, prompt: Prompt | None = None) -> str | None:
        return self._largest(ranks, slo_class, -math.inf)

    @staticmethod
    def _largest(ranks: Sequence[RankView], slo_class: str | None, at_least: float) -> str | None:
        best: str | None = None
        best_budget = 0.0
        for view in ranks:
            budget = view.budget(slo_class)
            if budget is None or budget < at_least:
                continue
            if best is None or budget > best_budget:
                best, best_budget = view.rank, budget
        return best


class RoundRobinBalancer(_Oblivious):
    """The next rank name after the last one chosen, in sorted order (wrapping), so the
    rotation survives ranks joining, leaving or going stale."""

    name = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, ranks: Sequence[RankView], prompt_tokens: int,
               slo_class: str | None = None, prompt: Prompt | None = None) -> str | None:
        if not ranks:
            return None
        names = sorted(view.rank for view in ranks)
        last = self._last
        chosen = names[0] if last is None else next((n for n in names if n > last), names[0])
        self._last = chosen
        return chosen


class LowestScoreBalancer(_Oblivious):
    """The rank with the lowest ``score`` among those ``eligible`` for the prompt; ties go to
    the first one met scanning from a start index that advances by one every call (vLLM's
    guard against herding). None when no rank is eligible."""

    def __init__(
        self,
        name: str,
        score: Callable[[RankView], float],
        eligible: Callable[[RankView, int, str | None], bool] = lambda *_: True,
    ) -> None:
        self.name = name
        self._score = score
        self._eligible = eligible
        self._start = 0

    def choose(self, ranks: Sequence[RankView], prompt_tokens: int,
               slo_class: str | None = None, prompt: Prompt | None = None) -> str | None:
        count = len(ranks)
        if count == 0:
            return None
        start = self._start % count
        self._start = start + 1
        best: RankView | None = None
        best_score = 0.0
        for offset in range(count):
            view = ranks[(start + offset) % count]
            if not self._eligible(view, prompt_tokens, slo_class):
                continue
            score = self._score(view)
            if best is None or score < best_score:
                best, best_score = view, score
        return None if best is None else best.rank


@dataclass(frozen=True, slots=True)
class CacheAwareSettings:
    """smg ``cache_aware``'s knobs, its CLI defaults (``smg --help``): a match ratio above
    ``cache_threshold`` routes to the best-matching rank; loads (requests in flight) are
    imbalanced when ``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold
    x min``. The tree's block size and per-rank bound: :mod:`controlplane.prefix_affinity`."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    block_size: int = DEFAULT_BLOCK_SIZE
    max_blocks_per_rank: int = DEFAULT_MAX_BLOCKS_PER_RANK

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache threshold must be in [0, 1], got {self.cache_threshold}")


class _AffinityPolicy(_Spills):
    """The prefix tree and the last prompt's match, kept so that ``record`` after
    ``choose`` does not hash the prompt again."""

    routes_on_budget = False

    def __init__(self, settings: CacheAwareSettings) -> None:
        self.settings = settings
        self.affinity = PrefixAffinity(settings.block_size, settings.max_blocks_per_rank)
        self._last: tuple[Prompt, PromptBlocks, AffinityMatch] | None = None

    def _match(self, prompt: Prompt) -> tuple[PromptBlocks, AffinityMatch]:
        last = self._last
        if last is not None and last[0] is prompt:
            return last[1], last[2]
        blocks = self.affinity.blocks(prompt)
        match = self.affinity.match(blocks)
        self._last = (prompt, blocks, match)
        return blocks, match

    def _imbalanced(self, ranks: Sequence[RankView], least: int) -> bool:
        """smg's test: the in-flight counts differ by more than both thresholds."""
        most = max(view.in_flight for view in ranks)
        settings = self.settings
        return (most - least > settings.balance_abs_threshold
                and most > settings.balance_rel_threshold * least)

    def record(self, rank: str, prompt: Prompt | None, prompt_tokens: int) -> int:
        if prompt is None:
            return 0
        blocks, match = self._match(prompt)
        cached = match.cached_tokens(rank, prompt_tokens)
        self.affinity.record(rank, blocks)
        self._last = None
        return cached


def _least_in_flight(ranks: Sequence[RankView]) -> RankView:
    return min(ranks, key=lambda view: view.in_flight)


class CacheAwareBalancer(_AffinityPolicy):
    """smg's ``cache_aware`` (approximate tree, no KV events): when the ranks' in-flight
    counts are imbalanced, the least loaded; else the rank holding the longest prefix of
    the prompt if its match ratio exceeds the threshold (ties: the least loaded), else the
    least loaded (ties: the first given). No prompt: the least loaded. Never declines a
    non-empty rank list."""

    name = "cache_aware"

    def choose(self, ranks: Sequence[RankView], prompt_tokens: int,
               slo_class: str | None = None, prompt: Prompt | None = None) -> str | None:
        if not ranks:
            return None
        least = _least_in_flight(ranks)
        if prompt is None or self._imbalanced(ranks, least.in_flight):
            return least.rank
        _, match = self._match(prompt)
        best: RankView | None = None
        best_units = 0
        for view in ranks:
            units = match.matched_units.get(view.rank, 0)
            if units > best_units or (units == best_units and best is not None
                                      and view.in_flight < best.in_flight):
                best, best_units = view, units
        if best is not None and match.ratio(best.rank) > self.settings.cache_threshold:
            return best.rank
        return least.rank


class PabLeastLoadedBalancer(_AffinityPolicy):
    """PAB as the admission filter, vLLM's load score as the choice: among the ranks whose
    effective PAB (of the request's class) covers the part of the prompt the rank does not
    hold (the prompt less its believed cached tokens, from the prefix tree; no prompt: the
    whole prompt), the lowest :func:`request_count_score`; ties go to the first one met
    scanning from a start index that advances by one every call (vLLM's guard against
    herding). None when no rank is eligible (the caller queues or rejects).

    Why not ``pab``'s largest budget first: at a TTFT target of seconds every rank's PAB is
    many prompts deep, so the largest is decided by small per-rank differences (e.g. in an
    online-learned step model) and herds onto the rank that looks fastest. Why the uncached
    part: a rank computes only that, so judging the whole prompt declines requests a rank
    holding their prefix could start at once (with shared prefixes under load, most of
    them), and debiting it understates the rank's budget until its next report.

    ``spill``: the same choice over every rank, budgets ignored."""

    name = "pab_least_loaded"
    routes_on_budget = True
    prefers_cached = False  # pab_cache_aware: the longest match above the threshold first

    def __init__(self, settings: CacheAwareSettings) -> None:
        super().__init__(settings)
        self._start = 0

    def choose(self, ranks: Sequence[RankView], prompt_tokens: int,
               slo_class: str | None = None, prompt: Prompt | None = None) -> str | None:
        return self._choose(ranks, prompt_tokens, slo_class, prompt, within_budget=True)

    def spill(self, ranks: Sequence[RankView], prompt_tokens: int,
              slo_class: str | None = None, prompt: Prompt | None = None) -> str | None:
        return self._choose(ranks, prompt_tokens, slo_class, prompt, within_budget=False)

    def _choose(self, ranks: Sequence[RankView], prompt_tokens: int, slo_class: str | None,
                prompt: Prompt | None, *, within_budget: bool) -> str | None:
        count = len(ranks)
        if count == 0:
            return None
        match = None if prompt is None else self._match(prompt)[1]
        affinity = match if self.prefers_cached else None
        threshold = self.settings.cache_threshold
        start = self._start % count
        self._start = start + 1
        affine: RankView | None = None
        affine_key = (0.0, 0.0)
        held = False  # some rank holds the prompt past the threshold, eligible or not
        least: RankView | None = None
        least_score = 0.0
        for offset in range(count):
            view = ranks[(start + offset) % count]
            holds = affinity is not None and affinity.ratio(view.rank) > threshold
            held = held or holds
            if within_budget:
                cached = 0 if match is None else match.cached_tokens(view.rank, prompt_tokens)
                if not budget_covers(view, prompt_tokens - cached, slo_class):
                    continue
            score = request_count_score(view)
            if holds:
                key = (affinity.ratio(view.rank), -score)
                if affine is None or key > affine_key:
                    affine, affine_key = view, key
            if least is None or score < least_score:
                least, least_score = view, score
        if affine is None and held:
            return None  # never moved to a rank that holds none of it
        chosen = affine or least
        return None if chosen is None else chosen.rank


class PabCacheAwareBalancer(PabLeastLoadedBalancer):
    """Prefix affinity within each rank's PAB for the request's class. A rank is eligible
    when its budget covers the part of the prompt it does not hold (the prompt less its
    believed cached tokens): a rank that cannot fit that prefill before the class's
    deadline is never chosen. Among eligible ranks whose match ratio exceeds the threshold,
    the longest match (ties: the lower vLLM load score). When ranks hold the prompt past
    the threshold but none of them is eligible, None: the request is not moved to a rank
    that holds none of it, where its whole prefix would be computed again, the capacity
    the other requests need once budgets run out (the caller queues, rejects or spills,
    which sends it to the longest match). When no rank holds it: ``pab_least_loaded``
    over the eligible ranks; when none is, None, unless the prompt shares a prefix past
    the threshold with a prompt declined earlier (not the same prompt retried).

    That exception founds prefix groups. Under overload no budget covers a whole prompt,
    while every rank's covers the uncached part of a prompt it holds. Without a home, a
    group's first prompt and all that follow it wait (or are refused) until they time
    out, though once placed they would cost only their own tokens. Evidence of a group,
    two prompts with a common prefix, places the second on the least in flight (smg
    ``cache_aware``'s choice), and every prompt of the group is then judged by its
    uncached part there. Prompts that share nothing are never placed past the budgets.

    ``spill`` (no budget covers the prompt anywhere, so budgets no longer tell the ranks
    apart): smg ``cache_aware``'s balance rule first, the least in flight when the ranks'
    in-flight counts are imbalanced; else the longest match, as ``choose`` without the
    budget filter. Without the balance rule, a rank whose groups drew more arrivals keeps
    every request of them once all ranks are out of budget."""

    name = "pab_cache_aware"
    prefers_cached = True

    def __init__(self, settings: CacheAwareSettings) -> None:
        super().__init__(settings)
        self._declined = PrefixAffinity(settings.block_size, settings.max_blocks_per_rank)

    def choose(self, ranks: Sequence[RankView], prompt_tokens: int,
               slo_class: str | None = None, prompt: Prompt | None = None) -> str | None:
        chosen = super().choose(ranks, prompt_tokens, slo_class, prompt)
        if chosen is not None or prompt is None or not ranks:
            return chosen
        return self._found_group(ranks, prompt)

    def _found_group(self, ranks: Sequence[RankView], prompt: Prompt) -> str | None:
        """A prompt no budget covers: None (a rank holds it past the threshold, or it is
        the first of its prefix, then remembered as declined); but a prompt no rank holds
        that shares a prefix past the threshold with an earlier declined one (and is not
        that one again) goes to the least in flight, where its group then lives."""
        blocks, match = self._match(prompt)
        threshold = self.settings.cache_threshold
        if any(match.ratio(view.rank) > threshold for view in ranks):
            return None
        declined = self._declined.match(blocks).matched_units.get(_DECLINED, 0)
        if declined >= len(blocks.names) * self.settings.block_size:
            return None  # the same prompt again, already remembered
        if declined > threshold * blocks.units:
            return _least_in_flight(ranks).rank
        self._declined.record(_DECLINED, blocks)
        return None

    def spill(self, ranks: Sequence[RankView], prompt_tokens: int,
              slo_class: str | None = None, prompt: Prompt | None = None) -> str | None:
        if ranks:
            least = _least_in_flight(ranks)
            if self._imbalanced(ranks, least.in_flight):
                return least.rank
        return super().spill(ranks, prompt_tokens, slo_class, prompt)


def budget_covers(view: RankView, prompt_tokens: int, slo_class: str | None = None) -> bool:
    budget = view.budget(slo_class)
    return budget is not None and budget >= prompt_tokens


def request_count_score(view: RankView) -> float:
    """vLLM's data-parallel load score."""
    return view.waiting * 4 + view.running


def total_tokens_score(view: RankView) -> float:
    """SGLang's ``total_tokens`` load: tokens held by the rank's requests."""
    return view.total_tokens


class PowerOfTwoBalancer(_Oblivious):
    """Two distinct ranks drawn by a seeded RNG; the one with fewer in flight wins (ties:
    the first drawn). One rank: that rank."""

    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self._random = random.Random(seed)

    def choose(self, ranks: Sequence[RankView], prompt_tokens: int,
               slo_class: str | None = None, prompt: Prompt | None = None) -> str | None:
        if not ranks:
            return None
        if len(ranks) == 1:
            return ranks[0].rank
        first, second = self._random.sample(range(len(ranks)), 2)
        a, b = ranks[first], ranks[second]
        return b.rank if b.in_flight < a.in_flight else a.rank


def make_balancer(name: str, seed: int = 0,
                  cache_aware: CacheAwareSettings | None = None) -> Balancer:
    """A fresh balancer by policy name (``seed`` drives ``power_of_two``'s draws;
    ``cache_aware`` the prefix-tree policies' knobs, default smg's; ``pab_least_loaded``
    uses only the tree's block size and bound)."""
    if name in PREFIX_TREE_POLICIES:
        settings = cache_aware or CacheAwareSettings()
        if name == "cache_aware":
            return CacheAwareBalancer(settings)
        if name == "pab_cache_aware":
            return PabCacheAwareBalancer(settings)
        return PabLeastLoadedBalancer(settings)
    if name == "pab":
        return PabBalancer()
    if name == "round_robin":
        return RoundRobinBalancer()
    if name == "request_count":
        return LowestScoreBalancer("request_count", request_count_score)
    if name == "total_tokens":
        return LowestScoreBalancer("total_tokens", total_tokens_score)
    if name == "power_of_two":
        return PowerOfTwoBalancer(seed)
    raise ValueError(f"unknown balancer {name!r}; expected one of {', '.join(BALANCERS)}")


def least_in_flight(ranks: Sequence[RankView], cap: int) -> str | None:
    """Local accounting when every rank is stale: the rank with the fewest in-flight
    requests among those below ``cap`` (ties: the first given); None if all are at it."""
    best: RankView | None = None
    for view in ranks:
        if view.in_flight >= cap:
            continue
        if best is None or view.in_flight < best.in_flight:
            best = view
    return None if best is None else best.rank
