"""Benchmark: capacity on a GPU the step-model file was not fitted to, bisected.

Same device (``qwen3-32b-h100nvl``), trace, starting file (the H100's) and SLO scenarios as
``benchmarks.sim.unfamiliar_gpu``. For each of seeds 0, 1 and 2, with the trace's own
arrivals and with gamma:4 arrivals, ``python -m sglang_ext.sim capacity`` bisects the
offered load to each configuration's capacity: the highest load at which 90% of requests
meet their SLO overall, in the worst prompt-length bucket and in the worst SLO class
(groups of at least 20 requests), with the three SLO classes. Configurations: the
shipped ``fb-smooth+defer`` and ``fb-steady+defer``, from the H100 file with the knee
learned, each also with the start-up calibration (``--calibrate``), and SGLang's orders on the Sarathi batch with SGLang's waiting timeout, each
tuned for capacity first.

The tuning: ``benchmarks.sim.unfamiliar_gpu`` tuned each order's token budget and timeout
for attainment at 3-8 req/s, past this device's capacity. Capacity sits lower, where a
smaller chunk may keep a 50 ms TPOT better and a longer timeout drops fewer requests. So
each order also runs at token budgets 128, 256 and 512, at its tuned timeout, four and
sixteen times it, on a grid of loads (seed 0, the trace's arrivals); the setting with the
highest worst-class capacity on that grid (then overall, then mean attainment) is the one
bisected, and one at the edge of either axis is marked.

Each ratio divides by the best SGLang order's capacity by the same measure, seed and
arrivals. From the repository root::

    python -m benchmarks.sim.unfamiliar_gpu_capacity              # the tuning and every bisection (about an hour on 2 cores)
    python -m benchmarks.sim.unfamiliar_gpu_capacity --from out/ugpu_capacity

Writes ``docs/bench/unfamiliar_gpu_capacity.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from statistics import mean

from benchmarks.sim.unfamiliar_gpu import DEVICE, FOREIGN_FILE, SCENARIOS
from benchmarks.sim.unfamiliar_gpu_seeds import ARRIVALS, SEEDS, TUNED_FROM, run_name, run_once
from benchmarks.support.outputs import write_outputs
from benchmarks.support.paths import DOCS_BENCH, REPO
from sglang_ext.provenance import git_state

TARGET = "0.9"
SCENARIO = "three"
TUNE_RATES = "0.5,1,1.5,2,2.5,3,4"
TUNE_BUDGETS = (128, 256, 512)
TUNE_TIMEOUT_FACTORS = (1.0, 4.0, 16.0)
MEASURES = {"overall": "overall", "worst_prompt_bucket": "worst bucket",
            "worst_slo_class": "worst class"}
FAIRBATCHING = {"fb-smooth+defer": "fb-smooth+defer (shipped)", "fb-steady+defer": "fb-steady+defer"}
#: bisected again with the start-up calibration (``--calibrate``), each condition its own run
CALIBRATED = {"fb-smooth+defer": "fb-smooth+defer (shipped), calibrated at start-up",
              "fb-steady+defer": "fb-steady+defer, calibrated at start-up"}
#: the bisection's range and resolution, req/s (the device serves about 4 req/s at 90%)
START, MIN_RATE, MAX_RATE, TOLERANCE = "3", "0.25", "32", "0.05"


def attainment_tuned(tuned_from: Path) -> dict[str, str]:
    """``{family: spec}`` as ``benchmarks.sim.unfamiliar_gpu`` tuned them for attainment."""
    doc = json.loads(tuned_from.read_text())
    return {row["policy"]: re.search(r"tuned: ([^)]+)\)", label).group(1)
            for label, row in doc["scenarios"][SCENARIO]["rows"].items() if row.get("baseline")}


def candidates(spec: str) -> list[str]:
    """The settings tried for capacity around an attainment-tuned ``spec``."""
    base, _, settings = spec.partition("@")
    timeout = float(dict(p.partition("=")[::2] for p in settings.split(",") if "=" in p)["timeout"])
    return [f"{base}@{budget},timeout={timeout * factor:.4g}"
            for budget in TUNE_BUDGETS for factor in TUNE_TIMEOUT_FACTORS]


def run_tuning(work: Path, tuned: dict[str, str], jobs: int) -> tuple[list[str], dict]:
    """The grid sweep of every candidate not yet swept in ``work/tuning*``; ``(commands,
    {family: {"chosen", "tried", "edge"}})`` over all of them."""
    swept = _tuning_results(work)
    wanted = [c for spec in tuned.values() for c in candidates(spec)]
    missing = [c for c in wanted if c not in swept]
    commands: list[str] = []
    if missing:
        common = ["sweep", "--profile", DEVICE, "--rates", TUNE_RATES, "--no-progress",
                  "--step-model", str(FOREIGN_FILE), "--seed", "0", "--jobs", str(jobs),
                  *SCENARIOS[SCENARIO][1]]
        run_once(common, work / f"tuning-{len(list(work.glob('tuning*')))}", missing, commands)
        swept = _tuning_results(work)
    return commands, choose(swept, tuned)


def _tuning_results(work: Path) -> dict:
    """Every candidate's results.json entry from ``work/tuning*`` (later sweeps win)."""
    entries: dict = {}
    for path in sorted(work.glob("tuning*/results.json")):
        entries.update(json.loads(path.read_text())["policies"])
    return entries


