"""Tune a baseline's tunables to an interior best (the project's baseline rule).

A *setting* is one concrete policy (``sarathi@1024``, ``sarathi-queue-cap@1024,cap=65536``)
run at every load of the sweep. Its score is its peak effective RPS over those loads;
**ties** go to the higher mean effective RPS over all loads, then to the smaller value.

One axis at a time:

1. start from the axis's grid (or, on a later pass, from the current best and its
   halving and doubling);
2. while the best is the smallest (largest) value tried and halving (doubling) stays
   inside the axis's bounds, try that;
3. refine: while a neighbour of the best is more than 25% of the best away, try the
   midpoint.

A best that is still at a bound of its axis is an **edge** best: reports mark it. An axis
given explicitly (``--budgets``) is searched over exactly those values, never widened or
refined. Axes: the token budget, 32 to 8192 (grid doubling); every other setting, its
default at the start budget (the policy's ``default_setting``) x 1/4 .. 4, within
x 1/16 .. 16, integer for token counts (``cap``, ``chunk``): vLLM's queued-token cap, TTFT x
prefill throughput at the budget (vLLM's sizing advice; the throughput is the profile's
offline step-model fit); SGLang's queue timeout, the TTFT (both alike on the shortest-first
and class-priority orders, ``sarathi-sjf-queue-cap``, ``sarathi-priority-queue-timeout``, ...,
which inherit them); the batching study's policies
(``sglang_ext.sim.competitors.study_policies``): fixed-batch's ``timeout_ms``, dynamic-batch's ``low``,
``high`` and ``latency_ms``, prefill-first's ``chunk``; ``slo-anneal``'s ``batch`` (its
maximum batch size, integer). A family with settings runs coordinate search: each tuned
setting in ``setting_names`` order at budget 512 (the others at their defaults), then the
budget, then each setting again around its best. With one setting (budget x cap, budget
x timeout, budget x chunk, budget x batch) that is three passes. A policy whose
``tuned_settings`` names a subset of its settings is tuned over that subset only (the
annealing's temperatures, window and seed stay at their defaults).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

from sglang_ext.policy.policies import POLICIES, PolicyContext
from sglang_ext.sim.runner import DEFAULT_TOKEN_BUDGETS, PolicySpec

REFINE_STEP = 0.25
START_BUDGET = 512
BUDGET_BOUNDS = (32, 8192)
SETTING_GRID = (0.25, 0.5, 1.0, 2.0, 4.0)
SETTING_BOUNDS = (1 / 16, 16.0)
INTEGER_SETTINGS = ("cap", "chunk", "batch")  # token counts, a batch size

Score = tuple[float, float]  # (peak effective RPS, mean effective RPS over the loads)
#: the driver sends the scores of every label asked for, and gets the next labels to run
Search = Generator[list[str], dict[str, Score], "TuningResult"]


@dataclass(frozen=True)
class Axis:
    name: str
    grid: tuple[float, ...]
    bounds: tuple[float, float]
    integer: bool
    search: bool = True  # False: exactly the grid, never widened or refined

    def snap(self, value: float) -> float:
        low, high = self.bounds
        value = min(max(value, low), high)
        return float(max(1, round(value))) if self.integer else round(value, 3)

    def next_values(self, tried: dict[float, Score]) -> list[float]:
        values = sorted(tried)
        best = best_value(tried)
        if not self.search:
            return []
        index = values.index(best)
        low, high = self.bounds
        if index == 0 and best > low:
            return [self.snap(best / 2)]
        if index == len(values) - 1 and best < high:
            return [self.snap(best * 2)]
        out = []
        neighbours = values[max(index - 1, 0):index] + values[index + 1:index + 2]
        for neighbour in neighbours:
            if abs(neighbour - best) > REFINE_STEP * best:
                middle = self.snap((neighbour + best) / 2)
                if middle not in tried:
                    out.append(middle)
        return out

    def at_edge(self, value: float) -> bool:
        low, high = (min(self.grid), max(self.grid)) if not self.search else self.bounds
        return value <= low or value >= high


def best_value(tried: dict[float, Score]) -> float:
    """The tie rule: highest peak, then highest mean, then the smallest value."""
    return max(tried, key=lambda value: (*tried[value], -value))


@dataclass
class TuningResult:
    best: str  # label of the best setting
    edge: list[str] = field(default_factory=list)  # axes whose best is at a bound
    tried: list[str] = field(default_factory=list)  # every label, in the order run


def budget_axis(budgets: Sequence[int] | None) -> Axis:
    if budgets:
        return Axis("budget", tuple(sorted(set(budgets))), (min(budgets), max(budgets)), True, False)
    return Axis("budget", DEFAULT_TOKEN_BUDGETS, BUDGET_BOUNDS, True)


def _axis_search(
    axis: Axis, start: Sequence[float], label_of: Callable[[float], str], result: TuningResult
) -> Generator[list[str], dict[str, Score], float]:
    tried: dict[float, Score] = {}
    todo = sorted({axis.snap(v) for v in start})
    while todo:
        labels = [label_of(value) for value in todo]
        scores = yield labels
        for value, label in zip(todo, labels):
            tried[value] = scores[label]
            if label not in result.tried:
                result.tried.append(label)
        todo = [v for v in axis.next_values(tried) if v not in tried]
    return best_value(tried)


def _neighbourhood(axis: Axis, value: float) -> list[float]:
    if not axis.search:
        return list(axis.grid)
    return [value / 2, value, value * 2]


def setting_axis(setting: str, default: float) -> Axis:
    """``setting``'s axis: ``default`` x the grid, within ``default`` x the bounds."""
    return Axis(setting, tuple(default * m for m in SETTING_GRID),
                (default * SETTING_BOUNDS[0], default * SETTING_BOUNDS[1]),
                integer=setting in INTEGER_SETTINGS)


