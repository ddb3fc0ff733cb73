"""Capacity, the paper's measure: the highest offered load at which at least a target share
(90%, 99%) of requests meet their SLO, overall, in the worst prompt-length bucket and in the
worst SLO class (``worst_prompt_bucket`` / ``worst_slo_class`` of a load point:
``sglang_ext.sim.metrics``).

Attainment against load need not be monotone (noise), so capacity is defined over the
loads probed: **the highest probed load that meets the target such that every lower probed
load meets it too**. ``next_fail`` is the lowest probed load that misses it; the capacity
lies in ``[capacity, next_fail)``, so ``capacity`` is a lower bound at the resolution of the
probes. Probed loads above ``next_fail`` that meet the target again are listed in
``met_above_failure`` (noise, or a non-monotone policy) and never count.

Two ways to probe:

- :func:`grid_capacity`: the loads of a sweep's grid (``at_top``: no load of the grid
  failed, the capacity is ``>=`` the highest load; ``capacity`` is ``None`` when the lowest
  load already fails).
- :func:`bisect_capacity`: doubling / halving from a start load until the target is
  bracketed, then geometric bisection until ``next_fail / capacity - 1 <= tolerance``
  (``python -m sglang_ext.sim capacity``). Every probe is shared by every measure and target
  of one policy.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

TARGETS = (0.9, 0.99)
#: results.json names of the three measures and what each reads from a load point
MEASURES = ("overall", "worst_prompt_bucket", "worst_slo_class")
MEASURE_TITLES = {"overall": "overall", "worst_prompt_bucket": "worst bucket",
                  "worst_slo_class": "worst class"}
DEFAULT_TOLERANCE = 0.05


def measure_attainment(load: Mapping, measure: str) -> float | None:
    """The attainment ``measure`` reads from a load point; ``None`` when undefined (no
    group large enough to be the worst, or a load point written before the field)."""
    if measure == "overall":
        return load["attainment"]
    return (load.get(measure) or {}).get("attainment")


def measure_label(load: Mapping, measure: str) -> str | None:
    """The worst group's label at a load point (``None`` for ``overall``)."""
    return None if measure == "overall" else (load.get(measure) or {}).get("label")


def target_key(target: float) -> str:
    """A target as a results.json key: ``"0.9"``, ``"0.99"``."""
    return f"{target:g}"


def capacity_from_probes(loads: Iterable[Mapping], target: float, measure: str) -> dict:
    """Capacity at ``target`` by ``measure`` from probed load points (any order):
    ``{"capacity", "next_fail", "at_top", "resolution", "met_above_failure", "probes",
    "worst_at_next_fail"}`` (see the module docstring); ``undefined`` instead when the
    measure has no value at some load."""
    ordered = sorted(loads, key=lambda load: load["rate"])
    values = [measure_attainment(load, measure) for load in ordered]
    if not ordered or any(value is None for value in values):
        return {"capacity": None, "next_fail": None, "at_top": False, "resolution": None,
                "met_above_failure": [], "probes": len(ordered),
                "undefined": "no group has enough requests to be the worst"
                if ordered else "no load probed"}
    met = [value >= target for value in values]
    first_fail = next((i for i, ok in enumerate(met) if not ok), None)
    capacity = next_fail = None
    if first_fail is None:
        capacity = ordered[-1]["rate"]
    else:
        next_fail = ordered[first_fail]["rate"]
        if first_fail > 0:
            capacity = ordered[first_fail - 1]["rate"]
    entry = {
        "capacity": capacity,
        "next_fail": next_fail,
        "at_top": first_fail is None,
        "resolution": (next_fail / capacity - 1.0
                       if capacity is not None and next_fail is not None else None),
        "met_above_failure": ([] if first_fail is None else
                              [load["rate"] for load, ok in zip(ordered[first_fail:],
                                                                met[first_fail:]) if ok]),
        "probes": len(ordered),
    }
    if measure != "overall":
        at = ordered[first_fail] if first_fail is not None else ordered[-1]
        entry["worst_at_next_fail" if first_fail is not None else "worst_at_top"] = \
            measure_label(at, measure)
    return entry


