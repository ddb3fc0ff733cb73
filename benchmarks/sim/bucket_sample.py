"""Benchmark: is a worst-bucket capacity of ``fair_capacity`` decided by a handful of
requests?

``fair_capacity`` runs the H20 on each workload's first 150 s, so its worst prompt-length
bucket holds a few dozen requests (38 prompts >= 4096 tokens in the Azure trace's window,
where 90% on time allows 3 misses). This reruns the worst-bucket capacity at 90% of the
same policies, at the same tuned settings (read from the saved scenario), on a window four
times as long: the bundled sample's whole 600 s, the Azure trace's 1500-2100 s. A ratio
that holds on both windows is a property of the policies; one that moves is noise of the
short one's sample.

Per H20 one-class scenario: the shipped policy, its fair setting, and every tuned-here
baseline family (``sglang-default`` and ``vllm-default``, 2-10x below the others, are
left out), each bisected to ``TOLERANCE`` from its short-window capacity. Trace
arrivals, seed 0, one SLO class, as ``fair_capacity``.

    python -m benchmarks.sim.bucket_sample [--jobs N] [--out DIR]

writes ``docs/bench/bucket_sample.{md,json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from bisect import bisect_right
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchmarks.sim import fair_capacity
from benchmarks.sim.fair_capacity import (
    SECOND_WINDOW_S,
    ScenarioKey,
    build_scenario,
    scenario_file,
)
from benchmarks.support.outputs import write_outputs
from benchmarks.support.paths import DOCS_BENCH, SHARED_AZURE_TRACE
from sglang_ext.provenance import git_state
from sglang_ext.sim import capacity
from sglang_ext.sim.metrics import MIN_GROUP_REQUESTS, PROMPT_TOKEN_EDGES, prompt_bucket_labels
from sglang_ext.sim.policy_spec import parse_policy
from sglang_ext.sim.runner import Scenario, simulate
from sglang_ext.sim.workloads import Workload, bundled_sample, load_workload

PROFILE = "qwen3-14b-h20"
KEYS = (ScenarioKey("bundled", PROFILE, "one class"), ScenarioKey("azure-1500s", PROFILE, "one class"))
LONG_HEAD_S = 600.0
TARGET = 0.9
MEASURE = "worst_prompt_bucket"
TOLERANCE = 0.05
FAIRBATCHING = fair_capacity.FAIRBATCHING[:2]  # the shipped policy and its fair setting
UNTUNED = fair_capacity.UNTUNED_BASELINES


@dataclass(frozen=True)
class Task:
    key: ScenarioKey
    label: str
    start: float


def long_workload(key: ScenarioKey, trace: Path) -> Workload:
    if key.workload == "bundled":
        return bundled_sample().head(LONG_HEAD_S)
    return load_workload(trace, "azure").skip(SECOND_WINDOW_S).head(LONG_HEAD_S)


def long_scenario(key: ScenarioKey, trace: Path) -> Scenario:
    return dataclasses.replace(build_scenario(key, trace), workload=long_workload(key, trace))


def bucket_sizes(workload: Workload) -> dict[str, int]:
    """Requests per prompt-length bucket, bucketed as ``by_prompt_tokens`` is."""
    labels = prompt_bucket_labels()
    counts = Counter(labels[bisect_right(PROMPT_TOKEN_EDGES, request.prompt_tokens)]
                     for request in workload.requests)
    return {label: counts[label] for label in labels}


def run_task(task: Task, trace: Path) -> dict:
    scenario = long_scenario(task.key, trace)
    spec = parse_policy(task.label)
    began = time.monotonic()
    search = capacity.bisect_capacity(
        lambda rate: simulate(scenario, spec, rate).load, targets=(TARGET,),
        measures=(MEASURE,), start=task.start, tolerance=TOLERANCE,
    )
    entry = search.capacity[capacity.target_key(TARGET)][MEASURE]
    return {"scenario": task.key.label, "label": task.label, "long": entry,
            "simulations": search.simulations, "wall_s": time.monotonic() - began}


def short_results(key: ScenarioKey, out: Path) -> tuple[list[str], dict[str, dict]]:
    """The policies to rerun and their saved short-window worst-bucket capacity at 90%."""
    saved = json.loads(scenario_file(out, key).read_text())
    labels = [*FAIRBATCHING, *(label for label in saved["labels"]["tuned here"]
                               if label not in UNTUNED)]
    key_90 = capacity.target_key(TARGET)
    return labels, {label: saved["capacity"][label]["capacity"][key_90][MEASURE]
                    for label in labels}


def best_baseline(rows: dict[str, float | None]) -> float:
    """The highest capacity of the baselines among ``rows`` (0 when none met the target)."""
    return max(value or 0.0 for label, value in rows.items() if label not in FAIRBATCHING)


def render(document: dict) -> str:
    lines = [
        "# Worst-bucket capacity on a window four times as long (the H20, one class)",
        "",
        (f"`python -m benchmarks.sim.bucket_sample` (commit {document['commit']}, "
         f"{document['date']}, {document['wall_s']:.0f} s of wall). Capacity at 90% in the "
         f"worst prompt-length bucket (groups of >= {MIN_GROUP_REQUESTS} requests), bisected "
         f"to {TOLERANCE:.0%}, at the tuned settings of `fair_capacity`'s scenario; short: "
         "its saved figure on the first 150 s; long: the same policy on the first 600 s "
         "(bundled sample) or 1500-2100 s (Azure trace). Ratios: over the best baseline "
         "of the same window."),
        "",
    ]
    for scenario in document["scenarios"]:
        lines += [
            f"## {scenario['scenario']}", "",
            "Requests per prompt-length bucket, short / long window: "
            + ", ".join(f"{label} {scenario['short_sizes'][label]} / {count}"
                        for label, count in scenario["long_sizes"].items()) + ".",
            "",
            ("| policy | short: cap90 worst bucket (bucket) | vs best | long: cap90 worst "
             "bucket (bucket) | vs best | probes |"),
            "|---|---|---|---|---|---|",
        ]
        for row in scenario["rows"]:
            lines.append(
                f"| `{row['label']}` | {_cell(row['short'])} | {_ratio(row['short_ratio'])} "
                f"| {_cell(row['long'])} | {_ratio(row['long_ratio'])} | {row['simulations']} |")
        lines.append("")
    return "\n".join(lines)


def _cell(entry: dict) -> str:
    value = capacity.capacity_text(entry)
    bucket = entry.get("worst_at_next_fail")
    return f"{value} ({bucket})" if bucket else value


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def assemble(keys, trace: Path, out: Path, results: list[dict]) -> list[dict]:
    scenarios = []
    for key in keys:
        labels, short = short_results(key, out)
        long = {r["label"]: r for r in results if r["scenario"] == key.label}
        short_best = best_baseline({label: short[label]["capacity"] for label in labels})
        long_best = best_baseline({label: long[label]["long"]["capacity"] for label in labels})
        rows = []
        for label in labels:
            short_value = short[label]["capacity"]
            long_value = long[label]["long"]["capacity"]
            rows.append({
                "label": label, "short": short[label], "long": long[label]["long"],
                "short_ratio": short_value / short_best if short_value and short_best else None,
                "long_ratio": long_value / long_best if long_value and long_best else None,
                "simulations": long[label]["simulations"], "wall_s": long[label]["wall_s"],
            })
        scenarios.append({
            "scenario": key.label,
            "short_sizes": bucket_sizes(build_scenario(key, trace).workload),
            "long_sizes": bucket_sizes(long_workload(key, trace)), "rows": rows,
        })
    return scenarios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=SHARED_AZURE_TRACE)
    parser.add_argument("--jobs", type=int, default=1, help="simulations run at once")
    parser.add_argument("--saved", type=Path, default=DOCS_BENCH,
                        help="where fair_capacity's scenarios are saved")
    parser.add_argument("--out", type=Path, default=DOCS_BENCH)
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    if not args.trace.is_file():
        parser.error(f"--trace {args.trace}: not found (the shared one-hour Azure trace)")
    tasks = []
    for key in KEYS:
        try:
            labels, short = short_results(key, args.saved)
        except (OSError, KeyError, ValueError) as exc:
            parser.error(f"no saved fair_capacity scenario for {key.label}: {exc}")
        tasks += [Task(key, label, short[label]["capacity"] or short[label]["next_fail"])
                  for label in labels]
    began = time.monotonic()
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_task, task, args.trace) for task in tasks]
        results = []
        for future in futures:
            result = future.result()
            print(f"{result['scenario']}: {result['label']} "
                  f"{capacity.capacity_text(result['long'])} ({result['wall_s']:.0f} s)",
                  file=sys.stderr)
            results.append(result)
    document = {
        "commit": git_state()["commit"], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "wall_s": time.monotonic() - began, "target": TARGET, "tolerance": TOLERANCE,
        "long_head_s": LONG_HEAD_S,
        "scenarios": assemble(KEYS, args.trace, args.saved, results),
    }
    text = render(document)
    print(text)
    write_outputs(args.out, "bucket_sample", text, document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