def choose(entries: dict, tuned: dict[str, str]) -> dict:
    """Each family's candidate with the highest grid capacity in the worst class, then
    overall, then mean attainment; ``edge`` when it sits at a bound of either axis."""
    choice = {}
    for family, spec in tuned.items():
        tried = {}
        listed = candidates(spec)
        for candidate in listed:
            entry = entries[candidate]
            grid = entry["capacity"][TARGET]
            tried[candidate] = (grid["worst_slo_class"].get("capacity") or 0.0,
                                grid["overall"].get("capacity") or 0.0,
                                mean(load["attainment"] for load in entry["loads"]))
        chosen = max(tried, key=tried.get)
        index = listed.index(chosen)
        budget, factor = divmod(index, len(TUNE_TIMEOUT_FACTORS))
        edge = [axis for axis, at, size in (("budget", budget, len(TUNE_BUDGETS)),
                                            ("timeout", factor, len(TUNE_TIMEOUT_FACTORS)))
                if at in (0, size - 1)]
        choice[family] = {"chosen": chosen, "tried": {k: list(v) for k, v in tried.items()},
                          "edge": edge}
    return choice


def run_bisections(work: Path, baselines: dict[str, str], jobs: int,
                   arrival_processes: Sequence[str] = tuple(ARRIVALS)) -> list[str]:
    commands: list[str] = []
    for scenario in (SCENARIO,):
        for arrivals in arrival_processes:
            for seed in SEEDS:
                name = run_name(scenario, arrivals, seed)
                common = ["capacity", "--profile", DEVICE, "--target", TARGET, "--start", START,
                          "--min-rate", MIN_RATE, "--max-rate", MAX_RATE, "--tolerance", TOLERANCE,
                          "--step-model", str(FOREIGN_FILE), "--seed", str(seed),
                          "--arrivals", arrivals, "--jobs", str(jobs), *SCENARIOS[scenario][1]]
                run_once(common, work / name, [*FAIRBATCHING, *baselines.values()], commands)
                run_once([*common, "--calibrate"], work / f"{name}-cal", list(CALIBRATED), commands)
    return commands


def collect(work: Path, baselines: dict[str, str],
            arrival_processes: Sequence[str] = tuple(ARRIVALS)) -> dict:
    doc: dict = {"device": DEVICE, "seeds": list(SEEDS), "target": float(TARGET), "scenarios": {}}
    for scenario in (SCENARIO,):
        title = SCENARIOS[scenario][0]
        conditions = {}
        for arrivals in arrival_processes:
            seeds = []
            for seed in SEEDS:
                name = run_name(scenario, arrivals, seed)
                capacities = {}
                for run, named in (
                    (name, [*((label, spec) for spec, label in FAIRBATCHING.items()), *baselines.items()]),
                    (f"{name}-cal", [(label, spec) for spec, label in CALIBRATED.items()]),
                ):
                    policies = json.loads((work / run / "results.json").read_text())["policies"]
                    for label, spec in named:
                        entry = policies[spec]["capacity"][TARGET]
                        capacities[label] = {m: entry[m].get("capacity") for m in MEASURES}
                seeds.append(capacities)
            conditions[arrivals] = _summarise(seeds, list(baselines))
        doc["scenarios"][scenario] = {"title": title, "conditions": conditions}
    return doc