def tuned_settings(factory) -> tuple[str, ...]:
    """The settings a sweep tunes: ``tuned_settings`` where a policy names them, else all
    of its ``setting_names``."""
    return tuple(getattr(factory, "tuned_settings", factory.setting_names))


def tune(name: str, context: PolicyContext, budgets: Sequence[int] | None,
         start_budget: int | None = None) -> Search:
    """The search for family ``name`` (a registered policy with tunables).

    ``start_budget``: where a family with settings tunes them first, and whose halving and
    doubling open its budget pass (default: the grid's value nearest ``START_BUDGET``). A
    search that starts where every setting fails (all scores tied) never leaves that
    region, so a caller that knows a good budget (the plain family's tuned one) passes it.
    """
    factory = POLICIES.get(name)
    result = TuningResult(best="")
    budget = budget_axis(budgets)
    if not tuned_settings(factory):
        best = yield from _axis_search(budget, budget.grid, lambda b: _label(name, b), result)
        result.best = _label(name, best)
        result.edge = ["budget"] if budget.at_edge(best) else []
        return result
    if start_budget is None:
        start_budget = min(budget.grid, key=lambda b: abs(b - START_BUDGET))
    else:
        start_budget = budget.snap(start_budget)
    best_budget = start_budget if factory.takes_token_budget else None
    defaults = {setting: factory.default_setting(setting, context, int(start_budget))
                for setting in tuned_settings(factory)}
    axes = [setting_axis(setting, default) for setting, default in defaults.items()]
    values = {axis.name: axis.snap(defaults[axis.name]) for axis in axes}

    def label_of(axis: Axis, at_budget: float | None) -> Callable[[float], str]:
        return lambda v: _label(name, at_budget, {**values, axis.name: v})

    for axis in axes:
        values[axis.name] = yield from _axis_search(
            axis, axis.grid, label_of(axis, best_budget), result
        )
    if factory.takes_token_budget:
        best_budget = yield from _axis_search(
            budget, _neighbourhood(budget, start_budget),
            lambda b: _label(name, b, values), result,
        )
    for axis in axes:
        values[axis.name] = yield from _axis_search(
            axis, _neighbourhood(axis, values[axis.name]), label_of(axis, best_budget), result
        )
    result.best = _label(name, best_budget, values)
    tuned = [(budget, best_budget)] if factory.takes_token_budget else []
    tuned += [(axis, values[axis.name]) for axis in axes]
    result.edge = [axis.name for axis, v in tuned if axis.at_edge(v)]
    return result


def _label(name: str, budget: float | None, settings: dict[str, float] | None = None) -> str:
    pairs = tuple(sorted((settings or {}).items()))
    return PolicySpec(name, None if budget is None else int(budget), pairs).label
