#!/usr/bin/env python
"""Regenerate the single-node report: the FairBatching paper's Tables 3-5 and Figure 7
in the simulator, plus the policies that go beyond the paper.

    scripts/report.sh                      # the committed (reduced) report, both cores
    scripts/report.sh --full               # the full grid (see --help for its size)
    scripts/report.sh --seed-systems       # only the seed systems' section (seed_systems.md)

Writes ``OUT/report.md`` with the tables, ``OUT/*.png`` and ``OUT/results/*.json``
(one ``results.json``-shaped document per sweep). Every number in the report is read
from those sweeps; nothing is typed in by hand.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tqdm import tqdm

from benchmarks.sim.report_baselines import best_without_admission
from benchmarks.sim.seed_systems import SETTINGS as SEED_SETTINGS
from benchmarks.sim.seed_systems import run_section as run_seed_systems
from benchmarks.support.paths import REPO, SHARED_AZURE_TRACE, relative
from sglang_ext.policy.slo import Slo, SloCatalog
from sglang_ext.policy.step_model import STEP_FORMS
from sglang_ext.sim.plots import plot_effective_rps, plot_latency_cdfs
from sglang_ext.sim.profile import bundled_profile_path, load_profile
from sglang_ext.sim.runner import Scenario
from sglang_ext.sim.sweep import (
    BASELINES,
    display_label,
    peak_text,
    plan_sweep,
    ratio_text,
    run_sweep,
    write_results,
)
from sglang_ext.sim.sweep import best_baseline as _best_baseline
from sglang_ext.sim.workloads import Workload, bundled_sample, load_workload

PAPER_POLICIES = ("fb-fb", "fb-tb", "fb", "fb-pab")
BEYOND = ("fb-anchor", "fb-margin", "fb-kairos", "fb-anchor-margin", "fb-anchor-margin-pab",
          "fb-anchor-margin+reject")
BREAKDOWN = ("sarathi", "sglang-default", "fb-fb", "fb-tb", "fb", "fb-pab")
ADMISSION = ("fb-anchor-margin-pab", "fb-anchor-margin+reject")
GRID_POLICIES = (*BASELINES, "fb", "fb-pab", "fb-anchor-margin", *ADMISSION)
GRID_TTFT_MS = (500, 1000, 1500, 2000)
GRID_TPOT_MS = (50, 100, 150, 200)
MAIN_SLO_MS = (2000, 50)  # the paper's Azure setting (Table 2)


@dataclass(frozen=True)
class Setting:
    """One reduced/full choice of sizes, per profile."""

    head_s: float
    rates: tuple[float, ...]


REDUCED = {
    "llama3.1-8b-h100": Setting(300, (4, 8, 12, 14, 16, 18, 20, 22, 24, 28, 32, 36, 40)),
    "llama3.1-8b-h100-measured": Setting(300, (4, 8, 12, 14, 16, 18, 20, 22, 24, 28, 32, 36, 40)),
    "qwen3-14b-h20": Setting(120, (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0)),
}
FULL = {
    "llama3.1-8b-h100": Setting(900, (4, 6, 8, 10, 12, 13, 14, 15, 16, 17, 18, 19, 20, 22, 24, 28, 32)),
    "llama3.1-8b-h100-measured": Setting(900, (4, 6, 8, 10, 12, 13, 14, 15, 16, 17, 18, 19, 20, 22, 24, 28, 32)),
    "qwen3-14b-h20": Setting(600, (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5)),
}
DEFAULT_PROFILES = ("llama3.1-8b-h100", "qwen3-14b-h20")
GRID_REDUCED = Setting(180, (2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 24, 28, 32, 36, 40))
GRID_FULL = Setting(600, (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 22, 24, 26, 28, 32, 36))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=SHARED_AZURE_TRACE,
                        help="Azure conversation trace CSV (default: the shared copy; "
                        "falls back to the bundled 600 s sample if absent)")
    parser.add_argument("--profiles", nargs="+", default=list(DEFAULT_PROFILES), choices=list(REDUCED),
                        help="profiles for Tables 3-4 and Figure 7 (default: "
                        + " ".join(DEFAULT_PROFILES) + ")")
    parser.add_argument("--step-form", choices=STEP_FORMS, default="knee",
                        help="form of the policies' initial step model, fitted offline on each "
                        "profile (fb, fb-pab and fb-tb keep the paper's linear model whatever "
                        "the form; default knee)")
    parser.add_argument("--grid-profile", default="llama3.1-8b-h100", help="profile of the SLO grid")
    parser.add_argument("--full", action="store_true", help="longer trace heads and finer rates")
    parser.add_argument("--no-grid", action="store_true", help="skip Table 5")
    parser.add_argument("--seed-systems", action="store_true",
                        help="run only the seed systems' section (Kairos, SLO-aware annealing, "
                        "the batching study's policies beside FairBatching and the baselines) "
                        "into OUT/seed_systems.md; --profiles picks its profiles")
    parser.add_argument("--from-results", action="store_true",
                        help="simulate nothing: rewrite OUT/report.md from OUT/results/ (the "
                        "figures are left as they are)")
    parser.add_argument("--grid-ttft-ms", type=int, nargs="+", default=list(GRID_TTFT_MS),
                        help="TTFT targets of the SLO grid (Table 5)")
    parser.add_argument("--grid-tpot-ms", type=int, nargs="+", default=list(GRID_TPOT_MS),
                        help="TPOT targets of the SLO grid (Table 5)")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes (default: all cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "report")
    return parser.parse_args(argv)


def load_trace(path: Path) -> tuple[Workload, str]:
    if path.is_file():
        return load_workload(path, "azure"), f"`{path.name}` (Azure LLM inference trace 2023, conversation)"
    return bundled_sample(), "the bundled 600 s sample of the Azure conversation trace (shared trace not found)"


def slo_catalog(ttft_ms: float, tpot_ms: float) -> SloCatalog:
    return SloCatalog.single(Slo.from_ms(ttft_ms, tpot_ms), "report")


def sweep(scenario: Scenario, policies: Sequence[str], rates: Sequence[float], jobs, bar) -> tuple[dict, dict]:
    plan = plan_sweep(policies)
    cdf_rate = rates[len(rates) // 2]

    def planned(n: int) -> None:
        bar.total += n
        bar.refresh()

    return run_sweep(scenario, plan, rates, cdf_rate=cdf_rate, jobs=jobs, progress=bar.update,
                     planned=planned)


def best_baseline(policies: dict) -> tuple[str, dict]:
    found = _best_baseline(policies)
    assert found is not None
    return found


def at_rate(entry: dict, rate: float) -> dict:
    return next(load for load in entry["loads"] if load["rate"] == rate)


def knee_rate(document: dict) -> float:
    """The best baseline's peak load: where the baselines start to break down."""
    name, _ = best_baseline(document["policies"])
    return document["policies"][name]["peak_rate"]


