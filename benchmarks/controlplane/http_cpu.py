"""What the control plane costs in CPU behind its OpenAI HTTP API: CPU-seconds per streamed
token and per 1,000 requests of the processes between an HTTP client and the ranks.

    python -m benchmarks.controlplane.http_cpu [--modes gateway,embedded] [--source DIR]
        [--label NAME] [--seconds S] [--rate R]
        [--workload short|prefix] [--json PATH]

One machine, loopback: one process of two simulated ranks in real time
(``python -m sglang_ext.sim.rank``), the control plane in front of them, and the load
generator (this process, aiohttp): Poisson arrivals at ``RATE`` req/s (``--rate``) of
streamed completions, 100-200 output tokens each (``ignore_eos``), a 64-token prompt, as
in ``benchmarks.controlplane.cpu_cost``'s streamed part; or (``--workload prefix``) the
router benchmark's shared prefixes (about 4,200-token text prompts, 32-128 output tokens),
where a request's own handling weighs more against its tokens. Modes:

- ``gateway``: the daemon (``serve``) and the gateway (``gateway``), two processes;
- ``embedded``: ``serve --http``, one process.

CPU (user + system, every thread) is read from ``/proc`` over the load window for the
control plane's processes and for the ranks. ``--source DIR`` runs the control plane and
the ranks from another checkout (e.g. ``git archive`` of an older commit; only ``gateway``
mode exists there), with a minimal daemon config (addresses and log level), so that one
harness measures before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from benchmarks.controlplane.cpu_cost import CpuWindow, machine_load
from benchmarks.support.paths import REPO
from benchmarks.support.ports import free_ports
from benchmarks.support.processes import spawn, stop_group

RATE = 5.0
SECONDS = 20.0
PROMPT = [17] * 64
MODES = ("gateway", "embedded")


@dataclass
class HttpStack:
    """Simulated ranks and the control plane in front of them, run from ``source``."""

    source: Path
    scratch: Path
    mode: str

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {', '.join(MODES)}")
        self.scratch.mkdir(parents=True, exist_ok=True)
        client, rank, report, self.port = free_ports(4)
        self.addresses = {"client": f"tcp://127.0.0.1:{client}", "rank": f"tcp://127.0.0.1:{rank}",
                          "report": f"tcp://127.0.0.1:{report}"}
        config = self.scratch / "daemon.toml"
        config.write_text("[daemon]\n" + "".join(f'{k}_address = "{v}"\n' for k, v in self.addresses.items())
                          + 'log_level = "warning"\n')
        env = {**os.environ, "PYTHONPATH": str(self.source), "PYTHONUNBUFFERED": "1"}
        listen = f"127.0.0.1:{self.port}"
        http = ["--http", listen] if self.mode == "embedded" else []
        self.processes = {"daemon": spawn([sys.executable, "-m", "controlplane", "serve", "--config", str(config),
                                           *http], self.scratch / "daemon.log", env=env, cwd=self.source)}
        if self.mode == "gateway":
            self.processes["gateway"] = spawn(
                [sys.executable, "-m", "controlplane", "gateway", "--daemon", self.addresses["client"],
                 "--listen", listen], self.scratch / "gateway.log", env=env, cwd=self.source)
        self.processes["ranks"] = spawn(
            [sys.executable, "-m", "sglang_ext.sim.rank", "--daemon", self.addresses["rank"], "--ranks", "2",
             "--agent-id", "cpu", "--log-level", "warning"], self.scratch / "ranks.log", env=env, cwd=self.source)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/completions"

    def window(self) -> CpuWindow:
        return CpuWindow({name: process.pid for name, process in self.processes.items()})

    def close(self) -> None:
        for process in self.processes.values():
            stop_group(process, timeout=5)


async def wait_ready(stack: HttpStack, timeout_s: float = 60.0) -> None:
    """Until a completion through the stack succeeds (the ranks have joined)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.post(stack.url, json={"prompt": PROMPT, "max_tokens": 1}) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stack never answered; logs in {stack.scratch}")
            await asyncio.sleep(0.2)


