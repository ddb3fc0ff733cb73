"""Policies x offered loads, in parallel, into ``results.json`` (schema version 1).

A policy that takes a token budget and is named without one (``sarathi``) is run at
every budget of the sweep, each reported as ``NAME@BUDGET``; ``NAME`` itself holds the
budget with the highest peak effective RPS (``best_of`` says which).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from sglang_ext.sim.metrics import LatencySamples
from sglang_ext.sim.runner import (
    DEFAULT_TOKEN_BUDGETS,
    PolicySpec,
    RunResult,
    Scenario,
    parse_policy,
    simulate,
)

SCHEMA_VERSION = 1
DEFAULT_POLICIES = (
    "sglang-default", "vllm-default", "sarathi", "fb-fb", "fb-tb", "fb", "fb-pab",
    "fb-anchor-margin", "fb-anchor-margin-pab",
)


@dataclass(frozen=True)
class SweepPlan:
    requested: tuple[str, ...]  # names as passed to --policy
    runs: tuple[PolicySpec, ...]  # every concrete policy run
    families: dict[str, tuple[str, ...]] = field(default_factory=dict)  # NAME -> NAME@B labels


def plan_sweep(names: Sequence[str], budgets: Sequence[int] = DEFAULT_TOKEN_BUDGETS) -> SweepPlan:
    runs: list[PolicySpec] = []
    families: dict[str, tuple[str, ...]] = {}
    for name in dict.fromkeys(names):
        spec = parse_policy(name)
        if spec.sweeps_budget and spec.token_budget is None:
            members = [PolicySpec(spec.base, budget) for budget in budgets]
            families[name] = tuple(m.label for m in members)
            runs.extend(members)
        else:
            runs.append(spec)
    unique = tuple(dict.fromkeys(runs))
    return SweepPlan(tuple(dict.fromkeys(names)), unique, families)


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
    progress: Callable[[int], None] | None = None,
) -> tuple[dict, dict[str, LatencySamples]]:
    """Returns (results.json document, per-policy latency samples at ``cdf_rate``)."""
    work = [(spec, rate, rate == cdf_rate) for spec in plan.runs for rate in rates]
    workers = max(1, min(jobs or os.cpu_count() or 1, len(work)))
    results: list[RunResult] = []
    if workers == 1:
        _init_worker(scenario)
        for job in work:
            results.append(_run_job(job))
            if progress:
                progress(1)
    else:
        with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(scenario,)) as pool:
            for result in pool.map(_run_job, work, chunksize=1):
                results.append(result)
                if progress:
                    progress(1)
    return assemble(scenario, plan, rates, cdf_rate, results)


def assemble(
    scenario: Scenario, plan: SweepPlan, rates: Sequence[float], cdf_rate: float,
    results: list[RunResult],
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
    for name, members in plan.families.items():
        best = max(members, key=lambda label: policies[label]["peak_effective_rps"])
        policies[name] = dict(policies[best], best_of=best)
        if best in samples:
            samples[name] = samples[best]
    slo = scenario.catalog.default
    document = {
        "schema_version": SCHEMA_VERSION,
        "scenario": {
            "workload": scenario.workload.source,
            "requests": len(scenario.workload.requests),
            "natural_rate": scenario.workload.mean_rate,
            "profile": scenario.profile.name,
            "arrivals": scenario.arrivals,
            "seed": scenario.seed,
            "drain_s": scenario.drain_s,
            "max_token_budget": scenario.max_token_budget,
            "slo": {
                "default_class": scenario.catalog.default_class,
                "ttft_ms": slo.ttft_s * 1e3,
                "tpot_ms": slo.tpot_s * 1e3,
            },
        },
        "rates": list(rates),
        "cdf_rate": cdf_rate,
        "requested": list(plan.requested),
        "policies": policies,
    }
    return document, samples


def write_results(document: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps(document, indent=2, allow_nan=False, default=_jsonable) + "\n")
    return path


def _jsonable(value: object) -> object:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {value!r}")


def summary_table(document: dict, names: Sequence[str] | None = None) -> str:
    """A fixed-width table: peak effective RPS per policy, latencies at the CDF load."""
    cdf_rate = document["cdf_rate"]
    policies = document["policies"]
    names = list(names or document["requested"])
    header = (
        f"{'policy':<22}{'peak eff RPS':>13}{'@ rate':>8}  |  {f'at {cdf_rate:g} req/s:':<16}"
        f"{'attain':>8}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}"
    )
    lines = [header, "-" * len(header)]
    for name in names:
        entry = policies[name]
        label = f"{name} ({entry['best_of'].split('@')[1]})" if "best_of" in entry else name
        at = next((load for load in entry["loads"] if load["rate"] == cdf_rate), None)
        cells = ""
        if at is not None:
            cells = (
                f"{at['attainment']:>8.3f}{_ms(at['ttft_ms']['p50']):>10}{_ms(at['ttft_ms']['p99']):>8}"
                f"{_ms(at['tpot_ms']['p50']):>10}{_ms(at['tpot_ms']['p99']):>8}"
            )
        lines.append(
            f"{label:<22}{entry['peak_effective_rps']:>13.2f}{entry['peak_rate']:>8g}  |  "
            f"{'':<16}{cells}"
        )
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
