"""What the saved points say (pure): the comparison's points, the sweeps, the routers'
added latency and CPU, where each side wins, and the notes the points call for."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from benchmarks.routers.records import added_latency, cpu_per_1000, percentile
from benchmarks.routers.stack import ROUTERS, TUNED_SMG, limits_key
from benchmarks.routers.traffic import WORKLOADS


def router_label(point: dict) -> str:
    router = point["router"]
    if router in TUNED_SMG:
        limits = point.get("limits") or {}
        reserved = f", R={limits['interactive_reserved']}" if "interactive_reserved" in limits else ""
        return f"{router} (C={limits.get('max_concurrent')}, Q={limits.get('queue_size')}{reserved})"
    return router


def main_points(points: Iterable[dict]) -> list[dict]:
    """The points of the comparison table: every router's at every rate (a tuned smg
    router's, :data:`TUNED_SMG`, at the limits tuned for that rate: a per-rate sweep's,
    else those of a workload sweep run at that rate, else the workload's last sweep's; the
    last saved point per key)."""
    points = list(points)
    tuned = {router: tuned_limits(points, router) for router in TUNED_SMG}
    at_rate = {router: {**swept_rate_limits(points, router), **rate_tuned_limits(points, router)}
               for router in TUNED_SMG}
    chosen: dict[tuple, dict] = {}
    for p in points:
        if "error" in p or "result" not in p:
            continue
        router = p["router"]
        if router in TUNED_SMG:
            best = at_rate[router].get((p["workload"], p["rate"]), tuned[router].get(p["workload"]))
            if best is None or limits_key(p["limits"]) != best:
                continue
        chosen[(p["workload"], p["rate"], p["router"])] = p
    order = {r: i for i, r in enumerate(ROUTERS)}
    return sorted(chosen.values(), key=lambda p: (WORKLOADS.index(p["workload"]) if p["workload"] in WORKLOADS
                                                  else 99, p["rate"], order.get(p["router"], 99)))


def sweep_points(points: Iterable[dict], workload: str, router: str = "smg-ca") -> list[dict]:
    chosen: dict[tuple, dict] = {}
    for p in points:
        if p.get("workload") == workload and p.get("router") == router and p.get("phase") in ("sweep", "rate-sweep") \
                and "result" in p:
            chosen[(p["rate"], *limits_key(p["limits"]))] = p
    return list(chosen.values())


def tuned_limits(points: Iterable[dict], router: str = "smg-ca") -> dict[str, tuple[int, ...]]:
    """Per workload, the limits (:func:`~benchmarks.routers.stack.limits_key`) ``router``'s last
    sweep chose (saved with its points)."""
    return {w: tuple(t["limits"]) for w, t in tuned_records(points, router).items()}


def swept_rate_limits(points: Iterable[dict], router: str = "smg-ca") -> dict[tuple[str, float], tuple[int, ...]]:
    """Per (workload, rate), the limits a workload sweep run at that rate chose (a later
    invocation may sweep the same workload again at a higher rate)."""
    return {(p["workload"], p["tuned"]["rate"]): tuple(p["tuned"]["limits"]) for p in points
            if p.get("router") == router and p.get("tuned") is not None and "rate" in p["tuned"]}


def rate_tuned_limits(points: Iterable[dict], router: str = "smg-ca") -> dict[tuple[str, float], tuple[int, ...]]:
    """Per (workload, rate), the limits a per-rate concurrency sweep chose, where one ran."""
    return {(p["workload"], p["rate"]): tuple(p["rate_tuned"]["limits"]) for p in points
            if p.get("router") == router and p.get("rate_tuned") is not None}


def tuned_records(points: Iterable[dict], router: str = "smg-ca") -> dict[str, dict]:
    tuned = {}
    for p in points:
        if p.get("router") == router and p.get("tuned") is not None:
            tuned[p["workload"]] = p["tuned"]
    return tuned


def sweep_summary(points: Sequence[dict], workload: str, router: str = "smg-ca") -> dict | None:
    """``router``'s sweep: its points, its choice and whether it is interior in each swept
    dimension."""
    sweep = sweep_points(points, workload, router)
    if not sweep:
        return None
    tuned = tuned_records(points, router).get(workload) or {}
    rows = [{"max_concurrent": p["limits"]["max_concurrent"], "queue_size": p["limits"]["queue_size"],
             **({"interactive_reserved": p["limits"]["interactive_reserved"]}
                if "interactive_reserved" in p["limits"] else {}),
             "rate": p["rate"], "good": p["result"]["good"], "goodput": p["result"]["goodput"],
             "attainment": p["result"]["attainment"], "ttft_p99": p["result"]["ttft_ms"]["p99"],
             "tpot_p99": p["result"]["tpot_ms"]["p99"], "failed": p["result"]["failed"],
             "server_died": bool(p.get("server_died"))} for p in sweep]
    rows.sort(key=lambda r: (-r["rate"], r.get("interactive_reserved", 0), r["queue_size"], r["max_concurrent"]))
    per_rate = {f"{p['rate']:g}": p["rate_tuned"] for p in points
                if p.get("workload") == workload and p.get("router") == router and p.get("rate_tuned")}
    return {"rate": tuned.get("rate", rows[0]["rate"]), "points": rows, "best": tuned.get("limits"),
            "grids": {k: tuned.get(k) for k in ("concurrency_grid", "queue_grid", "queue_during_concurrency",
                                                "reserved_grid", "reserved_during_limits") if k in tuned},
            "verdicts": tuned.get("verdicts", {}), "per_rate": per_rate}


def probe_summary(points: Iterable[dict]) -> dict[str, dict]:
    """Per router, the added latency over every probe it had (pooled medians)."""
    pooled: dict[str, tuple[list, list]] = {}
    for p in points:
        probe = p.get("probe")
        if not probe:
            continue
        via, direct = pooled.setdefault(p["router"], ([], []))
        via.extend(probe.get("router_ttft_s", []))
        direct.extend(probe.get("direct_ttft_s", []))
    return {router: added_latency(via, direct) for router, (via, direct) in pooled.items()}


def point_output_tokens(point: dict) -> int | None:
    """The output tokens a run streamed through its router (None: a point saved before
    runs recorded them)."""
    tokens = (point.get("cpu") or {}).get("output_tokens")
    return tokens if tokens is not None else (point.get("result") or {}).get("output_tokens")


def cpu_summary(points: Iterable[dict]) -> dict[str, dict[str, float | None]]:
    """Per workload and router: router (and servers) CPU s per 1000 requests and per 1000
    streamed output tokens, summed over its runs (per token: None when a run did not record
    its tokens)."""
    sums: dict[tuple, list] = {}
    for p in main_points(points):
        cpu = p.get("cpu") or {}
        entry = sums.setdefault((p["workload"], p["router"]), [0.0, 0, 0.0, 0])
        entry[0] += cpu.get("router_s", 0.0)
        entry[1] += p["result"]["requests"]
        entry[2] += cpu.get("servers_s", 0.0)
        tokens = point_output_tokens(p)
        entry[3] = None if tokens is None or entry[3] is None else entry[3] + tokens
    out: dict[str, dict] = {}
    for (workload, router), (cpu_s, n, servers, tokens) in sums.items():
        out.setdefault(workload, {})[router] = {
            "router_s_per_1000": cpu_per_1000(cpu_s, n), "servers_s_per_1000": cpu_per_1000(servers, n),
            "output_tokens": tokens, "router_s_per_1000_tokens": cpu_per_1000(cpu_s, tokens, 4),
            "servers_s_per_1000_tokens": cpu_per_1000(servers, tokens, 4)}
    return out


SIDES = {"smg": ("smg", "the daemon"), "cp": ("the daemon", "smg")}
WIN_MARGIN = 0.03  # goodputs within 3% are a tie (one seed per point; see the sweep tables' spread)


def wins(points: Sequence[dict], side: str) -> list[str]:
    """Plain sentences: where the best configuration of ``side`` ("smg" or "cp", the
    daemon) has more goodput than the best of the other (by more than ``WIN_MARGIN``); at a
    goodput tie, a TTFT p99 at most 2/3 of the other's; a lower added latency (every
    configuration of one side below every one of the other); less router CPU."""
    other = "cp" if side == "smg" else "smg"
    name, other_name = SIDES[side]
    lines = []
    by_cell: dict[tuple, dict[str, dict]] = {}
    for p in main_points(points):
        by_cell.setdefault((p["workload"], p["rate"]), {})[p["router"]] = p
    order = lambda kv: (WORKLOADS.index(kv[0][0]) if kv[0][0] in WORKLOADS else 99, kv[0][1])  # noqa: E731
    for (workload, rate), cell in sorted(by_cell.items(), key=order):
        mine = [p for r, p in cell.items() if r.startswith(side)]
        theirs = [p for r, p in cell.items() if r.startswith(other)]
        if not mine or not theirs:
            continue
        best = max(mine, key=lambda p: p["result"]["goodput"])
        rival = max(theirs, key=lambda p: p["result"]["goodput"])
        g, h = best["result"]["goodput"], rival["result"]["goodput"]
        if g > h * (1 + WIN_MARGIN):
            ratio = f"{g / h:.2f}x" if h else "the other serves nothing in its SLO"
            lines.append(f"goodput, {workload} at {rate:g} req/s: {g:.2f} ({best['router']}) against "
                         f"{h:.2f} ({rival['router']}), {ratio}")
        elif g >= h / (1 + WIN_MARGIN):  # a goodput tie: the tail TTFT among the tied
            top = max(g, h)
            tied = lambda ps: [p for p in ps if p["result"]["goodput"] >= top / (1 + WIN_MARGIN)  # noqa: E731
                               and p["result"]["ttft_ms"]["p99"] is not None]
            a, b = tied(mine), tied(theirs)
            if a and b:
                fa = min(a, key=lambda p: p["result"]["ttft_ms"]["p99"])
                fb = min(b, key=lambda p: p["result"]["ttft_ms"]["p99"])
                ta, tb = fa["result"]["ttft_ms"]["p99"], fb["result"]["ttft_ms"]["p99"]
                if ta * 1.5 <= tb:
                    lines.append(f"TTFT p99 at equal goodput (within {100 * WIN_MARGIN:.0f}%), {workload} at "
                                 f"{rate:g} req/s: {ta:.0f} ms ({fa['router']}) against {tb:.0f} ms ({fb['router']})")
    probes = probe_summary(points)
    mine_lat = [v["added_ms"] for r, v in probes.items() if r.startswith(side) and v]
    their_lat = [v["added_ms"] for r, v in probes.items() if r.startswith(other) and v]
    if mine_lat and their_lat and max(mine_lat) + 0.5 < min(their_lat):  # 0.5 ms: below that, a tie
        lines.append(f"added latency (unloaded): {max(mine_lat):.1f} ms or less through {name} against "
                     f"{min(their_lat):.1f} ms or more through {other_name}")
    for workload, routers in cpu_summary(points).items():
        m = [v["router_s_per_1000"] for r, v in routers.items() if r.startswith(side) and v["router_s_per_1000"]]
        t = [v["router_s_per_1000"] for r, v in routers.items() if r.startswith(other) and v["router_s_per_1000"]]
        if m and t and max(m) < min(t):
            line = (f"router CPU, {workload}: {max(m):.1f} s per 1000 requests or less for {name} "
                    f"against {min(t):.1f} s or more for {other_name} ({min(t) / max(m):.1f}x)")
            mk = [v["router_s_per_1000_tokens"] for r, v in routers.items() if r.startswith(side)]
            tk = [v["router_s_per_1000_tokens"] for r, v in routers.items() if r.startswith(other)]
            if mk and tk and None not in mk + tk:
                line += f"; per 1000 streamed output tokens {_span(mk)} s against {_span(tk)} s"
            lines.append(line)
    return lines


def _span(values: Sequence[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.3f}" if low == high else f"{low:.3f}-{high:.3f}"


def smg_wins(points: Sequence[dict]) -> list[str]:
    return wins(points, "smg")


def auto_notes(points: Sequence[dict]) -> list[str]:
    """Notes the points call for: server crashes, the machine's load."""
    notes = []
    died = [p for p in points if p.get("server_died") and "result" in p]
    if died:
        seen = sorted({f"{p['workload']} at {p['rate']:g} req/s through {router_label(p)}" for p in died})
        first = next(iter(died[0]["server_died"].values()))
        notes.append(f"A FairBatching server crashed in {len(seen)} run(s) ({'; '.join(seen)}); "
                     f"its requests failed and the stack was restarted for the next run. Log: `{first[:400]}`")
    loads = [p["machine_during_run"]["load_average_after"][0] for p in points
             if p.get("machine_during_run")]
    if loads:
        notes.append(f"1-minute load average after each run: {min(loads):.1f}-{max(loads):.1f} "
                     f"(median {percentile(loads, 50):.1f}) on {os.cpu_count()} vCPUs.")
    return notes


def provenance_text(points: Sequence[dict], meta: dict) -> str:
    """The commits the points were measured at, with counts (a run may span a commit)."""
    counts: dict[str, int] = {}
    for p in points:
        if "result" in p and p.get("commit"):
            label = p["commit"] + (" + uncommitted changes" if p.get("dirty") else "")
            counts[label] = counts.get(label, 0) + 1
    if not counts:
        git = meta.get("git", {})
        return f"{git.get('commit', '?')}{' + uncommitted changes' if git.get('dirty') else ''}"
    return ", ".join(f"{c} ({n} points)" if len(counts) > 1 else c for c, n in counts.items())
