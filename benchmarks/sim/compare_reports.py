"""Side by side: the same report sweep run with different GPUs or step models.

    python -m benchmarks.sim.compare_reports \\
        --run "measured GPU, linear=docs/report/measured/linear/results/llama3.1-8b-h100-measured" \\
        --run "measured GPU, knee=docs/report/measured/knee/results/llama3.1-8b-h100-measured" \\
        --out docs/report/measured/README.md

Each ``--run LABEL=DIR`` names a folder holding one ``results.json`` (as
``scripts/report.sh`` writes under ``results/<profile>/``).  The tables: every policy's
peak effective RPS and its effective RPS at the highest load; the ratio of the two headline
FairBatching policies to the best baseline; and, for the margin policies, the mean margin
(the budget is divided by 1 + margin) and the online step model's mean error at each load.
Every number is read from the files; the markdown goes to ``--out`` and stdout.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.sim.report_baselines import NO_ADMISSION
from sglang_ext.sim.sweep import BASELINES, best_baseline, display_label, peak_text

HEADLINE = ("fb-anchor-margin", "fb-anchor-margin-pab", "fb-anchor-margin+reject")
MARGIN_POLICIES = ("fb-margin", "fb-anchor-margin", "fb-anchor-margin-pab", "fb-anchor-margin+reject")


def parse_run(text: str) -> tuple[str, Path]:
    label, sep, folder = text.rpartition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"expected LABEL=DIR, got {text!r}")
    path = Path(folder) / "results.json"
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{path}: no results.json there")
    return label, Path(folder)


def load(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def at_load(entry: dict, rate: float) -> dict | None:
    return next((point for point in entry["loads"] if point["rate"] == rate), None)


def peaks_table(runs: dict[str, dict]) -> list[str]:
    labels = list(runs)
    names = [n for n in next(iter(runs.values()))["requested"] if all(n in d["policies"] for d in runs.values())]
    top = {label: max(d["rates"]) for label, d in runs.items()}
    head = ["policy"] + [f"{label}: peak" for label in labels] + [
        f"{label}: at {top[label]:g} req/s" for label in labels]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name in names:
        cells = [f"`{name}`"]
        cells += [f"{peak_text(runs[label]['policies'][name])}"
                  + _setting(runs[label]["policies"][name]) for label in labels]
        cells += [f"{at_load(runs[label]['policies'][name], top[label])['effective_rps']:.2f}"
                  for label in labels]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _setting(entry: dict) -> str:
    shown = display_label("", entry).strip()
    return f" {shown}" if shown else ""


def ratios_table(runs: dict[str, dict]) -> list[str]:
    lines = ["| run | best baseline at the highest load | " + " | ".join(
        f"`{n}` / it" for n in HEADLINE) + " | best without admission (peak) | "
        "`fb-anchor-margin` / it (peak) |", "|---|---|" + "---:|" * (len(HEADLINE) + 2)]
    for label, document in runs.items():
        policies, top = document["policies"], max(document["rates"])
        at_top = {n: at_load(e, top)["effective_rps"] for n, e in policies.items()}
        base = max((n for n in BASELINES if n in policies), key=lambda n: at_top[n])
        cells = [label, f"{display_label(base, policies[base])} {at_top[base]:.2f}"]
        cells += [f"{at_top[n] / at_top[base]:.2f}x" if n in policies else "—" for n in HEADLINE]
        found = best_baseline({n: e for n, e in policies.items() if n in NO_ADMISSION})
        if found is None or "fb-anchor-margin" not in policies:
            cells += ["—", "—"]
        else:
            name, entry = found
            mine = policies["fb-anchor-margin"]
            ratio = (f"{mine['peak_effective_rps'] / entry['peak_effective_rps']:.2f}x"
                     if not (mine.get("peak_at_highest_load") or entry.get("peak_at_highest_load"))
                     else "n/a (>=)")
            cells += [f"{display_label(name, entry)} {peak_text(entry)}", ratio]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def margin_table(runs: dict[str, dict]) -> list[str]:
    rates = sorted({r for d in runs.values() for r in d["rates"]})
    lines = ["| policy | run | " + " | ".join(f"{r:g}" for r in rates) + " |",
             "|---|---|" + "---:|" * len(rates)]
    for name in MARGIN_POLICIES:
        for label, document in runs.items():
            entry = document["policies"].get(name)
            if entry is None:
                continue
            cells = []
            for rate in rates:
                point = at_load(entry, rate)
                if point is None:
                    cells.append("")
                    continue
                margin = point.get("mean_margin")
                margin_text = f"{margin:.1%}" if margin is not None else "—"
                cells.append(f"{margin_text} / {point['step_model_mean_abs_rel_error']:.1%}")
            lines.append(f"| `{name}` | {label} | " + " | ".join(cells) + " |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", type=parse_run, required=True,
                        help="LABEL=DIR with DIR/results.json, repeatable (at least two)")
    parser.add_argument("--out", type=Path, help="markdown file to write")
    parser.add_argument("--title", default="The report's main table, side by side")
    args = parser.parse_args(argv)
    if len(args.run) < 2:
        parser.error("--run at least twice")
    runs = {label: load(folder) for label, folder in args.run}
    command = shlex.join(["python", "-m", "benchmarks.sim.compare_reports",
                          *(sys.argv[1:] if argv is None else argv)])
    lines = [
        f"# {args.title}", "",
        "Runs: " + "; ".join(
            f"**{label}**: profile `{d['scenario']['profile']}`, initial step model "
            f"`{d['scenario'].get('step_model', 'linear')}`, {d['scenario']['requests']} requests, "
            f"seed {d['scenario']['seed']}" for label, d in runs.items()) + ".",
        "",
        "## Peak effective RPS, and effective RPS at the highest load", "",
        "`>=`: the peak is at the highest load tried (a lower bound). Tuned families show their "
        "best setting.", "",
        *peaks_table(runs), "",
        "## Against the best baseline", "",
        "At the highest load (where the admission-controlled policies plateau), and at the "
        "peak among the baselines without admission control.", "",
        *ratios_table(runs), "",
        "## The margin", "",
        "Per offered load (req/s): the mean margin over the run's steps (the time budget is "
        "divided by 1 + margin; the margin is the p95 of the last 256 relative step-time "
        "errors, at most 50%) / the online step model's mean absolute relative error. `—`: "
        "the run predates the margin's record.", "",
        *margin_table(runs), "",
        f"Regenerate: `{command}`", "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
