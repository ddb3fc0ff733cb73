"""Benchmark: routers x rank policies at data-parallel size 8, in the cluster simulator:
capacity overall, in the worst prompt bucket and the worst SLO class,
and goodput under overload.

What: ``sglang_ext.sim.cluster`` (8 simulated ranks behind one dispatcher that uses the
control plane's balancers and PAB ledger; reports 5 ms late; the pab balancers' admission
queue with the daemon's defaults) on three workloads:

- ``azure``: the first ``--requests`` requests of the shared Azure conversation trace, trace
  arrivals rescaled, one SLO class (standard). Lengths only: every prompt is its own, so
  cache affinity cannot help (the cache-aware routers would be least-loaded routers; they
  are not run).
- ``prefix``: the router benchmark's shared-prefix shape (``benchmarks.routers.traffic``:
  a 4096-token prefix of one group, uniform, plus 64-192 tokens of its own, 32-128 output
  tokens) over ``PREFIX_GROUPS`` groups, Poisson arrivals, one class. The routers
  benchmark's 24 groups fit every H100 rank's free KV here, so affinity would matter only
  for cold misses; 256 groups (1 Mi tokens) fit the cluster, not one rank.
- ``bursty``: the Azure lengths, each after a 2048-token prefix of one of ``BURSTY_GROUPS``
  groups, gamma arrivals with CV ``BURSTY_CV``, SLO classes ``CLASS_MIX``.

With shared prefixes each rank has a prefix cache (``sglang_ext.sim.prefix_cache``: what
it assumes) and the balancers get each request's prompt.

Configurations (rank policy + router): Sarathi behind ``request_count`` with its token
budget swept over ``SARATHI_BUDGETS`` and widened while the best (by capacity: the lower of
the worst bucket's and the worst class's, then overall) is at an edge; the best budget also
behind ``round_robin`` and ``cache_aware``; the single-rank tuned admission baselines of
``configs/tuned_baselines.toml`` (Sarathi with a waiting timeout, shortest-first with a
waiting timeout) behind ``round_robin``, ``request_count`` and ``cache_aware``; the shipped
FairBatching policy (``fb-smooth+defer``) behind ``request_count``, ``cache_aware``,
``pab_least_loaded`` and ``pab_cache_aware``. Baselines: every configuration whose ranks are
not FairBatching's (the paper's comparison); the verdicts also compare the pab routers with
the load routers over FairBatching ranks (the paper's PAB-LB increment) and
``pab_cache_aware`` with ``cache_aware``.

Capacity: the highest cluster-wide rate with >= 90% of requests on time, bisected to
``TOLERANCE`` (``sglang_ext.sim.capacity``; a lower bound). Overload: every configuration
at 1.5x and 2x the best baseline's overall capacity. Uses ``--jobs`` processes::

    source scripts/_env.sh
    python -m benchmarks.sim.cluster_sim --jobs 2     # writes docs/bench/cluster_sim.{md,json}
    python -m benchmarks.sim.cluster_sim --quick --no-write
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchmarks.routers.traffic import prefix_requests
from benchmarks.sim.fair_capacity import CLASS_MIX, capacity_of, tuning_score
from benchmarks.support.machine import machine_info, machine_line
from benchmarks.support.outputs import write_outputs
from benchmarks.support.paths import DOCS_BENCH, REPO, SHARED_AZURE_TRACE
from sglang_ext.policy.slo import SloCatalog
from sglang_ext.sim import capacity, tuned
from sglang_ext.sim.cluster import ClusterConfig, simulate_cluster
from sglang_ext.sim.prefix_cache import SharedPrefix
from sglang_ext.sim.profile import bundled_profile_path, load_profile
from sglang_ext.sim.runner import Scenario, parse_policy
from sglang_ext.sim.workloads import ClassMix, TraceRequest, Workload, bundled_sample, load_workload

PROFILE = "llama3.1-8b-h100"
RANKS = 8
#: shorter runs let queueing inside the TTFT absorb the bursts, which inflates capacity:
#: at 2,000 the ratios moved by up to 30% against this (about 2 hours on one core)
DEFAULT_REQUESTS = 6_000
QUICK_REQUESTS = 600
START_RATE = 150.0  # the bisection's first probe, cluster-wide req/s
TOLERANCE = 0.05
QUICK_TOLERANCE = 0.15
OVERLOADS = (1.5, 2.0)
SARATHI_BUDGETS = (512, 1024, 2048)
QUICK_SARATHI_BUDGETS = (1024, 2048)
SARATHI_BUDGET_BOUNDS = (64, 16384)
PREFIX_GROUPS = 256
BURSTY_GROUPS = 256
BURSTY_PREFIX_TOKENS = 2048
BURSTY_CV = 4.0
WORKLOADS = ("azure", "prefix", "bursty")
FAIRBATCHING = "fb-smooth+defer"
ADMISSION_FAMILIES = ("sarathi-queue-timeout", "sarathi-sjf-queue-timeout")
BASELINE_ROUTERS = ("round_robin", "request_count", "cache_aware")
FB_ROUTERS = ("request_count", "cache_aware", "pab_least_loaded", "pab_cache_aware")
PROMPT_ROUTERS = ("cache_aware", "pab_cache_aware")  # useless without shared prefixes


@dataclass(frozen=True, slots=True)
class Configuration:
    policy: str
    router: str

    @property
    def label(self) -> str:
        return f"{self.policy} + {self.router}"

    @property
    def pab_aware(self) -> bool:
        return self.router.startswith("pab")


@dataclass(frozen=True)
class Case:
    """One workload: its scenario and, with shared prefixes, each request's prefix."""

    name: str
    scenario: Scenario
    prefixes: tuple[SharedPrefix | None, ...] | None
    description: str


