"""The comparison's runs: the plan, and every (workload, rate, router) run saved as a point
as soon as it finishes, once per arrival seed, the tuned smg routers' limits swept first at
each seed."""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.routers.load_generator import probe, run_requests, smg_priority_headers
from benchmarks.routers.records import cpu_per_1000, prefill_summary, summarize
from benchmarks.routers.process_probes import crash_summary
from benchmarks.routers.stack import (
    DAEMON_ROUTERS,
    EMBEDDED_ROUTERS,
    PRIORITY_SMG,
    ROUTERS,
    SMG_QUEUE_TIMEOUT_S,
    TUNED_SMG,
    Router,
    Stack,
    limits_key,
)
from benchmarks.routers.limit_sweep import edge_extension, pick_best, sweep_verdict
from benchmarks.routers.traffic import (
    SEED,
    bundled_azure_lengths,
    point_seed,
    prompt_text,
    workload_requests,
)
from benchmarks.support.points import append_point, load_points

DEFAULT_SECONDS = 30.0
QUICK_SECONDS = 12.0


@dataclass(frozen=True)
class Plan:
    """What to run: workloads and rates, seconds of arrivals per run, the sweep of the
    tuned smg routers' limits, the routers, the arrival seeds (each run once per seed)."""

    workloads: tuple[str, ...]
    rates: dict[str, tuple[float, ...]]
    seconds: float
    sweep_concurrency: tuple[int, ...]
    sweep_queue: tuple[int, ...]
    sweep_queue_at: int
    max_extensions: int
    quick: bool
    routers: tuple[str, ...] = ROUTERS
    per_rate: bool = True
    #: the priority scheduler's slots reserved for ``interactive``: held at the first while C
    #: and Q are swept, then swept at the best C and Q (never C or more)
    sweep_reserved: tuple[int, ...] = (0, 4, 16)
    seeds: tuple[int, ...] = (SEED,)


def smg_limits(c: int, q: int, reserved: int | None = None) -> dict:
    """A tuned smg router's limits: C, Q, the queue timeout and, for the priority
    scheduler's routers, the interactive class's reserved slots."""
    limits = {"max_concurrent": c, "queue_size": q, "queue_timeout_s": SMG_QUEUE_TIMEOUT_S}
    return limits if reserved is None else limits | {"interactive_reserved": reserved}


def run_key(workload: str, rate: float, router: str, limits: dict | None, seed: int) -> tuple:
    """The key of a run: one point per key is run, and one saved is not run again."""
    return (workload, rate, router, limits_key(limits), seed)


def point_key(point: dict) -> tuple:
    """A saved point's :func:`run_key` (a point saved without a seed ran at :data:`SEED`)."""
    return run_key(point["workload"], point["rate"], point["router"], point.get("limits"),
                   point_seed(point))


def run_tag(workload: str, rate: float, router: str, limits: dict | None, seed: int) -> str:
    """A run's name in the log and in its raw files' names (the seed where not the default)."""
    tag = f"{workload}-r{rate:g}-{router}" + ("" if limits is None else "".join(
        f"-{letter}{value}" for letter, value in zip("cqr", limits_key(limits))))
    return tag if seed == SEED else f"{tag}-s{seed}"


