"""Benchmark: ``benchmarks.sim.unfamiliar_gpu`` over three seeds and two arrival processes,
with every ``give_up`` setting of ``defer``.

Same device (``qwen3-32b-h100nvl``), trace (the bundled Azure sample), starting file (the
H100's) and SLO scenarios as ``benchmarks.sim.unfamiliar_gpu``; each of seeds 0, 1 and 2
runs with the trace's own arrivals (the seed draws the GPU's noise) and with gamma:4
arrivals (the seed also draws the arrivals). Configurations:

- FairBatching from the H100 file, knee learned: the shipped ``fb-smooth+defer`` and
  ``fb-steady+defer`` at every ``give_up`` setting: length weights 1 (``longest``, the
  default), 0.75, 0.5, 0.25 and 0 (``fair``), and ``latest``; both with ``max_defer_s``
  0.1 (a request still without a first token ended 0.1 s past its TTFT deadline instead
  of 2 s); and both with the start-up calibration a server runs when no step-model file
  is named (``--calibrate``: the scheduler's plan served on the device first, its fit
  adopted);
- SGLang's orders on the Sarathi batch with SGLang's waiting timeout, from the settings
  ``benchmarks.sim.unfamiliar_gpu`` tuned (``docs/bench/unfamiliar_gpu.json``), each also
  at 1/8, 1/4, 1/2, 2, 4 and 8 times its timeout and without one; of these, each family
  runs with the one whose mean attainment over every load and seed is highest for these
  arrivals (one setting, as an operator would choose it; the shortest timeout, an end of
  the axis, is marked). The worst class is compared with each order at its setting best
  for its worst class.

Every figure is requests on time (TTFT and TPOT met), the mean of the three seeds, with
the worst seed's ratio to the best baseline beside it; per SLO class and per prompt-length
bucket. From the repository root::

    python -m benchmarks.sim.unfamiliar_gpu_seeds                  # every sweep (about an hour on 2 cores)
    python -m benchmarks.sim.unfamiliar_gpu_seeds --from out/ugpu_seeds

Writes ``docs/bench/unfamiliar_gpu_seeds.{md,json}``.
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

from benchmarks.sim.unfamiliar_gpu import DEVICE, FOREIGN_FILE, RATES, SCENARIOS, who_pays_lines
from benchmarks.support.outputs import write_outputs
from benchmarks.support.paths import DOCS_BENCH, REPO
from sglang_ext.provenance import git_state

SEEDS = (0, 1, 2)
ARRIVALS = {"trace": "the trace's arrivals", "gamma:4": "gamma:4 arrivals"}
TUNED_FROM = DOCS_BENCH / "unfamiliar_gpu.json"
TIMEOUT_FACTORS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
SHIPPED = "fb-smooth+defer"
GIVE_UPS = {"1": "longest (1, the default)", "0.75": "0.75", "0.5": "0.5", "0.25": "0.25",
            "0": "fair (0)", "latest": "latest"}
SHORT_DEFER_S = 0.1  # max_defer_s of the rows that end hopeless requests soon after their deadline


#: rows run with the simulator's start-up calibration (``--calibrate``), each its own sweep
CALIBRATED = {"fb-smooth+defer": "fb-smooth+defer (shipped), calibrated at start-up",
              "fb-steady+defer": "fb-steady+defer, calibrated at start-up"}


def fairbatching_policies() -> dict[str, str]:
    """``{policy spec: row label}`` of the FairBatching rows."""
    rows = {SHIPPED: "fb-smooth+defer (shipped)"}
    for give_up, label in GIVE_UPS.items():
        spec = "fb-steady+defer" if give_up == "1" else f"fb-steady+defer:{give_up}"
        rows[spec] = f"fb-steady+defer, give_up {label}"
    for policy in ("fb-smooth", "fb-steady"):
        rows[f"{policy}+defer:max_defer={SHORT_DEFER_S:g}"] = (
            f"{policy}+defer, max_defer_s {SHORT_DEFER_S:g}")
    return rows


def tuned_baselines(tuned_from: Path) -> dict[str, dict[str, list[str]]]:
    """``{scenario: {family: [spec at each timeout factor]}}`` from the tuned settings
    that ``benchmarks.sim.unfamiliar_gpu`` recorded."""
    doc = json.loads(tuned_from.read_text())
    out: dict[str, dict[str, list[str]]] = {}
    for scenario, entry in doc["scenarios"].items():
        families = {}
        for label, row in entry["rows"].items():
            if not row.get("baseline"):
                continue
            match = re.search(r"tuned: ([^)]+)\)", label)
            if match is None:
                raise SystemExit(f"{tuned_from}: no tuned setting in row {label!r}")
            families[row["policy"]] = _timeout_neighbours(match.group(1))
        out[scenario] = families
    return out


def _timeout_neighbours(spec: str) -> list[str]:
    """The tuned ``spec`` at each of :data:`TIMEOUT_FACTORS` times its timeout, then the
    same order without a timeout (the axis' limit)."""
    base, _, settings = spec.partition("@")
    parts = dict(part.partition("=")[::2] for part in settings.split(",") if "=" in part)
    budget = settings.split(",")[0]
    timeout = float(parts["timeout"])
    return [*(f"{base}@{budget},timeout={timeout * factor:.4g}" for factor in TIMEOUT_FACTORS),
            f"{base.removesuffix('-queue-timeout')}@{budget}"]


def run_name(scenario: str, arrivals: str, seed: int) -> str:
    """The directory of one condition's run."""
    return f"{scenario}-{arrivals.replace(':', '')}-s{seed}"


def run_once(common: list[str], out: Path, policies: Sequence[str], commands: list[str]) -> None:
    """``python -m sglang_ext.sim COMMON --out OUT --policy ...``, recorded in ``commands``;
    skipped when ``OUT`` already holds its results (a run resumed)."""
    from sglang_ext.sim.commands import main as sim

    argv = [*common, "--out", str(out)]
    for spec in policies:
        argv += ["--policy", spec]
    commands.append("python -m sglang_ext.sim " + " ".join(argv))
    if (out / "results.json").exists():
        return
    if sim(argv) != 0:
        raise SystemExit(f"simulation failed: {commands[-1]}")


def run_sweeps(work: Path, baselines: dict, jobs: int) -> list[str]:
    commands: list[str] = []
    for scenario in SCENARIOS:
        specs = [*fairbatching_policies(), *(s for f in baselines[scenario].values() for s in f)]
        for arrivals in ARRIVALS:
            for seed in SEEDS:
                name = run_name(scenario, arrivals, seed)
                common = ["sweep", "--profile", DEVICE, "--rates", RATES, "--no-progress",
                          "--step-model", str(FOREIGN_FILE), "--seed", str(seed),
                          "--arrivals", arrivals, "--jobs", str(jobs), *SCENARIOS[scenario][1]]
                run_once(common, work / name, specs, commands)
                missing = [spec for spec in specs if spec not in _policies(work / name)]
                if missing:  # settings added since that run
                    added = len(list(work.glob(f"{name}-more*/results.json")))
                    run_once(common, work / f"{name}-more{added or ''}", missing, commands)
                run_once([*common, "--calibrate"], work / f"{name}-cal", list(CALIBRATED), commands)
    return commands


def _point(load: dict) -> dict:
    return {
        "attainment": load["attainment"],
        "by_slo_class": {k: v["attainment"] for k, v in load["by_slo_class"].items()},
        "by_prompt_tokens": {k: v["attainment"] for k, v in load["by_prompt_tokens"].items()},
    }


def _mean_point(points: list[dict]) -> dict:
    return {
        "attainment": mean(p["attainment"] for p in points),
        "by_slo_class": {k: mean(p["by_slo_class"][k] for p in points) for k in points[0]["by_slo_class"]},
        "by_prompt_tokens": {k: mean(p["by_prompt_tokens"][k] for p in points)
                             for k in points[0]["by_prompt_tokens"]},
    }


def collect(work: Path, baselines: dict) -> dict:
    rates = [float(r) for r in RATES.split(",")]
    doc: dict = {"device": DEVICE, "rates": rates, "seeds": list(SEEDS), "scenarios": {}}
    for scenario, (title, _) in SCENARIOS.items():
        conditions = {}
        for arrivals in ARRIVALS:
            runs = [_policies(work / run_name(scenario, arrivals, seed)) for seed in SEEDS]
            calibrated = [_policies(work / f"{run_name(scenario, arrivals, seed)}-cal") for seed in SEEDS]
            settings = {family: _best_setting(runs, specs) for family, specs in baselines[scenario].items()}
            worst_class, worst_class_settings = _worst_class_baseline(runs, baselines[scenario], len(rates))
            per_seed = []
            for policies, calibrated_policies in zip(runs, calibrated, strict=True):
                rows = {label: [_point(x) for x in policies[spec]["loads"]]
                        for spec, label in fairbatching_policies().items()}
                rows.update({label: [_point(x) for x in calibrated_policies[spec]["loads"]]
                             for spec, label in CALIBRATED.items()})
                rows.update({family: [_point(x) for x in policies[spec]["loads"]]
                             for family, spec in settings.items()})
                per_seed.append(rows)
            edges = {family: spec for family, spec in settings.items()
                     if spec == baselines[scenario][family][0]}
            edges.update({f"{family} (worst class)": spec for family, spec in worst_class_settings.items()
                          if spec == baselines[scenario][family][0]})
            summary = _summarise(per_seed, list(settings), len(rates))
            summary["worst_class"] = {
                "best_baseline": worst_class,
                "ratios": {label: [min(summary["rows"][label][i]["by_slo_class"].values())
                                   / worst_class[i]["attainment"] for i in range(len(rates))]
                           for label in summary["ratios"]}}
            conditions[arrivals] = {**summary, "baseline_settings": settings, "baseline_at_edge": edges}
        doc["scenarios"][scenario] = {"title": title, "conditions": conditions}
    return doc


def _policies(run: Path) -> dict:
    """The policies of a run, with those of its ``-more`` runs (settings added later)."""
    policies = dict(json.loads((run / "results.json").read_text())["policies"])
    for more in sorted(run.parent.glob(f"{run.name}-more*/results.json")):
        policies.update(json.loads(more.read_text())["policies"])
    return policies


def _best_setting(runs: list[dict], specs: list[str]) -> str:
    """The one setting of a family an operator would pick for these arrivals: the best
    mean attainment over every load and seed."""
    return max(specs, key=lambda spec: mean(load["attainment"] for policies in runs
                                            for load in policies[spec]["loads"]))


def _worst_class_baseline(
    runs: list[dict], families: dict[str, list[str]], n_rates: int,
) -> tuple[list[dict], dict[str, str]]:
    """At each load, the best worst-class attainment (mean of the seeds) of SGLang's orders,
    each at its setting with the best worst class over every load and seed: the baseline
    of the worst-class target, tuned for it."""
    def worst(spec: str, index: int) -> float:
        return mean(min(v["attainment"] for v in policies[spec]["loads"][index]["by_slo_class"].values())
                    for policies in runs)

    tuned = {family: max(specs, key=lambda spec: mean(worst(spec, i) for i in range(n_rates)))
             for family, specs in families.items()}
    out = []
    for index in range(n_rates):
        family = max(tuned, key=lambda f: worst(tuned[f], index))
        out.append({"attainment": worst(tuned[family], index), "policy": tuned[family]})
    return out, tuned


def _summarise(per_seed: list[dict], families: list[str], n_rates: int) -> dict:
    labels = list(per_seed[0])
    rows = {label: [_mean_point([s[label][i] for s in per_seed]) for i in range(n_rates)]
            for label in labels}
    best_baseline = []
    for index in range(n_rates):
        by_seed = [max(s[f][index]["attainment"] for f in families) for s in per_seed]
        best_name = max(families, key=lambda f: rows[f][index]["attainment"])
        best_baseline.append({"mean": mean(by_seed), "by_seed": by_seed, "best_mean_family": best_name})
    ratios = {}
    for label in labels:
        if label in families:
            continue
        ratios[label] = [
            {"of_means": rows[label][i]["attainment"] / best_baseline[i]["mean"],
             "worst_seed": min(s[label][i]["attainment"] / best_baseline[i]["by_seed"][k]
                               for k, s in enumerate(per_seed))}
            for i in range(n_rates)]
    return {"rows": rows, "baselines": families, "best_baseline": best_baseline, "ratios": ratios}


def render(doc: dict) -> str:
    rates = doc["rates"]
    lines = [
        "# FairBatching on a GPU its step-model file was not fitted to: three seeds, two "
        "arrival processes, every give_up setting",
        "",
        f"Device `{doc['device']}` (simulated), FairBatching started from the H100 file (knee "
        "learned); SGLang's orders as tuned in [unfamiliar_gpu.md](unfamiliar_gpu.md), each at "
        "whichever of its tuned timeout, 1/8 to 8 times it and no timeout has the best "
        "mean over loads and seeds for these arrivals (named in each table). Requests on time (TTFT and TPOT met), the "
        f"mean of seeds {', '.join(map(str, doc['seeds']))}; ratios are to the best SGLang order "
        "at each point (of the means; in brackets the worst seed's own ratio). "
        "`python -m benchmarks.sim.unfamiliar_gpu_seeds`.",
    ]
    for scenario in doc["scenarios"].values():
        for arrivals, condition in scenario["conditions"].items():
            rows = condition["rows"]
            settings = ", ".join(f"`{spec}`" for spec in condition["baseline_settings"].values())
            if condition["baseline_at_edge"]:
                settings += ("; at the shortest timeout tried: "
                             + ", ".join(f"{k} `{v}`" for k, v in condition["baseline_at_edge"].items()))
            lines += ["", f"## {scenario['title']}, {ARRIVALS[arrivals]}", "",
                      f"SGLang's orders at {settings}.", "",
                      "| configuration | " + " | ".join(f"{r:g} req/s" for r in rates) + " |",
                      "|---|" + "---|" * len(rates)]
            for label, loads in rows.items():
                ratio = condition["ratios"].get(label)
                cells = []
                for i, point in enumerate(loads):
                    cell = f"{point['attainment']:.3f}"
                    if ratio is not None:
                        cell += f" ({ratio[i]['of_means']:.2f}x [{ratio[i]['worst_seed']:.2f}x])"
                    cells.append(cell)
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
            worst = condition["worst_class"]
            if len(next(iter(rows.values()))[0]["by_slo_class"]) > 1:
                lines += ["", "Worst class against the best worst class of SGLang's orders, each "
                          "order at its setting best for its worst class ("
                          + ", ".join(f"{rate:g} req/s: `{w['policy']}` {w['attainment']:.2f}"
                                      for rate, w in zip(rates, worst["best_baseline"])) + "):", ""]
                for label, ratios in worst["ratios"].items():
                    lines.append(f"- {label}: " + " / ".join(f"{r:.2f}x" for r in ratios))
            lines += ["", "Who pays (mean of the seeds), per SLO class and per prompt-length bucket "
                      "(<512 / 512-1023 / 1024-2047 / 2048-4095 / >=4096):", ""]
            lines += who_pays_lines(rates, rows)
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", type=Path,
                        help="render sweeps already run in this directory")
    parser.add_argument("--work", type=Path, default=REPO / "out" / "unfamiliar_gpu_seeds",
                        help="where the sweeps write (default out/unfamiliar_gpu_seeds)")
    parser.add_argument("--tuned-from", type=Path, default=TUNED_FROM,
                        help="the tuned baselines (benchmarks.sim.unfamiliar_gpu's JSON)")
    parser.add_argument("--jobs", type=int, default=2, help="simulator worker processes")
    parser.add_argument("--out", type=Path, default=DOCS_BENCH)
    args = parser.parse_args(argv)
    started = time.monotonic()
    baselines = tuned_baselines(args.tuned_from)
    commands = [] if args.source else run_sweeps(args.work, baselines, args.jobs)
    doc = collect(args.source or args.work, baselines)
    doc["provenance"] = {**git_state(REPO), "wall_s": round(time.monotonic() - started),
                         "commands": commands or ["(rendered from sweeps already run)"]}
    text = render(doc)
    print(text)
    write_outputs(args.out, "unfamiliar_gpu_seeds", text, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
