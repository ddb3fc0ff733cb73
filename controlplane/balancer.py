"""Rank choice: the ``pab`` policies and the baselines users run today, pure and stdlib only.

The caller passes only the ranks it considers fresh (stale means unknown, never idle)
as :class:`RankView` values built from the last reports plus its own dispatches since
(see ``docs/controlplane.md``). A balancer may keep a little state of its own (a cursor,
a seeded RNG) but does no I/O. ``choose`` returns a rank name, or None when the policy
declines: no rank given, or (``pab`` and ``pab_least_loaded`` only) no rank's budget
covers the prompt.

``slo_class`` names the SLO class whose budget a request is judged by (the ``pab``
policies; :func:`routing_class` maps a request's SLO onto one); None, or a class a
rank did not report, means that rank's default-class budget.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

BALANCERS: tuple[str, ...] = (
    "pab", "pab_least_loaded", "round_robin", "request_count", "total_tokens", "power_of_two",
)


@dataclass(frozen=True, slots=True)
class RankView:
    rank: str
    pab_tokens: float | None  # effective: reported minus unreported debits; None = never reported
    running: int  # last reported running
    waiting: int  # last reported waiting + dispatches the last report does not include yet
    total_tokens: int  # last reported total_tokens + prompt tokens of those dispatches
    in_flight: int  # the daemon's own count of dispatched, unfinished requests
    class_pab_tokens: Mapping[str, float] = field(default_factory=dict)  # effective, per SLO class

    def budget(self, slo_class: str | None = None) -> float | None:
        """The effective budget of ``slo_class`` (None or unreported: the default class's)."""
        if slo_class is None:
            return self.pab_tokens
        return self.class_pab_tokens.get(slo_class, self.pab_tokens)


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

    def choose(self, ranks: Sequence[RankView], prompt_tokens: int,
               slo_class: str | None = None) -> str | None: ...


class PabBalancer:
    """The rank whose effective PAB (of the request's class) covers the prompt with the
    most to spare (ties: the first given); None when no rank's budget covers it (the
    caller queues or rejects)."""

    name = "pab"

    def choose(self, ranks: Sequence[RankView], prompt_tokens: int,
               slo_class: str | None = None) -> str | None:
        best: str | None = None
        best_budget = 0.0
        for view in ranks:
            budget = view.budget(slo_class)
            if budget is None or budget < prompt_tokens:
                continue
            if best is None or budget > best_budget:
                best, best_budget = view.rank, budget
        return best


class RoundRobinBalancer:
    """The next rank name after the last one chosen, in sorted order (wrapping), so the
    rotation survives ranks joining, leaving or going stale."""

    name = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, ranks: Sequence[RankView], prompt_tokens: int,
               slo_class: str | None = None) -> str | None:
        if not ranks:
            return None
        names = sorted(view.rank for view in ranks)
        last = self._last
        chosen = names[0] if last is None else next((n for n in names if n > last), names[0])
        self._last = chosen
        return chosen


class LowestScoreBalancer:
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
               slo_class: str | None = None) -> str | None:
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


def budget_covers(view: RankView, prompt_tokens: int, slo_class: str | None = None) -> bool:
    budget = view.budget(slo_class)
    return budget is not None and budget >= prompt_tokens


def request_count_score(view: RankView) -> float:
    """vLLM's data-parallel load score."""
    return view.waiting * 4 + view.running


def total_tokens_score(view: RankView) -> float:
    """SGLang's ``total_tokens`` load: tokens held by the rank's requests."""
    return view.total_tokens


class PowerOfTwoBalancer:
    """Two distinct ranks drawn by a seeded RNG; the one with fewer in flight wins (ties:
    the first drawn). One rank: that rank."""

    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self._random = random.Random(seed)

    def choose(self, ranks: Sequence[RankView], prompt_tokens: int,
               slo_class: str | None = None) -> str | None:
        if not ranks:
            return None
        if len(ranks) == 1:
            return ranks[0].rank
        first, second = self._random.sample(range(len(ranks)), 2)
        a, b = ranks[first], ranks[second]
        return b.rank if b.in_flight < a.in_flight else a.rank


def make_balancer(name: str, seed: int = 0) -> Balancer:
    """A fresh balancer by policy name (``seed`` drives ``power_of_two``'s draws)."""
    if name == "pab":
        return PabBalancer()
    if name == "pab_least_loaded":
        # PAB as the admission filter, vLLM's load score as the choice. Why not pab's
        # largest budget first: at a TTFT target of seconds every rank's PAB is many prompts
        # deep, so the largest is decided by small per-rank differences (e.g. in an
        # online-learned step model) and herds onto the rank that looks fastest.
        return LowestScoreBalancer("pab_least_loaded", request_count_score, budget_covers)
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
