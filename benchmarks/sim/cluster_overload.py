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
  ``on_no_budget = "queue"``), spilled (``"spill"``) or refused (``"reject"``, the
  daemon's default) and resubmitted as the gateway's SDK resubmits it, at most
  ``DEFAULT_MAX_RETRIES`` times after the daemon's ``retry_after_s``.
- FairBatching ranks run ``fb-smooth+defer`` at each of ``RANK_SETTINGS``: ``give_up``
  (the ``[admission]`` length weight of the prefill ``defer`` gives up first; None is 1,
  the longest) and ``max_defer_s`` (how long past its TTFT deadline a late prefill is
  kept), behind every router, so neither side of a PAB comparison has a rank setting the
  other lacks.

Every configuration runs at every arrival seed of ``--seeds`` (default 0, 1, 2: past
capacity the cluster is chaotic, a 0.05% change of rate moves one configuration's on-time
req/s by 5%); a cell is the mean over the seeds. The verdict per workload and rate: the
best PAB configuration over the best of all the others by that mean, with the ratio per
seed and each side's on-time share per prompt-length bucket and per SLO class (who pays).
``--only REGEX`` runs the configurations whose label matches; with ``--keep JSON`` (a
committed run of this benchmark) the others are that run's figures, which stand because the
simulations are deterministic: rerun what a change touches, keep what it does not.
``--step-model FILE`` starts every rank's step model from that file (another GPU's)
instead of the offline fit on the simulated H100; kept from a run that started elsewhere,
only the configurations that never read the step model (the Sarathi baselines) stand. Uses
``--jobs`` processes (about 15 minutes per seed at 2)::

    source scripts/_env.sh
    python -m benchmarks.sim.cluster_overload --jobs 2   # writes docs/bench/cluster_overload.{md,json}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import statistics
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
from controlplane.retry import DEFAULT_MAX_RETRIES
from sglang_ext.policy.policies import POLICIES
from sglang_ext.policy.step_model import StepModelError, StepModelFile
from sglang_ext.sim.cluster import ClusterConfig, simulate_cluster
from sglang_ext.sim.runner import parse_policy

SJF = "sarathi-sjf-queue-timeout@1024"
SJF_TIMEOUTS = (1.0, 2.0, 3.0)
SJF_TIMEOUT_BOUNDS = (0.25, 8.0)
FIFO_TIMEOUT = "sarathi-queue-timeout@1024,timeout=1.75"
FAIRBATCHING = cluster_sim.FAIRBATCHING
#: (give_up, max_defer_s) of the FairBatching ranks; (None, 2.0) is the default
RANK_SETTINGS: tuple[tuple[float | None, float], ...] = ((None, 0.5), (None, 2.0), (0.9, 3.0))
LOAD_ROUTERS = ("round_robin", "request_count", "cache_aware")
FB_LOAD_ROUTERS = ("request_count", "cache_aware")
PAB_ROUTERS = ("pab_least_loaded", "pab_cache_aware")
ON_NO_BUDGET = ("queue", "spill", "reject")


@dataclass(frozen=True, slots=True)
class Configuration:
    policy: str
    router: str
    on_no_budget: str = "queue"

    @property
    def pab(self) -> bool:
        return self.router.startswith("pab")

    @property
    def client_retries(self) -> int:
        """The gateway SDK's resubmissions of a refused request, for ``reject`` only: the
        daemon's default, measured as users run it. The queue and spill rows resubmit
        nothing."""
        return DEFAULT_MAX_RETRIES if self.pab and self.on_no_budget == "reject" else 0

    @property
    def label(self) -> str:
        if not self.pab:
            return f"{self.policy} + {self.router}"
        retries = f", {self.client_retries} retries" if self.client_retries else ""
        return f"{self.policy} + {self.router} ({self.on_no_budget}{retries})"


def fb_policy(max_defer_s: float, give_up: float | None = None) -> str:
    weight = "" if give_up is None else f":{give_up:g}"
    return str(parse_policy(f"{FAIRBATCHING}{weight}:max_defer={max_defer_s:g}").label)


def _routers(case: Case, routers: Sequence[str]) -> list[str]:
    return [r for r in routers if case.prefixes or r not in PROMPT_ROUTERS]


