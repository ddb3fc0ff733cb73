"""The demo (``scripts/demo.sh``): the shipped FairBatching configuration against the three
strongest baselines, on one SLO class and on a mix of three, on one screen.

Each case has a tuned-settings file written by a full sweep of every baseline family on
its scenario (``configs/tuned_baselines*.toml``). The baselines shown are chosen by that
sweep's results, not by name: the tuned families ranked by peak effective RPS, where
families with the same peak short of every request on time, at the same load, ran alike (a
cap that never binds) and count once. They run at their tuned settings. The tables print who pays at the case's table
load, per prompt-length bucket and per SLO class; the figure puts effective RPS and the
worst group's attainment against load for both cases.
"""

from __future__ import annotations

import re
import textwrap
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sglang_ext.bundled import CONFIGS_DIR
from sglang_ext.sim.capacity import capacity_text, target_key
from sglang_ext.sim.sweep import BASELINES, peak_text
from sglang_ext.sim.tuned import SHIPPED, SHIPPED_THREE_CLASSES, TunedSettings

WIDTH = 100
BASELINE_COUNT = 3
CAPACITY_TARGET = 0.9
THREE_CLASSES = "interactive:0.2,standard:0.5,relaxed:0.3"
SHIPPED_CONFIG = CONFIGS_DIR / "fairbatching.toml"


@dataclass(frozen=True)
class DemoCase:
    title: str
    slug: str  # its output folder
    class_mix: str | None  # a `--class-mix`, None for the default class alone
    tuned_file: Path
    table_rate: float  # the load whose attainment per bucket and class is printed
    worst_group: str  # the group the figure follows: worst_prompt_bucket or worst_slo_class
    workload_argv: tuple[str, ...] = ()  # `sweep` workload options besides the class mix

    @property
    def sweep_argv(self) -> tuple[str, ...]:
        """The `sweep` options that make this case's scenario (the rest are defaults)."""
        return (*self.workload_argv, *(("--class-mix", self.class_mix) if self.class_mix else ()))


CASES = (
    DemoCase("one SLO class", "one-class", None, SHIPPED, 36.0, "worst_prompt_bucket"),
    DemoCase("three SLO classes", "three-classes", THREE_CLASSES, SHIPPED_THREE_CLASSES, 36.0,
             "worst_slo_class"),
)


def shipped_policy(config: Path = SHIPPED_CONFIG) -> str:
    """The simulator's name for the shipped server configuration: its policy with its
    admission mode (``fb-smooth+defer``)."""
    data = tomllib.loads(config.read_text())
    mode = data.get("admission", {}).get("mode", "off")
    return data["policy"] if mode == "off" else f"{data['policy']}+{mode}"


def strongest_baselines(settings: TunedSettings, count: int = BASELINE_COUNT) -> tuple[str, ...]:
    """The ``count`` baseline families of ``settings`` with the highest peak effective RPS;
    a family whose peak and peak load equal a stronger one's is left out (it ran alike),
    unless that peak had every request on time."""
    ranked = sorted(
        (name for name, family in settings.families.items()
         if name in BASELINES and family.peak_effective_rps is not None),
        key=lambda name: (-settings.families[name].peak_effective_rps, BASELINES.index(name)),
    )
    chosen: list[str] = []
    peaks: set[tuple[float, float | None]] = set()
    for name in ranked:
        family = settings.families[name]
        peak = (round(family.peak_effective_rps, 9), family.peak_rate)
        if peak in peaks:
            continue
        if family.peak_rate is None or family.peak_effective_rps < family.peak_rate - 1e-9:
            peaks.add(peak)  # every request on time says nothing of how alike two ran
        chosen.append(name)
        if len(chosen) == count:
            break
    return tuple(chosen)


def row_label(name: str, entry: Mapping, shipped: str) -> str:
    """A policy's row: the shipped configuration marked, a tuned family at its setting."""
    if name == shipped:
        return f"{name} (shipped)"
    return entry.get("best_of", name)


def _load_at(entry: Mapping, rate: float) -> Mapping:
    return next(load for load in entry["loads"] if load["rate"] == rate)


