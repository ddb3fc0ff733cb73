"""Benchmark: FairBatching on a GPU its step-model file was not fitted to, against SGLang's
own orders tuned on that GPU.

The device is ``qwen3-32b-h100nvl`` (a decode-only step of ~20 ms, the weights' read, so
a large share of a 50 ms TPOT); FairBatching starts from the shipped H100 file
(``configs/step_models/llama3.1-8b-h100.toml``), as an operator who names no file for
their GPU would, the bundled Azure sample (its own arrivals), one SLO class (TTFT 2 s,
TPOT 50 ms) and the three classes of ``configs/slo.toml`` (a third each). Configurations:

- ``fb-smooth+defer`` (shipped) with the knee learned online, with the knee frozen at the
  file's (the step model as it was before it learned the knee), and with the device's own
  file (``configs/step_models/qwen3-32b-h100nvl.toml``);
- ``fb-steady+defer`` (fb-smooth without Algorithm 1's fallback) from the H100 file;
- SGLang's orders on the Sarathi batch (mixed chunked prefill) with SGLang's waiting
  timeout, each tuned on this device and scenario by the sweep's tuner (token budget
  64-2048 and the timeout): FCFS, shortest-first, ``hrrn``, ``shortest-prefill-first``,
  and with three classes the class priority.

Every figure is requests on time (TTFT and TPOT met) per offered load, overall, per SLO
class and per prompt-length bucket. From the repository root::

    python -m benchmarks.sim.unfamiliar_gpu                 # runs every sweep (about an hour on 2 cores)
    python -m benchmarks.sim.unfamiliar_gpu --from out/ugpu # renders sweeps already run there

Writes ``docs/bench/unfamiliar_gpu.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.support.outputs import write_outputs
from benchmarks.support.paths import DOCS_BENCH, REPO
from sglang_ext.provenance import git_state

DEVICE = "qwen3-32b-h100nvl"
FOREIGN_FILE = REPO / "configs" / "step_models" / "llama3.1-8b-h100.toml"
OWN_FILE = REPO / "configs" / "step_models" / f"{DEVICE}.toml"
RATES = "3,4,5,6,8"
BUDGETS = "64,128,256,512,1024,2048"
SCENARIOS = {
    "one": ("one class (TTFT 2 s, TPOT 50 ms)", ["--ttft-ms", "2000", "--tpot-ms", "50"]),
    "three": ("three classes (interactive 500/50, standard 2000/50, relaxed 5000/200 ms)",
              ["--class-mix", "interactive:0.333,standard:0.334,relaxed:0.333"]),
}
BASELINES = ("sarathi-queue-timeout", "sarathi-sjf-queue-timeout", "sarathi-hrrn-queue-timeout",
             "sarathi-spf-queue-timeout")
PRIORITY = "sarathi-priority-queue-timeout"
#: (run directory suffix, policy, label, extra arguments)
FAIRBATCHING_RUNS = (
    ("learned", "fb-smooth+defer", "fb-smooth+defer, H100 file, knee learned (shipped)",
     ["--step-model", str(FOREIGN_FILE)]),
    ("frozen", "fb-smooth+defer", "fb-smooth+defer, H100 file, knee frozen",
     ["--step-model", str(FOREIGN_FILE), "--frozen-knee"]),
    ("own", "fb-smooth+defer", "fb-smooth+defer, the device's own file",
     ["--step-model", str(OWN_FILE)]),
    ("steady", "fb-steady+defer", "fb-steady+defer, H100 file, knee learned",
     ["--step-model", str(FOREIGN_FILE)]),
)


def sweep_argv(scenario: str, run: str, out: Path) -> list[str]:
    common = ["sweep", "--profile", DEVICE, "--rates", RATES, "--budgets", BUDGETS,
              "--no-progress", *SCENARIOS[scenario][1]]
    suffix, policy, _, extra = next(r for r in FAIRBATCHING_RUNS if r[0] == run)
    argv = [*common, "--policy", policy, *extra, "--out", str(out / f"{scenario}-{run}")]
    if run == "learned":  # the baselines, tuned once per scenario, beside the shipped policy
        baselines = (*BASELINES, PRIORITY) if scenario == "three" else BASELINES
        for name in baselines:
            argv += ["--policy", name]
        argv += ["--retune"]
    return argv


def run_sweeps(out: Path) -> list[str]:
    from sglang_ext.sim.commands import main as sim

    commands = []
    for scenario in SCENARIOS:
        for run, *_ in FAIRBATCHING_RUNS:
            argv = sweep_argv(scenario, run, out)
            commands.append("python -m sglang_ext.sim " + " ".join(argv))
            if sim(argv) != 0:
                raise SystemExit(f"sweep failed: {commands[-1]}")
    return commands


def _point(load: dict) -> dict:
    return {
        "rate": load["rate"], "attainment": load["attainment"],
        "effective_rps": load["effective_rps"],
        "by_slo_class": {k: v["attainment"] for k, v in load["by_slo_class"].items()},
        "by_prompt_tokens": {k: v["attainment"] for k, v in load["by_prompt_tokens"].items()},
        "tpot_p50_ms": load["tpot_ms"]["p50"], "max_tbt_p50_ms": load["max_tbt_ms"]["p50"],
    }


def collect(out: Path) -> dict:
    doc: dict = {"device": DEVICE, "rates": [float(r) for r in RATES.split(",")], "scenarios": {}}
    for scenario, (title, _) in SCENARIOS.items():
        rows = {}
        for run, policy, label, _ in FAIRBATCHING_RUNS:
            results = json.loads((out / f"{scenario}-{run}" / "results.json").read_text())
            rows[label] = {"policy": policy, "loads": [_point(x) for x in results["policies"][policy]["loads"]]}
            if run == "learned":
                for name in (*BASELINES, PRIORITY):
                    entry = results["policies"].get(name)
                    if entry is None:
                        continue
                    best = entry["loads"][0].get("policy") or entry.get("best_of") or name
                    rows[f"{name} (tuned: {best})"] = {
                        "policy": name, "baseline": True,
                        "loads": [_point(x) for x in entry["loads"]],
                    }
        doc["scenarios"][scenario] = {"title": title, "rows": rows}
    return doc


def _best_baseline(rows: dict, index: int) -> tuple[str, float]:
    baselines = [(name, row["loads"][index]["attainment"]) for name, row in rows.items() if row.get("baseline")]
    return max(baselines, key=lambda item: item[1])


def render(doc: dict) -> str:
    lines = [
        "# FairBatching on a GPU its step-model file was not fitted to",
        "",
        f"Device `{doc['device']}` (simulated), FairBatching started from the H100 file; SGLang's "
        "orders tuned on this device. Requests on time (TTFT and TPOT met) at each offered load; "
        "`python -m benchmarks.sim.unfamiliar_gpu`.",
    ]
    for scenario in doc["scenarios"].values():
        rows = scenario["rows"]
        lines += ["", f"## {scenario['title']}", "",
                  "| configuration | " + " | ".join(f"{r:g} req/s" for r in doc["rates"]) + " |",
                  "|---|" + "---|" * len(doc["rates"])]
        for name, row in rows.items():
            cells = [f"{p['attainment']:.3f}" for p in row["loads"]]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        ratios = []
        for index, rate in enumerate(doc["rates"]):
            best_name, best = _best_baseline(rows, index)
            ratios.append(f"{rate:g}: " + ", ".join(
                f"{label.split(',')[0]} {row['loads'][index]['attainment'] / best:.2f}x"
                for label, row in rows.items() if not row.get("baseline") and "frozen" not in label
                and "own file" not in label) + f" (best baseline {best_name.split(' ')[0]})")
        lines += ["", "Against the best tuned baseline at each load: " + "; ".join(ratios) + "."]
        lines += ["", "Who pays, per SLO class and per prompt-length bucket (<512 / 512-1023 / "
                  "1024-2047 / 2048-4095 / >=4096), at each load:", ""]
        lines += who_pays_lines(doc["rates"], {name: row["loads"] for name, row in rows.items()})
    return "\n".join(lines) + "\n"


def who_pays_lines(rates: Sequence[float], rows: dict[str, list[dict]]) -> list[str]:
    """Per load, each row's attainment per SLO class and per prompt-length bucket
    (``rows``: label -> one point per rate, as :func:`_point` keeps them)."""
    lines = []
    for index, rate in enumerate(rates):
        lines.append(f"- {rate:g} req/s:")
        for label, points in rows.items():
            point = points[index]
            classes = ", ".join(f"{k} {v:.2f}" for k, v in point["by_slo_class"].items())
            buckets = " / ".join(f"{v:.2f}" for v in point["by_prompt_tokens"].values())
            lines.append(f"  - {label}: {classes}; {buckets}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", type=Path,
                        help="render sweeps already run in this directory (one-learned, ...)")
    parser.add_argument("--work", type=Path, default=REPO / "out" / "unfamiliar_gpu",
                        help="where the sweeps write (default out/unfamiliar_gpu)")
    parser.add_argument("--out", type=Path, default=DOCS_BENCH)
    args = parser.parse_args(argv)
    started = time.monotonic()
    source = args.source
    commands = [] if source else run_sweeps(args.work)
    doc = collect(source or args.work)
    doc["provenance"] = {**git_state(REPO), "wall_s": round(time.monotonic() - started),
                         "commands": commands or ["(rendered from sweeps already run)"]}
    text = render(doc)
    print(text)
    write_outputs(args.out, "unfamiliar_gpu", text, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