def _scenario(workload: Workload, arrivals: str) -> Scenario:
    return Scenario(workload=workload, profile=load_profile(bundled_profile_path(PROFILE)),
                    catalog=SloCatalog.from_toml(REPO / "configs" / "slo.toml"),
                    arrivals=arrivals)


def azure_lengths(trace: Path, requests: int) -> Workload:
    workload = load_workload(trace, "azure") if trace.exists() else bundled_sample()
    if requests < len(workload.requests):
        workload = Workload(workload.requests[:requests],
                            f"{workload.source}[:{requests} requests]", workload.dropped)
    return workload


def build_cases(trace: Path, requests: int) -> dict[str, Case]:
    azure = azure_lengths(trace, requests)
    shaped = prefix_requests(1.0, requests, 0, prefixes=PREFIX_GROUPS)
    prefix = Workload(
        tuple(TraceRequest(r.at_s, r.prompt_tokens, r.output_tokens) for r in shaped),
        f"shared prefixes ({PREFIX_GROUPS} groups x {shaped[0].prefix_tokens} tokens)")
    groups = [(i * 7919 + 13) % BURSTY_GROUPS for i in range(len(azure.requests))]
    bursty = Workload(
        tuple(TraceRequest(r.arrival_s, r.prompt_tokens + BURSTY_PREFIX_TOKENS, r.output_tokens)
              for r in azure.requests),
        f"{azure.source} after a {BURSTY_PREFIX_TOKENS}-token prefix of {BURSTY_GROUPS} groups",
    ).with_class_mix(ClassMix.parse(CLASS_MIX), 0)
    return {
        "azure": Case("azure", _scenario(azure, "trace"), None,
                      f"{azure.source}, trace arrivals rescaled, one class (standard)"),
        "prefix": Case("prefix", _scenario(prefix, "poisson"),
                       tuple(SharedPrefix(r.prefix_id, r.prefix_tokens) for r in shaped),
                       f"{prefix.source} + 64-192 own tokens, 32-128 output tokens, Poisson "
                       "arrivals, one class (standard)"),
        "bursty": Case("bursty", _scenario(bursty, f"gamma:{BURSTY_CV:g}"),
                       tuple(SharedPrefix(g, BURSTY_PREFIX_TOKENS) for g in groups),
                       f"{bursty.source}, gamma arrivals CV {BURSTY_CV:g}"),
    }


def tuned_admission_baselines() -> list[str]:
    families = tuned.load().families
    return [families[name].best for name in ADMISSION_FAMILIES]


def fixed_configurations(case: Case, budgets: Sequence[int]) -> list[Configuration]:
    """Everything but the best Sarathi budget's other routers."""
    routers = BASELINE_ROUTERS if case.prefixes else (
        tuple(r for r in BASELINE_ROUTERS if r not in PROMPT_ROUTERS))
    fb_routers = FB_ROUTERS if case.prefixes else (
        tuple(r for r in FB_ROUTERS if r not in PROMPT_ROUTERS))
    return ([Configuration(f"sarathi@{b}", "request_count") for b in budgets]
            + [Configuration(p, r) for p in tuned_admission_baselines() for r in routers]
            + [Configuration(FAIRBATCHING, r) for r in fb_routers])


_cases: dict[str, Case] = {}


