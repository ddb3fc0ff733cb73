"""Benchmark: Kairos in its native (disaggregated) setting against colocated FairBatching.

What, per GPU count G (``--gpus``, default 2 and 4):
- ``kairos`` and ``kairos-fcfs`` (DistServe-like) on every prefill:decode split with
  ``P + D = G``, the best split (highest peak effective RPS, then mean) shown, marked
  ``[edge]`` when it is ``1:G-1`` or ``G-1:1`` and another split exists;
- colocated ``fb-anchor-margin`` and ``sarathi`` (budget tuned over ``--sarathi-budgets``,
  best shown) on G data-parallel ranks (``sglang_ext.sim.cluster``, ``request_count``
  balancer, reports 5 ms late).
Loads are offered per GPU (``--rates-per-gpu``), so every row compares the same traffic
per GPU; the cluster's rate is G times it. Effective RPS = offered x attainment (TTFT and
max-TPOT both met), reported per GPU. Workload: the bundled Azure sample's first
``--head-seconds``, trace arrivals rescaled, profile ``llama3.1-8b-h100``,
``configs/slo.toml`` (TTFT 2000 ms / TPOT 50 ms), seed 0, KV link 400 Gb/s::

    source scripts/_env.sh
    python -m benchmarks.sim.kairos               # writes docs/bench/kairos.{md,json}
    python -m benchmarks.sim.kairos --gpus 2 --no-write
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from benchmarks.support.outputs import write_outputs
from benchmarks.support.paths import DOCS_BENCH
from sglang_ext.policy.slo import SloCatalog
from sglang_ext.sim.cluster import ClusterConfig, simulate_cluster
from sglang_ext.sim.disagg import DisaggConfig
from sglang_ext.sim.profile import PROFILES_DIR, bundled_profile_path, load_profile
from sglang_ext.sim.runner import Scenario, parse_policy, simulate
from sglang_ext.sim.workloads import bundled_sample

OUT = DOCS_BENCH / "kairos"


def _scenario(head_s: float, split: tuple[int, int] = (1, 1)) -> Scenario:
    return Scenario(
        workload=bundled_sample().head(head_s),
        profile=load_profile(bundled_profile_path("llama3.1-8b-h100")),
        catalog=SloCatalog.from_toml(PROFILES_DIR.parent / "slo.toml"),
        disagg=DisaggConfig(*split),
    )


def _run(job: tuple) -> dict:
    """One (configuration, load) point; ``job``: (kind, policy, gpus, split, rate, head)."""
    kind, policy, gpus, split, rate, head = job
    spec = parse_policy(policy)
    if kind == "disagg":
        load = simulate(_scenario(head, split), spec, rate).load
    else:
        cluster = ClusterConfig(ranks=gpus, balancer="request_count")
        load = simulate_cluster(_scenario(head), spec, rate, cluster).load
    return {
        "kind": kind, "policy": policy, "gpus": gpus,
        "split": f"{split[0]}:{split[1]}" if split else None,
        "rate": rate, "rate_per_gpu": rate / gpus, "attainment": load["attainment"],
        "effective_rps": load["effective_rps"],
        "effective_rps_per_gpu": load["effective_rps"] / gpus,
        "ttft_attainment": load["ttft_attainment"], "tpot_attainment": load["tpot_attainment"],
        "requests": load["requests"],
    }


def _jobs(args: argparse.Namespace) -> list[tuple]:
    jobs = []
    for gpus in args.gpus:
        rates = [r * gpus for r in args.rates_per_gpu]
        for rate in rates:
            for prefill in range(1, gpus):
                for policy in ("kairos", "kairos-fcfs"):
                    split = (prefill, gpus - prefill)
                    jobs.append(("disagg", policy, gpus, split, rate, args.head_seconds))
            jobs.append(("colocated", "fb-anchor-margin", gpus, None, rate, args.head_seconds))
            for budget in args.sarathi_budgets:
                jobs.append(("colocated", f"sarathi@{budget}", gpus, None, rate, args.head_seconds))
    return jobs


def _best(points: list[dict], family: str, gpus: int) -> tuple[str, list[dict]] | None:
    """The configuration of ``family`` on ``gpus`` GPUs with the highest peak (then mean)
    effective RPS per GPU: its label and its points by rate."""
    by_config: dict[str, list[dict]] = {}
    for p in points:
        if p["gpus"] != gpus or p["policy"].split("@")[0] != family:
            continue
        label = p["policy"] + (f" {p['split']}" if p["split"] else "")
        by_config.setdefault(label, []).append(p)
    if not by_config:
        return None
    def score(label: str) -> tuple[float, float]:
        values = [p["effective_rps_per_gpu"] for p in by_config[label]]
        return max(values), sum(values) / len(values)
    label = max(by_config, key=score)
    splits = {p["split"] for p in by_config[label]} - {None}
    if splits and len(by_config) > 1:
        prefill, decode = map(int, next(iter(splits)).split(":"))
        if min(prefill, decode) == 1:
            label += " [edge]"
    elif "@" in label and len(by_config) > 1:
        budgets = [int(name.split("@")[1]) for name in by_config]
        if int(label.split("@")[1]) in (min(budgets), max(budgets)):
            label += " [edge]"
    return label, sorted(by_config[label.removesuffix(" [edge]")], key=lambda p: p["rate"])


def render(points: list[dict], args: argparse.Namespace, seconds: float) -> str:
    lines = [
        "# Kairos in its native setting (prefill/decode disaggregation), in the simulator",
        "",
        f"`python -m benchmarks.sim.kairos` ({seconds:.0f} s). Bundled Azure sample, first "
        f"{args.head_seconds:g} s; llama3.1-8b-h100; TTFT 2000 ms / TPOT 50 ms; KV link 400 Gb/s. "
        "Offered load and effective RPS (offered x attainment) are **per GPU**; the "
        "cluster's rate is G times it. Disaggregated rows show the best prefill:decode "
        "split of G GPUs (`[edge]`: the best split is 1:G-1 or G-1:1 while others exist); "
        "colocated rows run G data-parallel ranks behind the `request_count` balancer; "
        "sarathi's budget is the best of " + ", ".join(map(str, args.sarathi_budgets))
        + " (`[edge]` at either end).",
        "",
    ]
    rates = args.rates_per_gpu
    header = "| GPUs | configuration | " + " | ".join(f"eff/GPU @ {r:g}" for r in rates) + \
        " | attain (TTFT, TPOT) @ " + f"{rates[-1]:g} |"
    for gpus in args.gpus:
        lines += [header, "|" + "---|" * (3 + len(rates))]
        for family in ("kairos", "kairos-fcfs", "fb-anchor-margin", "sarathi"):
            best = _best(points, family, gpus)
            if best is None:
                continue
            label, series = best
            cells = " | ".join(f"{p['effective_rps_per_gpu']:.2f}" for p in series)
            top = series[-1]
            lines.append(f"| {gpus} | {label} | {cells} | {top['attainment']:.3f} "
                         f"({top['ttft_attainment']:.3f}, {top['tpot_attainment']:.3f}) |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=lambda t: [int(x) for x in t.split(",")], default=[2, 4])
    parser.add_argument("--rates-per-gpu", type=lambda t: [float(x) for x in t.split(",")],
                        default=[6.0, 10.0, 14.0, 18.0, 22.0])
    parser.add_argument("--sarathi-budgets", type=lambda t: [int(x) for x in t.split(",")],
                        default=[256, 512, 1024, 2048])
    parser.add_argument("--head-seconds", type=float, default=600.0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    jobs = _jobs(args)
    with ProcessPoolExecutor(args.jobs) as pool:
        points = list(pool.map(_run, jobs))
    text = render(points, args, time.perf_counter() - start)
    print(text)
    if not args.no_write:
        write_outputs(OUT.parent, OUT.name, text + "\n", {
            "settings": {k: v for k, v in vars(args).items() if k != "no_write"},
            "points": points})
    return 0


if __name__ == "__main__":
    sys.exit(main())