label = display_label


def peak(entry: dict, rates: Sequence[float]) -> str:  # noqa: ARG001
    return peak_text(entry)


def table3(document: dict) -> list[str]:
    policies = document["policies"]
    base_name, base = best_baseline(policies)
    top = max(document["rates"])
    best_at_top = max(at_rate(policies[n], top)["effective_rps"] for n in BASELINES)
    lines = [f"| policy | peak effective RPS | at offered load | vs best baseline | at {top:g} req/s "
             f"| vs best baseline at {top:g} |", "|---|---:|---:|---:|---:|---:|"]
    for name in (*BASELINES, *PAPER_POLICIES, *BEYOND):
        entry = policies[name]
        value_at_top = at_rate(entry, top)["effective_rps"]
        lines.append(
            f"| {label(name, entry)} | {peak(entry, document['rates'])} | {entry['peak_rate']:g} "
            f"| {ratio_text(entry, base)} | {value_at_top:.2f} | {_ratio(value_at_top, best_at_top)} |"
        )
    lines.append("")
    lines.append(
        f"Best baseline: **{label(base_name, base)}**. "
        + ", ".join(f"`{n}` / best baseline = **{ratio_text(policies[n], base)}**"
                    for n in ("fb", "fb-pab", "fb-anchor-margin", *ADMISSION))
        + ". Among the baselines without admission control the best is "
        f"**{label(*best_without_admission(policies))}**: "
        + ", ".join(f"`{n}` / it = **{ratio_text(policies[n], best_without_admission(policies)[1])}**"
                    for n in ("fb", "fb-anchor-margin"))
        + ". A `>=` peak was reached at the highest load tried: a lower bound, never used for "
        "a ratio (`n/a (>=)`); admission-controlled policies plateau rather than collapse, "
        "so the last two columns compare every policy at the highest load against the best "
        "baseline there. `[edge: X]`: the tuned best sits at a bound of axis X."
    )
    return lines


