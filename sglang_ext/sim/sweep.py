"""Policies x offered loads, in parallel, into ``results.json`` (schema version 2).

A policy with tunables named without them (``sarathi``, ``fb-fb``,
``sarathi-queue-cap``, ``sarathi-queue-timeout``, the batching study's ``fixed-batch``,
``dynamic-batch`` and ``prefill-first``) is tuned to an interior best by
``sglang_ext.sim.fitting.tuning``: every setting it tries is reported as its own
``NAME@...`` entry, and ``NAME`` holds the best one (``best_of`` says which,
``tuning`` lists every setting tried and any axis whose best is at a bound). A plan may
instead run a family at a setting tuned before (a *preset*, from a tuned-settings file:
``sglang_ext.sim.tuned``): ``NAME`` then holds that setting's runs, ``best_of`` names it and
``tuning`` says where it came from (``from``, ``shipped``, ``tuned_by``, ``tuned_on``,
``edge_axes``) instead of listing settings tried.

Schema version 2 added, for end-to-end SLOs (``sglang_ext.policy.slo``): each load's
``e2e_ms`` percentiles and ``by_slo_class`` (per SLO class: kind, requests, attainment,
TTFT, TPOT and e2e percentiles); the scenario's ``slo`` records its default class by
kind (``ttft_ms`` + ``tpot_ms``, or ``e2e_ms`` + ``ttft_ms``, the first-token budget)
and every class the same way under ``classes``. A load's ``ttft_attainment`` and
``tpot_attainment`` count TTFT+TPOT requests only (``null`` when there are none); for
a run without an e2e request every version-1 field keeps its value.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sglang_ext.policy.policies import POLICIES
from sglang_ext.policy.slo import SloCatalog
from sglang_ext.sim import capacity
from sglang_ext.sim.executors import PROCESSES, ExecutorSpec, open_pool
from sglang_ext.sim.fitting.tuning import Search, TuningResult, tune
from sglang_ext.sim.metrics import MIN_GROUP_REQUESTS, LatencySamples
from sglang_ext.sim.runner import (
    PolicySpec,
    PolicySpecError,
    RunResult,
    Scenario,
    build_policy,
    parse_policy,
    simulate,
)

SCHEMA_VERSION = 2
DEFAULT_POLICIES = (
    "sglang-default", "vllm-default", "sarathi", "sarathi-queue-cap", "sarathi-queue-timeout",
    "sarathi-sjf", "sarathi-sjf-queue-cap", "sarathi-sjf-queue-timeout",
    "sarathi-hrrn", "sarathi-hrrn-queue-timeout", "sarathi-spf", "sarathi-spf-queue-timeout",
    "fb-fb", "fb-tb", "fb", "fb-pab", "fb-anchor-margin", "fb-anchor-margin-pab",
    "fb-anchor-margin+reject", "fb-anchor-margin+defer", "fb-smooth", "fb-smooth+defer",
)
#: class-priority orders: with one SLO class they are FCFS, so a sweep adds them by default
#: only to a scenario with several classes (``default_policies``)
PRIORITY_BASELINES = ("sarathi-priority", "sarathi-priority-queue-cap", "sarathi-priority-queue-timeout")
#: the baselines users run today, admission controls and shortest-first and class-priority
#: orders included; ratios divide by their best
BASELINES = (
    "sglang-default", "vllm-default", "sarathi", "sarathi-queue-cap", "sarathi-queue-timeout",
    "sarathi-sjf", "sarathi-sjf-queue-cap", "sarathi-sjf-queue-timeout",
    "sarathi-hrrn", "sarathi-hrrn-queue-timeout", "sarathi-spf", "sarathi-spf-queue-timeout",
    *PRIORITY_BASELINES,
)
#: the baselines whose rule is an admission control (vLLM's queued-token cap, SGLang's
#: waiting timeout; in FCFS, shortest-first, SGLang's hrrn and shortest-prefill-first, or
#: class-priority order: sglang_ext.sim.competitors.baselines and .sglang_orders)
ADMISSION_BASELINES = (
    "sarathi-queue-cap", "sarathi-queue-timeout",
    "sarathi-sjf-queue-cap", "sarathi-sjf-queue-timeout",
    "sarathi-hrrn-queue-timeout", "sarathi-spf-queue-timeout",
    "sarathi-priority-queue-cap", "sarathi-priority-queue-timeout",
)


def default_policies(several_classes: bool) -> tuple[str, ...]:
    """What a sweep runs when no policy is named: ``DEFAULT_POLICIES``, and the
    class-priority baselines when the scenario has several SLO classes."""
    return DEFAULT_POLICIES + (PRIORITY_BASELINES if several_classes else ())


def policy_kind(name: str) -> tuple[bool, bool]:
    """(of the FairBatching family, with admission control) for a policy name: its own
    ``+MODE``, a name that implies one (``fb-pab``), or an admission-control baseline."""
    try:
        spec = parse_policy(name)
        factory = POLICIES.get(spec.base)
    except (PolicySpecError, KeyError):
        return False, False
    fairbatching = bool(getattr(factory, "takes_admission", False))
    admission = (spec.admission is not None or spec.base in ADMISSION_BASELINES
                 or getattr(factory, "implied_admission", None) is not None)
    return fairbatching, admission


@dataclass(frozen=True)
class Preset:
    """A tunable family run at a setting tuned before, not searched."""

    name: str  # the family, e.g. sarathi
    label: str  # its setting, e.g. sarathi@1024
    tuning: dict  # its results.json ``tuning``: where the setting comes from


@dataclass(frozen=True)
class SweepPlan:
    requested: tuple[str, ...]  # names as passed to --policy
    runs: tuple[PolicySpec, ...]  # concrete policies run as given (and presets' settings)
    tuned: tuple[str, ...] = ()  # families tuned by sglang_ext.sim.fitting.tuning
    budgets: tuple[int, ...] | None = None  # explicit --budgets: searched exactly
    presets: tuple[Preset, ...] = ()  # families run at a setting tuned before


def plan_sweep(
    names: Sequence[str], budgets: Sequence[int] | None = None,
    presets: Sequence[Preset] = (),
) -> SweepPlan:
    """Concrete policies run as given; a family named bare runs at its preset when there is
    one, else it is tuned."""
    by_name = {preset.name: preset for preset in presets}
    runs: list[PolicySpec] = []
    tuned: list[str] = []
    used: list[Preset] = []
    for name in dict.fromkeys(names):
        spec = parse_policy(name)
        if spec.is_tunable and name in by_name:
            used.append(by_name[name])
            runs.append(parse_policy(by_name[name].label))
        elif spec.is_tunable:
            tuned.append(name)
        else:
            runs.append(spec)
    return SweepPlan(
        tuple(dict.fromkeys(names)), tuple(dict.fromkeys(runs)), tuple(tuned),
        tuple(budgets) if budgets else None, tuple(used),
    )


_scenario: Scenario | None = None


def _init_worker(scenario: Scenario) -> None:
    global _scenario
    _scenario = scenario


def _run_job(job: tuple[PolicySpec, float, bool]) -> RunResult:
    spec, rate, keep = job
    assert _scenario is not None
    return simulate(_scenario, spec, rate, keep_samples=keep)


def run_sweep(
    scenario: Scenario,
    plan: SweepPlan,
    rates: Sequence[float],
    *,
    cdf_rate: float,
    jobs: int | None = None,
    executor: ExecutorSpec = PROCESSES,
    progress: Callable[[int], None] | None = None,
    planned: Callable[[int], None] | None = None,
) -> tuple[dict, dict[str, LatencySamples]]:
    """Returns (results.json document, per-policy latency samples at ``cdf_rate``).

    The simulations run on ``executor`` with ``jobs`` workers
    (``sglang_ext.sim.executors.open_pool``), with the same results on any. ``progress(n)`` after every ``n`` finished simulations;
    ``planned(n)`` whenever ``n`` more are scheduled (tuning decides as it goes)."""
    results: dict[str, list[RunResult]] = {}
    with open_pool(executor, jobs, _init_worker, (scenario,)).executor as pool:
        def run(specs: Sequence[PolicySpec]) -> None:
            fresh = [spec for spec in dict.fromkeys(specs) if spec.label not in results]
            work = [(spec, rate, rate == cdf_rate) for spec in fresh for rate in rates]
            if planned:
                planned(len(work))
            for result in pool.map(_run_job, work, chunksize=1):
                results.setdefault(result.policy, []).append(result)
                if progress:
                    progress(1)

        run(plan.runs)
        tunings = _tune_all(scenario, plan, run, results)
    flat = [result for runs in results.values() for result in runs]
    return assemble(scenario, plan, rates, cdf_rate, flat, tunings)


def _tune_all(
    scenario: Scenario, plan: SweepPlan, run: Callable[[Sequence[PolicySpec]], None],
    results: dict[str, list[RunResult]],
) -> dict[str, TuningResult]:
    """Drive every family's search together, one batch of settings per round."""
    searches: dict[str, Search] = {}
    asked: dict[str, list[str]] = {}
    done: dict[str, TuningResult] = {}
    for name in plan.tuned:
        context = build_policy(scenario, PolicySpec(name)).context
        searches[name] = tune(name, context, plan.budgets)
        asked[name] = next(searches[name])
    while asked:
        run([parse_policy(label) for labels in asked.values() for label in labels])
        for name in list(asked):
            scores = {label: _score(results[label]) for label in asked[name]}
            try:
                asked[name] = searches[name].send(scores)
            except StopIteration as stop:
                done[name] = stop.value
                del asked[name]
    return done


