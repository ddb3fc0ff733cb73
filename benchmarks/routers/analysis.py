"""What the saved points say (pure): the comparison's points (per arrival seed, and their
means where a point ran at several seeds), the sweeps, the routers' added latency and CPU,
where each side wins, and the notes the points call for."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from statistics import fmean

from benchmarks.routers.records import added_latency, cpu_per_1000, percentile
from benchmarks.routers.stack import ROUTERS, TUNED_SMG, limits_key
from benchmarks.routers.traffic import WORKLOADS, point_seed


def router_label(point: dict) -> str:
    """The router's name, a tuned smg router's with its limits (a row of several seeds:
    each seed's, in seed order, where they differ)."""
    router = point["router"]
    if router in TUNED_SMG:
        limits = _row_limits(point)
        c, q = _seed_values(limits, "max_concurrent"), _seed_values(limits, "queue_size")
        has_reserved = "interactive_reserved" in limits[0]
        reserved = f", R={_seed_values(limits, 'interactive_reserved')}" if has_reserved else ""
        return f"{router} (C={c}, Q={q}{reserved})"
    return router


def _row_limits(row: dict) -> list[dict]:
    if "by_seed" in row:
        return [s.get("limits") or {} for s in row["by_seed"]]
    return [row.get("limits") or {}]


def _seed_values(limits: Sequence[dict], key: str) -> str:
    """One limit over a row's seeds: its value, or each seed's joined by ``/`` where they
    differ."""
    values = [str(lim.get(key)) for lim in limits]
    return values[0] if len(set(values)) == 1 else "/".join(values)


def seeds_of(points: Iterable[dict]) -> list[int]:
    """The arrival seeds of the points with a result, in order."""
    return sorted({point_seed(p) for p in points if "result" in p})


def at_seed(points: Iterable[dict], seed: int) -> list[dict]:
    return [p for p in points if point_seed(p) == seed]


def split_by_seed(points: Sequence[dict]) -> list[tuple[int | None, list[dict]]]:
    """The points split by arrival seed; points of one seed stay whole, under None."""
    seeds = seeds_of(points)
    if len(seeds) <= 1:
        return [(None, list(points))]
    return [(seed, at_seed(points, seed)) for seed in seeds]


def main_points(points: Iterable[dict]) -> list[dict]:
    """The points of the comparison table, at every arrival seed: every router's at every
    rate (a tuned smg router's, :data:`TUNED_SMG`, at the limits tuned for that rate and
    seed: a per-rate sweep's, else those of a workload sweep run at that rate, else the
    workload's last sweep's; the last saved point per key)."""
    points = list(points)
    chosen = [p for _, group in split_by_seed(points) for p in _main_points_at_seed(group)]
    order = {r: i for i, r in enumerate(ROUTERS)}

    def position(p: dict) -> tuple:
        workload = WORKLOADS.index(p["workload"]) if p["workload"] in WORKLOADS else 99
        return workload, p["rate"], order.get(p["router"], 99), point_seed(p)

    return sorted(chosen, key=position)


def _main_points_at_seed(points: list[dict]) -> list[dict]:
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
    return list(chosen.values())


def comparison_rows(points: Iterable[dict]) -> list[dict]:
    """The comparison table's rows: per (workload, rate, router) its point, or where it ran
    at several seeds, their :func:`mean_point`."""
    groups: dict[tuple, list[dict]] = {}
    for p in main_points(points):
        groups.setdefault((p["workload"], p["rate"], p["router"]), []).append(p)
    return [group[0] if len(group) == 1 else mean_point(group) for group in groups.values()]


def _mean(values: Iterable[float | None], digits: int) -> float | None:
    """The mean of the known values (None: none known)."""
    known = [v for v in values if v is not None]
    return round(fmean(known), digits) if known else None


def _mean_all(values: Iterable[float | None], digits: int) -> float | None:
    """The mean, None where a value is unknown."""
    values = list(values)
    return None if None in values else _mean(values, digits)


def _mean_percentiles(pcts: Sequence[dict]) -> dict:
    return {q: _mean((p.get(q) for p in pcts), 2) for q in ("p50", "p90", "p99")}


def _mean_by_class(results: Sequence[dict]) -> dict:
    classes = sorted({c for r in results for c in r.get("by_class", {})})
    out = {}
    for name in classes:
        rows = [r["by_class"][name] for r in results if name in r.get("by_class", {})]
        out[name] = {"requests": sum(c["requests"] for c in rows),
                     "good": sum(c["good"] for c in rows),
                     "attainment": _mean((c["attainment"] for c in rows), 4),
                     "ttft_p99_ms": _mean((c["ttft_p99_ms"] for c in rows), 2)}
    return out


def _mean_result(results: Sequence[dict]) -> dict:
    result = {"requests": sum(r["requests"] for r in results),
              "good": sum(r["good"] for r in results),
              "failed": _mean((r["failed"] for r in results), 1),
              "attainment": _mean((r["attainment"] for r in results), 4),
              "goodput": _mean((r["goodput"] for r in results), 3),
              "ttft_ms": _mean_percentiles([r["ttft_ms"] for r in results]),
              "tpot_ms": _mean_percentiles([r["tpot_ms"] for r in results])}
    if any("by_class" in r for r in results):
        result["by_class"] = _mean_by_class(results)
    return result


def _mean_cpu(group: Sequence[dict]) -> dict:
    cpus = [p.get("cpu") or {} for p in group]
    return {key: _mean_all((c.get(key) for c in cpus), digits)
            for key, digits in (("router_s_per_1000", 2), ("router_s_per_1000_tokens", 4))}


def mean_point(group: Sequence[dict]) -> dict:
    """One (workload, rate, router)'s points at several seeds as one row: the mean over the
    seeds of goodput, attainment, failures, latency percentiles, per-class attainment and
    TTFT p99, prefill computed and router CPU; each seed's goodput, attainment and limits in
    ``by_seed`` (seed order)."""
    first = group[0]
    prefill = _mean(((p.get("prefill") or {}).get("computed_fraction") for p in group), 4)
    died = {k: v for p in group for k, v in (p.get("server_died") or {}).items()}
    by_seed = [{"seed": point_seed(p), "goodput": p["result"]["goodput"],
                "attainment": p["result"]["attainment"], "limits": p.get("limits")} for p in group]
    return {"workload": first["workload"], "rate": first["rate"], "router": first["router"],
            "limits": first.get("limits"), "command": first.get("command"),
            "result": _mean_result([p["result"] for p in group]),
            "prefill": {"computed_fraction": prefill}, "cpu": _mean_cpu(group),
            **({"server_died": died} if died else {}), "by_seed": by_seed}


def seed_goodputs(row: dict) -> dict[int, float]:
    """A comparison row's goodput per arrival seed."""
    if "by_seed" in row:
        return {s["seed"]: s["goodput"] for s in row["by_seed"]}
    return {point_seed(row): row["result"]["goodput"]}


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
WIN_MARGIN = 0.03  # goodputs within 3% are a tie (see the sweep tables' spread)


def comparison_cells(points: Iterable[dict]) -> list[tuple[tuple[str, float], dict[str, dict]]]:
    """The comparison's rows per (workload, rate), in order, each cell's rows by router."""
    by_cell: dict[tuple, dict[str, dict]] = {}
    for row in comparison_rows(points):
        by_cell.setdefault((row["workload"], row["rate"]), {})[row["router"]] = row

    def position(item: tuple) -> tuple:
        (workload, rate), _ = item
        return WORKLOADS.index(workload) if workload in WORKLOADS else 99, rate

    return sorted(by_cell.items(), key=position)


def against(mine: Sequence[dict], theirs: Sequence[dict]) -> dict | None:
    """One side's best row (the highest mean goodput) against the other side's best at each
    seed the best row ran (the highest goodput among its rows at that seed, a tuned smg
    router at the limits tuned for that seed): the seeds, each seed's goodputs and ratio,
    the means over those seeds and their ratio (None: no seed in common)."""
    best = max(mine, key=lambda r: r["result"]["goodput"])
    own = seed_goodputs(best)
    rival_at = _best_per_seed(theirs, own)
    if not rival_at:
        return None
    per_seed = [{"seed": s, "goodput": own[s], "rival": rival["router"], "rival_goodput": goodput,
                 "ratio": _ratio(own[s], goodput)}
                for s, (rival, goodput) in sorted(rival_at.items())]
    g = _seed_mean(s["goodput"] for s in per_seed)
    h = _seed_mean(s["rival_goodput"] for s in per_seed)
    rivals = "/".join(dict.fromkeys(s["rival"] for s in per_seed))
    return {"best": best["router"], "goodput": g, "rival": rivals, "rival_goodput": h,
            "ratio": _ratio(g, h), "seeds": [s["seed"] for s in per_seed], "per_seed": per_seed}


def _best_per_seed(rows: Sequence[dict], seeds: Iterable[int]) -> dict[int, tuple[dict, float]]:
    """Per seed of ``seeds``, the row of ``rows`` with the highest goodput there (the first
    at a tie) and that goodput."""
    wanted = set(seeds)
    best: dict[int, tuple[dict, float]] = {}
    for row in rows:
        for seed, goodput in seed_goodputs(row).items():
            if seed in wanted and (seed not in best or goodput > best[seed][1]):
                best[seed] = (row, goodput)
    return best


def _seed_mean(values: Iterable[float]) -> float:
    values = list(values)
    return values[0] if len(values) == 1 else round(fmean(values), 3)


def _ratio(g: float, h: float) -> float | None:
    return round(g / h, 4) if h else None


def _cell_text(workload: str, rate: float, seeds: Sequence[int]) -> str:
    text = f"{workload} at {rate:g} req/s"
    return text if len(seeds) == 1 else f"{text}, mean over seeds {', '.join(map(str, seeds))}"


def _per_seed_ratios(verdict: dict) -> str:
    """``; per seed: seed 0 1.20x, ...`` for a verdict over several seeds, else nothing."""
    if len(verdict["seeds"]) == 1:
        return ""
    ratios = (f"seed {s['seed']} " + ("-" if s["ratio"] is None else f"{s['ratio']:.2f}x")
              for s in verdict["per_seed"])
    return "; per seed: " + ", ".join(ratios)


def wins(points: Sequence[dict], side: str) -> list[str]:
    """Plain sentences: where the best configuration of ``side`` ("smg" or "cp", the
    daemon) has more goodput than the best of the other (by more than ``WIN_MARGIN``); at a
    goodput tie, a TTFT p99 at most 2/3 of the other's; a lower added latency (every
    configuration of one side below every one of the other); less router CPU. Where a point
    ran at several seeds: the side's configuration with the highest mean goodput against the
    other's best at each seed (:func:`against`), the ratio of the means and each seed's."""
    other = "cp" if side == "smg" else "smg"
    name, other_name = SIDES[side]
    lines = []
    for (workload, rate), cell in comparison_cells(points):
        mine = [p for r, p in cell.items() if r.startswith(side)]
        theirs = [p for r, p in cell.items() if r.startswith(other)]
        if not mine or not theirs:
            continue
        verdict = against(mine, theirs)
        if verdict is None:
            continue
        g, h = verdict["goodput"], verdict["rival_goodput"]
        where = _cell_text(workload, rate, verdict["seeds"])
        if g > h * (1 + WIN_MARGIN):
            ratio = f"{g / h:.2f}x" if h else "the other serves nothing in its SLO"
            lines.append(f"goodput, {where}: {g:.2f} ({verdict['best']}) against "
                         f"{h:.2f} ({verdict['rival']}), {ratio}{_per_seed_ratios(verdict)}")
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
                    lines.append(f"TTFT p99 at equal goodput (within {100 * WIN_MARGIN:.0f}%), "
                                 f"{where}: {ta:.0f} ms ({fa['router']}) against {tb:.0f} ms "
                                 f"({fb['router']})")
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


def seed_verdicts(points: Sequence[dict]) -> list[dict]:
    """Per (workload, rate) that ran at several seeds: the daemon's configuration with the
    highest mean goodput against smg's best at each seed (:func:`against`)."""
    verdicts = []
    for (workload, rate), cell in comparison_cells(points):
        daemon = [p for r, p in cell.items() if r.startswith("cp")]
        smg = [p for r, p in cell.items() if r.startswith("smg")]
        verdict = against(daemon, smg) if daemon and smg else None
        if verdict is not None and len(verdict["seeds"]) > 1:
            verdicts.append({"workload": workload, "rate": rate, **verdict})
    return verdicts


def auto_notes(points: Sequence[dict]) -> list[str]:
    """Notes the points call for: server crashes, the machine's load."""
    notes = []
    died = [p for p in points if p.get("server_died") and "result" in p]
    if died:
        several = len(seeds_of(points)) > 1
        seen = sorted({f"{p['workload']} at {p['rate']:g} req/s through {router_label(p)}"
                       + (f", seed {point_seed(p)}" if several else "") for p in died})
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
