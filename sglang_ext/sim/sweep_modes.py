"""What ``python -m sglang_ext.sim sweep`` does with the tunable families, and its closing
summary (``scripts/demo.sh --all`` is that command).

Four modes:

- **quick** (the default): a family named bare that the tuned-settings file has (shipped:
  ``configs/tuned_baselines.toml`` for one SLO class and
  ``configs/tuned_baselines_three_classes.toml`` for the demo's three, each written by a
  full sweep) runs at that setting, not searched, provided the sweep's scenario is the
  file's (``sglang_ext.sim.tuned``). On another scenario the families are tuned here, and
  the sweep says why; a file named with ``--tuned-settings`` for another scenario is
  refused instead. Loads: the quick grid.
- **retune** (``--retune``): every family named bare is searched on this scenario.
- **full** (``--full``): every family named bare searched, over the full load grid.
- **search** (``--budgets``): the families searched over exactly those budgets.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sglang_ext.sim.capacity import TARGETS, grid_capacity_table
from sglang_ext.sim.metrics import MIN_GROUP_REQUESTS
from sglang_ext.sim.runner import Scenario
from sglang_ext.sim.sweep import Preset, SweepPlan, display_label, headline_table
from sglang_ext.sim.tuned import (
    TunedSettings,
    TunedSettingsError,
    display_path,
    load,
    preset_labels,
    scenario_fingerprint,
    shipped_for,
)

WIDTH = 100


@dataclass(frozen=True)
class Mode:
    name: str  # quick, retune, full, search
    presets: tuple[Preset, ...] = ()
    settings: TunedSettings | None = None
    #: why a family is tuned here in the quick mode (a scenario other than the file's)
    refused: tuple[str, ...] = ()


def choose_mode(
    plan: SweepPlan, scenario: Scenario, *, full: bool, retune: bool,
    settings_path: Path | None, save_tuned: Path | None,
) -> Mode:
    """The mode of a sweep of ``plan`` (made without presets) on ``scenario``."""
    searching = full or retune or plan.budgets is not None
    if settings_path is not None and searching:
        flags = "--full" if full else "--retune" if retune else "--budgets"
        raise TunedSettingsError(f"--tuned-settings gives settings to run instead of tuning; "
                                 f"{flags} tunes")
    if save_tuned is not None and not searching:
        raise TunedSettingsError("--save-tuned records settings this sweep tunes: add --full "
                                 "(the full sweep) or --retune")
    if full:
        return Mode("full")
    if searching:
        return Mode("retune" if retune else "search")
    if not plan.tuned:
        return Mode("quick")
    fingerprint = scenario_fingerprint(scenario)
    path = settings_path or shipped_for(fingerprint)
    if not path.is_file():
        if settings_path is not None:
            raise TunedSettingsError(f"--tuned-settings {path}: no such file")
        raise TunedSettingsError(f"the shipped tuned settings {display_path(path)} are missing; "
                                 "tune here with --retune, or run the full sweep with --full")
    settings = load(path)
    differences = settings.differences(fingerprint)
    if differences and settings_path is not None:
        raise TunedSettingsError(
            f"--tuned-settings {path} was tuned on another scenario ({'; '.join(differences)}); "
            "tune on this one with --retune, or name a file tuned on it"
        )
    if differences:
        return Mode("quick", settings=settings, refused=tuple(differences))
    return Mode("quick", presets(settings, plan.tuned), settings)


def presets(settings: TunedSettings, names: Sequence[str]) -> tuple[Preset, ...]:
    """Each bare tunable family among ``names`` that ``settings`` has, at its setting there."""
    return tuple(Preset(name, label, settings.tuning_entry(name))
                 for name, label in preset_labels(settings, names).items())


def start_note(mode: Mode, plan: SweepPlan) -> str | None:
    """One line for stderr before the sweep: where the families' settings come from."""
    if mode.refused and mode.settings:
        return (f"not using the tuned settings in {mode.settings.source}: they are for another "
                f"scenario ({'; '.join(mode.refused)}); tuning {', '.join(plan.tuned)} on this "
                "one instead (several hundred simulations)")
    if mode.presets and mode.settings:
        return (f"{', '.join(p.name for p in mode.presets)}: the tuned settings in "
                f"{mode.settings.source}, not searched (re-tune: --retune; the full sweep: --full)")
    return None


def capacity_lines(document: dict) -> list[str]:
    """Capacity per policy from the grid (``sglang_ext.sim.capacity``), with its rule."""
    targets = " and ".join(f"{t:.0%}" for t in TARGETS)
    note = (
        f"Capacity from the grid: the highest load where at least {targets} of requests "
        "meet their SLO, every lower load of the grid meeting it too: overall / in the worst "
        "prompt-length bucket / in the worst SLO class (the lowest-attainment group of at "
        f"least {MIN_GROUP_REQUESTS} requests). A lower bound at the grid's resolution (the "
        "next load fails: results.json `capacity`); >= : the highest load meets it; <: the "
        "lowest fails. Finer: `python -m sglang_ext.sim capacity --policy P`."
    )
    return [grid_capacity_table(document, list(document["requested"]), label=display_label),
            *textwrap.wrap(note, WIDTH)]


def closing_summary(
    document: dict, plan: SweepPlan, mode: Mode, *, full_rates: Sequence[float],
    rates_given: bool, results: Path, plots: Sequence[Path],
) -> str:
    """The one-screen summary printed last: what ran, the headline table, what the quick
    mode leaves out and how to get it (the loads of ``full_rates`` it skipped, unless the
    loads were ``rates_given``), and where the files are."""
    rates = document["rates"]
    simulations = sum(len(entry["loads"]) for entry in document["policies"].values()
                      if "best_of" not in entry)
    what = {"quick": "quick demo", "retune": "re-tuned", "full": "full sweep",
            "search": "tuned over --budgets"}[mode.name]
    head = (f"Summary ({what}): {len(plan.requested)} policies x {len(rates)} loads "
            f"({min(rates):g}-{max(rates):g} req/s), {simulations} simulations")
    if mode.presets and mode.settings:
        provenance = mode.settings.provenance
        head += (f"; {', '.join(p.name for p in mode.presets)} at the tuned settings from "
                 f"{mode.settings.source} (tuned by `{provenance.get('command')}`"
                 + (f" at {provenance['commit']}" if provenance.get("commit") else "")
                 + f", {provenance.get('date')}), not searched here: re-tune with --retune.")
    elif plan.tuned:
        head += f"; {', '.join(plan.tuned)} tuned here (every setting tried is in results.json)"
        head += (f", because the tuned settings in {mode.settings.source} are for another "
                 f"scenario: {'; '.join(mode.refused)}." if mode.refused and mode.settings else ".")
    else:
        head += "."
    lines = [*textwrap.wrap(head, WIDTH), "", headline_table(document)]
    lines += ["", *capacity_lines(document)]
    missing = [] if rates_given else sorted(set(full_rates) - set(rates))
    if mode.name == "quick":
        left_out = []
        if mode.presets:
            left_out.append("the tuning")
        if missing:
            left_out.append(f"the loads {', '.join(f'{r:g}' for r in missing)} (a peak at one "
                            "of them would be missed)")
        if left_out:
            lines += [""] + textwrap.wrap(
                f"Not done by the quick demo: {' and '.join(left_out)}. The full sweep, every "
                f"baseline tuned over {len(full_rates)} loads (about 2,700 simulations, about an hour "
                "on 2 cores): --full.", WIDTH)
    lines += ["", f"results: {results}", f"plots:   {', '.join(map(str, plots))}"]
    return "\n".join(lines)