def _score(runs: list[RunResult]) -> tuple[float, float]:
    values = [run.load["effective_rps"] for run in runs]
    return max(values), sum(values) / len(values)


def assemble(
    scenario: Scenario, plan: SweepPlan, rates: Sequence[float], cdf_rate: float,
    results: list[RunResult], tunings: dict[str, TuningResult] | None = None,
) -> tuple[dict, dict[str, LatencySamples]]:
    """The ``results.json`` document (and CDF samples) from finished runs."""
    by_label: dict[str, list[dict]] = {}
    samples: dict[str, LatencySamples] = {}
    for result in results:
        by_label.setdefault(result.policy, []).append(result.load)
        if result.samples is not None:
            samples[result.policy] = result.samples
    policies: dict[str, dict] = {}
    for label, loads in by_label.items():
        loads.sort(key=lambda load: load["rate"])
        peak = max(loads, key=lambda load: load["effective_rps"])
        policies[label] = {
            "peak_effective_rps": peak["effective_rps"],
            "peak_rate": peak["rate"],
            "loads": loads,
        }
    top = max(rates)
    for label, entry in policies.items():
        entry["peak_at_highest_load"] = entry["peak_rate"] == top
    for name, tuning in (tunings or {}).items():
        best = tuning.best
        policies[name] = dict(
            policies[best], best_of=best,
            tuning={"tried": list(tuning.tried), "edge_axes": list(tuning.edge)},
        )
        if best in samples:
            samples[name] = samples[best]
    for preset in plan.presets:
        policies[preset.name] = dict(policies[preset.label], best_of=preset.label,
                                     tuning=dict(preset.tuning))
        if preset.label in samples:
            samples[preset.name] = samples[preset.label]
    document = {
        "schema_version": SCHEMA_VERSION,
        "scenario": {
            "workload": scenario.workload.source,
            "requests": len(scenario.workload.requests),
            "natural_rate": scenario.workload.mean_rate,
            "profile": scenario.profile.name,
            "arrivals": scenario.arrivals,
            "seed": scenario.seed,
            "step_model": (scenario.step_model.model.form if scenario.step_model
                           else scenario.step_form),
            "learn_knee": scenario.learn_knee,
            "calibrate": scenario.calibrate,
            "drain_s": scenario.drain_s,
            "max_token_budget": scenario.max_token_budget,
            "slo": slo_entry(scenario.catalog),
        },
        "rates": list(rates),
        "cdf_rate": cdf_rate,
        "requested": list(plan.requested),
        "policies": policies,
    }
    capacity.annotate(document)
    return document, samples