def _init_worker(cases: dict[str, Case]) -> None:
    _cases.update(cases)


def _point(load: dict) -> dict:
    cached = load.get("prompt_tokens_cached", 0)
    dispatched = load.get("prompt_tokens_dispatched", 0)
    return {
        "rate": load["rate"], "attainment": load["attainment"],
        "effective_rps": load["effective_rps"],
        "worst_prompt_bucket": load["worst_prompt_bucket"],
        "worst_slo_class": load["worst_slo_class"],
        "ttft_p99_ms": load["ttft_ms"]["p99"], "tpot_p99_ms": load["tpot_ms"]["p99"],
        "rejected": load["rejected"], "dispatch_imbalance": load["dispatch_imbalance"],
        "prefilled_share": 1 - cached / dispatched if dispatched else None,
    }


def _simulate(case: Case, configuration: Configuration, rate: float) -> dict:
    result = simulate_cluster(case.scenario, parse_policy(configuration.policy), rate,
                              ClusterConfig(RANKS, configuration.router),
                              prefixes=case.prefixes)
    return _point(result.load)


def _capacity_job(job: tuple[str, Configuration, float]) -> tuple[str, str, dict, float]:
    name, configuration, tolerance = job
    case = _cases[name]
    began = time.perf_counter()
    search = capacity.bisect_capacity(
        lambda rate: _simulate(case, configuration, rate), targets=(0.9,),
        start=START_RATE, tolerance=tolerance, max_rate=START_RATE * 4)
    entry = {"policy": configuration.policy, "router": configuration.router,
             "capacity": search.capacity,
             "loads": [search.loads[rate] for rate in sorted(search.loads)]}
    return name, configuration.label, entry, time.perf_counter() - began


def _overload_job(job: tuple[str, Configuration, str, float]
                  ) -> tuple[str, str, tuple[str, dict], float]:
    name, configuration, key, rate = job
    began = time.perf_counter()
    point = _simulate(_cases[name], configuration, rate)
    return name, configuration.label, (key, point), time.perf_counter() - began


def _run(pool: ProcessPoolExecutor, function, jobs: list) -> list:
    out = []
    for done, result in enumerate(pool.map(function, jobs, chunksize=1), 1):
        out.append(result)
        print(f"[{done}/{len(jobs)}] {result[0]}: {result[1]} ({result[3]:.0f} s)",
              file=sys.stderr, flush=True)
    return out


def sarathi_score(entry: dict) -> tuple[float, float]:
    return tuning_score({"capacity": entry["capacity"]})


def best_budget(entries: dict[str, dict]) -> tuple[int, dict[int, tuple[float, float]]]:
    scores = {int(e["policy"].split("@")[1]): sarathi_score(e) for e in entries.values()
              if e["policy"].startswith("sarathi@") and e["router"] == "request_count"}
    return max(scores, key=lambda budget: (scores[budget], -budget)), scores


def run_all(cases: dict[str, Case], budgets: Sequence[int], tolerance: float,
            jobs: int) -> tuple[dict, float]:
    results: dict[str, dict] = {name: {"configurations": {}} for name in cases}
    cpu_s = 0.0
    with ProcessPoolExecutor(jobs, initializer=_init_worker, initargs=(cases,)) as pool:
        work = [(name, c, tolerance) for name, case in cases.items()
                for c in fixed_configurations(case, budgets)]
        pending = work
        while pending:
            for name, label, entry, seconds in _run(pool, _capacity_job, pending):
                results[name]["configurations"][label] = entry
                cpu_s += seconds
            pending = []
            for name in cases:  # widen the Sarathi budget while its best is at an edge
                best, scores = best_budget(results[name]["configurations"])
                low, high = min(scores), max(scores)
                wider = low // 2 if best == low else high * 2 if best == high else None
                if wider and SARATHI_BUDGET_BOUNDS[0] <= wider <= SARATHI_BUDGET_BOUNDS[1]:
                    pending.append((name, Configuration(f"sarathi@{wider}", "request_count"),
                                    tolerance))
        follow = []
        for name, case in cases.items():
            best, scores = best_budget(results[name]["configurations"])
            results[name]["sarathi_best"] = best
            results[name]["sarathi_scores"] = {str(b): list(s) for b, s in sorted(scores.items())}
            routers = [r for r in BASELINE_ROUTERS if r != "request_count"
                       and (case.prefixes or r not in PROMPT_ROUTERS)]
            follow += [(name, Configuration(f"sarathi@{best}", r), tolerance) for r in routers]
        for name, label, entry, seconds in _run(pool, _capacity_job, follow):
            results[name]["configurations"][label] = entry
            cpu_s += seconds
        overload = []
        for name in cases:
            entries = results[name]["configurations"]
            baseline = max(capacity_of(e, "0.9", "overall") for e in entries.values()
                           if e["policy"] != FAIRBATCHING)
            rates = {f"{share:g}x": baseline * share for share in OVERLOADS}
            results[name]["overload_rates"] = rates
            for entry in entries.values():
                entry["overload"] = {}
                configuration = Configuration(entry["policy"], entry["router"])
                overload += [(name, configuration, key, rate) for key, rate in rates.items()]
        for name, label, (key, point), seconds in _run(pool, _overload_job, overload):
            results[name]["configurations"][label]["overload"][key] = point
            cpu_s += seconds
    return results, cpu_s


