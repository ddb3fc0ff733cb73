"""The report's seed-systems section: every system of the seeds beside FairBatching's best
policies and the baselines users run today, on one multi-SLO workload.

    scripts/report.sh --seed-systems        # writes docs/report/seed_systems.md

The workload is the shared Azure conversation trace with each request labelled ``chat``
(TTFT + TPOT) or ``code`` (end-to-end) by the seeded class mix (``configs/slo-multi.toml``,
half each: the annealing paper's even split of ShareGPT chat and Python-code requests; the
Azure trace carries no task labels). Per profile, two sweeps over the same offered loads
per GPU:

- **colocated, one GPU**: the baselines (tuned, admission controls included),
  FairBatching's best (``fb-anchor-margin``, with and without ``+reject``), SLO-aware
  annealing (``slo-anneal``) and the batching study's policies, each tunable one tuned to
  an interior best by ``sglang_ext.sim.fitting.tuning``;
- **disaggregated, two GPUs** (one prefill rank, one decode rank; the only split of two):
  Kairos, Kairos with its decode table updated online (our extension), and its
  DistServe-like FCFS baseline, at twice the offered load so every row reads per GPU.

Every ratio divides a policy's peak effective RPS per GPU by the best baseline's.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.sim.report_baselines import best_without_admission
from benchmarks.support.paths import REPO
from sglang_ext.policy.slo import SloCatalog
from sglang_ext.sim.disagg import DisaggConfig
from sglang_ext.sim.profile import bundled_profile_path, load_profile
from sglang_ext.sim.runner import Scenario
from sglang_ext.sim.sweep import (
    BASELINES,
    best_baseline,
    display_label,
    plan_sweep,
    run_sweep,
    write_results,
)
from sglang_ext.sim.workloads import ClassMix, Workload

SLO_FILE = REPO / "configs" / "slo-multi.toml"
CLASS_MIX = "chat:0.5,code:0.5"
CLASSES = ("chat", "code")
FAIRBATCHING = ("fb-anchor-margin", "fb-anchor-margin+reject")
SEED_COLOCATED = ("slo-anneal-short", "fixed-batch", "dynamic-batch", "fcfs-complete",
                  "prefill-first")
SEED_DISAGGREGATED = ("kairos", "kairos-online", "kairos-fcfs")
SPLIT = (1, 1)
COLOCATED = (*BASELINES, *FAIRBATCHING, *SEED_COLOCATED)


@dataclass(frozen=True)
class SeedSetting:
    head_s: float
    rates_per_gpu: tuple[float, ...]


SETTINGS = {
    "llama3.1-8b-h100": SeedSetting(300, (4, 8, 12, 14, 16, 18, 20, 24, 28, 32)),
    "qwen3-14b-h20": SeedSetting(120, (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0)),
}


@dataclass(frozen=True)
class ProfileRuns:
    """One profile's sweeps (``results.json`` documents): colocated, disaggregated, and
    the paper's annealing schedule at the short schedule's tuned setting."""

    profile: str
    colocated: dict
    disaggregated: dict
    annealing_check: dict

    @property
    def paper_annealing(self) -> str:
        return paper_schedule_of(self.colocated["policies"]["slo-anneal-short"]["best_of"])


def paper_schedule_of(short_label: str) -> str:
    """``slo-anneal@B,batch=N`` for the short schedule's ``slo-anneal-short@B,batch=N``."""
    return "slo-anneal" + short_label.removeprefix("slo-anneal-short")