def sjf_configurations(case: Case, timeouts: Sequence[float]) -> list[Configuration]:
    return [Configuration(f"{SJF},timeout={t:g}", r) for t in timeouts
            for r in _routers(case, LOAD_ROUTERS)]


def fixed_configurations(case: Case) -> list[Configuration]:
    out = [Configuration(FIFO_TIMEOUT, r) for r in _routers(case, LOAD_ROUTERS)]
    for give_up, max_defer in RANK_SETTINGS:
        policy = fb_policy(max_defer, give_up)
        out += [Configuration(policy, r) for r in _routers(case, FB_LOAD_ROUTERS)]
        out += [Configuration(policy, r, mode) for r in _routers(case, PAB_ROUTERS)
                for mode in ON_NO_BUDGET]
    return out


_cases: dict[str, Case] = {}


def _init_worker(cases: dict[str, Case]) -> None:
    _cases.update(cases)


def _group_attainment(groups: dict) -> dict[str, float]:
    return {name: round(group["attainment"], 4) for name, group in groups.items()}


def _job(job: tuple[str, str, float, Configuration, int]
         ) -> tuple[str, str, Configuration, int, dict, float]:
    name, key, rate, configuration, seed = job
    case = _cases[name]
    began = time.perf_counter()
    load = simulate_cluster(
        dataclasses.replace(case.scenario, seed=seed), parse_policy(configuration.policy), rate,
        ClusterConfig(RANKS, configuration.router, on_no_budget=configuration.on_no_budget,
                      client_retries=configuration.client_retries),
        prefixes=case.prefixes).load
    point = {
        "policy": configuration.policy, "router": configuration.router,
        "on_no_budget": configuration.on_no_budget if configuration.pab else None,
        "rate": rate, "effective_rps": load["effective_rps"], "attainment": load["attainment"],
        "by_prompt_bucket": _group_attainment(load["by_prompt_tokens"]),
        "by_slo_class": _group_attainment(load["by_slo_class"]),
        "rejected": load["rejected"], "queue_timeout": load["queue_timeout"],
        "spilled": load["spilled"], "retries": load["retries"],
        "dispatch_imbalance": round(load["dispatch_imbalance"], 3),
    }
    return name, key, configuration, seed, point, time.perf_counter() - began


def mean_point(by_seed: dict[int, dict]) -> dict:
    """One configuration at one rate over its seeds: the means, and each seed's on-time req/s."""
    points = list(by_seed.values())
    mean = dict(points[0])
    for field in ("effective_rps", "attainment"):
        mean[field] = statistics.fmean(p[field] for p in points)
    for field in ("by_prompt_bucket", "by_slo_class"):
        mean[field] = {group: round(statistics.fmean(p[field][group] for p in points), 4)
                       for group in points[0][field]}
    for field in ("rejected", "queue_timeout", "spilled", "retries"):
        mean[field] = statistics.fmean(p.get(field, 0) for p in points)
    mean["seeds"] = {str(seed): round(p["effective_rps"], 2) for seed, p in sorted(by_seed.items())}
    return mean


def best_sjf_timeout(points: dict[str, dict]) -> tuple[float, list[float]]:
    """The SJF timeout whose best router delivers the most on time, and every timeout run."""
    by_timeout: dict[float, float] = {}
    for point in points.values():
        if point["policy"].startswith(SJF + ","):
            timeout = float(point["policy"].rsplit("timeout=", 1)[1])
            by_timeout[timeout] = max(by_timeout.get(timeout, 0.0), point["effective_rps"])
    best = max(by_timeout, key=lambda t: (by_timeout[t], -t))
    return best, sorted(by_timeout)


