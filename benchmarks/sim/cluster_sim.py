"""Benchmark: balancers x rank schedulers at data-parallel size 8, in the cluster simulator.

What: ``sglang_ext.sim.cluster`` (N simulated ranks behind one dispatcher that uses the
control plane's balancer and PAB ledger, reports 5 ms late, the pab balancers' admission
queue with the daemon's defaults: TTL 5 s, 1024 deep) replaying the Azure conversation
trace at several cluster-wide arrival rates. Configurations:

- FairBatching ranks (``fb-anchor-margin``, the repository's FairBatching variant) with
  the ``pab``, ``pab_least_loaded``, ``request_count`` and ``round_robin`` balancers, and
  the two pab balancers again with the queue TTL set to the TTFT target (a request
  queued longer has missed its SLO anyway; a deployment would set it so);
- the paper's FairBatching exactly as specified (``fb``) with ``pab``,
  ``pab_least_loaded`` and ``request_count`` (``pab`` and ``request_count``: the paper's
  Figure 8 pairs);
- the baselines users run today: SGLang's default scheduler behind SGLang's
  ``total_tokens`` balancer, vLLM's default scheduler behind vLLM's ``request_count``,
  and Sarathi behind ``request_count`` with its token budget tuned (every budget of
  ``--sarathi-budgets`` is run; the table shows the one with the highest peak goodput
  and the JSON keeps all of them).

Goodput is the effective rate: offered req/s x SLO attainment (a rejected or
unfinished request is a violation). Workload: the first ``--requests`` requests of
``../shared/data/traces/azure_conv_2023.csv`` (the bundled 600 s sample if that file is
missing, which the output then says), trace arrivals rescaled to each rate, profile
``llama3.1-8b-h100``, ``configs/slo.toml`` (TTFT 2000 ms / TPOT 50 ms), seed 0, 120 s
drain. Uses every core (``--jobs``)::

    source scripts/_env.sh
    python -m benchmarks.sim.cluster_sim          # writes docs/bench/cluster_sim.{md,json}
    python -m benchmarks.sim.cluster_sim --quick --no-write
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchmarks.support.machine import machine_info, machine_line
from benchmarks.support.outputs import write_outputs
from benchmarks.support.paths import DOCS_BENCH, REPO, SHARED_AZURE_TRACE
from sglang_ext.policy.slo import SloCatalog
from sglang_ext.sim.cluster import (
    DEFAULT_MAX_QUEUED,
    DEFAULT_QUEUE_TTL_S,
    DEFAULT_REPORT_DELAY_S,
    ClusterConfig,
    simulate_cluster,
)
from sglang_ext.sim.profile import bundled_profile_path, load_profile
from sglang_ext.sim.runner import Scenario, parse_policy
from sglang_ext.sim.workloads import Workload, bundled_sample, load_workload

PROFILE = "llama3.1-8b-h100"
RANKS = 8
PER_RANK_RATES = (14, 16, 18, 20, 22, 24, 26)
QUICK_PER_RANK_RATES = (16, 20, 24)
SARATHI_BUDGETS = (256, 512, 1024, 2048)
QUICK_SARATHI_BUDGETS = (512, 1024)
DEFAULT_REQUESTS = 12_000
QUICK_REQUESTS = 3_000
SARATHI_FAMILY = "sarathi (tuned) + request_count"


@dataclass(frozen=True, slots=True)
class Configuration:
    label: str
    policy: str
    balancer: str
    baseline: bool = False  # a system users run today (the "vs best baseline" column)
    family: str | None = None  # a tuned family reports its best member under this name
    queue_ttl_s: float = DEFAULT_QUEUE_TTL_S  # the admission queue's (pab balancers only)


def configurations(sarathi_budgets: Sequence[int], ttft_s: float) -> tuple[Configuration, ...]:
    """The grid; ``ttft_s`` (the SLO's TTFT target) is the short queue TTL's value."""
    short_ttl = f"queue TTL {ttft_s:g} s"
    fixed = (
        Configuration("fb-anchor-margin + pab", "fb-anchor-margin", "pab"),
        Configuration("fb-anchor-margin + pab_least_loaded", "fb-anchor-margin",
                      "pab_least_loaded"),
        Configuration(f"fb-anchor-margin + pab, {short_ttl}", "fb-anchor-margin", "pab",
                      queue_ttl_s=ttft_s),
        Configuration(f"fb-anchor-margin + pab_least_loaded, {short_ttl}", "fb-anchor-margin",
                      "pab_least_loaded", queue_ttl_s=ttft_s),
        Configuration("fb-anchor-margin + request_count", "fb-anchor-margin", "request_count"),
        Configuration("fb-anchor-margin + round_robin", "fb-anchor-margin", "round_robin"),
        Configuration("fb + pab", "fb", "pab"),
        Configuration("fb + pab_least_loaded", "fb", "pab_least_loaded"),
        Configuration("fb + request_count", "fb", "request_count"),
        Configuration("sglang-default + total_tokens", "sglang-default", "total_tokens",
                      baseline=True),
        Configuration("vllm-default + request_count", "vllm-default", "request_count",
                      baseline=True),
    )
    sarathi = tuple(
        Configuration(f"sarathi@{budget} + request_count", f"sarathi@{budget}", "request_count",
                      baseline=True, family=SARATHI_FAMILY)
        for budget in sarathi_budgets
    )
    return fixed + sarathi


def build_scenario(trace: Path, requests: int) -> tuple[Scenario, bool]:
    """The scenario, and whether it fell back to the bundled sample."""
    if trace.exists():
        workload = load_workload(trace, "azure")
        fallback = False
    else:
        workload = bundled_sample()
        fallback = True
    if requests < len(workload.requests):
        workload = Workload(
            workload.requests[:requests], f"{workload.source}[:{requests} requests]",
            workload.dropped,
        )
    scenario = Scenario(
        workload=workload,
        profile=load_profile(bundled_profile_path(PROFILE)),
        catalog=SloCatalog.from_toml(REPO / "configs" / "slo.toml"),
    )
    return scenario, fallback


_scenario: Scenario | None = None


def _init_worker(scenario: Scenario) -> None:
    global _scenario
    _scenario = scenario


def _run(job: tuple[Configuration, float]) -> tuple[str, dict, float]:
    configuration, rate = job
    assert _scenario is not None
    start = time.perf_counter()
    result = simulate_cluster(
        _scenario, parse_policy(configuration.policy), rate,
        ClusterConfig(RANKS, configuration.balancer, queue_ttl_s=configuration.queue_ttl_s),
    )
    return configuration.label, result.load, time.perf_counter() - start


def run_grid(
    scenario: Scenario, grid: Sequence[Configuration], rates: Sequence[float], jobs: int
) -> tuple[dict[str, list[dict]], float]:
    # the slow configurations (overloaded, high rates) first, so both workers stay busy
    work = sorted(((c, r) for c in grid for r in rates), key=lambda job: -job[1])
    loads: dict[str, list[dict]] = {c.label: [] for c in grid}
    cpu_s = 0.0
    done = 0
    with ProcessPoolExecutor(jobs, initializer=_init_worker, initargs=(scenario,)) as pool:
        for label, load, seconds in pool.map(_run, work, chunksize=1):
            loads[label].append(load)
            cpu_s += seconds
            done += 1
            print(f"[{done}/{len(work)}] {label} @ {load['rate']:g} req/s: attainment "
                  f"{load['attainment']:.3f} ({seconds:.1f} s)", file=sys.stderr, flush=True)
    for entries in loads.values():
        entries.sort(key=lambda load: load["rate"])
    return loads, cpu_s


def _peak(loads: list[dict]) -> dict:
    return max(loads, key=lambda load: load["effective_rps"])


def assemble(
    scenario: Scenario, fallback: bool, grid: Sequence[Configuration], rates: Sequence[float],
    loads: dict[str, list[dict]], wall_s: float, cpu_s: float, jobs: int,
) -> dict:
    entries: dict[str, dict] = {}
    for configuration in grid:
        runs = loads[configuration.label]
        peak = _peak(runs)
        entries[configuration.label] = {
            "policy": configuration.policy,
            "balancer": configuration.balancer,
            "baseline": configuration.baseline,
            "family": configuration.family,
            "queue_ttl_s": configuration.queue_ttl_s,
            "peak_goodput": peak["effective_rps"],
            "peak_rate": peak["rate"],
            "loads": runs,
        }
    families: dict[str, str] = {}
    for family in {c.family for c in grid if c.family}:
        members = [c.label for c in grid if c.family == family]
        families[family] = max(members, key=lambda label: entries[label]["peak_goodput"])
    slo = scenario.catalog.default
    return {
        "machine": machine_info(),
        "wall_s": round(wall_s, 1),
        "simulation_cpu_s": round(cpu_s, 1),
        "jobs": jobs,
        "workload": {
            "source": scenario.workload.source,
            "requests": len(scenario.workload.requests),
            "natural_rate": scenario.workload.mean_rate,
            "bundled_sample_fallback": fallback,
        },
        "scenario": {
            "profile": scenario.profile.name,
            "arrivals": scenario.arrivals,
            "seed": scenario.seed,
            "drain_s": scenario.drain_s,
            "max_token_budget": scenario.max_token_budget,
            "slo": {"ttft_ms": slo.ttft_s * 1e3, "tpot_ms": slo.tpot_s * 1e3},
        },
        "cluster": {
            "ranks": RANKS,
            "report_delay_s": DEFAULT_REPORT_DELAY_S,
            "on_no_budget": "queue",
            "queue_ttl_s": DEFAULT_QUEUE_TTL_S,
            "max_queued": DEFAULT_MAX_QUEUED,
        },
        "rates": list(rates),
        "configurations": entries,
        "best_of": families,
    }


def _rows(doc: dict) -> list[tuple[str, dict]]:
    """(title, entry) per configuration; a tuned family shows only its best member."""
    rows = []
    shown: set[str] = set()
    entries = doc["configurations"]
    for label, entry in entries.items():
        family = entry["family"]
        if family is None:
            rows.append((label, entry))
        elif family not in shown:
            shown.add(family)
            best = entries[doc["best_of"][family]]
            rows.append((f"{best['policy']} (tuned) + {best['balancer']}", best))
    return rows


def markdown(doc: dict, command: str) -> str:
    workload = doc["workload"]
    scenario = doc["scenario"]
    cluster = doc["cluster"]
    rates = doc["rates"]
    rows = _rows(doc)
    best_baseline = max(entry["peak_goodput"] for _, entry in rows if entry["baseline"])
    lines = [
        "# Cluster simulation: balancers x rank schedulers at DP=8",
        "",
        f"Machine: {machine_line(doc['machine'])}. Wall time {doc['wall_s']:.0f} s on "
        f"{doc['jobs']} worker processes ({doc['simulation_cpu_s']:.0f} s of simulation).",
        "",
    ]
    if workload["bundled_sample_fallback"]:
        lines += ["**The full Azure trace was not found: this ran the bundled 600 s sample.**", ""]
    lines += [
        f"Workload: {workload['source']} -- {workload['requests']} requests (natural rate "
        f"{workload['natural_rate']:.2f} req/s), trace arrivals rescaled to each cluster-wide "
        f"rate; profile {scenario['profile']} on every rank; SLO TTFT "
        f"{scenario['slo']['ttft_ms']:.0f} ms / TPOT {scenario['slo']['tpot_ms']:.0f} ms; seed "
        f"{scenario['seed']}; {scenario['drain_s']:.0f} s drain. {cluster['ranks']} ranks; "
        f"reports reach the dispatcher {cluster['report_delay_s'] * 1e3:.0f} ms late; the pab "
        f"balancers queue what no budget covers (FIFO, TTL {cluster['queue_ttl_s']:g} s unless "
        f"the row names another, {cluster['max_queued']} deep; a timed-out or refused request "
        "is a violation).",
        "",
        "Each cell: SLO attainment / goodput (req/s meeting both SLOs = rate x attainment). "
        "Peak goodput is the best cell of the row; a peak at the highest rate may not be "
        "the true peak.",
        "",
        "| configuration (ranks + balancer) | " + " | ".join(f"{rate:g} req/s" for rate in rates)
        + " | peak goodput | vs best baseline |",
        "|---|" + "---:|" * (len(rates) + 2),
    ]
    for title, entry in rows:
        cells = [f"{load['attainment']:.3f} / {load['effective_rps']:.1f}"
                 for load in entry["loads"]]
        peak = f"**{entry['peak_goodput']:.1f}** @ {entry['peak_rate']:g}"
        ratio = f"{entry['peak_goodput'] / best_baseline:.2f}x"
        lines.append(f"| `{title}` | " + " | ".join(cells) + f" | {peak} | {ratio} |")
    lines += [
        "",
        "Where the violations come from, and how the dispatcher spread the load (at each "
        "row's peak and at the highest rate):",
        "",
        "| configuration | rate | TTFT met | TPOT met | rejected (queue timeout / overloaded) "
        "| queued | dispatched max/mean | TTFT p99 ms | TPOT p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for title, entry in rows:
        for load in entry["loads"]:
            if load["rate"] not in (entry["peak_rate"], rates[-1]):
                continue
            lines.append(
                f"| `{title}` | {load['rate']:g} | {load['ttft_attainment']:.3f} | "
                f"{load['tpot_attainment']:.3f} | {load['rejected']} ({load['queue_timeout']} / "
                f"{load['overloaded']}) | {load['queued']} | {load['dispatch_imbalance']:.2f} | "
                f"{_ms(load['ttft_ms']['p99'])} | {_ms(load['tpot_ms']['p99'])} |"
            )
    for family, best in doc["best_of"].items():
        members = ", ".join(
            f"`{label}` {entry['peak_goodput']:.1f}"
            for label, entry in doc["configurations"].items() if entry["family"] == family
        )
        lines += ["", f"{family}: peak goodput per member: {members}; the table shows `{best}`."]
    lines += ["", f"Regenerate: `{command}`", ""]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=SHARED_AZURE_TRACE, help="Azure trace CSV")
    parser.add_argument("--requests", type=int,
                        help=f"first N requests (default {DEFAULT_REQUESTS})")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_REQUESTS} requests, rates {QUICK_PER_RANK_RATES} per rank, "
                        f"Sarathi budgets {QUICK_SARATHI_BUDGETS}")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--out", type=Path, default=DOCS_BENCH)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.requests is not None and args.requests < 2:
        parser.error("--requests must be >= 2")
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    requests = args.requests or (QUICK_REQUESTS if args.quick else DEFAULT_REQUESTS)
    per_rank = QUICK_PER_RANK_RATES if args.quick else PER_RANK_RATES
    rates = tuple(float(RANKS * r) for r in per_rank)
    scenario, fallback = build_scenario(args.trace, requests)
    grid = configurations(QUICK_SARATHI_BUDGETS if args.quick else SARATHI_BUDGETS,
                          scenario.catalog.default.ttft_s)
    print(f"{len(grid)} configurations x {len(rates)} rates on {len(scenario.workload.requests)} "
          f"requests from {scenario.workload.source}, {args.jobs} workers", file=sys.stderr)
    start = time.perf_counter()
    loads, cpu_s = run_grid(scenario, grid, rates, args.jobs)
    wall_s = time.perf_counter() - start
    doc = assemble(scenario, fallback, grid, rates, loads, wall_s, cpu_s, args.jobs)
    command = "python -m benchmarks.sim.cluster_sim" + (" --quick" if args.quick else "")
    if args.requests:
        command += f" --requests {args.requests}"
    text = markdown(doc, command)
    print(text)
    if not args.no_write:
        write_outputs(args.out, "cluster_sim", text, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