def _attainment(group: Mapping | None) -> str:
    return "-" if not group or group.get("attainment") is None else f"{group['attainment']:.2f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], first: int) -> list[str]:
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) + 2
              for i in range(1, len(header))]

    def line(cells: Sequence[str]) -> str:
        return f"{cells[0]:<{first}}" + "".join(
            f"{cell:>{width}}" for cell, width in zip(cells[1:], widths))

    head = line(header)
    return [head, "-" * len(head), *(line(row) for row in rows)]


def short_bucket(label: str) -> str:
    """A prompt-length bucket in a few characters: ``1024-2047`` is ``1k-2k``."""
    def short(match: re.Match) -> str:
        tokens = int(match.group())
        if tokens >= 1023 and (tokens + 1) % 1024 == 0:
            return f"{(tokens + 1) // 1024}k"
        return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else match.group()
    return re.sub(r"\d+", short, label)


def case_tables(document: Mapping, names: Sequence[str], case: DemoCase, shipped: str) -> str:
    """The case's three tables, each at most :data:`WIDTH` columns: peak and capacity; on
    time per prompt-length bucket; on time per SLO class (with several classes)."""
    policies = document["policies"]
    labels = {name: row_label(name, policies[name], shipped) for name in names}
    first = max(len("policy"), *(len(text) for text in labels.values())) + 2
    key = target_key(CAPACITY_TARGET)
    several = case.class_mix is not None
    header = ["policy", "peak", "at", f"eff @ {case.table_rate:g}",
              f"cap {CAPACITY_TARGET:.0%}", "bucket", *(["class"] if several else [])]
    rows = []
    for name in names:
        entry = policies[name]
        capacity = entry["capacity"][key]
        row = [labels[name], peak_text(entry), f"{entry['peak_rate']:g}",
               f"{_load_at(entry, case.table_rate)['effective_rps']:.2f}",
               capacity_text(capacity["overall"]), capacity_text(capacity["worst_prompt_bucket"])]
        if several:
            row.append(capacity_text(capacity["worst_slo_class"]))
        rows.append(row)
    note = ("peak: the peak effective RPS (offered load x share on time), at that load "
            "(req/s); >=: at the highest load tried. "
            f"cap {CAPACITY_TARGET:.0%}: the highest load with {CAPACITY_TARGET:.0%} on time, "
            "every lower load too; overall, in the worst prompt-length bucket"
            + (" and in the worst SLO class." if several else "."))
    lines = [*_table(header, rows, first), *textwrap.wrap(note, WIDTH), ""]
    loads = {name: _load_at(policies[name], case.table_rate) for name in names}
    buckets = list(dict.fromkeys(b for load in loads.values() for b in load["by_prompt_tokens"]))
    lines.append(f"on time at {case.table_rate:g} req/s, per prompt-length bucket (tokens):")
    lines += _table(["policy", *map(short_bucket, buckets), "all"],
                    [[labels[n], *(_attainment(loads[n]["by_prompt_tokens"].get(b)) for b in buckets),
                      f"{loads[n]['attainment']:.2f}"] for n in names], first)
    if several:
        classes = list(dict.fromkeys(c for load in loads.values() for c in load["by_slo_class"]))
        lines += ["", f"on time at {case.table_rate:g} req/s, per SLO class:"]
        lines += _table(["policy", *classes, "all"],
                        [[labels[n], *(_attainment(loads[n]["by_slo_class"].get(c)) for c in classes),
                          f"{loads[n]['attainment']:.2f}"] for n in names], first)
    return "\n".join(lines)


def case_heading(case: DemoCase, document: Mapping, baselines: Sequence[str]) -> str:
    scenario = document["scenario"]
    classes = scenario["slo"]["classes"]
    used = [name for name in dict.fromkeys(
        c for entry in document["policies"].values() for load in entry["loads"]
        for c in load["by_slo_class"]) if name in classes]
    targets = "; ".join(f"{name} TTFT {classes[name]['ttft_ms']:g} ms, TPOT "
                        f"{classes[name]['tpot_ms']:g} ms" for name in used
                        if "ttft_ms" in classes[name])
    about = (f"{scenario['requests']} requests of {Path(scenario['workload']).name} on a "
             f"simulated {scenario['profile']}; the strongest baselines of its full sweep, at "
             f"their tuned settings: {', '.join(baselines)}.")
    return "\n".join([*textwrap.wrap(f"== {case.title}: {targets}", WIDTH),
                      *textwrap.wrap(about, WIDTH)])