def run_all(cases: dict[str, Case], rates: dict[str, dict[str, float]], seeds: Sequence[int],
            jobs: int, only: re.Pattern | None = None) -> tuple[dict, float]:
    """Every configuration (``only``: those whose label it matches) at every rate and seed;
    a configuration's point is its mean over the seeds."""
    by_seed: dict[str, dict[str, dict[str, dict[int, dict]]]] = {
        name: {key: {} for key in rates[name]} for name in cases}
    cpu_s = 0.0

    def wanted(configurations: list[Configuration]) -> list[Configuration]:
        return [c for c in configurations if only is None or only.search(c.label)]

    work = [(name, key, rate, c, seed) for name, case in cases.items()
            for key, rate in rates[name].items()
            for c in wanted(sjf_configurations(case, SJF_TIMEOUTS) + fixed_configurations(case))
            for seed in seeds]
    with ProcessPoolExecutor(jobs, initializer=_init_worker, initargs=(cases,)) as pool:
        while work:
            for done, (name, key, configuration, seed, point, seconds) in enumerate(
                    pool.map(_job, work, chunksize=1), 1):
                by_seed[name][key].setdefault(configuration.label, {})[seed] = point
                cpu_s += seconds
                print(f"[{done}/{len(work)}] {name} {key} seed {seed}: {configuration.label} "
                      f"{point['effective_rps']:.1f} ({seconds:.0f} s)", file=sys.stderr, flush=True)
            work = []
            for name, case in cases.items():  # widen the timeout while its best is at an edge
                for key, rate in rates[name].items():
                    points = {label: mean_point(p) for label, p in by_seed[name][key].items()}
                    if not any(p["policy"].startswith(SJF + ",") for p in points.values()):
                        continue
                    best, tried = best_sjf_timeout(points)
                    wider = (best / 2 if best == tried[0] else best * 1.5 if best == tried[-1]
                             else None)
                    if wider and SJF_TIMEOUT_BOUNDS[0] <= wider <= SJF_TIMEOUT_BOUNDS[1]:
                        work += [(name, key, rate, c, seed)
                                 for c in wanted(sjf_configurations(case, (wider,))) for seed in seeds]
    results = {name: {key: {label: mean_point(p) for label, p in points.items()}
                      for key, points in by_rate.items()} for name, by_rate in by_seed.items()}
    return results, cpu_s


def verdicts(results: dict) -> dict:
    out: dict[str, dict] = {}
    for name, by_rate in results.items():
        out[name] = {}
        for key, points in by_rate.items():
            pab = [(label, p) for label, p in points.items() if p["router"].startswith("pab")]
            other = [(label, p) for label, p in points.items() if not p["router"].startswith("pab")]
            if not pab or not other:
                continue
            ours_label, ours = max(pab, key=lambda item: item[1]["effective_rps"])
            theirs_label, theirs = max(other, key=lambda item: item[1]["effective_rps"])
            best_sjf, tried = best_sjf_timeout(points) if any(
                p["policy"].startswith(SJF + ",") for p in points.values()) else (None, [])
            out[name][key] = {
                "ours": ours_label, "baseline": theirs_label,
                "ratio": ours["effective_rps"] / theirs["effective_rps"],
                "ours_rps": ours["effective_rps"], "baseline_rps": theirs["effective_rps"],
                "ratio_per_seed": {seed: rps / theirs["seeds"][seed]
                                   for seed, rps in ours.get("seeds", {}).items()
                                   if theirs.get("seeds", {}).get(seed)},
                "sjf_timeouts": tried, "best_sjf_timeout": best_sjf,
            }
    return out


def reads_step_model(point: dict) -> bool:
    """Whether a configuration's dispatch or batches depend on the ranks' step model: the
    FairBatching family's batches, and every rank's budget under a pab router."""
    return point["router"].startswith("pab") or POLICIES.get(
        parse_policy(point["policy"]).base).takes_admission