def slo_entry(catalog: SloCatalog) -> dict:
    """The scenario's ``slo``: the default class's name and targets, and every class's."""
    return {
        "default_class": catalog.default_class,
        **catalog.default.as_spec(),
        "classes": {name: slo.as_spec() for name, slo in catalog.classes.items()},
    }


def write_results(document: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps(document, indent=2, allow_nan=False, default=_jsonable) + "\n")
    return path


def _jsonable(value: object) -> object:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {value!r}")


def display_label(name: str, entry: dict) -> str:
    """``sarathi (1024)``: a tuned family with its best setting; ``sarathi (1024, shipped)``
    when that setting comes from the shipped tuned-settings file (``from file``: another
    file) rather than this sweep's search; ``[edge: budget]`` when that best is at a bound
    of the searched range."""
    if "best_of" not in entry:
        return name
    tuning = entry.get("tuning", {})
    origin = "" if "from" not in tuning else (", shipped" if tuning.get("shipped") else
                                             ", from file")
    text = f"{name} ({entry['best_of'].split('@', 1)[1]}{origin})"
    edge = tuning.get("edge_axes")
    return f"{text} [edge: {', '.join(edge)}]" if edge else text


def peak_text(entry: dict) -> str:
    """Peak effective RPS; ``>=`` when reached at the highest load tried (a lower bound)."""
    bound = ">=" if entry.get("peak_at_highest_load") else ""
    return f"{bound}{entry['peak_effective_rps']:.2f}"