def grid_capacity(loads: Sequence[Mapping], targets: Sequence[float] = TARGETS,
                  measures: Sequence[str] = MEASURES) -> dict:
    """A policy's ``capacity`` entry from a sweep's loads: per target (``"0.9"``), per
    measure, :func:`capacity_from_probes` (the grid's resolution: a lower bound)."""
    return {target_key(t): {m: dict(capacity_from_probes(loads, t, m), method="grid")
                            for m in measures}
            for t in targets}


def annotate(document: dict, targets: Sequence[float] = TARGETS) -> dict:
    """Add every policy's grid ``capacity`` to a results.json document, in place."""
    for entry in document["policies"].values():
        entry["capacity"] = grid_capacity(entry["loads"], targets)
    return document


def capacity_text(entry: Mapping) -> str:
    """A capacity cell: ``16``, ``>=36`` (the highest load meets it), ``<4`` (the lowest
    load fails), ``n/a`` (undefined)."""
    if entry.get("undefined"):
        return "n/a"
    if entry["capacity"] is None:
        return f"<{entry['next_fail']:g}"
    return f"{'>=' if entry['at_top'] else ''}{entry['capacity']:g}"


def grid_capacity_table(document: Mapping, names: Sequence[str],
                        targets: Sequence[float] = TARGETS,
                        label: Callable[[str, Mapping], str] = lambda name, entry: name) -> str:
    """Per policy, grid capacity at each target: overall / worst bucket / worst class
    (``label(name, entry)``: the policy's row label)."""
    policies = document["policies"]
    labels = {name: label(name, policies[name]) for name in names}
    width = max(24, *(len(text) + 2 for text in labels.values()))
    groups = "".join(f"{f'{t:.0%}: overall / bucket / class':>32}" for t in targets)
    lines = [f"{'policy':<{width}}{groups}", "-" * (width + 32 * len(targets))]
    for name in names:
        capacity = policies[name].get("capacity") or grid_capacity(policies[name]["loads"],
                                                                   targets)
        cells = ""
        for target in targets:
            by = capacity[target_key(target)]
            cells += f"{' / '.join(capacity_text(by[m]) for m in MEASURES):>32}"
        lines.append(f"{labels[name]:<{width}}{cells}")
    return "\n".join(lines)


# ------------------------------------------------------------------ bisection
@dataclass
class CapacitySearch:
    """One policy's bisection: every probed load point (by rate) and the result per target
    and measure."""

    loads: dict[float, dict] = field(default_factory=dict)
    capacity: dict[str, dict[str, dict]] = field(default_factory=dict)

    @property
    def simulations(self) -> int:
        return len(self.loads)


def round_rate(rate: float) -> float:
    """Four significant digits, so probed loads print cleanly."""
    return float(f"{rate:.4g}")


