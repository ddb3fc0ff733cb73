"""Benchmark: on-time req/s past capacity at data-parallel size 8, every router tuned at
each overload point, per prompt bucket and per SLO class.

What: the workloads of :mod:`benchmarks.sim.cluster_sim` (8 simulated ranks, reports 5 ms
late) at its overload rates, 1.5x and 2x the best baseline's capacity as its committed
``docs/bench/cluster_sim.json`` states them (``--rates`` names others). At each rate:

- **Baselines**, tuned at that rate: shortest-first Sarathi with a waiting timeout
  (``sarathi-sjf-queue-timeout@1024``, the cluster's best baseline family) with its
  timeout swept over ``SJF_TIMEOUTS`` and widened while the best is at an edge, and
  Sarathi with a waiting timeout at its tuned point, each behind ``round_robin``,
  ``request_count`` and (shared prefixes) ``cache_aware``; FairBatching ranks behind the
  load routers (``request_count``, ``cache_aware``).
- **PAB dispatch**: FairBatching ranks behind ``pab_least_loaded`` and (shared prefixes)
  ``pab_cache_aware``, a request no budget covers queued (the daemon's
  ``on_no_budget = "queue"``) or spilled (``"spill"``).
- FairBatching ranks run ``fb-smooth+defer`` with ``max_defer_s`` over ``MAX_DEFERS``
  (the ``[admission]`` setting: how long past its TTFT deadline a late prefill is kept),
  behind every router, so neither side of a PAB comparison has a rank setting the other
  lacks.

The verdict per workload and rate: the best PAB configuration over the best of all the
others, with each side's on-time share per prompt-length bucket and per SLO class (who
pays). Uses ``--jobs`` processes (about 10 minutes at 2)::

    source scripts/_env.sh
    python -m benchmarks.sim.cluster_overload --jobs 2   # writes docs/bench/cluster_overload.{md,json}
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchmarks.sim import cluster_sim
from benchmarks.sim.cluster_sim import PROMPT_ROUTERS, RANKS, WORKLOADS, Case, build_cases
from benchmarks.support.machine import machine_info, machine_line
from benchmarks.support.outputs import write_outputs
from benchmarks.support.paths import DOCS_BENCH, SHARED_AZURE_TRACE
from sglang_ext.sim.cluster import ClusterConfig, simulate_cluster
from sglang_ext.sim.runner import parse_policy

SJF = "sarathi-sjf-queue-timeout@1024"
SJF_TIMEOUTS = (1.0, 2.0, 3.0)
SJF_TIMEOUT_BOUNDS = (0.25, 8.0)
FIFO_TIMEOUT = "sarathi-queue-timeout@1024,timeout=1.75"
FAIRBATCHING = cluster_sim.FAIRBATCHING
MAX_DEFERS = (0.5, 2.0)
LOAD_ROUTERS = ("round_robin", "request_count", "cache_aware")
FB_LOAD_ROUTERS = ("request_count", "cache_aware")
PAB_ROUTERS = ("pab_least_loaded", "pab_cache_aware")
ON_NO_BUDGET = ("queue", "spill")


@dataclass(frozen=True, slots=True)
class Configuration:
    policy: str
    router: str
    on_no_budget: str = "queue"

    @property
    def pab(self) -> bool:
        return self.router.startswith("pab")

    @property
    def label(self) -> str:
        router = f"{self.router} ({self.on_no_budget})" if self.pab else self.router
        return f"{self.policy} + {router}"


def fb_policy(max_defer_s: float) -> str:
    return str(parse_policy(f"{FAIRBATCHING}:max_defer={max_defer_s:g}").label)


def _routers(case: Case, routers: Sequence[str]) -> list[str]:
    return [r for r in routers if case.prefixes or r not in PROMPT_ROUTERS]


def sjf_configurations(case: Case, timeouts: Sequence[float]) -> list[Configuration]:
    return [Configuration(f"{SJF},timeout={t:g}", r) for t in timeouts
            for r in _routers(case, LOAD_ROUTERS)]


def fixed_configurations(case: Case) -> list[Configuration]:
    out = [Configuration(FIFO_TIMEOUT, r) for r in _routers(case, LOAD_ROUTERS)]
    for max_defer in MAX_DEFERS:
        policy = fb_policy(max_defer)
        out += [Configuration(policy, r) for r in _routers(case, FB_LOAD_ROUTERS)]
        out += [Configuration(policy, r, mode) for r in _routers(case, PAB_ROUTERS)
                for mode in ON_NO_BUDGET]
    return out


_cases: dict[str, Case] = {}


def _init_worker(cases: dict[str, Case]) -> None:
    _cases.update(cases)


def _group_attainment(groups: dict) -> dict[str, float]:
    return {name: round(group["attainment"], 4) for name, group in groups.items()}


def _job(job: tuple[str, str, float, Configuration]) -> tuple[str, str, Configuration, dict, float]:
    name, key, rate, configuration = job
    case = _cases[name]
    began = time.perf_counter()
    load = simulate_cluster(
        case.scenario, parse_policy(configuration.policy), rate,
        ClusterConfig(RANKS, configuration.router, on_no_budget=configuration.on_no_budget),
        prefixes=case.prefixes).load
    point = {
        "policy": configuration.policy, "router": configuration.router,
        "on_no_budget": configuration.on_no_budget if configuration.pab else None,
        "rate": rate, "effective_rps": load["effective_rps"], "attainment": load["attainment"],
        "by_prompt_bucket": _group_attainment(load["by_prompt_tokens"]),
        "by_slo_class": _group_attainment(load["by_slo_class"]),
        "rejected": load["rejected"], "queue_timeout": load["queue_timeout"],
        "spilled": load["spilled"], "dispatch_imbalance": round(load["dispatch_imbalance"], 3),
    }
    return name, key, configuration, point, time.perf_counter() - began


def best_sjf_timeout(points: dict[str, dict]) -> tuple[float, list[float]]:
    """The SJF timeout whose best router delivers the most on time, and every timeout run."""
    by_timeout: dict[float, float] = {}
    for point in points.values():
        if point["policy"].startswith(SJF + ","):
            timeout = float(point["policy"].rsplit("timeout=", 1)[1])
            by_timeout[timeout] = max(by_timeout.get(timeout, 0.0), point["effective_rps"])
    best = max(by_timeout, key=lambda t: (by_timeout[t], -t))
    return best, sorted(by_timeout)


def run_all(cases: dict[str, Case], rates: dict[str, dict[str, float]], jobs: int
            ) -> tuple[dict, float]:
    results = {name: {key: {} for key in rates[name]} for name in cases}
    cpu_s = 0.0
    work = [(name, key, rate, c) for name, case in cases.items()
            for key, rate in rates[name].items()
            for c in sjf_configurations(case, SJF_TIMEOUTS) + fixed_configurations(case)]
    with ProcessPoolExecutor(jobs, initializer=_init_worker, initargs=(cases,)) as pool:
        while work:
            for done, (name, key, configuration, point, seconds) in enumerate(
                    pool.map(_job, work, chunksize=1), 1):
                results[name][key][configuration.label] = point
                cpu_s += seconds
                print(f"[{done}/{len(work)}] {name} {key}: {configuration.label} "
                      f"{point['effective_rps']:.1f} ({seconds:.0f} s)", file=sys.stderr, flush=True)
            work = []
            for name, case in cases.items():  # widen the timeout while its best is at an edge
                for key, rate in rates[name].items():
                    best, tried = best_sjf_timeout(results[name][key])
                    wider = (best / 2 if best == tried[0] else best * 1.5 if best == tried[-1]
                             else None)
                    if wider and SJF_TIMEOUT_BOUNDS[0] <= wider <= SJF_TIMEOUT_BOUNDS[1]:
                        work += [(name, key, rate, c) for c in sjf_configurations(case, (wider,))]
    return results, cpu_s


def verdicts(results: dict) -> dict:
    out: dict[str, dict] = {}
    for name, by_rate in results.items():
        out[name] = {}
        for key, points in by_rate.items():
            pab = [(label, p) for label, p in points.items() if p["router"].startswith("pab")]
            other = [(label, p) for label, p in points.items() if not p["router"].startswith("pab")]
            ours_label, ours = max(pab, key=lambda item: item[1]["effective_rps"])
            theirs_label, theirs = max(other, key=lambda item: item[1]["effective_rps"])
            best_sjf, tried = best_sjf_timeout(points)
            out[name][key] = {
                "ours": ours_label, "baseline": theirs_label,
                "ratio": ours["effective_rps"] / theirs["effective_rps"],
                "ours_rps": ours["effective_rps"], "baseline_rps": theirs["effective_rps"],
                "sjf_timeouts": tried, "best_sjf_timeout": best_sjf,
            }
    return out


def _groups(ours: dict, theirs: dict, field: str) -> str:
    return ", ".join(f"{group} {ours[field][group]:.2f}/{theirs[field].get(group, 0.0):.2f}"
                     for group in ours[field])


def markdown(doc: dict, command: str) -> str:
    lines = [
        "# Cluster past capacity: every router tuned at each overload point",
        "",
        (f"Machine: {machine_line(doc['machine'])}. Wall time {doc['wall_s']:.0f} s on "
         f"{doc['jobs']} worker processes ({doc['simulation_cpu_s']:.0f} s of simulation)."),
        "",
        (f"{RANKS} ranks of profile {cluster_sim.PROFILE}, {doc['requests']} requests per "
         "workload, the workloads and overload rates of `cluster_sim` (1.5x and 2x the best "
         "baseline's capacity). On time: effective req/s. `(queue)` / `(spill)`: the pab "
         "routers' `on_no_budget`. `max_defer=S`: the FairBatching ranks' `[admission]` "
         f"`max_defer_s` (default 2). SJF timeouts swept per point: {SJF_TIMEOUTS} widened "
         "while the best is at an edge."),
        "",
    ]
    for name, by_rate in doc["results"].items():
        lines += [f"## {name}: {doc['cases'][name]}", ""]
        keys = list(by_rate)
        lines += ["| rank policy + router | " + " | ".join(
            f"{doc['rates'][name][k]:.0f} req/s ({k}) on time" for k in keys) + " |",
            "|---|" + "---:|" * len(keys)]
        labels = sorted(by_rate[keys[0]], key=lambda label: -by_rate[keys[-1]][label]["effective_rps"]
                        if label in by_rate[keys[-1]] else 0.0)
        for label in labels:
            cells = [f"{by_rate[k][label]['effective_rps']:.1f}" if label in by_rate[k] else "-"
                     for k in keys]
            lines.append(f"| `{label}` | " + " | ".join(cells) + " |")
        lines.append("")
        for key in keys:
            verdict = doc["verdicts"][name][key]
            ours = by_rate[key][verdict["ours"]]
            theirs = by_rate[key][verdict["baseline"]]
            lines.append(
                f"- {key}: best PAB / best other {verdict['ratio']:.2f}x (`{verdict['ours']}` "
                f"{verdict['ours_rps']:.1f} vs `{verdict['baseline']}` {verdict['baseline_rps']:.1f}; "
                f"SJF timeout best at {verdict['best_sjf_timeout']:g} of {verdict['sjf_timeouts']}). "
                f"On-time share, PAB/other, per prompt bucket: {_groups(ours, theirs, 'by_prompt_bucket')}; "
                f"per SLO class: {_groups(ours, theirs, 'by_slo_class')}.")
        lines.append("")
    lines += [f"Regenerate: `{command}`", ""]
    return "\n".join(lines)


def committed_rates(path: Path) -> dict[str, dict[str, float]]:
    document = json.loads(path.read_text())
    return {name: dict(result["overload_rates"]) for name, result in document["workloads"].items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=SHARED_AZURE_TRACE, help="Azure trace CSV")
    parser.add_argument("--requests", type=int, default=cluster_sim.DEFAULT_REQUESTS,
                        help="requests per workload (default %(default)s)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="comma-separated subset of " + ", ".join(WORKLOADS))
    parser.add_argument("--rates", type=Path, default=DOCS_BENCH / "cluster_sim.json",
                        help="a cluster_sim results JSON whose overload rates to run")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--out", type=Path, default=DOCS_BENCH)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    if not names or any(n not in WORKLOADS for n in names):
        parser.error(f"--workloads: expected names from {', '.join(WORKLOADS)}")
    if args.requests < 2:
        parser.error("--requests must be >= 2")
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    try:
        rates = committed_rates(args.rates)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        parser.error(f"--rates {args.rates}: not a cluster_sim results JSON ({exc})")
    missing = [n for n in names if n not in rates]
    if missing:
        parser.error(f"--rates {args.rates} has no overload rates for {', '.join(missing)}")
    cases = {name: case for name, case in build_cases(args.trace, args.requests).items()
             if name in names}
    start = time.perf_counter()
    results, cpu_s = run_all(cases, {n: rates[n] for n in names}, args.jobs)
    doc = {"machine": machine_info(), "wall_s": round(time.perf_counter() - start, 1),
           "simulation_cpu_s": round(cpu_s, 1), "jobs": args.jobs, "requests": args.requests,
           "ranks": RANKS, "profile": cluster_sim.PROFILE,
           "cases": {name: case.description for name, case in cases.items()},
           "rates": {n: rates[n] for n in names}, "results": results,
           "verdicts": verdicts(results)}
    command = "python -m benchmarks.sim.cluster_overload --jobs 2"
    if args.requests != cluster_sim.DEFAULT_REQUESTS:
        command += f" --requests {args.requests}"
    if names != list(WORKLOADS):
        command += f" --workloads {','.join(names)}"
    text = markdown(doc, command)
    print(text)
    if not args.no_write:
        write_outputs(args.out, "cluster_overload", text, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