def best_baseline(policies: dict) -> tuple[str, dict] | None:
    """The baseline (users' systems, admission controls included) with the highest peak."""
    present = [name for name in BASELINES if name in policies]
    if not present:
        return None
    name = max(present, key=lambda n: policies[n]["peak_effective_rps"])
    return name, policies[name]


def ratio_text(entry: dict, base: dict) -> str:
    """``entry`` / ``base`` peak; ``n/a`` when either is a lower bound (>=) or zero."""
    if entry.get("peak_at_highest_load") or base.get("peak_at_highest_load"):
        return "n/a (>=)"
    if base["peak_effective_rps"] <= 0:
        return "n/a"
    return f"{entry['peak_effective_rps'] / base['peak_effective_rps']:.2f}x"


def summary_table(document: dict, names: Sequence[str] | None = None) -> str:
    """A fixed-width table: peak effective RPS per policy, the ratio to the best baseline,
    latencies at the CDF load; with several SLO classes, each class's attainment there."""
    cdf_rate = document["cdf_rate"]
    policies = document["policies"]
    names = list(names or document["requested"])
    width = max(22, *(len(display_label(n, policies[n])) + 2 for n in names))
    base = best_baseline(policies)
    top = max(document["rates"])
    at_cdf = {name: next((load for load in policies[name]["loads"] if load["rate"] == cdf_rate),
                         None) for name in names}
    classes = _classes_at(at_cdf.values())
    header = (
        f"{'policy':<{width}}{'peak eff RPS':>13}{'@ rate':>8}{'vs best':>10}"
        f"{f'eff @ {top:g}':>12}  |  "
        f"{f'at {cdf_rate:g} req/s:':<16}"
        f"{'attain':>8}{'worst bucket':>19}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}"
        + "".join(f"{name:>{_class_width(name)}}" for name in classes)
    )
    lines = [header, "-" * len(header)]
    for name in names:
        entry = policies[name]
        at = at_cdf[name]
        cells = ""
        if at is not None:
            cells = (
                f"{at['attainment']:>8.3f}{_worst_cell(at):>19}"
                f"{_ms(at['ttft_ms']['p50']):>10}{_ms(at['ttft_ms']['p99']):>8}"
                f"{_ms(at['tpot_ms']['p50']):>10}{_ms(at['tpot_ms']['p99']):>8}"
                + "".join(_class_cell(at, slo_class) for slo_class in classes)
            )
        versus = ratio_text(entry, base[1]) if base else "-"
        at_top = next((load for load in entry["loads"] if load["rate"] == top), None)
        top_text = "-" if at_top is None else f"{at_top['effective_rps']:.2f}"
        lines.append(
            f"{display_label(name, entry):<{width}}{peak_text(entry):>13}{entry['peak_rate']:>8g}"
            f"{versus:>10}{top_text:>12}  |  {'':<16}{cells}"
        )
    if base:
        lines.append(
            f"\nvs best = peak / the best baseline's ({display_label(*base)}); baselines: "
            f"{', '.join(n for n in BASELINES if n in policies)}. >= : peak at the highest load "
            "tried, a lower bound, never used for a ratio (admission-controlled policies "
            "plateau instead of collapsing, so compare them at the highest load: the eff @ "
            "column). [edge: X]: the tuned best sits at a bound of axis X."
        )
    lines.append(
        f"\nworst bucket: the attainment of the prompt-length bucket with the lowest one at "
        f"{cdf_rate:g} req/s, among the buckets of at least {MIN_GROUP_REQUESTS} requests."
    )
    if classes:
        lines.append(
            f"\n{', '.join(classes)}: the SLO attainment of each class's requests at "
            f"{cdf_rate:g} req/s ({_kinds_text(at_cdf.values(), classes)})."
        )
    return "\n".join(lines)