WORKLOADS = ("short", "prefix")
PREFIX_WORDS = tuple(f"w{i:03d}" for i in range(1000))  # one token each, roughly: 5 characters


def bodies(workload: str, rate: float, duration_s: float, seed: int = 0) -> list[tuple[float, dict]]:
    """The run's requests, (arrival offset, body): ``short`` is the 64-token prompt and
    100-200 output tokens above; ``prefix`` the router benchmark's shared-prefix workload
    (:func:`benchmarks.routers.traffic.prefix_requests`) as text of 5-character words."""
    if workload == "short":
        rng = random.Random(seed)
        times, at = [], 0.0
        while at < duration_s:
            times.append(at)
            at += rng.expovariate(rate)
        return [(t, {"prompt": PROMPT, "max_tokens": rng.randint(100, 200)}) for t in times]
    if workload == "prefix":
        from benchmarks.routers.traffic import prefix_requests, prompt_text
        return [(r.at_s, {"prompt": prompt_text(r, PREFIX_WORDS, seed), "max_tokens": r.output_tokens})
                for r in prefix_requests(rate, duration_s, seed)]
    raise ValueError(f"unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}")


async def open_loop(url: str, requests: list[tuple[float, dict]]) -> dict:
    """Streamed completions sent at their offsets; tokens counted from their events."""
    done = {"finished": 0, "failed": 0, "tokens": 0}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(request: dict) -> None:
            body = {**request, "ignore_eos": True, "stream": True, "slo": "relaxed"}
            try:
                async with session.post(url, json=body) as response:
                    if response.status != 200:
                        done["failed"] += 1
                        return
                    async for line in response.content:
                        if line.startswith(b"data: {") and b'"text":""' not in line:
                            done["tokens"] += 1
                done["finished"] += 1
            except aiohttp.ClientError:
                done["failed"] += 1

        tasks = []
        started = time.monotonic()
        for at, request in requests:
            await asyncio.sleep(max(0.0, started + at - time.monotonic()))
            tasks.append(asyncio.create_task(one(request)))
        await asyncio.gather(*tasks)
    return done


def run(source: Path, scratch: Path, mode: str, seconds: float, rate: float = RATE,
        workload: str = "short") -> dict:
    stack = HttpStack(source, scratch, mode)
    try:
        asyncio.run(wait_ready(stack))
        window = stack.window()
        window.start()
        requests = bodies(workload, rate, seconds)
        done = asyncio.run(open_loop(stack.url, requests))
        window.stop()
    finally:
        stack.close()
    plane = sum(v for k, v in window.used.items() if k != "ranks")
    tokens, requests = max(1, done["tokens"]), max(1, done["finished"])
    return {
        "mode": mode, "workload": workload, "rate": rate, **done, "seconds": round(window.seconds, 2),
        "cpu_s": {k: round(v, 3) for k, v in window.used.items()},
        "control_plane_cpu_s_per_1k_requests": round(plane / requests * 1e3, 2),
        "control_plane_cpu_us_per_token": round(plane / tokens * 1e6, 1),
        "cpu_us_per_token": {k: round(v / tokens * 1e6, 1) for k, v in window.used.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: gateway, embedded")
    parser.add_argument("--source", type=Path, default=REPO, help="the checkout to run (default: this one)")
    parser.add_argument("--label", default="", help="a name for this source in the output")
    parser.add_argument("--seconds", type=float, default=SECONDS, help="seconds of arrivals per mode")
    parser.add_argument("--rate", type=float, default=RATE, help="arrivals per second (Poisson)")
    parser.add_argument("--workload", choices=WORKLOADS, default="short",
                        help="short (default): 64-token prompts, 100-200 output tokens; prefix: the router "
                             "benchmark's shared prefixes")
    parser.add_argument("--json", type=Path, help="append one JSON line per mode here")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    with tempfile.TemporaryDirectory() as scratch:
        for mode in modes:
            row = {"label": args.label, "source": str(args.source), "load_before": machine_load(),
                   **run(args.source.resolve(), Path(scratch) / mode, mode, args.seconds, args.rate, args.workload),
                   "load_after": machine_load()}
            print(json.dumps(row), flush=True)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                with args.json.open("a") as out:
                    out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
