"""Benchmark: the shipped policy's capacity started from another GPU's step-model file, on
the fair-capacity scenarios, against their baselines tuned for capacity.

``benchmarks.sim.fair_capacity`` gives FairBatching a step model fitted offline to the
simulated GPU itself, its best case. Here the shipped ``fb-smooth+defer`` (knee learned)
starts as an operator's server would, from a shipped file, on each of those scenarios: the
two GPUs (``llama3.1-8b-h100-measured``, the profile of the measured H100 grid, and
``qwen3-14b-h20``) x the two workloads x one SLO class or three. Starting points:

- the device's own shipped file;
- the other of the two (crosswise: the H20's file on the H100, the H100's on the H20), and
  that file with the start-up calibration (``--calibrate``) a server runs when it names no
  file for its GPU;
- for reference, the offline fit to the simulated GPU that ``fair_capacity`` uses.

Each bisection's result is saved under ``--work`` as it ends; a run stopped midway starts
again where it was.

The baselines are that benchmark's saved scenarios (``docs/bench/fair_capacity.scenarios``):
every family tuned for capacity on the scenario ("tuned here"). They use no step model, so
their capacities stand whatever file FairBatching starts from. Each figure is the capacity
at 90% (overall, worst prompt bucket, worst SLO class: groups of >= 20 requests), bisected
to 3% as there, and its ratio to the best baseline by the same measure. From the
repository root::

    python -m benchmarks.sim.crosswise_capacity [--jobs N] [--only REGEX]

Writes ``docs/bench/crosswise_capacity.{md,json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from benchmarks.sim.fair_capacity import (
    SCENARIOS_DIR,
    TOLERANCE,
    ScenarioKey,
    build_scenario,
    capacity_of,
)
from benchmarks.support.outputs import write_outputs
from benchmarks.support.paths import DOCS_BENCH, REPO, SHARED_AZURE_TRACE
from sglang_ext.policy.step_model import StepModelFile
from sglang_ext.provenance import git_state
from sglang_ext.sim import capacity
from sglang_ext.sim.policy_spec import parse_policy
from sglang_ext.sim.runner import simulate

SHIPPED = "fb-smooth+defer"
STEP_MODELS = REPO / "configs" / "step_models"
#: each device's crosswise file, the other device's (its own file shares its name)
CROSSWISE = {"llama3.1-8b-h100-measured": "qwen3-14b-h20", "qwen3-14b-h20": "llama3.1-8b-h100-measured"}
MEASURES = {"overall": "overall", "worst_prompt_bucket": "worst bucket", "worst_slo_class": "worst class"}
TARGET = "0.9"


@dataclasses.dataclass(frozen=True)
class Start:
    """Where FairBatching's step model starts: a shipped file (None: the offline fit to the
    simulated GPU), and whether the start-up calibration runs first."""

    label: str
    file: str | None
    calibrate: bool = False


def starts(profile: str) -> list[Start]:
    own, other = profile, CROSSWISE[profile]
    return [Start(f"own file ({own})", own),
            Start(f"crosswise file ({other})", other),
            Start(f"crosswise file ({other}), calibrated at start-up", other, calibrate=True),
            Start("offline fit to the simulated GPU", None)]


def saved_scenarios(source: Path) -> list[dict]:
    found = sorted((source / SCENARIOS_DIR).glob("*.json"))
    if not found:
        raise SystemExit(f"{source / SCENARIOS_DIR}: no saved fair-capacity scenarios "
                         "(python -m benchmarks.sim.fair_capacity writes them)")
    return [json.loads(path.read_text()) for path in found]


def saved_path(work: Path, key_fields: dict, start: Start) -> Path:
    name = re.sub(r"[^A-Za-z0-9.]+", "-", f"{ScenarioKey(**key_fields).label}--{start.label}")
    return work / f"{name.strip('-')}.json"


def bisect_start(job: tuple[dict, Start, Path, Path]) -> dict:
    """Capacity of the shipped policy from ``start`` on the scenario ``job`` names, saved
    under the work folder (and read back from there when a stopped run saved it)."""
    key_fields, start, trace, work = job
    saved = saved_path(work, key_fields, start)
    if saved.is_file():
        return json.loads(saved.read_text())
    scenario = build_scenario(ScenarioKey(**key_fields), trace)
    step_model = None if start.file is None else StepModelFile.load(STEP_MODELS / f"{start.file}.toml")
    scenario = dataclasses.replace(scenario, step_model=step_model, calibrate=start.calibrate)
    spec = parse_policy(SHIPPED)
    began = time.perf_counter()
    search = capacity.bisect_capacity(
        lambda rate: simulate(scenario, spec, rate).load, targets=(float(TARGET),),
        start=scenario.workload.mean_rate * 4, tolerance=TOLERANCE,
    )
    result = {"start": dataclasses.asdict(start), "capacity": search.capacity,
              "simulations": search.simulations, "wall_s": round(time.perf_counter() - began, 1)}
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(result, indent=1) + "\n")
    return result


def collect(entries: list[dict], results: dict[tuple[str, str], dict]) -> dict:
    scenarios = []
    for entry in entries:
        key = ScenarioKey(**entry["scenario"])
        baselines = entry["labels"]["tuned here"]
        best = {}
        for measure in MEASURES:
            label = max(baselines, key=lambda b: capacity_of(entry["capacity"][b], TARGET, measure))
            best[measure] = {"policy": label,
                             "capacity": capacity_of(entry["capacity"][label], TARGET, measure)}
        rows = []
        for start in starts(key.profile):
            result = results.get((key.label, start.label))
            if result is None:
                continue
            cells = {}
            for measure in MEASURES:
                ours = capacity_of({"capacity": result["capacity"]}, TARGET, measure)
                theirs = best[measure]["capacity"]
                cells[measure] = {"capacity": ours, "ratio": ours / theirs if theirs else None}
            rows.append({"start": start.label, "file": start.file, "calibrate": start.calibrate,
                         "cap90": cells, "simulations": result["simulations"]})
        scenarios.append({"scenario": key.label, "requests": entry["requests"], "best_baseline": best,
                          "rows": rows})
    return {"policy": SHIPPED, "target": float(TARGET), "tolerance": TOLERANCE, "scenarios": scenarios}


def _cell(cell: dict) -> str:
    if not cell["capacity"]:
        return "< min"
    ratio = "" if cell["ratio"] is None else f" ({cell['ratio']:.2f}x)"
    return f"{cell['capacity']:.2f}{ratio}"


def render(doc: dict) -> str:
    lines = [
        "# The shipped policy's capacity from another GPU's step-model file",
        "",
        (f"`python -m benchmarks.sim.crosswise_capacity`. `{doc['policy']}` (knee learned) "
         "started from each file, on the scenarios of [fair_capacity.md](fair_capacity.md); "
         f"capacity at {doc['target']:.0%} on time (req/s, bisected to {doc['tolerance']:.0%}), "
         "in brackets over the best baseline tuned for capacity on that scenario, by the same "
         "measure (worst bucket / class: the lowest of the groups of >= 20 requests)."),
        "",
        "| scenario | FairBatching starts from | overall | worst bucket | worst class |",
        "|---|---|---|---|---|",
    ]
    for scenario in doc["scenarios"]:
        best = scenario["best_baseline"]
        lines.append(f"| {scenario['scenario']} | the best baseline | "
                     + " | ".join(f"{best[m]['capacity']:.2f}" for m in MEASURES) + " |")
        for row in scenario["rows"]:
            lines.append(f"| {scenario['scenario']} | {row['start']} | "
                         + " | ".join(_cell(row["cap90"][m]) for m in MEASURES) + " |")
    lines += ["", "The best baselines (overall / worst bucket / worst class):", ""]
    lines += [f"- {s['scenario']}: " + " / ".join(f"`{s['best_baseline'][m]['policy']}`" for m in MEASURES)
              for s in doc["scenarios"]]
    foreign = [(s["scenario"], r) for s in doc["scenarios"] for r in s["rows"]
               if r["file"] is not None and not r["start"].startswith("own")]
    lowest = []
    for measure, name in MEASURES.items():
        rated = [item for item in foreign if item[1]["cap90"][measure]["ratio"] is not None]
        if rated:
            scenario, row = min(rated, key=lambda item: item[1]["cap90"][measure]["ratio"])
            lowest.append(f"{name} {row['cap90'][measure]['ratio']:.2f}x ({scenario}, {row['start']})")
    if lowest:
        lines += ["", "From another GPU's file, the lowest ratio: " + "; ".join(lowest)
                  + " (a measure no baseline reaches at any load has no ratio)."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DOCS_BENCH,
                        help="where fair_capacity saved its scenarios (default docs/bench)")
    parser.add_argument("--trace", type=Path, default=SHARED_AZURE_TRACE)
    parser.add_argument("--jobs", type=int, default=1, help="bisections at once")
    parser.add_argument("--only", default=None, help="scenarios whose label matches this regex")
    parser.add_argument("--work", type=Path, default=REPO / "out" / "crosswise_capacity",
                        help="where each bisection's result is saved (default out/crosswise_capacity)")
    parser.add_argument("--out", type=Path, default=DOCS_BENCH)
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        parser.error(f"--trace {args.trace}: not found (the shared one-hour Azure trace)")
    try:
        only = re.compile(args.only) if args.only else None
    except re.error as exc:
        parser.error(f"--only {args.only!r}: {exc}")
    started = time.monotonic()
    entries = [e for e in saved_scenarios(args.source)
               if only is None or only.search(ScenarioKey(**e["scenario"]).label)]
    if not entries:
        parser.error(f"--only {args.only!r}: matches no saved scenario")
    jobs = [(e["scenario"], start, args.trace, args.work) for e in entries
            for start in starts(e["scenario"]["profile"])]
    results: dict[tuple[str, str], dict] = {}
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        for (fields, start, _, _), result in zip(jobs, pool.map(bisect_start, jobs), strict=True):
            label = ScenarioKey(**fields).label
            print(f"{label} / {start.label}: {result['simulations']} simulations in "
                  f"{result['wall_s']:.0f} s", file=sys.stderr)
            results[(label, start.label)] = result
    doc = collect(entries, results)
    doc["provenance"] = {**git_state(REPO), "wall_s": round(time.monotonic() - started),
                         "command": "python -m benchmarks.sim.crosswise_capacity"
                                    + (f" --only '{args.only}'" if args.only else "")}
    text = render(doc)
    print(text)
    write_outputs(args.out, "crosswise_capacity", text, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
