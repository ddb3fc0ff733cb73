"""Control-plane daemon benchmark: routed requests per second, the dispatch latency it
adds, and reports ingested per second.

    python -m benchmarks.controlplane.daemon_throughput [--quick] [--out docs/bench]

Everything runs on this machine over loopback TCP: the daemon (`python -m controlplane
serve`, policy pab) and one process hosting 8 simulated ranks (`python -m
sglang_ext.sim.rank --ranks 8`, time scale 0.01 so ranks are not the bottleneck).

- **Routing**: closed-loop raw clients (the wire protocol, no SDK) keep C requests
  outstanding; each request is 32 prompt tokens and 1 output token. Throughput is
  finished requests per second; *dispatch latency* is a client's Submit until its
  Dispatched reply (receipt, balancing, ledger debit, two loopback hops), p50/p99.
- **Reports**: 8 PUSH sockets send valid reports for 8 registered ranks as fast as they
  can; ingested = the daemon's ``reports_applied`` counter over the window.

The client, the daemon and the ranks share the machine's cores, so the figures are a
floor for the daemon, not its ceiling. Writes ``controlplane.json`` and ``controlplane.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq
import zmq.asyncio

from benchmarks.controlplane.live_daemon import loopback_config, start_process_daemon
from benchmarks.controlplane.sim_ranks_and_gateway import start_sim_ranks, wait_for_ranks
from benchmarks.support.paths import DOCS_BENCH
from benchmarks.support.processes import stop_group
from controlplane import protocol as p

RANKS = 8  # simulated, in one process
RANK_TIME_SCALE = 0.01  # so that the ranks are not the bottleneck
REPLIES = p.client_reply_channel()


async def request(socket, message, timeout_s: float = 10.0):
    await socket.send(p.encode(message))
    return REPLIES.decode(await asyncio.wait_for(socket.recv(), timeout_s))


async def closed_loop(address: str, concurrency: int, duration_s: float) -> dict:
    """``concurrency`` requests outstanding for ``duration_s``; one DEALER per 16 slots."""
    context = zmq.asyncio.Context()
    sockets = []
    for _ in range(max(1, concurrency // 16)):
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(address)
        sockets.append(socket)
    sent_at: dict[str, float] = {}
    dispatch_latency: list[float] = []
    finished = rejected = 0
    stop_at = time.monotonic() + duration_s
    counter = iter(range(10**9))
    prompt = p.Prompt(token_ids=[17] * 32)
    sampling = p.SamplingParams(max_new_tokens=1, ignore_eos=True)

    async def submit(socket) -> None:
        request_id = f"b{next(counter)}"
        sent_at[request_id] = time.monotonic()
        await socket.send(p.encode(p.Submit(request_id, prompt, sampling, p.SloSpec(slo_class="relaxed"),
                                            stream=False, protocol=p.PROTOCOL_VERSION)))

    async def drive(socket, slots: int) -> None:
        nonlocal finished, rejected
        for _ in range(slots):
            await submit(socket)
        outstanding = slots
        while outstanding:
            replies = p.unbatched(REPLIES.decode(await socket.recv()))
            now = time.monotonic()
            for reply in replies:
                if isinstance(reply, p.Dispatched):
                    dispatch_latency.append(now - sent_at[reply.request_id])
                    continue
                sent_at.pop(reply.request_id, None)
                outstanding -= 1
                if isinstance(reply, p.Finish):
                    finished += 1
                else:
                    rejected += 1
                if now < stop_at:
                    await submit(socket)
                    outstanding += 1

    per_socket = [concurrency // len(sockets)] * len(sockets)
    per_socket[0] += concurrency - sum(per_socket)
    started = time.monotonic()
    tasks = [asyncio.create_task(drive(s, n)) for s, n in zip(sockets, per_socket)]
    done, pending = await asyncio.wait(tasks, timeout=duration_s + 30)
    for task in pending:
        task.cancel()
    elapsed = time.monotonic() - started
    for task in done:
        task.result()
    for socket in sockets:
        socket.close()
    context.term()
    latency_ms = np.array(dispatch_latency) * 1e3
    return {
        "concurrency": concurrency, "seconds": round(elapsed, 2), "finished": finished, "rejected": rejected,
        "requests_per_s": round(finished / elapsed, 1),
        "dispatch_latency_ms_p50": round(float(np.percentile(latency_ms, 50)), 3),
        "dispatch_latency_ms_p99": round(float(np.percentile(latency_ms, 99)), 3),
    }


async def report_ingest(config, duration_s: float) -> dict:
    context = zmq.asyncio.Context()
    agent = context.socket(zmq.DEALER)
    agent.setsockopt(zmq.ROUTING_ID, b"bench-agent")
    agent.setsockopt(zmq.LINGER, 0)
    agent.connect(config.rank_address)
    for i in range(RANKS):
        await agent.send(p.encode(p.Hello("bench-agent", f"r{i}", 1, protocol=p.PROTOCOL_VERSION)))
        await asyncio.wait_for(agent.recv(), 10)
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(config.client_address)
    before = (await request(client, p.StatusRequest())).counters.get("reports_applied", 0)
    stop_at = time.monotonic() + duration_s

    async def blast(rank: str) -> int:
        socket = context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 1000)
        socket.connect(config.report_address)
        seq = 0
        while time.monotonic() < stop_at:
            for _ in range(200):
                seq += 1
                await socket.send(p.encode(p.Report(rank, 1, seq, 50_000.0, 3, 1, 4_000, 90_000, 0, 0.02,
                                                    time.monotonic())))
            await asyncio.sleep(0)
        socket.close()
        return seq

    started = time.monotonic()
    sent = sum(await asyncio.gather(*(blast(f"r{i}") for i in range(RANKS))))
    await asyncio.sleep(1.0)
    status = await request(client, p.StatusRequest())
    elapsed = time.monotonic() - started
    applied = status.counters.get("reports_applied", 0) - before
    agent.close()
    client.close()
    context.term()
    return {"seconds": round(elapsed, 2), "sent": sent, "applied": applied,
            "ingested_per_s": round(applied / elapsed), "seq_gaps": status.counters.get("report_seq_gaps", 0)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter windows, fewer load points")
    parser.add_argument("--out", type=Path, default=DOCS_BENCH)
    args = parser.parse_args()
    duration = 4.0 if args.quick else 10.0
    concurrencies = (1, 16, 64) if args.quick else (1, 4, 16, 64, 256)
    results: dict = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                 "platform": platform.platform()}, "ranks": RANKS, "routing": []}
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        config = loopback_config(policy="pab", stale_after_s=2.0, log_level="warning", max_in_flight=100_000)
        daemon = start_process_daemon(scratch, config)
        ranks = start_sim_ranks(config, scratch / "ranks.log", ranks=RANKS, agent_id="bench",
                                time_scale=RANK_TIME_SCALE)
        try:
            wait_for_ranks(config.client_address, RANKS)
            for concurrency in concurrencies:
                row = asyncio.run(closed_loop(config.client_address, concurrency, duration))
                print(json.dumps(row))
                results["routing"].append(row)
        finally:
            stop_group(ranks, timeout=0)
            daemon.terminate()
        config = loopback_config(policy="pab", stale_after_s=2.0, log_level="warning")
        daemon = start_process_daemon(scratch, config, "daemon-reports")
        try:
            results["reports"] = asyncio.run(report_ingest(config, duration))
            print(json.dumps(results["reports"]))
        finally:
            daemon.terminate()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "controlplane.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        "# Control-plane daemon benchmark", "",
        f"`python -m benchmarks.controlplane.daemon_throughput` on {results['machine']['cpus']} CPUs "
        f"(client, daemon and {RANKS} simulated ranks share them), loopback TCP.", "",
        "| outstanding requests | finished req/s | dispatch latency p50 (ms) | p99 (ms) | rejected |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in results["routing"]:
        lines.append(f"| {row['concurrency']} | {row['requests_per_s']} | {row['dispatch_latency_ms_p50']} | "
                     f"{row['dispatch_latency_ms_p99']} | {row['rejected']} |")
    reports = results["reports"]
    lines += ["", f"Reports: {reports['ingested_per_s']} ingested/s ({reports['applied']} of {reports['sent']} "
              f"sent in {reports['seconds']} s; sequence gaps seen: {reports['seq_gaps']}; the difference is "
              f"reports still queued or dropped at a PUSH high-water mark when the counter was read)."]
    (args.out / "controlplane.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