def run_profile(trace: Workload, profile_name: str, seed: int, step_form: str, jobs: int | None,
                out: Path, bar) -> ProfileRuns:
    setting = SETTINGS[profile_name]
    workload = trace.head(setting.head_s).with_class_mix(ClassMix.parse(CLASS_MIX), seed)
    scenario = Scenario(workload, load_profile(bundled_profile_path(profile_name)),
                        SloCatalog.from_toml(SLO_FILE), seed=seed, step_form=step_form,
                        disagg=DisaggConfig(*SPLIT))
    gpus = sum(SPLIT)
    colocated_rates = setting.rates_per_gpu
    bar.set_description(f"seed systems {profile_name}")

    def sweep(names: Sequence[str], rates: Sequence[float]) -> dict:
        document, _ = run_sweep(scenario, plan_sweep(names), rates, cdf_rate=rates[len(rates) // 2],
                                jobs=jobs, progress=bar.update, planned=_grow(bar))
        return document

    colocated = sweep(COLOCATED, colocated_rates)
    disaggregated = sweep(SEED_DISAGGREGATED, tuple(r * gpus for r in colocated_rates))
    check = sweep([paper_schedule_of(colocated["policies"]["slo-anneal-short"]["best_of"])],
                  colocated_rates)
    root = out / "results" / "seed_systems"
    for document, name in ((colocated, profile_name), (disaggregated, f"{profile_name}-disagg"),
                           (check, f"{profile_name}-anneal")):
        write_results(document, root / name)
    return ProfileRuns(profile_name, colocated, disaggregated, check)


def load_profile_runs(out: Path, profile_name: str) -> ProfileRuns:
    root = out / "results" / "seed_systems"
    return ProfileRuns(*(
        [profile_name] + [json.loads((root / name / "results.json").read_text())
                          for name in (profile_name, f"{profile_name}-disagg", f"{profile_name}-anneal")]
    ))


def _grow(bar) -> Callable[[int], None]:
    def planned(n: int) -> None:
        bar.total += n
        bar.refresh()
    return planned


# ------------------------------------------------------------------ tables
@dataclass(frozen=True)
class Row:
    name: str
    entry: dict
    gpus: int

    @property
    def label(self) -> str:
        return display_label(self.name, self.entry)

    @property
    def peak_per_gpu(self) -> float:
        return self.entry["peak_effective_rps"] / self.gpus

    def load_at(self, rate_per_gpu: float) -> dict | None:
        return next((load for load in self.entry["loads"]
                     if abs(load["rate"] - rate_per_gpu * self.gpus) < 1e-9), None)


def rows(runs: ProfileRuns) -> list[Row]:
    gpus = sum(SPLIT)
    colocated = runs.colocated["policies"]
    disaggregated = runs.disaggregated["policies"]
    paper = runs.paper_annealing
    return ([Row(n, colocated[n], 1) for n in COLOCATED]
            + [Row(paper, runs.annealing_check["policies"][paper], 1)]
            + [Row(n, disaggregated[n], gpus) for n in SEED_DISAGGREGATED])


def peak_table(runs: ProfileRuns) -> list[str]:
    policies = runs.colocated["policies"]
    base_name, base = best_baseline(policies)
    plain_name, plain = best_without_admission(policies)
    top = max(runs.colocated["rates"])
    base_top = Row(base_name, base, 1).load_at(top)["effective_rps"]
    lines = ["| policy | GPUs | peak effective RPS / GPU | at offered load / GPU | vs best baseline "
             f"| vs best without admission | effective RPS / GPU at {top:g} | vs best baseline "
             f"at {top:g} |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows(runs):
        bound = ">=" if row.entry.get("peak_at_highest_load") else ""
        at_top = row.load_at(top)
        top_value = None if at_top is None else at_top["effective_rps"] / row.gpus
        top_text = "-" if top_value is None else f"{top_value:.2f}"
        top_ratio = "-" if top_value is None or base_top <= 0 else f"{top_value / base_top:.2f}x"
        lines.append(
            f"| {row.label} | {row.gpus} | {bound}{row.peak_per_gpu:.2f} "
            f"| {row.entry['peak_rate'] / row.gpus:g} | {_versus(row, base)} "
            f"| {_versus(row, plain)} | {top_text} | {top_ratio} |"
        )
    lines += ["", f"Best baseline: **{display_label(base_name, base)}** "
              f"({'>=' if base.get('peak_at_highest_load') else ''}"
              f"{base['peak_effective_rps']:.2f} req/s on one GPU); without admission control: "
              f"**{display_label(plain_name, plain)}** ({plain['peak_effective_rps']:.2f}). An "
              "admission-controlled policy plateaus rather than collapses, so where a peak is a "
              f"lower bound the last column compares effective RPS at {top:g} req/s per GPU."]
    return lines


def _versus(row: Row, base: dict) -> str:
    if row.entry.get("peak_at_highest_load") or base.get("peak_at_highest_load"):
        return "n/a (>=)"
    if base["peak_effective_rps"] <= 0:
        return "n/a"
    return f"{row.peak_per_gpu / base['peak_effective_rps']:.2f}x"


def class_table(runs: ProfileRuns) -> tuple[float, list[str]]:
    """Attainment per SLO class and latency percentiles at the knee: the peak load of the
    best baseline without admission control, where the baselines start to break down."""
    _, plain = best_without_admission(runs.colocated["policies"])
    rate = plain["peak_rate"]
    lines = [
        "| policy | attainment | chat | code | chat TTFT p50 | p99 | chat TPOT p50 | p99 "
        "| code e2e p50 | p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows(runs):
        load = row.load_at(rate)
        if load is None:
            continue
        by_class = load.get("by_slo_class", {})
        chat, code = by_class.get("chat", {}), by_class.get("code", {})
        cells = [
            _share(load.get("attainment")), _share(chat.get("attainment")), _share(code.get("attainment")),
            *_pair(chat.get("ttft_ms")), *_pair(chat.get("tpot_ms")), *_pair(code.get("e2e_ms")),
        ]
        lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
    return rate, lines


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _pair(summary: dict | None) -> tuple[str, str]:
    if not summary:
        return "-", "-"
    return tuple("-" if summary.get(p) is None else f"{summary[p]:.0f}" for p in ("p50", "p99"))


def section(runs_by_profile: Sequence[ProfileRuns], elapsed_s: float, command: str) -> list[str]:
    catalog = SloCatalog.from_toml(SLO_FILE)
    chat, code = catalog.classes["chat"], catalog.classes["code"]
    lines = [
        "# Seed systems beside FairBatching (simulated)",
        "",
        f"Generated by `{command}` in {elapsed_s / 60:.1f} min. Every number is read from the "
        "sweeps in `results/seed_systems/`.",
        "",
        f"Workload: the shared Azure conversation trace, each request labelled by the seeded "
        f"class mix `{CLASS_MIX}` (`Workload.with_class_mix`): **chat** meets its SLO with "
        f"TTFT <= {chat.ttft_s * 1e3:g} ms and max TPOT <= {chat.tpot_s * 1e3:g} ms; **code** "
        f"when its last token arrives within {code.e2e_s * 1e3:g} ms of arrival "
        "(`configs/slo-multi.toml`). FairBatching and Kairos schedule a code request by a token "
        "envelope paced over its class's learnt mean output length (`sglang_ext/policy/slo.py`); "
        "`slo-anneal` plans on a draw from the class's online Gaussian. The simulator charges "
        "no policy's decision time to simulated time.",
        "",
        "Systems: the baselines " + ", ".join(f"`{n}`" for n in BASELINES) + "; FairBatching's "
        "best " + ", ".join(f"`{n}`" for n in FAIRBATCHING) + "; SLO-aware annealing, tuned "
        "(budget x maximum batch size) as `slo-anneal-short` (the reading of the paper's "
        "hyperparameters with 20 proposals per temperature down to 100: a tenth of the "
        "default's search, so the sweep stays affordable), then re-run with the default "
        "reading (100 proposals down to 20) at the tuned setting (`slo-anneal@...`); the batching study's `fixed-batch`, `dynamic-batch`, `fcfs-complete`, "
        "`prefill-first`; Kairos `kairos`, `kairos-online` (its decode table updated online: "
        "our extension) and `kairos-fcfs` (DistServe-like) on "
        f"{SPLIT[0]} prefill + {SPLIT[1]} decode GPU, offered twice the load so each row reads "
        "per GPU. Tunable policies are tuned to an interior best (`[edge: X]` marks a best at "
        "a bound of axis X). `>=`: the peak was at the highest load tried (a lower bound, no "
        "ratio).",
        "",
    ]
    for runs in runs_by_profile:
        setting = SETTINGS[runs.profile]
        rate, table = class_table(runs)
        lines += [
            f"## {runs.profile}",
            "",
            f"First {setting.head_s:g} s of the trace ({runs.colocated['scenario']['requests']} "
            f"requests); offered loads per GPU {', '.join(f'{r:g}' for r in setting.rates_per_gpu)} "
            "req/s.",
            "",
            "### Peak effective RPS per GPU",
            "",
            *peak_table(runs),
            "",
            f"### Per SLO class at {rate:g} req/s per GPU (the knee: the peak of the best "
            "baseline without admission control)",
            "",
            *table,
            "",
            "Attainment overall and per class; latencies in ms (TPOT: each request's max over "
            "j >= 1 of (t_j - t_0)/j; e2e: last token - arrival).",
            "",
        ]
    return lines


def run_section(trace: Workload, profiles: Sequence[str], *, seed: int, step_form: str,
                jobs: int | None, out: Path, command: str, bar, from_results: bool) -> Path:
    started = time.time()
    if from_results:
        runs = [load_profile_runs(out, p) for p in profiles]
        previous = out / "seed_systems.md"
        elapsed = _elapsed_from(previous.read_text()) if previous.exists() else 0.0
    else:
        runs = [run_profile(trace, p, seed, step_form, jobs, out, bar) for p in profiles]
        elapsed = time.time() - started
    path = out / "seed_systems.md"
    path.write_text("\n".join(section(runs, elapsed, command)) + "\n")
    return path


def _elapsed_from(text: str) -> float:
    found = re.search(r"` in ([0-9.]+) min", text)
    return float(found.group(1)) * 60 if found else 0.0