def _cap(entry: dict, measure: str) -> float:
    return capacity_of(entry, "0.9", measure)


def _at_capacity(entry: dict) -> dict | None:
    at = entry["capacity"]["0.9"]["overall"]["capacity"]
    return next((load for load in entry["loads"] if load["rate"] == at), None)


COMPARISONS = {
    "pab-aware FairBatching / best baseline": (
        lambda e: e["policy"] == FAIRBATCHING and e["router"].startswith("pab"),
        lambda e: e["policy"] != FAIRBATCHING),
    "pab routers / load routers, FairBatching ranks": (
        lambda e: e["policy"] == FAIRBATCHING and e["router"].startswith("pab"),
        lambda e: e["policy"] == FAIRBATCHING and not e["router"].startswith("pab")),
    "pab_cache_aware / cache_aware": (
        lambda e: e["router"] == "pab_cache_aware", lambda e: e["router"] == "cache_aware"),
}


def verdicts(results: dict) -> dict:
    """Per workload and comparison: the best of each side, per measure."""
    out: dict[str, dict] = {}
    for name, result in results.items():
        entries = list(result["configurations"].values())
        out[name] = {}
        for title, (ours_side, their_side) in COMPARISONS.items():
            ours_all = [e for e in entries if ours_side(e)]
            theirs_all = [e for e in entries if their_side(e)]
            if not ours_all or not theirs_all:
                continue
            row = {}
            for measure in capacity.MEASURES:
                ours = max(ours_all, key=lambda e, m=measure: _cap(e, m))
                theirs = max(theirs_all, key=lambda e, m=measure: _cap(e, m))
                row[measure] = {"ours": f"{ours['policy']} + {ours['router']}",
                                "ours_capacity": _cap(ours, measure),
                                "baseline": f"{theirs['policy']} + {theirs['router']}",
                                "baseline_capacity": _cap(theirs, measure)}
            out[name][title] = row
    return out


