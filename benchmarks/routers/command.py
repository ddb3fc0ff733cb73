"""``python -m benchmarks.routers``: the command line, the run's metadata, and the page
rendered at the end (``--render-only``: from the saved points alone)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import routers
from benchmarks.routers.rendering import write_outputs
from benchmarks.routers.runs import DEFAULT_SECONDS, QUICK_SECONDS, Bench, Plan
from benchmarks.routers.stack import ROUTERS, SERVER_ARGS, SMG_CA_EXTRA, DaemonSettings, Stack
from benchmarks.routers.limit_sweep import (
    MAX_EXTENSIONS,
    QUICK_SWEEP_CONCURRENCY,
    QUICK_SWEEP_QUEUE,
    SWEEP_CONCURRENCY,
    SWEEP_QUEUE,
    SWEEP_QUEUE_AT,
)
from benchmarks.routers.traffic import (
    DEFAULT_RATES,
    QUICK_RATES,
    SEED,
    WORKLOADS,
    chars_per_token,
    single_token_words,
)
from benchmarks.support.machine import cpu_model
from benchmarks.support.paths import DOCS_BENCH, REPO, relative
from benchmarks.support.points import load_points, move_aside
from sglang_ext.provenance import git_state

RAW_ROOT = REPO / "out" / "bench_routers"
DEFAULT_POINTS = RAW_ROOT / "points.jsonl"
DEFAULT_OUT = DOCS_BENCH


def versions(smg: str) -> dict:
    out = {}
    try:
        text = subprocess.run([str(Path(smg).parent / "python"), "-c",
                               "import importlib.metadata as m; print(m.version('smg'))"],
                              capture_output=True, text=True, timeout=60).stdout.strip()
        out["smg_version"] = text or "?"
    except (OSError, subprocess.TimeoutExpired):
        out["smg_version"] = "?"
    try:
        import importlib.metadata as md

        out["sglang_version"] = md.version("sglang")
    except Exception:  # noqa: BLE001
        out["sglang_version"] = "?"
    return out


def machine_text() -> str:
    model = cpu_model() or "unknown CPU"
    memory = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f", {kb / 1024 / 1024:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return f"{os.cpu_count()} vCPUs ({model}){memory}, shared with other jobs"


def find_smg(explicit: str | None) -> str | None:
    for candidate in (explicit, os.environ.get("FB_SMG")):
        if candidate:
            return candidate
    from shutil import which

    return which("smg")


def parse_rates(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_seeds(text: str | None) -> tuple[int, ...]:
    """``--seeds``: distinct arrival seeds in the order given (none given: :data:`SEED`)."""
    seeds = tuple(dict.fromkeys(parse_ints(text or "")))
    return seeds or (SEED,)


def build_plan(args: argparse.Namespace) -> Plan:
    rates = dict(QUICK_RATES if args.quick else DEFAULT_RATES)
    if args.azure_rates:
        rates["azure"] = parse_rates(args.azure_rates)
    if args.prefix_rates:
        rates["prefix"] = parse_rates(args.prefix_rates)
    if getattr(args, "bursty_rates", None):
        rates["bursty"] = parse_rates(args.bursty_rates)
    workloads = tuple(w for w in args.workloads.split(",") if w)
    for w in workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
    for r in args.routers.split(","):
        if r and r not in ROUTERS:
            raise SystemExit(f"unknown router {r!r}; known: {', '.join(ROUTERS)}")
    return Plan(
        workloads=workloads, rates=rates,
        seconds=args.seconds or (QUICK_SECONDS if args.quick else DEFAULT_SECONDS),
        sweep_concurrency=parse_ints(args.sweep_concurrency) if args.sweep_concurrency else
        (QUICK_SWEEP_CONCURRENCY if args.quick else SWEEP_CONCURRENCY),
        sweep_queue=parse_ints(args.sweep_queue) if args.sweep_queue is not None else
        (QUICK_SWEEP_QUEUE if args.quick else SWEEP_QUEUE),
        sweep_queue_at=args.sweep_queue_at,
        max_extensions=args.max_extensions if args.max_extensions is not None else
        (0 if args.quick else MAX_EXTENSIONS), quick=args.quick,
        routers=tuple(r for r in args.routers.split(",") if r),
        per_rate=not getattr(args, "no_per_rate", False),
        seeds=parse_seeds(getattr(args, "seeds", None)),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.routers",
                                     description=routers.__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one rate per workload, short runs, a 3-point sweep")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--azure-rates", help="comma-separated req/s")
    parser.add_argument("--prefix-rates", help="comma-separated req/s")
    parser.add_argument("--bursty-rates", help="comma-separated req/s")
    parser.add_argument("--seconds", type=float, help="seconds of arrivals per run")
    parser.add_argument("--seeds", default=str(SEED),
                        help="comma-separated arrival seeds: every run once per seed, the tuned "
                        "smg routers swept per seed (default: %(default)s)")
    parser.add_argument("--sweep-concurrency", help="smg cache_aware --max-concurrent-requests grid")
    parser.add_argument("--sweep-queue", help="smg cache_aware --queue-size grid ('' = not swept)")
    parser.add_argument("--sweep-queue-at", type=int, default=SWEEP_QUEUE_AT,
                        help="the queue size while the concurrency limit is swept")
    parser.add_argument("--max-extensions", type=int, help=f"grid extensions per swept dimension "
                        f"(default {MAX_EXTENSIONS}; 0 with --quick)")
    parser.add_argument("--routers", default=",".join(ROUTERS), help="the comparison's routers (a subset)")
    parser.add_argument("--smg-ca-extra", default=shlex.join(SMG_CA_EXTRA),
                        help="extra smg flags for cache_aware (default: %(default)s)")
    parser.add_argument("--smg", help="the smg executable (default: $FB_SMG, then smg on PATH)")
    parser.add_argument("--points", type=Path, default=DEFAULT_POINTS)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for routers.md / routers.json")
    parser.add_argument("--render-only", action="store_true")
    parser.add_argument("--note", action="append", default=[],
                        help="with --render-only: add a note to the page (kept with the points)")
    parser.add_argument("--append", action="store_true",
                        help="keep the points file and run only what it lacks (e.g. a per-rate sweep)")
    parser.add_argument("--no-per-rate", action="store_true",
                        help="no per-rate concurrency sweep where the top rate's limits leave misses")
    args = parser.parse_args(argv)
    meta_path = args.points.with_suffix(".meta.json")
    if args.render_only:
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        if args.note:
            meta["notes"] = [*meta.get("notes", []), *args.note]
            meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        write_outputs(load_points(args.points), meta, args.out)
        return 0
    smg = find_smg(args.smg)
    if not smg or not Path(smg).exists():
        print("error: smg not found: install the bench-router extra (scripts/bench_routers.sh does) "
              "and pass --smg or set FB_SMG", file=sys.stderr)
        return 2
    plan = build_plan(args)
    os.chdir(REPO)  # the servers and the daemon import this checkout's packages
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    raw = args.points.parent / stamp
    raw.mkdir(parents=True, exist_ok=True)
    moved = None if args.append else move_aside(args.points)
    if moved:
        print(f"previous points kept as {relative(moved)}", file=sys.stderr)
    from sglang_ext.adapter.emulated_gpu.tiny_model import write_tiny_model

    write_tiny_model(raw / "model")
    words = single_token_words(raw / "model" / "tokenizer.json")
    argv_text = shlex.join(sys.argv[1:] if argv is None else list(argv))
    meta = {
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_state(REPO),
        "machine": machine_text(), "seconds": plan.seconds, "quick": plan.quick, **versions(smg),
        "plan": asdict(plan), "raw": str(relative(raw)), "points": str(relative(args.points)),
        "commands": [f"scripts/bench_routers.sh {argv_text}".strip(),
                     "# servers (x2): FAIRBATCHING_CONFIG=... FAIRBATCHING_EMULATED_GPU=llama3.1-8b-h100 "
                     "FAIRBATCHING_EMULATED_GPU_TIME_SCALE=2 FAIRBATCHING_CONTROLPLANE=tcp://127.0.0.1:R "
                     "FAIRBATCHING_CONTROLPLANE_REPORTS=tcp://127.0.0.1:P FAIRBATCHING_RANK_NAME=bench-a|b "
                     "python -m sglang.launch_server --model-path <tiny model> "
                     + " ".join(("--device cpu --load-format dummy --attention-backend torch_native "
                                 "--disable-cuda-graph --tp 1 --sleep-on-idle",) + SERVER_ARGS)],
        "words": len(words), "chars_per_token": round(chars_per_token(words), 2),
        "notes": [],
    }
    meta["provenance"] = {"commit": meta["git"]["commit"], "dirty": meta["git"]["dirty"]}
    if args.append and meta_path.exists():  # one page for both invocations
        old = json.loads(meta_path.read_text())
        meta["started"] = old.get("started", meta["started"])
        meta["commands"] = [*old.get("commands", [])[:1], meta["commands"][0], *old.get("commands", [])[1:]]
        meta["notes"] = old.get("notes", [])
        meta["raw"] = f"{old.get('raw', '?')}, {meta['raw']}"
    meta_path.parent.mkdir(parents=True, exist_ok=True)
    stack = Stack(raw, smg, words)
    stack.smg_ca_extra = tuple(shlex.split(args.smg_ca_extra))

    def on_signal(signum, frame):  # noqa: ARG001 - clean up the process groups on a kill
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        print(f"starting two servers (logs in {relative(raw)}) ...", file=sys.stderr, flush=True)
        stack.spawn_daemon(DaemonSettings())  # first: the servers' ingress joins it at start-up
        stack.start_servers()
        stack.wait_daemon()
        bench = Bench(plan, stack, args.points, meta)
        for workload in plan.workloads:
            bench.workload(workload)
        if not any(c.startswith("# daemon config") for c in meta["commands"]):
            meta["commands"].append(stack.daemon_config_comment())
    finally:
        stack.close()
        meta["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    write_outputs(load_points(args.points), meta, args.out)
    return 0