def headline_table(document: dict, names: Sequence[str] | None = None) -> str:
    """The headline on one screen: each policy's peak effective RPS and the load it is
    reached at; for a policy without admission control, that peak against the best peak of
    the baselines without one (a peak at the highest load is a lower bound and gets no
    ratio); for every policy, its effective RPS at the highest load against the best
    baseline's there (where admission controls are compared: they plateau rather than
    collapse, so their peaks sit at or near the highest load)."""
    policies = document["policies"]
    names = list(names or document["requested"])
    top = max(document["rates"])
    at_top = {name: next((load["effective_rps"] for load in policies[name]["loads"]
                          if load["rate"] == top), None) for name in policies}
    baselines = [name for name in BASELINES if name in policies]
    interior = [name for name in baselines if not policies[name].get("peak_at_highest_load")
                and not policy_kind(name)[1]]
    peak_base = max(interior, key=lambda n: policies[n]["peak_effective_rps"], default=None)
    top_base = max((n for n in baselines if at_top[n] is not None),
                   key=lambda n: at_top[n], default=None)
    width = max(24, *(len(display_label(n, policies[n])) + 2 for n in names))
    header = (f"{'policy':<{width}}{'peak eff RPS':>13}{'@ req/s':>9}{'vs peak*':>10}"
              f"{f'eff @ {top:g}':>11}{f'vs @{top:g}**':>11}")
    lines = [header, "-" * len(header)]
    for name in names:
        entry = policies[name]
        if policy_kind(name)[1]:
            versus_peak = "-"
        elif peak_base is None or entry.get("peak_at_highest_load"):
            versus_peak = "n/a" if peak_base is None else "n/a (>=)"
        else:
            versus_peak = _ratio(entry["peak_effective_rps"], policies[peak_base]["peak_effective_rps"])
        value = at_top[name]
        versus_top = ("-" if value is None or top_base is None
                      else _ratio(value, at_top[top_base]))
        lines.append(
            f"{display_label(name, entry):<{width}}{peak_text(entry):>13}{entry['peak_rate']:>9g}"
            f"{versus_peak:>10}{'-' if value is None else f'{value:.2f}':>11}{versus_top:>11}"
        )
    notes = []
    if peak_base:
        notes.append(
            f"*  peak / the peak of {display_label(peak_base, policies[peak_base])}, "
            f"{policies[peak_base]['peak_effective_rps']:.2f} at {policies[peak_base]['peak_rate']:g} "
            "req/s: the best peak of the baselines without admission control, for the "
            "policies without one. >= : a peak at the highest load, a lower bound, no ratio. "
            "-: admission control (compared at the highest load)."
        )
    if top_base:
        notes.append(
            f"** effective RPS at {top:g} req/s / that of {display_label(top_base, policies[top_base])}, "
            f"{at_top[top_base]:.2f}: the best baseline there."
        )
    for note in notes:
        lines += textwrap.wrap(note, 100, subsequent_indent="   ")
    return "\n".join(lines)


def _ratio(value: float, base: float) -> str:
    return "n/a" if base <= 0 else f"{value / base:.2f}x"


def _classes_at(loads: Iterable[dict | None]) -> list[str]:
    """The SLO classes of ``loads`` (by name) when there are several, else none."""
    names = {name for load in loads if load for name in load.get("by_slo_class", {})}
    return sorted(names) if len(names) > 1 else []


def _class_width(name: str) -> int:
    return max(8, len(name) + 2)


def _class_cell(load: dict, slo_class: str) -> str:
    group = load.get("by_slo_class", {}).get(slo_class)
    text = "-" if group is None else f"{group['attainment']:.3f}"
    return f"{text:>{_class_width(slo_class)}}"


def _kinds_text(loads: Iterable[dict | None], classes: Sequence[str]) -> str:
    kinds = {}
    for load in loads:
        for name, group in (load or {}).get("by_slo_class", {}).items():
            kinds.setdefault(name, group["kind"])
    return ", ".join(f"{name}: {kinds[name]}" for name in classes)


def _worst_cell(load: dict) -> str:
    """``0.912 >=4096``: the worst prompt bucket's attainment and label; ``-`` when none."""
    worst = load.get("worst_prompt_bucket") or {}
    if worst.get("label") is None:
        return "-"
    return f"{worst['attainment']:.3f} {worst['label']:<9}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