def markdown(doc: dict, command: str) -> str:
    lines = [
        "# Cluster simulation: routers x rank policies at DP=8",
        "",
        (f"Machine: {machine_line(doc['machine'])}. Wall time {doc['wall_s']:.0f} s on "
         f"{doc['jobs']} worker processes ({doc['simulation_cpu_s']:.0f} s of simulation)."),
        "",
        (f"{RANKS} ranks of profile {PROFILE}; reports reach the dispatcher 5 ms late; the pab "
         "routers queue what no budget covers (the daemon's queue: each request waits at most its "
         "TTFT target, capped by the 5 s TTL, 1024 deep, a later request that fits goes before "
         "one that does not; a timed-out or refused request is a violation). SLO classes from configs/slo.toml "
         "(standard: TTFT 2 s, TPOT 50 ms; interactive 0.5 s / 50 ms; relaxed 5 s / 200 ms). "
         f"Capacity: the highest cluster-wide req/s with >= 90% on time (every lower probe "
         f"too), bisected to {doc['tolerance']:.0%} (a lower bound); worst bucket / class: the "
         "lowest-attainment prompt-length bucket / SLO class of >= 20 requests. Overload: "
         "effective req/s (on time) at 1.5x and 2x the best baseline's overall capacity. "
         "Prefilled: the share of prompt tokens the ranks computed (the rest hit their prefix "
         "cache), at the configuration's capacity. With shared prefixes every rank has a "
         "prefix cache (`sglang_ext/sim/prefix_cache.py`: a prompt enters it once prefilled; "
         "cached tokens are neither computed nor charged to KV; bounded by the KV its requests "
         "leave free, LRU leaves first)."),
        "",
    ]
    for name, result in doc["workloads"].items():
        entries = result["configurations"]
        rates = result["overload_rates"]
        lines += [f"## {name}: {doc['cases'][name]}", "",
                  "Sarathi budget (behind request_count) by capacity score (worst of bucket "
                  "and class, overall): " + ", ".join(
                      f"{b}: {s[0]:g}/{s[1]:g}" for b, s in result["sarathi_scores"].items())
                  + f"; best {result['sarathi_best']}.", "",
                  ("| rank policy + router | cap90 overall | worst bucket | worst class | "
                   f"{rates['1.5x']:.0f} req/s (1.5x) on time | {rates['2x']:.0f} req/s (2x) "
                   "on time | prefilled at cap | TTFT p99 ms at cap |"),
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        ordered = sorted(entries.items(), key=lambda item: -_cap(item[1], "overall"))
        for label, entry in ordered:
            at = _at_capacity(entry)
            over = entry["overload"]
            prefilled = "-" if at is None or at["prefilled_share"] is None \
                else f"{at['prefilled_share']:.2f}"
            ttft = "-" if at is None or at["ttft_p99_ms"] is None else f"{at['ttft_p99_ms']:.0f}"
            marker = " (pab)" if entry["router"].startswith("pab") else ""
            lines.append(
                f"| `{label}`{marker} | {_cap(entry, 'overall'):.1f} | "
                f"{_cap(entry, 'worst_prompt_bucket'):.1f} | {_cap(entry, 'worst_slo_class'):.1f}"
                f" | {over['1.5x']['effective_rps']:.1f} | {over['2x']['effective_rps']:.1f} | "
                f"{prefilled} | {ttft} |")
        lines.append("")
        for title, verdict in doc["verdicts"][name].items():
            lines.append(f"- {title}: " + "; ".join(
                f"{capacity.MEASURE_TITLES[m]} {v['ours_capacity'] / v['baseline_capacity']:.2f}x"
                f" (`{v['ours']}` {v['ours_capacity']:.1f} vs `{v['baseline']}` "
                f"{v['baseline_capacity']:.1f})" if v["baseline_capacity"] else
                f"{capacity.MEASURE_TITLES[m]} n/a" for m, v in verdict.items()) + ".")
        lines.append("")
    lines += [f"Regenerate: `{command}`", ""]
    return "\n".join(lines)


def workload_names(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """``--workloads``: names from :data:`WORKLOADS`, comma-separated (a parser error else)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in WORKLOADS for n in names):
        parser.error(f"--workloads: expected names from {', '.join(WORKLOADS)}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=SHARED_AZURE_TRACE, help="Azure trace CSV")
    parser.add_argument("--requests", type=int,
                        help=f"requests per workload (default {DEFAULT_REQUESTS})")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="comma-separated subset of " + ", ".join(WORKLOADS))
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_REQUESTS} requests, Sarathi budgets "
                        f"{QUICK_SARATHI_BUDGETS}, bisection to {QUICK_TOLERANCE:.0%}%")  # %%: argparse
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--out", type=Path, default=DOCS_BENCH)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    names = workload_names(parser, args.workloads)
    if args.requests is not None and args.requests < 2:
        parser.error("--requests must be >= 2")
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    requests = args.requests or (QUICK_REQUESTS if args.quick else DEFAULT_REQUESTS)
    tolerance = QUICK_TOLERANCE if args.quick else TOLERANCE
    budgets = QUICK_SARATHI_BUDGETS if args.quick else SARATHI_BUDGETS
    cases = {name: case for name, case in build_cases(args.trace, requests).items()
             if name in names}
    start = time.perf_counter()
    results, cpu_s = run_all(cases, budgets, tolerance, args.jobs)
    doc = {"machine": machine_info(), "wall_s": round(time.perf_counter() - start, 1),
           "simulation_cpu_s": round(cpu_s, 1), "jobs": args.jobs, "tolerance": tolerance,
           "requests": requests, "ranks": RANKS, "profile": PROFILE,
           "cases": {name: case.description for name, case in cases.items()},
           "workloads": results, "verdicts": verdicts(results)}
    command = "python -m benchmarks.sim.cluster_sim" + (" --quick" if args.quick else "")
    if args.requests:
        command += f" --requests {args.requests}"
    if names != list(WORKLOADS):
        command += f" --workloads {','.join(names)}"
    if args.out != DOCS_BENCH:
        command += f" --out {args.out}"
    text = markdown(doc, command)
    print(text)
    if not args.no_write:
        write_outputs(args.out, "cluster_sim", text, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
