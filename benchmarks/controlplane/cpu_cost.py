"""What the control plane costs in CPU: seconds per 1,000 requests and per streamed token,
the idle floor, and the one-core ceiling.

    python -m benchmarks.controlplane.cpu_cost [--quick] [--json PATH] [--only PART,...]
        [--coalesce-ms MS]

One machine, loopback: the daemon (`python -m controlplane serve`), one process of
simulated ranks (`python -m sglang_ext.sim.rank`) and the load generator, this process
(the SDK, ``AsyncClient``, as the gateway uses it). CPU is read from ``/proc`` (user +
system, every thread) for each process over the measured window only, so another job on
the machine slows the run but hardly changes the CPU-seconds.

- **idle**: 2 ranks joined, no requests, for ``IDLE_S``: each process's share of a core.
- **streamed** / **unstreamed**: 2 ranks in real time, Poisson arrivals at ``RATE`` req/s,
  100-200 output tokens each (``ignore_eos``); CPU-seconds per 1,000 requests and
  microseconds per output token, per process.
- **ceiling**: the daemon pinned to one core (``taskset``), 8 ranks at time scale 0.01,
  closed loop with 64 requests outstanding; 1-token requests (requests/s) and 200-token
  streams (tokens/s). Besides what was reached, the rate the daemon's core would carry
  (reached / the daemon's share of its core).

``--coalesce-ms MS`` (0 to 50, default 0) starts the simulated ranks with ``--coalesce-ms
MS``: their agent holds output up to MS ms so that the steps within it share one message
(fewer messages per streamed token, up to MS ms added per token). The JSON records it.

``--json`` writes the figures; ``docs/bench/controlplane_cpu.md`` records runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.controlplane.live_daemon import loopback_config, start_process_daemon
from benchmarks.controlplane.sim_ranks_and_gateway import start_sim_ranks, wait_for_ranks
from benchmarks.support.processes import stop_group
from controlplane.cli_args import coalesce_ms
from controlplane.client import AsyncClient
from controlplane.protocol import SamplingParams

RATE = 5.0
IDLE_S = 10.0
PROMPT = [17] * 64
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU-seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


class CpuWindow:
    """CPU-seconds of named processes between :meth:`start` and :meth:`stop`."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._start: dict[str, float] = {}
        self._wall = 0.0
        self.used: dict[str, float] = {}
        self.seconds = 0.0

    def start(self) -> None:
        self._wall = time.monotonic()
        self._start = {name: cpu_s(pid) for name, pid in self.pids.items()}

    def stop(self) -> None:
        self.seconds = time.monotonic() - self._wall
        self.used = {name: cpu_s(pid) - self._start[name] for name, pid in self.pids.items()}


def machine_load() -> float:
    return round(os.getloadavg()[0], 2)


async def open_loop(address: str, rate: float, duration_s: float, stream: bool, seed: int = 0) -> dict:
    rng = random.Random(seed)
    done = {"finished": 0, "failed": 0, "tokens": 0}

    async with AsyncClient(address, daemon_timeout_s=30.0) as client:
        await client.ping()

        async def one(index: int) -> None:
            sampling = SamplingParams(max_new_tokens=rng.randint(100, 200), ignore_eos=True)
            try:
                if stream:
                    async with client.stream(PROMPT, sampling=sampling, slo="relaxed",
                                             request_id=f"c{index}") as chunks:
                        async for chunk in chunks:
                            done["tokens"] += len(chunk.token_ids)
                else:
                    result = await client.generate(PROMPT, sampling=sampling, slo="relaxed",
                                                   request_id=f"c{index}")
                    done["tokens"] += len(result.token_ids)
                done["finished"] += 1
            except Exception:
                done["failed"] += 1

        tasks = []
        started = time.monotonic()
        index = 0
        next_at = started
        while next_at < started + duration_s:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            tasks.append(asyncio.create_task(one(index)))
            index += 1
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return done


async def closed_loop(address: str, concurrency: int, duration_s: float, tokens: int) -> dict:
    done = {"finished": 0, "failed": 0, "tokens": 0}
    stop_at = time.monotonic() + duration_s
    sampling = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    async with AsyncClient(address, daemon_timeout_s=30.0) as client:
        await client.ping()

        async def worker(number: int) -> None:
            index = 0
            while time.monotonic() < stop_at:
                index += 1
                try:
                    async with client.stream(PROMPT[:32], sampling=sampling, slo="relaxed",
                                             request_id=f"w{number}-{index}") as chunks:
                        async for chunk in chunks:
                            done["tokens"] += len(chunk.token_ids)
                    done["finished"] += 1
                except Exception:
                    done["failed"] += 1
                    await asyncio.sleep(0.01)

        await asyncio.gather(*(worker(n) for n in range(concurrency)))
    return done