def keep_results(results: dict, kept: dict, seeds: Sequence[int], requests: int,
                 step_model: str | None = None) -> dict[str, list[str]]:
    """Fill ``results`` with ``kept``'s (a previous run's) points for the workloads, rates
    and configurations this run lacks; returns the labels kept per workload. From a run
    whose ranks started from another step model than ``step_model`` only the points that
    do not read it are kept. Refuses a run at other seeds or request counts (``main``
    refuses other rates)."""
    same_start = kept.get("step_model") == step_model
    if sorted(kept["seeds"]) != list(seeds):
        raise ValueError(f"kept run has seeds {kept['seeds']}, this run {list(seeds)}")
    if kept.get("requests") != requests:
        raise ValueError(f"kept run has {kept.get('requests')} requests per workload, "
                         f"this run {requests}")
    labels: dict[str, list[str]] = {}
    for name, by_rate in kept["results"].items():
        ours = results.setdefault(name, {})
        for key, points in by_rate.items():
            mine = ours.setdefault(key, {})
            for label, point in points.items():
                if label not in mine and (same_start or not reads_step_model(point)):
                    mine[label] = point
                    if label not in labels.setdefault(name, []):
                        labels[name].append(label)
    return labels


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
         "baseline's capacity). On time: effective req/s. `(queue)` / `(spill)` / `(reject, "
         f"{DEFAULT_MAX_RETRIES} retries)`: the pab routers' `on_no_budget` (`reject`, the daemon's default: a "
         "refused request is resubmitted as the gateway's SDK does). "
         + ("Every rank's step model starts from the offline fit on the simulated device. "
            if doc.get("step_model") is None else
            f"Every rank's step model starts from `{doc['step_model']}`, another device's "
            "file, and learns online. ")
         + "`max_defer=S`: the FairBatching ranks' `[admission]` "
         "`max_defer_s` (default 2); `:W` before it: their `give_up` length weight (default "
         f"1, the longest prompt first). SJF timeouts swept per point: {SJF_TIMEOUTS} widened "
         f"while the best is at an edge. Each cell is the mean over arrival seeds "
         f"{', '.join(map(str, doc['seeds']))} (Azure's trace arrivals do not depend on it)"
         + (f"; configurations matching `{doc['only']}` only" if doc.get("only")
            and not doc.get("kept") else "") + "."),
        "",
    ]
    if doc.get("kept"):
        kept = doc["kept"]
        lines += [(f"Configurations matching `{doc['only']}` ran here; the others (marked "
                   f"*kept*) are the figures of an earlier run ({kept['machine']}), which "
                   "stand because the simulations are deterministic and the configurations "
                   "rerun here are the only ones the change touches."), ""]
    for name, by_rate in doc["results"].items():
        lines += [f"## {name}: {doc['cases'][name]}", ""]
        keys = list(by_rate)
        lines += ["| rank policy + router | " + " | ".join(
            f"{doc['rates'][name][k]:.0f} req/s ({k}) on time" for k in keys) + " |",
            "|---|" + "---:|" * len(keys)]
        labels = sorted(by_rate[keys[0]], key=lambda label: -by_rate[keys[-1]][label]["effective_rps"]
                        if label in by_rate[keys[-1]] else 0.0)
        kept_labels = set((doc.get("kept") or {}).get("labels", {}).get(name, ()))
        for label in labels:
            cells = [f"{by_rate[k][label]['effective_rps']:.1f}" if label in by_rate[k] else "-"
                     for k in keys]
            mark = " *kept*" if label in kept_labels else ""
            lines.append(f"| `{label}`{mark} | " + " | ".join(cells) + " |")
        lines.append("")
        for key in keys:
            verdict = doc["verdicts"][name].get(key)
            if verdict is None:
                continue
            ours = by_rate[key][verdict["ours"]]
            theirs = by_rate[key][verdict["baseline"]]
            lines.append(
                f"- {key}: best PAB / best other {verdict['ratio']:.2f}x (per seed "
                + ", ".join(f"{r:.2f}x" for r in verdict["ratio_per_seed"].values())
                + f"; `{verdict['ours']}` "
                f"{verdict['ours_rps']:.1f} vs `{verdict['baseline']}` {verdict['baseline_rps']:.1f}; "
                f"SJF timeout best at {verdict['best_sjf_timeout']} of {verdict['sjf_timeouts']}; "
                f"per seed {ours['seeds']} against {theirs['seeds']}). "
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
    parser.add_argument("--seeds", default="0,1,2",
                        help="arrival seeds, comma-separated; a cell is their mean (default %(default)s)")
    parser.add_argument("--only", help="run only the configurations whose label matches this regex")
    parser.add_argument("--keep", type=Path,
                        help="a previous run's JSON: its figures for what --only does not run")
    parser.add_argument("--step-model", type=Path,
                        help="a step-model TOML every rank starts from (default: the offline fit "
                        "on the simulated device)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--out", type=Path, default=DOCS_BENCH)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    names = cluster_sim.workload_names(parser, args.workloads)
    if args.keep is not None and args.only is None:
        parser.error("--keep needs --only: without it every configuration runs")
    if args.requests < 2:
        parser.error("--requests must be >= 2")
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    try:
        seeds = sorted({int(seed) for seed in args.seeds.split(",") if seed.strip()})
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: expected integers, comma-separated")
    if not seeds:
        parser.error("--seeds: at least one")
    try:
        only = None if args.only is None else re.compile(args.only)
    except re.error as exc:
        parser.error(f"--only {args.only!r}: {exc}")
    try:
        rates = committed_rates(args.rates)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        parser.error(f"--rates {args.rates}: not a cluster_sim results JSON ({exc})")
    missing = [n for n in names if n not in rates]
    if missing:
        parser.error(f"--rates {args.rates} has no overload rates for {', '.join(missing)}")
    kept_run = None
    if args.keep is not None:
        try:
            kept_run = json.loads(args.keep.read_text())
            kept_rates = kept_run["rates"]
            if not isinstance(kept_run["results"], dict) or not kept_run["seeds"]:
                raise ValueError("no results or no seeds")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            parser.error(f"--keep {args.keep}: not a cluster_overload results JSON ({exc})")
        changed = [n for n in names if n in kept_rates and kept_rates[n] != rates[n]]
        if changed:
            parser.error(f"--keep {args.keep}: other rates for {', '.join(changed)}")
    start_from = None
    if args.step_model is not None:
        try:
            start_from = StepModelFile.load(args.step_model)
        except (OSError, StepModelError) as exc:
            parser.error(f"--step-model {args.step_model}: {exc}")
    step_model = None if args.step_model is None else args.step_model.as_posix()
    cases = {name: dataclasses.replace(case, scenario=dataclasses.replace(
                 case.scenario, step_model=start_from))
             for name, case in build_cases(args.trace, args.requests).items() if name in names}
    start = time.perf_counter()
    results, cpu_s = run_all(cases, {n: rates[n] for n in names}, seeds, args.jobs, only)
    if not any(points for by_rate in results.values() for points in by_rate.values()):
        parser.error(f"--only {args.only!r} matches no configuration")
    wall_s = round(time.perf_counter() - start, 1)
    descriptions = {name: case.description for name, case in cases.items()}
    run_rates = {n: rates[n] for n in names}
    kept = None
    if kept_run is not None:
        try:
            labels = keep_results(results, kept_run, seeds, args.requests, step_model)
        except ValueError as exc:
            parser.error(f"--keep {args.keep}: {exc}")
        descriptions = {**kept_run["cases"], **descriptions}
        run_rates = {**kept_run["rates"], **run_rates}
        results = {name: results[name] for name in descriptions if name in results}
        machine = kept_run.get("machine", {})
        kept = {"labels": labels, "date": machine.get("date_utc", "unknown"),
                "machine": machine_line(machine) if machine else "an unrecorded machine",
                "commit": machine.get("git_commit"), "wall_s": kept_run.get("wall_s")}
    doc = {"machine": machine_info(), "wall_s": wall_s,
           "simulation_cpu_s": round(cpu_s, 1), "jobs": args.jobs, "requests": args.requests,
           "ranks": RANKS, "profile": cluster_sim.PROFILE, "cases": descriptions,
           "rates": run_rates, "seeds": seeds, "only": args.only, "step_model": step_model,
           "results": results,
           "verdicts": verdicts(results), "kept": kept}
    command = "python -m benchmarks.sim.cluster_overload --jobs 2"
    if args.seeds != "0,1,2":
        command += f" --seeds {args.seeds}"
    if args.only:
        command += f" --only {shlex.quote(args.only)}"
    if args.keep is not None:
        command += f" --keep {args.keep}"
    if step_model is not None:
        command += f" --step-model {step_model}"
    if args.requests != cluster_sim.DEFAULT_REQUESTS:
        command += f" --requests {args.requests}"
    if names != list(WORKLOADS):
        command += f" --workloads {','.join(names)}"
    if args.out != DOCS_BENCH:
        command += f" --out {args.out}"
    text = markdown(doc, command)
    print(text)
    if not args.no_write:
        write_outputs(args.out, "cluster_overload", text, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