class Bench:
    """Runs the plan on a :class:`~benchmarks.routers.stack.Stack`, each run once per seed:
    saved points (``--append``) are not run again."""

    def __init__(self, plan: Plan, stack: Stack, points_path: Path, meta: dict) -> None:
        self.plan = plan
        self.stack = stack
        self.points_path = points_path
        self.meta = meta
        self.azure = bundled_azure_lengths() if "azure" in plan.workloads else None
        self.runs: dict[tuple, dict] = {}
        for p in load_points(points_path):  # --append: runs already saved are not run again
            if "result" in p and "error" not in p:
                self.runs[point_key(p)] = p

    def router(self, name: str, limits: dict | None, tag: str) -> Router:
        if name == "smg-rr":
            return self.stack.start_smg(name, "round_robin", None, tag)
        if name in TUNED_SMG:
            return self.stack.start_smg(name, TUNED_SMG[name], limits, tag)
        self.stack.stop_smg()
        return self.stack.start_daemon(DAEMON_ROUTERS[name], embedded=name in EMBEDDED_ROUTERS)

    def run(self, workload: str, rate: float, name: str, limits: dict | None = None, phase: str = "main",
            tuned: dict | None = None, seed: int = SEED) -> dict:
        key = run_key(workload, rate, name, limits, seed)
        if key in self.runs:
            return self.runs[key]
        tag = run_tag(workload, rate, name, limits, seed)
        print(f"  {tag} ...", file=sys.stderr, flush=True)
        requests = workload_requests(workload, rate, self.plan.seconds, seed, self.azure)
        texts = [prompt_text(r, self.stack.words, seed) for r in requests]
        point = {"workload": workload, "rate": rate, "router": name, "limits": limits, "phase": phase,
                 "seconds": self.plan.seconds, "seed": seed, "requests": len(requests),
                 "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), **self.meta["provenance"]}
        started = time.monotonic()
        try:
            self.ensure_servers(tag)
            router = self.router(name, limits, tag)
            point["command"] = router.command
            direct = [(u, self.stack.served_model) for u in self.stack.server_urls]
            point["probe"] = asyncio.run(probe(router.url, router.model, direct, self.stack.words))
            self.stack.flush()
            for tail in self.stack.tails:
                tail.skip()
            cpu0, servers0 = router.cpu_s(), self.stack.servers_cpu_s()
            load0 = os.getloadavg()
            t0 = time.monotonic()
            headers = smg_priority_headers if name in PRIORITY_SMG else None
            records = asyncio.run(run_requests(router.url, router.model, requests, texts, headers=headers))
            wall = time.monotonic() - t0
            cpu1, servers1 = router.cpu_s(), self.stack.servers_cpu_s()
            time.sleep(0.3)  # the last steps reach the step logs
            dead = [s.log_path.name for s in self.stack.servers if not s.alive()]
            if dead:
                point["server_died"] = {name: crash_summary(self.stack.raw / name) for name in dead}
            computed = sum(t.prefill_tokens() for t in self.stack.tails)
            sent = sum(r.prompt_tokens for r in requests)
            served = sum(r.prompt_tokens for r, rec in zip(requests, records) if rec.status == 200)
            point["result"] = summarize(records, rate)
            point["prefill"] = prefill_summary(sent, served, computed)
            tokens = point["result"]["output_tokens"]  # streamed through the router
            point["cpu"] = {"router_s": round(cpu1 - cpu0, 3), "servers_s": round(servers1 - servers0, 3),
                            "router_s_per_1000": cpu_per_1000(cpu1 - cpu0, len(requests)),
                            "servers_s_per_1000": cpu_per_1000(servers1 - servers0, len(requests)),
                            "output_tokens": tokens,
                            "router_s_per_1000_tokens": cpu_per_1000(cpu1 - cpu0, tokens, 4),
                            "servers_s_per_1000_tokens": cpu_per_1000(servers1 - servers0, tokens, 4),
                            "run_wall_s": round(wall, 2)}
            point["machine_during_run"] = {"load_average_before": load0, "load_average_after": os.getloadavg()}
            point["probe_added"] = {k: point["probe"].get(k) for k in ("direct_ms", "router_ms", "added_ms")}
            if tuned is not None:
                point["tuned"] = tuned
            r = point["result"]
            print(f"  {tag}: goodput {r['goodput']:.2f} ({r['good']}/{r['requests']}), failed {r['failed']}, "
                  f"TTFT p99 {r['ttft_ms']['p99']} ms, TPOT p99 {r['tpot_ms']['p99']} ms, prefill computed "
                  f"{point['prefill']['computed_fraction']}, added {point['probe'].get('added_ms')} ms, "
                  f"router CPU {point['cpu']['router_s_per_1000']} s/1000 req, "
                  f"{point['cpu']['router_s_per_1000_tokens']} s/1000 tokens ({tokens} streamed; "
                  f"{wall:.0f} s)", file=sys.stderr, flush=True)
        except Exception as error:  # noqa: BLE001 - saved with the point, the run goes on
            point["error"] = f"{type(error).__name__}: {error}"
            print(f"  {tag}: FAILED {point['error']}", file=sys.stderr, flush=True)
        point["wall_s"] = round(time.monotonic() - started, 1)
        append_point(self.points_path, point)
        self.runs[key] = point
        return point

    def ensure_servers(self, tag: str) -> None:
        """Restart the servers (and the daemon) when one has died (a crash is saved with the
        point of the run it happened in; the stack starts afresh for the next)."""
        if all(s.alive() for s in self.stack.servers):
            return
        note = f"before {tag}: a server had died; the servers and the daemon were restarted"
        print(f"  {note}", file=sys.stderr, flush=True)
        self.meta["notes"].append(note)
        self.stack.restart()

    def sweep(self, workload: str, router: str = "smg-ca", seed: int = SEED) -> dict:
        """Coordinate sweep of a tuned smg router's limits at the workload's top rate, on the
        arrivals of ``seed``."""
        plan = self.plan
        rate = max(plan.rates[workload])

        prioritised = router in PRIORITY_SMG
        r0 = plan.sweep_reserved[0]

        def measured(c: int, q: int, r: int = r0) -> dict:
            limits = smg_limits(c, q, r if prioritised else None)
            p = self.run(workload, rate, router, limits, phase="sweep", seed=seed)
            result = p.get("result") or {"good": -1, "ttft_ms": {"p99": None}}
            return {"c": c, "q": q, "r": r, "good": result["good"], "ttft_p99": result["ttft_ms"]["p99"]}

        def line(key: str, grid: list[int], fixed: dict, lower: int,
                 below: float = math.inf) -> tuple[int, list[int]]:
            extensions = 0
            while True:
                results = [measured(**{**fixed, key: v}) for v in sorted(grid)]
                best = pick_best(results, key)[key]
                extra = edge_extension(grid, best, lower) if extensions < plan.max_extensions else None
                if extra is None or extra >= below:
                    return best, sorted(grid)
                grid.append(extra)
                extensions += 1

        q0 = plan.sweep_queue_at
        c_best, c_grid = line("c", list(plan.sweep_concurrency), {"q": q0}, 1)
        q_best, q_grid = q0, [q0]
        if plan.sweep_queue:
            q_best, q_grid = line("q", sorted(set(plan.sweep_queue) | {q0}), {"c": c_best}, 0)
        tuned = {"limits": [c_best, q_best], "rate": rate, "concurrency_grid": c_grid,
                 "queue_during_concurrency": q0, "queue_grid": q_grid,
                 "verdicts": {"max_concurrent": sweep_verdict(c_grid, c_best, 1),
                              "queue_size": sweep_verdict(q_grid, q_best, 0) if len(q_grid) > 1 else "not swept"}}
        if prioritised:
            grid = sorted({r for r in plan.sweep_reserved if r < c_best} | {r0})
            r_best, r_grid = line("r", grid, {"c": c_best, "q": q_best}, 0, below=c_best)
            tuned["limits"].append(r_best)
            tuned |= {"reserved_during_limits": r0, "reserved_grid": r_grid}
            tuned["verdicts"]["interactive_reserved"] = sweep_verdict(r_grid, r_best, 0)
        chosen = smg_limits(*tuned["limits"])
        self.save_choice(run_key(workload, rate, router, chosen, seed), tuned=tuned)
        print(f"  {workload}{seed_text(seed)}: {router} tuned to {tuned['limits']} "
              f"({tuned['verdicts']})", file=sys.stderr)
        return tuned

    def save_choice(self, key: tuple, **choice: dict) -> None:
        """The chosen run's point saved again, with the choice."""
        point = dict(self.runs[key], **choice)
        append_point(self.points_path, point)
        self.runs[key] = point

    def workload(self, workload: str) -> None:
        for seed in self.plan.seeds:
            self.workload_at_seed(workload, seed)

    def workload_at_seed(self, workload: str, seed: int) -> None:
        """Every router at every rate on the arrivals of ``seed``, the tuned smg routers'
        limits swept on them first."""
        tuned: dict[str, dict] = {}
        limits: dict[str, dict] = {}
        for router in self.plan.routers:
            if router in TUNED_SMG:
                tuned[router] = self.sweep(workload, router, seed)
                limits[router] = smg_limits(*tuned[router]["limits"])
        for rate in self.plan.rates[workload]:
            for name in self.plan.routers:
                point = self.run(workload, rate, name, limits.get(name), tuned=tuned.get(name),
                                 seed=seed)
                if name in tuned and self.plan.per_rate and rate != tuned[name]["rate"] \
                        and point.get("result", {}).get("attainment", 1.0) < 1.0:
                    self.rate_sweep(workload, rate, tuned[name], name, seed)

    def rate_sweep(self, workload: str, rate: float, tuned: dict, router: str = "smg-ca",
                   seed: int = SEED) -> None:
        """Where the limits tuned at the top rate leave SLO misses at a lower rate, sweep the
        concurrency limit at that rate too (the queue size as tuned), edges extended: each
        rate gets the tuned smg router at its best, as the other benchmarks tune baselines
        per point."""
        c_tuned, q, *reserved = tuned["limits"]
        grid = sorted({c for c in self.plan.sweep_concurrency if not reserved or c > reserved[0]} | {c_tuned})
        extensions = 0
        while True:
            results = []
            for c in sorted(grid):
                limits = smg_limits(c, q, *reserved)
                p = self.run(workload, rate, router, limits, phase="rate-sweep", seed=seed)
                r = p.get("result") or {"good": -1, "ttft_ms": {"p99": None}}
                results.append({"c": c, "good": r["good"], "ttft_p99": r["ttft_ms"]["p99"]})
            best = pick_best(results, "c")["c"]
            extra = edge_extension(grid, best, 1) if extensions < self.plan.max_extensions else None
            if extra is None:
                break
            grid.append(extra)
            extensions += 1
        choice = {"limits": [best, q, *reserved], "grid": sorted(grid), "verdict": sweep_verdict(grid, best, 1)}
        chosen = smg_limits(*choice["limits"])
        self.save_choice(run_key(workload, rate, router, chosen, seed), rate_tuned=choice)
        print(f"  {workload} at {rate:g}{seed_text(seed)}: {router} concurrency re-tuned to "
              f"C={best} ({choice['verdict']})", file=sys.stderr, flush=True)


def seed_text(seed: int) -> str:
    """A log line's mention of the seed (none for the default)."""
    return "" if seed == SEED else f", seed {seed}"