class Stack:
    """A daemon and one process of simulated ranks."""

    def __init__(self, scratch: Path, ranks: int, time_scale: float, pin_daemon: bool = False,
                 coalesce_ms: float = 0.0):
        scratch.mkdir(parents=True, exist_ok=True)
        self.config = loopback_config(stale_after_s=2.0, log_level="warning", max_in_flight=100_000)
        self.daemon = start_process_daemon(scratch, self.config)
        if pin_daemon and shutil.which("taskset"):
            subprocess.run(["taskset", "-a", "-p", "-c", "0", str(self.daemon.process.pid)],
                           check=True, stdout=subprocess.DEVNULL)
        self.ranks = start_sim_ranks(self.config, scratch / "ranks.log", ranks=ranks, agent_id="cpu",
                                     time_scale=time_scale,
                                     extra=["--coalesce-ms", f"{coalesce_ms:g}"])
        wait_for_ranks(self.config.client_address, ranks)

    def window(self) -> CpuWindow:
        return CpuWindow({"daemon": self.daemon.process.pid, "ranks": self.ranks.pid,
                          "client": os.getpid()})

    def close(self) -> None:
        stop_group(self.ranks, timeout=5)
        self.daemon.terminate()


def per_request(window: CpuWindow, done: dict) -> dict:
    requests = max(1, done["finished"])
    tokens = max(1, done["tokens"])
    return {
        **done, "seconds": round(window.seconds, 2),
        "cpu_s": {k: round(v, 3) for k, v in window.used.items()},
        "cpu_s_per_1k_requests": {k: round(v / requests * 1e3, 2) for k, v in window.used.items()},
        "cpu_us_per_token": {k: round(v / tokens * 1e6, 1) for k, v in window.used.items()},
    }


def run_idle(scratch: Path, seconds: float, coalesce_ms: float = 0.0) -> dict:
    stack = Stack(scratch, ranks=2, time_scale=1.0, coalesce_ms=coalesce_ms)
    try:
        time.sleep(1.0)
        window = stack.window()
        window.start()
        time.sleep(seconds)
        window.stop()
        return {"seconds": round(window.seconds, 2),
                "core_share": {k: round(v / window.seconds, 4) for k, v in window.used.items()
                               if k != "client"}}
    finally:
        stack.close()


def run_load(scratch: Path, seconds: float, stream: bool, coalesce_ms: float = 0.0) -> dict:
    stack = Stack(scratch, ranks=2, time_scale=1.0, coalesce_ms=coalesce_ms)
    try:
        window = stack.window()
        window.start()
        done = asyncio.run(open_loop(stack.config.client_address, RATE, seconds, stream))
        window.stop()
        return {"rate": RATE, **per_request(window, done)}
    finally:
        stack.close()


def run_ceiling(scratch: Path, seconds: float, tokens: int, coalesce_ms: float = 0.0) -> dict:
    stack = Stack(scratch, ranks=8, time_scale=0.01, pin_daemon=True, coalesce_ms=coalesce_ms)
    try:
        window = stack.window()
        window.start()
        done = asyncio.run(closed_loop(stack.config.client_address, 64, seconds, tokens))
        window.stop()
        share = window.used["daemon"] / window.seconds
        row = {"tokens_per_request": tokens, "daemon_core_share": round(share, 3),
               **per_request(window, done)}
        row["requests_per_s"] = round(done["finished"] / window.seconds, 1)
        row["tokens_per_s"] = round(done["tokens"] / window.seconds, 1)
        row["requests_per_s_per_daemon_core"] = round(row["requests_per_s"] / max(share, 1e-9), 1)
        row["tokens_per_s_per_daemon_core"] = round(row["tokens_per_s"] / max(share, 1e-9), 1)
        return row
    finally:
        stack.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter windows")
    parser.add_argument("--only", default="idle,streamed,unstreamed,ceiling",
                        help="comma-separated parts to run")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--coalesce-ms", type=coalesce_ms, default=0.0, metavar="MS",
                        help="the simulated ranks' --coalesce-ms: hold output up to MS ms to "
                             "share a message (0 to 50; default 0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    seconds = 8.0 if args.quick else 20.0
    parts = set(args.only.split(","))
    coalesce = args.coalesce_ms
    results: dict = {"load_before": machine_load(), "cpus": os.cpu_count(), "coalesce_ms": coalesce}
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        if "idle" in parts:
            results["idle"] = run_idle(scratch / "idle", IDLE_S / 2 if args.quick else IDLE_S,
                                       coalesce_ms=coalesce)
            print(json.dumps({"idle": results["idle"]}), flush=True)
        for name, stream in (("streamed", True), ("unstreamed", False)):
            if name in parts:
                results[name] = run_load(scratch / name, seconds, stream, coalesce_ms=coalesce)
                print(json.dumps({name: results[name]}), flush=True)
        if "ceiling" in parts:
            results["ceiling_requests"] = run_ceiling(scratch / "c1", seconds / 2, 1,
                                                      coalesce_ms=coalesce)
            print(json.dumps({"ceiling_requests": results["ceiling_requests"]}), flush=True)
            results["ceiling_tokens"] = run_ceiling(scratch / "c200", seconds / 2, 200,
                                                    coalesce_ms=coalesce)
            print(json.dumps({"ceiling_tokens": results["ceiling_tokens"]}), flush=True)
    results["load_after"] = machine_load()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