def bisect_capacity(
    evaluate: Callable[[float], Mapping],
    *,
    targets: Sequence[float] = TARGETS,
    measures: Sequence[str] = MEASURES,
    start: float,
    tolerance: float = DEFAULT_TOLERANCE,
    min_rate: float | None = None,
    max_rate: float | None = None,
    max_simulations: int = 60,
) -> CapacitySearch:
    """Capacity per target and measure by probing ``evaluate(rate)`` (a load point).

    For each (target, measure) in turn, over every load probed so far: with no failing
    load, double the highest (first probe: ``start``) up to ``max_rate``; with no meeting
    load below the lowest failing one, halve it down to ``min_rate``; else probe the
    geometric mean of the bracket (the highest meeting load below the lowest failing one,
    and that failing one) until ``next_fail / capacity - 1 <= tolerance``. ``resolved`` says
    whether it got there (not when ``max_rate`` met the target, ``min_rate`` failed it, or
    ``max_simulations`` ran out). When a whole pass over the targets and measures probes
    nothing new, every bracket is settled over all the loads probed."""
    if not start > 0:
        raise ValueError(f"start must be > 0, got {start!r}")
    min_rate = min_rate if min_rate is not None else round_rate(start / 64)
    max_rate = max_rate if max_rate is not None else round_rate(start * 64)
    search = CapacitySearch()

    def step(target: float, measure: str) -> float | None:
        """The next load to probe for (target, measure), None when it is settled."""
        result = capacity_from_probes(search.loads.values(), target, measure)
        if not search.loads:
            return round_rate(start)
        if result.get("undefined"):
            return None
        lo, hi = result["capacity"], result["next_fail"]
        if hi is None:
            return None if lo >= max_rate else min(round_rate(lo * 2), max_rate)
        if lo is None:
            return None if hi <= min_rate else max(round_rate(hi / 2), min_rate)
        if hi / lo - 1.0 <= tolerance:
            return None
        nxt = round_rate(math.sqrt(lo * hi))
        return nxt if lo < nxt < hi else None  # rounding left no load between them

    # every (target, measure) in turn until a whole pass probes nothing: a later probe can
    # fail below an earlier measure's bracket, which reopens it
    while True:
        probed = False
        for target in targets:
            for measure in measures:
                while (nxt := step(target, measure)) is not None and nxt not in search.loads:
                    if len(search.loads) >= max_simulations:
                        break
                    search.loads[nxt] = dict(evaluate(nxt))
                    probed = True
        if not probed or len(search.loads) >= max_simulations:
            break
    for target in targets:
        for measure in measures:
            result = capacity_from_probes(search.loads.values(), target, measure)
            resolution = result["resolution"]
            result.update(method="bisection", tolerance=tolerance,
                          resolved=resolution is not None and (
                              resolution <= tolerance or step(target, measure) is None))
            search.capacity.setdefault(target_key(target), {})[measure] = result
    return search


def bracket_text(entry: Mapping) -> str:
    """A bisection cell: ``17.31 [fails 18.05]``; ``>=X`` (the highest load probed meets
    it), ``<X`` (the lowest fails), ``n/a``; ``*`` when not resolved to the tolerance."""
    if entry.get("undefined"):
        return "n/a"
    text = capacity_text(entry)
    if entry["capacity"] is not None and entry["next_fail"] is not None:
        text = f"{entry['capacity']:g} [fails {entry['next_fail']:g}]"
    worst = entry.get("worst_at_next_fail")
    if worst:
        text += f" {worst}"
    return text + ("" if entry.get("resolved", True) else "*")


def bisection_table(document: Mapping, names: Sequence[str]) -> str:
    """``capacity``'s table: per policy and target, each measure's capacity and the lowest
    load that fails it (and which group is the worst there), the simulations run."""
    policies = document["policies"]
    width = max(24, *(len(name) + 2 for name in names))
    cell = 34
    header = (f"{'policy':<{width}}{'target':>7}  "
              + "".join(f"{MEASURE_TITLES[m]:<{cell}}" for m in MEASURES) + f"{'sims':>5}")
    lines = [header, "-" * len(header)]
    for name in names:
        entry = policies[name]
        sims = entry.get("capacity_search", {}).get("simulations", len(entry["loads"]))
        for index, (key, by) in enumerate(entry["capacity"].items()):
            cells = "".join(f"{bracket_text(by[m]):<{cell}}" for m in MEASURES)
            first = index == 0
            lines.append(f"{name if first else '':<{width}}{float(key):>7.0%}  {cells}"
                         f"{sims if first else '':>5}")
    tolerance = document.get("capacity", {}).get("tolerance", DEFAULT_TOLERANCE)
    minimum = document.get("capacity", {}).get("min_group_requests")
    lines += [""] + textwrap.wrap(
        "capacity [fails X]: the highest load probed where the target share of requests met "
        "their SLO, every lower load probed meeting it too; X: the lowest load probed that "
        f"fails it (the bracket; within {tolerance:.0%} unless marked *), then the worst group "
        "there. >= : the highest load probed meets it; < : the lowest fails; n/a: no group "
        + (f"of >= {minimum} requests." if minimum else "large enough."), 100)
    return "\n".join(lines)