def table4(document: dict) -> list[str]:
    rate = knee_rate(document)
    lines = [
        f"At {rate:g} req/s (the best baseline's peak):",
        "",
        "| policy | attainment | TTFT p50 | p95 | p99 | TPOT p50 | p95 | p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in (*BASELINES, *PAPER_POLICIES, *BEYOND):
        entry = document["policies"][name]
        load = at_rate(entry, rate)
        ttft, tpot = load["ttft_ms"], load["tpot_ms"]
        cells = " | ".join(_ms(x) for x in (ttft["p50"], ttft["p95"], ttft["p99"], tpot["p50"], tpot["p95"], tpot["p99"]))
        lines.append(f"| {label(name, entry)} | {load['attainment']:.3f} | {cells} |")
    lines.append("")
    lines.append("TTFT and TPOT in ms; TPOT is each request's max over j >= 1 of (t_j - t_0)/j.")
    return lines


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base > 0 else "n/a"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def plot_breakdown(documents: dict[str, dict], path: Path) -> None:
    names = (*BREAKDOWN, "vllm-default", *ADMISSION, *BEYOND)
    fig, axes = plt.subplots(1, len(documents), figsize=(6.5 * len(documents), 4.2), squeeze=False)
    for ax, (profile, document) in zip(axes[0], documents.items()):
        values = [document["policies"][n]["peak_effective_rps"] for n in names]
        colors = (["#4c72b0"] * len(BREAKDOWN) + ["#8c8c8c"] * (1 + len(ADMISSION))
                  + ["#dd8452"] * len(BEYOND))
        ax.bar(range(len(names)), values, color=colors)
        ax.set_xticks(range(len(names)), [label(n, document["policies"][n]) for n in names],
                      rotation=40, ha="right", fontsize=8)
        ax.set_ylabel("peak effective RPS")
        ax.set_title(profile)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Figure 7-style breakdown (blue: the paper's sequence; orange: beyond the paper)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table5(grid: dict[tuple[int, int], dict]) -> list[str]:
    ttfts = sorted({ttft for ttft, _ in grid})
    tpots = sorted({tpot for _, tpot in grid})
    lines = []
    for name in ("fb", "fb-pab", "fb-anchor-margin", *ADMISSION):
        lines += [f"**{name}** peak effective RPS vs the best baseline (max of "
                  + ", ".join(BASELINES) + ", each tuned):", "",
                  "| TTFT \\ TPOT | " + " | ".join(f"{t} ms" for t in tpots) + " |",
                  "|---|" + "---:|" * len(tpots)]
        for ttft in ttfts:
            cells = []
            for tpot in tpots:
                document = grid[(ttft, tpot)]
                policies = document["policies"]
                _, base = best_baseline(policies)
                entry = policies[name]
                if entry.get("peak_at_highest_load") or base.get("peak_at_highest_load"):
                    top = max(document["rates"])
                    ours = at_rate(entry, top)["effective_rps"]
                    theirs = max(at_rate(policies[n], top)["effective_rps"] for n in BASELINES)
                    cells.append(f"† {(ours / theirs - 1) * 100:+.1f}% at {top:g}" if theirs > 0 else "n/a †")
                elif base["peak_effective_rps"] > 0:
                    cells.append(f"{(entry['peak_effective_rps'] / base['peak_effective_rps'] - 1) * 100:+.1f}%")
                else:
                    cells.append("n/a")
            lines.append(f"| {ttft} ms | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append(
        "† one of the two peaks was reached at the highest load tried: a lower bound, so no "
        "peak ratio is given; the cell compares effective RPS at that load with the best "
        "baseline's there instead."
    )
    lines.append("")
    lines.append("Best baseline per cell (its peak effective RPS):")
    lines.append("")
    lines.append("| TTFT \\ TPOT | " + " | ".join(f"{t} ms" for t in tpots) + " |")
    lines.append("|---|" + "---|" * len(tpots))
    for ttft in ttfts:
        cells = []
        for tpot in tpots:
            policies = grid[(ttft, tpot)]["policies"]
            name, base = best_baseline(policies)
            cells.append(f"{label(name, base)} {peak(base, grid[(ttft, tpot)]['rates'])}")
        lines.append(f"| {ttft} ms | " + " | ".join(cells) + " |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = FULL if args.full else REDUCED
    grid_setting = GRID_FULL if args.full else GRID_REDUCED
    trace, trace_label = load_trace(args.trace)
    out = args.out
    if args.seed_systems:
        return seed_systems_section(args, trace, out)
    if args.from_results:
        return rerender(args, out, trace_label, settings, grid_setting)
    (out / "results").mkdir(parents=True, exist_ok=True)
    main_policies = (*BASELINES, *PAPER_POLICIES, *BEYOND)
    total = 0  # tuning decides the number of runs as it goes
    started = time.time()
    documents: dict[str, dict] = {}
    grid: dict[tuple[int, int], dict] = {}
    with tqdm(total=total, unit="sim", file=sys.stderr) as bar:
        for profile_name in args.profiles:
            setting = settings[profile_name]
            scenario = Scenario(trace.head(setting.head_s), load_profile(bundled_profile_path(profile_name)),
                                slo_catalog(*MAIN_SLO_MS), seed=args.seed, step_form=args.step_form)
            bar.set_description(profile_name)
            document, samples = sweep(scenario, main_policies, setting.rates, args.jobs, bar)
            documents[profile_name] = document
            write_results(document, out / "results" / profile_name)
            plot_effective_rps(document, main_policies, out / f"effective_rps_{profile_name}.png")
            plot_latency_cdfs(document, samples, main_policies, out / f"latency_cdf_{profile_name}.png")
        if not args.no_grid:
            grid_profile = load_profile(bundled_profile_path(args.grid_profile))
            base = Scenario(trace.head(grid_setting.head_s), grid_profile, slo_catalog(*MAIN_SLO_MS),
                            seed=args.seed, step_form=args.step_form)
            for ttft in args.grid_ttft_ms:
                for tpot in args.grid_tpot_ms:
                    bar.set_description(f"grid {ttft}/{tpot}")
                    scenario = replace(base, catalog=slo_catalog(ttft, tpot))
                    grid[(ttft, tpot)], _ = sweep(scenario, GRID_POLICIES, grid_setting.rates, args.jobs, bar)
            (out / "results" / "slo_grid.json").write_text(json.dumps(
                {f"{t}/{p}": doc for (t, p), doc in grid.items()}, indent=1) + "\n")
    plot_breakdown(documents, out / "breakdown.png")
    elapsed = time.time() - started
    write_report(args, out, trace_label, settings, grid_setting, documents, grid, elapsed)
    print(f"wrote {out / 'report.md'} in {elapsed / 60:.1f} min", file=sys.stderr)
    return 0


def seed_systems_section(args: argparse.Namespace, trace: Workload, out: Path) -> int:
    profiles = [p for p in args.profiles if p in SEED_SETTINGS]
    unknown = sorted(set(args.profiles) - set(SEED_SETTINGS))
    if unknown:
        print(f"error: the seed systems' section has no setting for {', '.join(unknown)}; "
              f"profiles: {', '.join(SEED_SETTINGS)}", file=sys.stderr)
        return 2
    command = "scripts/report.sh --seed-systems"
    if tuple(args.profiles) != DEFAULT_PROFILES:
        command += " --profiles " + " ".join(args.profiles)
    if args.step_form != "knee":
        command += f" --step-form {args.step_form}"
    (out / "results").mkdir(parents=True, exist_ok=True)
    with tqdm(total=0, unit="sim", file=sys.stderr) as bar:
        path = run_seed_systems(trace, profiles, seed=args.seed, step_form=args.step_form,
                                jobs=args.jobs, out=out, command=command, bar=bar,
                                from_results=args.from_results)
    print(f"wrote {path}", file=sys.stderr)
    return 0


def rerender(args, out: Path, trace_label: str, settings, grid_setting) -> int:
    """report.md from the sweeps saved under OUT/results (the run's time is read back
    from the report it replaces)."""
    documents = {
        profile: json.loads((out / "results" / profile / "results.json").read_text())
        for profile in args.profiles
    }
    grid_path = out / "results" / "slo_grid.json"
    grid = {}
    if grid_path.exists() and not args.no_grid:
        grid = {tuple(int(v) for v in key.split("/")): doc
                for key, doc in json.loads(grid_path.read_text()).items()}
        args.grid_ttft_ms = sorted({t for t, _ in grid})
        args.grid_tpot_ms = sorted({p for _, p in grid})
    previous = (out / "report.md").read_text() if (out / "report.md").exists() else ""
    found = re.search(r" in ([0-9.]+) min ", previous)
    elapsed = float(found.group(1)) * 60 if found else 0.0
    write_report(args, out, trace_label, settings, grid_setting, documents, grid, elapsed)
    print(f"rewrote {out / 'report.md'} from {out / 'results'}", file=sys.stderr)
    return 0


def write_report(args, out: Path, trace_label: str, settings, grid_setting, documents, grid, elapsed) -> None:
    command = "scripts/report.sh" + (" --full" if args.full else "")
    if tuple(args.profiles) != DEFAULT_PROFILES:
        command += " --profiles " + " ".join(args.profiles)
    if args.step_form != "knee":
        command += f" --step-form {args.step_form}"
    if tuple(args.out.resolve().parts) != tuple((REPO / "docs" / "report").parts):
        command += f" --out {relative(args.out)}"
    if args.no_grid:
        command += " --no-grid"
    if tuple(args.grid_ttft_ms) != GRID_TTFT_MS:
        command += " --grid-ttft-ms " + " ".join(map(str, args.grid_ttft_ms))
    if tuple(args.grid_tpot_ms) != GRID_TPOT_MS:
        command += " --grid-tpot-ms " + " ".join(map(str, args.grid_tpot_ms))
    lines = [
        "# Single-node report: FairBatching vs the baselines users run today (simulated)",
        "",
        f"Generated by `{command}` in {elapsed / 60:.1f} min on {platform.machine()} "
        f"({args.jobs or 'all'} worker processes), Python {platform.python_version()}, seed {args.seed}. "
        "Every number below is read from the sweeps in `results/`.",
        "",
        f"Workload: {trace_label}; the head of the trace is cut first, then arrival times are "
        "scaled to each offered load. GPU: the roofline profiles in `configs/profiles/` (noise "
        "and stalls on; policies learn their step model online). A request meets its SLO when "
        "TTFT <= target and its max TPOT <= target; effective RPS = offered load x attainment; "
        "a rejection (fb-pab, sarathi-queue-cap) or an abort (sarathi-queue-timeout) is a "
        "violation. Baselines: " + ", ".join(f"`{n}`" for n in BASELINES) + "; every ratio "
        "divides by the best of them.",
        "",
    ]
    for profile_name, document in documents.items():
        setting = settings[profile_name]
        form = document["scenario"].get("step_model", "linear")
        lines += [
            f"## {profile_name}: SLO TTFT {MAIN_SLO_MS[0]} ms, TPOT {MAIN_SLO_MS[1]} ms",
            "",
            f"Step model: the offline `{form}` fit on the profile, learned online from there "
            "(`fb`, `fb-pab` and `fb-tb` keep the paper's linear model).",
            "",
            f"First {setting.head_s:g} s of the trace ({document['scenario']['requests']} requests, "
            f"natural rate {document['scenario']['natural_rate']:.2f} req/s); offered loads "
            f"{', '.join(f'{r:g}' for r in setting.rates)} req/s. Tuned families (best shown, "
            "every setting in `results/`): `sarathi` and `fb-fb` over token budgets 32-8192 "
            "refined to a 25% step; `sarathi-queue-cap` (vLLM's queued-token cap) over budget x "
            "cap around TTFT x prefill throughput; `sarathi-queue-timeout` (SGLang's waiting "
            "timeout) over budget x timeout around the TTFT (`sglang_ext/sim/fitting/tuning.py`).",
            "",
            "### Table 3: peak effective RPS",
            "",
            *table3(document),
            "",
            "### Table 4: latency near the baselines' knee",
            "",
            *table4(document),
            "",
            f"![effective RPS](effective_rps_{profile_name}.png)",
            f"![latency CDFs](latency_cdf_{profile_name}.png)",
            "",
        ]
    lines += ["## Figure 7: breakdown", "", "![breakdown](breakdown.png)", ""]
    if (out / "seed_systems.md").exists():
        lines += ["## The seed systems", "",
                  "Kairos, SLO-aware annealing and the batching study's policies beside "
                  "FairBatching and the baselines, on a chat + code workload: "
                  "[seed_systems.md](seed_systems.md) (`scripts/report.sh --seed-systems`).", ""]
    if grid:
        lines += [
            f"## Table 5: SLO grid ({args.grid_profile})",
            "",
            f"First {grid_setting.head_s:g} s of the trace; offered loads "
            f"{', '.join(f'{r:g}' for r in grid_setting.rates)} req/s. Caveat: the trace head is "
            "scaled to each load, so at the highest loads it lasts only a few tens of seconds, "
            "the backlog never fully builds, and effective RPS creeps up again for every "
            "policy; a † cell compares two points of that region and is weak evidence. The "
            "curves in `results/slo_grid.json` show where it starts.",
            "",
            *table5(grid),
            "",
        ]
    if not args.full:
        lines += [
            "## Reduced grid",
            "",
            "This is the reduced configuration. `scripts/report.sh --full` uses longer trace "
            f"heads ({', '.join(f'{p}: {FULL[p].head_s:g} s' for p in args.profiles)}, grid "
            f"{GRID_FULL.head_s:g} s) and finer loads ({', '.join(f'{p}: {len(FULL[p].rates)}' for p in args.profiles)}, "
            f"grid {len(GRID_FULL.rates)} rates); expect roughly 10x the time above.",
            "",
        ]
    (out / "report.md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
