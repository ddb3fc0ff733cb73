"""Benchmark: simulator speed -- one hour of the Azure trace at its natural rate, one policy.

What: wall time of ``sglang_ext.sim.runner.simulate`` replaying the shared Azure
conversation trace (``../shared/data/traces/azure_conv_2023.csv``, 19,366 requests over
~58 minutes) at its own mean rate through one policy, on one core -- the scenario the
``python -m sglang_ext.sim run`` CLI builds by default (profile ``llama3.1-8b-h100``,
``configs/slo.toml``, trace arrivals, seed 0, 120 s drain, MAX_TOKEN_BUDGET 8192, the
offline-fitted initial step model). Reported per policy: wall seconds of ``simulate``
(loading the trace is timed separately), simulated steps, steps per wall second,
simulated seconds per wall second, and the wall time scaled to exactly one hour of
trace (wall x 3600 / trace duration). The goal: <= 30 s per hour of trace on one
core.

If the trace is missing, the bundled 600 s sample (``bundled_sample()``) is timed
instead: the output then says so, and the one-hour figure is an extrapolation
(x 3600 / 600), labelled as such.

Each policy is timed ``--repeats`` times (default 3, in rounds over the policies so
drift on the machine hits them alike); the tables show the run with the median wall
time, and all runs are in the JSON. Run pinned to one core::

    source scripts/_env.sh
    # fb, fb-anchor-margin, sarathi@512, vllm-default; writes docs/bench/sim_speed.{md,json}:
    taskset -c 1 python -m benchmarks.sim.sim_speed
    taskset -c 1 python -m benchmarks.sim.sim_speed --policy fb --repeats 1 --no-write
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.support.machine import cpu_times, cpu_usage, machine_info, machine_line
from benchmarks.support.outputs import write_outputs
from benchmarks.support.paths import DOCS_BENCH, REPO, SHARED_AZURE_TRACE
from sglang_ext.policy.slo import SloCatalog
from sglang_ext.sim import runner
from sglang_ext.sim.engine import SimEngine
from sglang_ext.sim.profile import bundled_profile_path, load_profile
from sglang_ext.sim.runner import PolicySpecError, Scenario, parse_policy, simulate
from sglang_ext.sim.workloads import bundled_sample, load_workload

DEFAULT_POLICIES = ("fb", "fb-anchor-margin", "sarathi@512", "vllm-default")
PROFILE = "llama3.1-8b-h100"
GOAL_S_PER_HOUR = 30.0
HOUR_S = 3600.0


class _RecordingEngine(SimEngine):
    """``SimEngine`` that remembers its last instance, so the benchmark can read the
    simulated clock and idle ticks after ``simulate`` returns; adds nothing per step."""

    last: SimEngine | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _RecordingEngine.last = self


def _type_name(value: object) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__name__}".removeprefix("builtins.")


def time_one(scenario: Scenario, label: str) -> dict:
    spec = parse_policy(label)
    rate = scenario.workload.mean_rate
    gc.collect()
    start = time.perf_counter()
    result = simulate(scenario, spec, rate)
    wall = time.perf_counter() - start
    engine = _RecordingEngine.last
    assert engine is not None
    trace_s = scenario.workload.duration_s
    return {
        "policy": result.policy,
        "wall_s": round(wall, 3),
        "wall_s_per_hour_of_trace": round(wall * HOUR_S / trace_s, 3),
        "steps": engine.steps,
        "idle_ticks": engine.idle_ticks,
        "steps_per_wall_s": round(engine.steps / wall, 1),
        "simulated_s": round(float(engine.now), 3),
        "simulated_s_per_wall_s": round(float(engine.now) / wall, 2),
        "step_model_number_type": _type_name(engine.policy.step_model.coefficients.a_s),
        "requests": len(scenario.workload.requests),
        "attainment": round(result.load["attainment"], 4),
        "gpu_busy_fraction": round(result.load["gpu_busy_fraction"], 4),
    }


def markdown(doc: dict) -> str:
    workload = doc["workload"]
    extrapolated = workload["extrapolated"]
    hour_col = ("wall s per hour of trace, EXTRAPOLATED from 600 s" if extrapolated
                else "wall s per hour of trace")
    lines = [
        "# Simulator speed",
        "",
        f"Machine: {doc['machine_line']}.",
        "",
    ]
    if extrapolated:
        lines += [
            f"**The full trace was not found ({doc['trace_requested']}): this timed the bundled "
            f"{workload['duration_s']:.0f} s sample (10 minutes), not an hour.** The hour column "
            "is that time x 3600 / duration -- an extrapolation, not a measurement.",
            "",
        ]
    lines += [
        f"Workload: {workload['source']} -- {workload['requests']} requests over "
        f"{workload['duration_s']:.0f} s of trace ({workload['duration_s'] / 60:.1f} min) at its "
        f"natural rate {workload['rate']:.3f} req/s, replayed as `python -m sglang_ext.sim run` "
        f"does (profile {PROFILE}, configs/slo.toml, trace arrivals, seed 0, 120 s drain, "
        f"MAX_TOKEN_BUDGET 8192). Loading and parsing the trace: {workload['load_s']:.2f} s "
        "(not in the table). Wall time is `simulate()` alone; "
        f"{doc['repeats']} runs per policy in rounds, the table shows the run with the median "
        "wall time (all runs in `sim_speed.json`). Goal: <= "
        f"{GOAL_S_PER_HOUR:g} s per hour of trace on one core. CPU use while timing "
        f"({doc['timing_wall_s']:.0f} s): "
        + ", ".join(f"{cpu} busy {u['busy_pct']:.0f}% (steal {u['steal_pct']:.0f}%)"
                    for cpu, u in doc["cpu_usage_during_timing"].items()) + ".",
        "",
        f"| policy | wall s | {hour_col} | goal <= {GOAL_S_PER_HOUR:g} s | simulated steps | "
        "steps / wall s | simulated s / wall s | runs (wall s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, row in doc["results"].items():
        hour = row["wall_s_per_hour_of_trace"]
        goal = "yes" if hour <= GOAL_S_PER_HOUR else "**no**"
        if extrapolated:
            goal += " (extrapolated)"
        lines.append(
            f"| `{label}` | {row['wall_s']:.1f} | {hour:.1f} | {goal} | {row['steps']:,} | "
            f"{row['steps_per_wall_s']:,.0f} | {row['simulated_s_per_wall_s']:.0f} | "
            + ", ".join(f"{w:.1f}" for w in row["runs_wall_s"]) + " |"
        )
    lines += [
        "",
        "Simulated seconds include the drain after the last arrival (until idle, at most 120 s).",
        "",
        "Step-model coefficients at the end of these runs are of type `"
        + "`/`".join(sorted({r["step_model_number_type"] for r in doc["results"].values()}))
        + "` (a `numpy.float64` here would mean numpy scalars leaked into the simulator's "
        "clock, which once made every later step slower).",
        "",
        f"Regenerate: `{doc['command']}`",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See the module docstring (top of benchmarks/sim/sim_speed.py) for the method.",
    )
    parser.add_argument("--policy", action="append", dest="policies",
                        help=f"policy, NAME@BUDGET for budgeted ones; repeatable "
                        f"(default: {' '.join(DEFAULT_POLICIES)})")
    parser.add_argument("--trace", type=Path, default=SHARED_AZURE_TRACE,
                        help="Azure-format trace (default: "
                        "../shared/data/traces/azure_conv_2023.csv relative to the repo; falls "
                        "back to the bundled 600 s sample if missing)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per policy; the table shows the median-wall run (default 3)")
    parser.add_argument("--out", type=Path, default=DOCS_BENCH,
                        help="output folder (default docs/bench)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    labels = args.policies or list(DEFAULT_POLICIES)
    try:
        for label in labels:
            parse_policy(label)
    except PolicySpecError as exc:
        parser.error(str(exc))

    info = machine_info()
    print(f"machine: {machine_line(info)}", file=sys.stderr)
    if not info["pinned_to_cpus"] or len(info["pinned_to_cpus"]) != 1:
        print("warning: not pinned to one CPU; run under `taskset -c 1`", file=sys.stderr)

    start = time.perf_counter()
    extrapolated = not args.trace.exists()
    if extrapolated:
        print(f"warning: {args.trace} not found; timing the bundled 600 s sample and "
              "EXTRAPOLATING to an hour", file=sys.stderr)
        workload = bundled_sample()
    else:
        workload = load_workload(args.trace, "azure")
    load_s = time.perf_counter() - start
    scenario = Scenario(
        workload=workload,
        profile=load_profile(bundled_profile_path(PROFILE)),
        catalog=SloCatalog.from_toml(REPO / "configs" / "slo.toml"),
    )
    runner.SimEngine = _RecordingEngine  # so time_one can read the simulated clock

    runs: dict[str, list[dict]] = {label: [] for label in labels}
    cpu_before, wall_start = cpu_times(), time.monotonic()
    for repeat in range(args.repeats):
        for label in labels:
            row = time_one(scenario, label)
            runs[label].append(row)
            print(f"run {repeat + 1}/{args.repeats} {label:<18} wall {row['wall_s']:7.2f} s  "
                  f"({row['wall_s_per_hour_of_trace']:.2f} s/hour of trace)  "
                  f"steps {row['steps']:,}  "
                  f"{row['simulated_s_per_wall_s']:.0f} sim s / wall s", file=sys.stderr)
    timing_wall = time.monotonic() - wall_start
    usage = cpu_usage(cpu_before, cpu_times())

    results = {}
    for label, rows in runs.items():
        ordered = sorted(rows, key=lambda r: r["wall_s"])
        results[label] = dict(ordered[len(ordered) // 2], runs_wall_s=[r["wall_s"] for r in rows],
                              median_wall_s=statistics.median(r["wall_s"] for r in rows))
    doc = {
        "schema": 1,
        "benchmark": "sim_speed",
        "machine": info,
        "machine_line": machine_line(info),
        "goal": {"wall_s_per_hour_of_trace": GOAL_S_PER_HOUR, "cores": 1},
        "trace_requested": str(args.trace),
        "workload": {
            "source": workload.source,
            "requests": len(workload.requests),
            "duration_s": workload.duration_s,
            "rate": workload.mean_rate,
            "load_s": round(load_s, 3),
            "extrapolated": extrapolated,
        },
        "scenario": {"profile": PROFILE, "slo_config": "configs/slo.toml", "arrivals": "trace",
                     "seed": 0, "drain_s": scenario.drain_s,
                     "max_token_budget": scenario.max_token_budget},
        "repeats": args.repeats,
        "timing_wall_s": round(timing_wall, 1),
        "cpu_usage_during_timing": usage,
        "command": " ".join(["taskset -c 1 python -m benchmarks.sim.sim_speed",
                             *(sys.argv[1:] if argv is None else argv)]),
        "results": results,
        "runs": runs,
    }
    text = markdown(doc)
    print(text)
    if not args.no_write:
        write_outputs(args.out, "sim_speed", text, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
