"""What the OpenAI-compatible gateway costs: the same closed-loop load through the SDK
and through HTTP (``POST /v1/completions``), end-to-end latency p50/p99 and requests/s.

    python -m benchmarks.controlplane.gateway_overhead [--quick] [--out docs/bench]

One machine, loopback: the daemon (`python -m controlplane serve`), one process of 8
simulated ranks (time scale 0.01, so ranks are not the bottleneck), the gateway
(`python -m controlplane gateway`) and the load generator (one process, asyncio:
``AsyncClient.generate`` for the SDK rows, aiohttp for the HTTP rows). Each request is
32 prompt tokens and 1 output token. All of them share the machine's cores, so the
figures are floors. Writes ``gateway.json`` and ``gateway.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import numpy as np

from benchmarks.controlplane.daemon_throughput import RANK_TIME_SCALE, RANKS
from benchmarks.controlplane.live_daemon import loopback_config, start_process_daemon
from benchmarks.controlplane.sim_ranks_and_gateway import start_gateway, start_sim_ranks, wait_for_ranks
from benchmarks.support.paths import DOCS_BENCH
from benchmarks.support.ports import free_port
from benchmarks.support.processes import stop_group
from controlplane.client import AsyncClient
from controlplane.protocol import SamplingParams

PROMPT = [17] * 32
SAMPLING = SamplingParams(max_new_tokens=1, ignore_eos=True)


async def closed_loop(one: Callable[[str], Awaitable[None]], concurrency: int, duration_s: float) -> dict:
    latencies: list[float] = []
    ids = itertools.count()
    stop_at = time.monotonic() + duration_s

    async def worker() -> None:
        while time.monotonic() < stop_at:
            started = time.monotonic()
            await one(f"g{next(ids)}")
            latencies.append(time.monotonic() - started)

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.monotonic() - started
    latency_ms = np.array(latencies) * 1e3
    return {"concurrency": concurrency, "finished": len(latencies), "seconds": round(elapsed, 2),
            "requests_per_s": round(len(latencies) / elapsed, 1),
            "latency_ms_p50": round(float(np.percentile(latency_ms, 50)), 2),
            "latency_ms_p99": round(float(np.percentile(latency_ms, 99)), 2)}


async def measure(client_address: str, http_url: str, concurrencies: tuple[int, ...], duration_s: float) -> list:
    rows = []
    async with AsyncClient(client_address) as client, aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0)) as session:
        async def via_sdk(request_id: str) -> None:
            await client.generate(PROMPT, sampling=SAMPLING, slo="relaxed", request_id=request_id)

        async def via_http(request_id: str) -> None:
            async with session.post(http_url, json={"prompt": PROMPT, "max_tokens": 1, "ignore_eos": True,
                                                    "slo": "relaxed"},
                                    headers={"X-Request-Id": request_id}) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}")

        for concurrency in concurrencies:
            for path, one in (("sdk", via_sdk), ("http", via_http)):
                row = {"path": path, **await closed_loop(one, concurrency, duration_s)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter windows, fewer load points")
    parser.add_argument("--out", type=Path, default=DOCS_BENCH)
    args = parser.parse_args()
    duration = 3.0 if args.quick else 8.0
    concurrencies = (1, 16) if args.quick else (1, 16, 64)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        config = loopback_config(stale_after_s=2.0, log_level="warning", max_in_flight=100_000)
        daemon = start_process_daemon(scratch, config)
        ranks = start_sim_ranks(config, scratch / "ranks.log", ranks=RANKS, agent_id="bench",
                                time_scale=RANK_TIME_SCALE)
        port = free_port()
        gateway = start_gateway(config.client_address, port, scratch / "gateway.log")
        try:
            wait_for_ranks(config.client_address, RANKS)
            rows = asyncio.run(measure(config.client_address, f"http://127.0.0.1:{port}/v1/completions",
                                       concurrencies, duration))
        finally:
            stop_group(gateway, timeout=10)
            stop_group(ranks, timeout=0)
            daemon.terminate()
    results = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "platform": platform.platform()}, "ranks": RANKS, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gateway.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = ["# OpenAI-compatible gateway benchmark", "",
             f"`python -m benchmarks.controlplane.gateway_overhead` on {results['machine']['cpus']} CPUs shared by the load "
             f"generator, the gateway, the daemon and {RANKS} simulated ranks; loopback; 32 prompt tokens, "
             "1 output token per request; end-to-end latency seen by the caller.", "",
             "| outstanding | path | req/s | latency p50 (ms) | p99 (ms) |", "|---:|---|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['concurrency']} | {row['path']} | {row['requests_per_s']} | "
                     f"{row['latency_ms_p50']} | {row['latency_ms_p99']} |")
    (args.out / "gateway.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
