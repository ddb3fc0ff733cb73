"""Benchmark: one hostile request in 50, and what the lateness guard costs.

What: the Azure conversation trace (the shared copy's first ``--head`` seconds, the
bundled sample if it is missing) replayed in the simulator on ``llama3.1-8b-h100`` with
every request in the standard class (TTFT 2000 ms / TPOT 50 ms), at several offered
loads, three ways:

- ``clean``: as recorded;
- ``tiny-tpot``: every 50th request asks for TTFT 100 ms / TPOT 4 ms (below the step
  floor: the door refuses it, so the simulator counts it ``rejected``);
- ``tiny-ttft``: every 50th request asks for TTFT 1 ms (accepted, late at once).

Each through FairBatching with the lateness guard (``batch_former``), and without it
(``PolicyContext(lateness_guard=False)``: the printed algorithm, no door). The figures:
the *other* requests' SLO attainment (hostile ones excluded) against the clean run's,
and peak effective RPS of the clean run with and without the guard::

    source scripts/_env.sh
    python -m benchmarks.sim.hostile          # writes docs/bench/hostile.{md,json}
    python -m benchmarks.sim.hostile --quick --no-write
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.support.machine import machine_info, machine_line
from benchmarks.support.outputs import write_outputs
from benchmarks.support.paths import DOCS_BENCH, SHARED_AZURE_TRACE
from sglang_ext.policy.slo import Slo, SloCatalog
from sglang_ext.sim.metrics import summarize
from sglang_ext.sim.profile import bundled_profile_path, load_profile
from sglang_ext.sim.runner import Scenario, build_policy, parse_policy, replay
from sglang_ext.sim.workloads import Workload, bundled_sample, load_workload

HOSTILE_EVERY = 50
CATALOG = SloCatalog("standard", {
    "standard": Slo.from_ms(2000, 50),
    "tiny-tpot": Slo.from_ms(100, 4),
    "tiny-ttft": Slo.from_ms(1, 50),
})
VARIANTS = ("clean", "tiny-tpot", "tiny-ttft")
POLICIES = ("fb", "fb-anchor-margin")
RATES = (8.0, 12.0, 16.0, 18.0, 20.0, 22.0)
QUICK_RATES = (12.0, 18.0)
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Job:
    policy: str
    guard: bool
    variant: str
    rate: float
    seed: int


def with_hostile(workload: Workload, variant: str) -> Workload:
    if variant == "clean":
        return workload
    requests = tuple(
        replace(r, slo_class=variant) if i % HOSTILE_EVERY == HOSTILE_EVERY // 2 else r
        for i, r in enumerate(workload.requests)
    )
    return replace(workload, requests=requests)


_base: Scenario | None = None


def _init(scenario: Scenario) -> None:
    global _base
    _base = scenario


def run(job: Job) -> dict:
    assert _base is not None
    scenario = replace(_base, workload=with_hostile(_base.workload, job.variant), seed=job.seed)
    policy = build_policy(scenario, parse_policy(job.policy), lateness_guard=job.guard)
    engine, duration = replay(scenario, policy, job.rate)
    records = list(engine.records.values())
    hostile = [r for r in records if r.slo.ttft_s < 2.0]
    others = [r for r in records if r.slo.ttft_s >= 2.0]
    return {
        "policy": job.policy, "guard": job.guard, "variant": job.variant, "rate": job.rate,
        "seed": job.seed,
        "all": summarize(records, job.rate, duration),
        "others": summarize(others, job.rate, duration),
        "hostile": {
            "requests": len(hostile),
            "rejected": sum(r.rejected for r in hostile),
            "finished": sum(r.finished for r in hostile),
        },
        "gpu_busy_fraction": engine.busy_s / engine.now if engine.now > 0 else 0.0,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=SHARED_AZURE_TRACE)
    parser.add_argument("--head", type=float, default=300.0, help="seconds of the trace")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS),
                        help="GPU-noise seeds; figures are means over them")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--quick", action="store_true", help=f"rates {QUICK_RATES} only")
    parser.add_argument("--out", type=Path, default=DOCS_BENCH)
    parser.add_argument("--no-write", action="store_true")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    info = machine_info()
    if args.trace.is_file():
        workload, source = load_workload(args.trace, "azure").head(args.head), args.trace.name
    else:
        workload, source = bundled_sample().head(args.head), "the bundled sample (shared trace not found)"
    scenario = Scenario(workload, load_profile(bundled_profile_path("llama3.1-8b-h100")), CATALOG)
    rates = QUICK_RATES if args.quick else RATES
    jobs = [Job(p, g, v, r, s) for p in POLICIES for g in (True, False) for v in VARIANTS
            for r in rates for s in args.seeds]
    started = time.time()
    with ProcessPoolExecutor(max(1, args.jobs or 1), initializer=_init, initargs=(scenario,)) as pool:
        results = list(pool.map(run, jobs, chunksize=1))
    elapsed = time.time() - started
    text = report(results, rates, source, len(workload.requests), args, info, elapsed)
    print(text)
    if not args.no_write:
        write_outputs(args.out, "hostile", text, {
            "machine": info, "trace": source, "head_s": args.head, "seeds": args.seeds,
            "hostile_every": HOSTILE_EVERY, "rates": list(rates), "runs": results,
        })
    return 0


def _mean(results: list[dict], policy: str, guard: bool, variant: str, rate: float,
          group: str, key: str) -> float:
    """``group[key]`` averaged over the seeds of one configuration."""
    values = [r[group][key] for r in results
              if (r["policy"], r["guard"], r["variant"], r["rate"]) == (policy, guard, variant, rate)]
    return sum(values) / len(values)


def _peak(results: list[dict], policy: str, guard: bool, rates: Sequence[float]) -> tuple[float, float]:
    """The highest seed-mean effective RPS of the clean run, and its load."""
    return max((_mean(results, policy, guard, "clean", rate, "all", "effective_rps"), rate)
               for rate in rates)


def report(results, rates, source, requests, args, info, elapsed) -> str:
    lines = [
        "# One hostile request in 50: the lateness guard",
        "",
        f"`python -m benchmarks.sim.hostile{' --quick' if args.quick else ''}` in {elapsed:.0f} s; "
        f"{machine_line(info)}.",
        "",
        f"Trace: {source}, first {args.head:g} s ({requests} requests), arrivals rescaled to each "
        f"load; `llama3.1-8b-h100`; means over GPU-noise seeds {', '.join(map(str, args.seeds))}; "
        f"every {HOSTILE_EVERY}th request hostile: "
        "`tiny-tpot` = TTFT 100 ms / TPOT 4 ms (below the floor: refused at the door), "
        "`tiny-ttft` = TTFT 1 ms / TPOT 50 ms (accepted, late at once). Attainment is that of "
        "the *other* requests (standard class, TTFT 2000 / TPOT 50 ms); Δ is against the clean "
        "run of the same policy and guard setting, in percentage points.",
        "",
        "| policy | guard | load | clean | tiny-tpot | Δ | tiny-ttft | Δ |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    worst = {}
    for policy in POLICIES:
        for guard in (True, False):
            for rate in rates:
                clean = _mean(results, policy, guard, "clean", rate, "others", "attainment")
                cells = []
                for variant in VARIANTS[1:]:
                    value = _mean(results, policy, guard, variant, rate, "others", "attainment")
                    delta = (value - clean) * 100
                    worst[(policy, guard)] = min(worst.get((policy, guard), 0.0), delta)
                    cells += [f"{value:.3f}", f"{delta:+.1f}"]
                lines.append(f"| {policy} | {'on' if guard else 'off'} | {rate:g} | {clean:.3f} | "
                             + " | ".join(cells) + " |")
    lines += ["", "Worst Δ over the loads (pp): " + ", ".join(
        f"`{p}` guard {'on' if g else 'off'} {d:+.1f}" for (p, g), d in worst.items()) + ".", ""]
    lines += ["Peak effective RPS of the clean run (what the guard costs):", "",
              "| policy | guard on | guard off | on / off |", "|---|---:|---:|---:|"]
    for policy in POLICIES:
        (on, on_rate), (off, off_rate) = _peak(results, policy, True, rates), _peak(results, policy, False, rates)
        mark = lambda r: " (≥: highest load)" if r == max(rates) else ""  # noqa: E731
        lines.append(f"| {policy} | {on:.2f} @ {on_rate:g}{mark(on_rate)} | {off:.2f} @ {off_rate:g}"
                     f"{mark(off_rate)} | {on / off:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