def _summarise(seeds: list[dict], families: list[str]) -> dict:
    """Per configuration and measure: each seed's capacity (None: below the range) and its
    ratio to that seed's best SGLang order."""
    rows = {}
    for label in seeds[0]:
        rows[label] = {}
        for measure in MEASURES:
            values = [s[label][measure] for s in seeds]
            best = [max((s[f][measure] or 0.0) for f in families) for s in seeds]
            ratios = [v / b if v is not None and b > 0 else None for v, b in zip(values, best)]
            known = [r for r in ratios if r is not None]
            rows[label][measure] = {
                "by_seed": values, "best_baseline_by_seed": best, "ratio_by_seed": ratios,
                "mean": mean(v for v in values if v is not None) if any(v is not None for v in values) else None,
                "worst_ratio": min(known) if known and len(known) == len(ratios) else None,
                "mean_ratio": mean(known) if known and len(known) == len(ratios) else None,
            }
    return {"rows": rows, "baselines": families}


def _cell(entry: dict, baseline: bool) -> str:
    values = " / ".join("<" + MIN_RATE if v is None else f"{v:.2f}" for v in entry["by_seed"])
    if baseline or entry["mean_ratio"] is None:
        return values
    return f"{values} ({entry['mean_ratio']:.2f}x, worst seed {entry['worst_ratio']:.2f}x)"


def render(doc: dict) -> str:
    lines = [
        "# Capacity on a GPU the step-model file was not fitted to",
        "",
        f"Device `{doc['device']}` (simulated), FairBatching from the H100 file (knee learned); "
        "SGLang's orders tuned for capacity on this device (below). "
        f"Capacity at {doc['target']:.0%} (req/s, bisected to {float(TOLERANCE):.0%}) for seeds "
        f"{' / '.join(map(str, doc['seeds']))}; the ratio is the mean over seeds of each seed's "
        "capacity over the best SGLang order's by the same measure. "
        "`python -m benchmarks.sim.unfamiliar_gpu_capacity`.",
    ]
    lines += ["", "SGLang's orders as tuned for capacity (grid of "
              f"{doc['tuning']['rates']} req/s; worst-class / overall grid capacity):", ""]
    for family, entry in doc["tuning"]["families"].items():
        worst, overall, _ = entry["tried"][entry["chosen"]]
        edge = f"; at the edge of the {' and '.join(entry['edge'])} axis" if entry["edge"] else ""
        lines.append(f"- {family}: `{entry['chosen']}` ({worst:g} / {overall:g}{edge})")
    for scenario in doc["scenarios"].values():
        for arrivals, condition in scenario["conditions"].items():
            lines += ["", f"## {scenario['title']}, {ARRIVALS[arrivals]}", "",
                      "| configuration | " + " | ".join(MEASURES.values()) + " |",
                      "|---|" + "---|" * len(MEASURES)]
            for label, row in condition["rows"].items():
                baseline = label in condition["baselines"]
                lines.append(f"| {label} | " + " | ".join(_cell(row[m], baseline) for m in MEASURES) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", type=Path,
                        help="render the tuning and bisections already run here")
    parser.add_argument("--work", type=Path, default=REPO / "out" / "unfamiliar_gpu_capacity")
    parser.add_argument("--tuned-from", type=Path, default=TUNED_FROM)
    parser.add_argument("--jobs", type=int, default=2, help="policies bisected at once")
    parser.add_argument("--arrivals", default=",".join(ARRIVALS),
                        help=f"arrival processes, comma-separated (default {','.join(ARRIVALS)})")
    parser.add_argument("--out", type=Path, default=DOCS_BENCH)
    args = parser.parse_args(argv)
    arrival_processes = [a for a in args.arrivals.split(",") if a]
    unknown = set(arrival_processes) - set(ARRIVALS)
    if unknown or not arrival_processes:
        parser.error(f"--arrivals takes some of {', '.join(ARRIVALS)}")
    started = time.monotonic()
    work = args.source or args.work
    commands, tuning = run_tuning(work, attainment_tuned(args.tuned_from), args.jobs)
    baselines = {family: entry["chosen"] for family, entry in tuning.items()}
    if not args.source:
        commands += run_bisections(work, baselines, args.jobs, arrival_processes)
    doc = collect(work, baselines, arrival_processes)
    doc["tuning"] = {"rates": TUNE_RATES, "families": tuning}
    doc["provenance"] = {**git_state(REPO), "wall_s": round(time.monotonic() - started),
                         "commands": commands or ["(rendered from bisections already run)"]}
    text = render(doc)
    print(text)
    write_outputs(args.out, "unfamiliar_gpu_capacity", text, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
