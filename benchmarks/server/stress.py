"""A stress campaign over HTTP: FairBatching and stock SGLang side by side on the same
hostile schedules, counting what an operator cannot accept.

Both servers (the stock ``python -m sglang.launch_server`` on the emulated GPU, with a
small KV pool and priority scheduling on) run at once and serve the same seeded
schedules in turn, run after run:

- bursts (gamma arrivals, CV 4) of up to ``--concurrency`` open streams;
- long prompts sharing prefixes beside short ones, prompts of half to nearly all of
  what the pool holds, and some past it;
- clients that disconnect mid-stream, and ones that give up before their first token
  (an abort mid-prefill);
- priorities, and SLOs no server can meet beside ordinary ones.

Per configuration it reports: server crashes (the server is restarted and the run
counted), requests without exactly one final answer (a stream that ends without one,
or with two; a clean refusal such as a 400, 429 or 503, as a status or inside the
stream, is an answer), retractions
(``sglang:num_retracted_requests_total``), KV leaked after the drain (SGLang's own
idle check, which logs a leak), stuck requests (still queued or running 120 s after
the last client left, or a client that timed out) and TTFT p99. From the repository
root::

    python -m benchmarks.server.stress --runs 100 --out docs/bench/stress.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.server.emulated import PROFILE, TIME_SCALE, TINY_MODEL_CONTEXT, write_fb_config
from benchmarks.server.stock_server import Server, ServerFailed, launch
from benchmarks.support.paths import REPO
from benchmarks.support.sse import json_events_async

DRAIN_TIMEOUT_S = 120.0
CLIENT_TIMEOUT_S = 300.0
LEAK_MARKERS = ("memory leak", "leak detected")
UNMEETABLE = {"ttft_ms": 30, "tpot_ms": 20}
ORDINARY = ({"class": "interactive"}, {"class": "standard"}, {"class": "relaxed"})


@dataclass(frozen=True)
class Config:
    name: str
    args: tuple[str, ...]
    fairbatching: bool


def configs(pool_tokens: int) -> list[Config]:
    common = ("--max-total-tokens", str(pool_tokens), "--enable-priority-scheduling",
              "--enable-metrics", "--context-length", str(TINY_MODEL_CONTEXT))
    return [Config("fairbatching", common, True),
            Config("stock-mixed-256", (*common, "--enable-mixed-chunk", "--chunked-prefill-size", "256"), False)]


@dataclass(frozen=True)
class Request:
    rid: str
    at_s: float
    prompt: tuple[int, ...]
    max_new_tokens: int
    slo: Mapping[str, Any]
    priority: int
    behaviour: str  # "complete", "disconnect" (after some chunks) or "give_up" (before the first)
    after_chunks: int = 0


def schedule(seed: int, pool_tokens: int, concurrency: int) -> list[Request]:
    """One run's requests, drawn from ``seed``: most runs a burst of 8 to 64 requests,
    one in ten ``concurrency`` requests at once (short outputs then, so a run stays
    minutes at most on a CPU)."""
    rng = random.Random(seed)
    wide = rng.random() < 0.1
    count = concurrency if wide else rng.choice((8, 16, 32, 64))
    outputs = (1, 4, 16, 32) if wide else (1, 8, 32, 128, 512)
    rate = rng.choice((20.0, 60.0, 200.0)) * (8 if wide else 1)
    shape, scale = 1 / 16, 16 / rate  # gamma with CV 4 and mean 1 / rate
    prefixes = [[7 + (i * 31 + g * 97) % 900 for i in range(rng.randint(500, max(600, pool_tokens // 3)))]
                for g in range(3)]
    requests, at = [], 0.0
    for i in range(count):
        at += rng.gammavariate(shape, scale)
        kind = rng.random()
        if kind < 0.4:
            prompt = prefixes[rng.randrange(3)] + [11 + (i * 13 + j) % 800 for j in range(rng.randint(1, 200))]
        elif kind < 0.8:
            prompt = [11 + (i * 17 + j) % 800 for j in range(rng.randint(1, 300))]
        elif kind < 0.95:  # most of what the pool (or the model's context) holds
            near = min(pool_tokens, TINY_MODEL_CONTEXT)
            prompt = [11 + (i * 23 + j) % 800 for j in range(rng.randint(near // 2, near - 600))]
        else:
            prompt = [11 + (i * 19 + j) % 800 for j in range(rng.randint(pool_tokens, 2 * pool_tokens))]
        behaviour = rng.choices(("complete", "disconnect", "give_up"), (0.8, 0.1, 0.1))[0]
        requests.append(Request(
            rid=f"s{seed}-{i}", at_s=at, prompt=tuple(prompt), max_new_tokens=rng.choice(outputs),
            slo=UNMEETABLE if rng.random() < 0.1 else rng.choice(ORDINARY), priority=rng.randint(-3, 3),
            behaviour=behaviour, after_chunks=rng.randint(1, 4)))
    return requests


async def _one(session: Any, url: str, request: Request, started: float) -> dict[str, Any]:
    import aiohttp

    await asyncio.sleep(max(0.0, request.at_s - (time.perf_counter() - started)))
    body = {"rid": request.rid, "input_ids": list(request.prompt), "stream": True, "priority": request.priority,
            "sampling_params": {"max_new_tokens": request.max_new_tokens, "ignore_eos": True,
                                "custom_params": {"slo": dict(request.slo)}}}
    sent = time.perf_counter()
    outcome: dict[str, Any] = {"behaviour": request.behaviour, "finals": 0, "chunks": 0, "ttft_s": None}
    try:
        async with session.post(f"{url}/generate", json=body,
                                timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)) as reply:
            outcome["status"] = reply.status
            if reply.status != 200:
                await reply.read()
                outcome["finals"] = 1  # a refusal is the answer
                return outcome
            if request.behaviour == "give_up":
                await asyncio.sleep(0.05)
                return outcome
            async for event in json_events_async(reply.content):
                if outcome["ttft_s"] is None:
                    outcome["ttft_s"] = time.perf_counter() - sent
                outcome["chunks"] += 1
                if "error" in event:  # a refusal inside the stream (SGLang streams errors)
                    outcome["finals"] += 1
                    outcome["status"] = f"streamed {(event['error'] or {}).get('code', 'error')}"
                elif (event.get("meta_info") or {}).get("finish_reason") is not None:
                    outcome["finals"] += 1
                if request.behaviour == "disconnect" and outcome["chunks"] >= request.after_chunks:
                    return outcome
    except asyncio.TimeoutError:
        outcome["status"] = "client timeout"
    except aiohttp.ClientError as exc:
        outcome["status"] = f"client error: {type(exc).__name__}"
    return outcome


async def _run_clients(url: str, requests: Sequence[Request]) -> list[dict[str, Any]]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        return await asyncio.gather(*(_one(session, url, r, started) for r in requests))


def _metric(url: str, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _drain(url: str) -> bool:
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while time.monotonic() < deadline:
        if _metric(url, "sglang:num_running_reqs") + _metric(url, "sglang:num_queue_reqs") == 0:
            return True
        time.sleep(0.5)
    return False


def run_once(server: Server, seed: int, pool_tokens: int, concurrency: int) -> dict[str, Any]:
    requests = schedule(seed, pool_tokens, concurrency)
    log_start = len(server.log_text())
    retracted_before = _metric(server.url, "sglang:num_retracted_requests_total")
    outcomes = asyncio.run(_run_clients(server.url, requests))
    crashed = not server.alive()
    drained = not crashed and _drain(server.url)
    time.sleep(1.0)  # SGLang's idle check runs on the next idle step
    crashed = crashed or not server.alive()
    log = server.log_text()[log_start:]
    answered = [o for o in outcomes if o["behaviour"] == "complete"]
    ttfts = sorted(o["ttft_s"] for o in answered if o["ttft_s"] is not None)
    return {
        "seed": seed, "requests": len(requests), "crashed": crashed,
        "crash_log": log[-1500:] if crashed else None,
        "not_one_answer": sum(o["finals"] != 1 and o.get("status") not in ("client timeout",) for o in answered),
        "client_timeouts": sum(o.get("status") == "client timeout" for o in outcomes),
        "stuck": 0 if crashed or drained else 1,
        "retracted": None if crashed else _metric(server.url, "sglang:num_retracted_requests_total") - retracted_before,
        "leak_warnings": sum(log.lower().count(marker) for marker in LEAK_MARKERS),
        "statuses": dict(Counter(str(o.get("status")) for o in outcomes)),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
    }


def run_pool(pool_tokens: int, seeds: Sequence[int], concurrency: int, workdir: Path, model_dir: Path,
             only: str | None) -> list[dict[str, Any]]:
    """Every configuration's server up at once, each seed run on each in turn (the
    order alternating), so they see the same machine load; a server that dies is
    counted and restarted."""
    env = {"FAIRBATCHING_EMULATED_GPU": PROFILE, "FAIRBATCHING_EMULATED_GPU_TIME_SCALE": f"{TIME_SCALE:g}"}
    chosen = [c for c in configs(pool_tokens) if only is None or c.name == only]
    envs = {c.name: {**env, **({"FAIRBATCHING_CONFIG": str(write_fb_config(workdir))} if c.fairbatching else {})}
            for c in chosen}
    servers: dict[str, Server] = {}
    results: list[dict[str, Any]] = []
    try:
        for seed in seeds:
            for config in chosen if seed % 2 == 0 else reversed(chosen):
                server = servers.get(config.name)
                if server is None or not server.alive():
                    if server is not None:
                        server.stop()
                    server = servers[config.name] = launch(
                        model_dir, config.args, envs[config.name],
                        workdir / f"{config.name}-{pool_tokens}-{seed}.log")
                result = {"config": config.name, "pool_tokens": pool_tokens,
                          **run_once(server, seed, pool_tokens, concurrency)}
                results.append(result)
                print(json.dumps({k: v for k, v in result.items() if k != "crash_log"}), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return results


def summarise(results: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per configuration, over all pools and per pool (``NAME@POOL``)."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for result in results:
        groups.setdefault(result["config"], []).append(result)
        groups.setdefault(f"{result['config']}@{result['pool_tokens']}", []).append(result)
    table: dict[str, dict[str, Any]] = {}
    for name, runs in sorted(groups.items()):
        ttfts = sorted(r["ttft_p99_s"] for r in runs if r["ttft_p99_s"] is not None)
        table[name] = {
            "runs": len(runs), "requests": sum(r["requests"] for r in runs),
            "crashes": sum(r["crashed"] for r in runs),
            "not_one_answer": sum(r["not_one_answer"] for r in runs),
            "retracted": sum(r["retracted"] or 0 for r in runs),
            "leak_warnings": sum(r["leak_warnings"] for r in runs),
            "stuck": sum(r["stuck"] for r in runs) + sum(r["client_timeouts"] for r in runs),
            "ttft_p99_s_median_over_runs": ttfts[len(ttfts) // 2] if ttfts else None,
        }
    return table


def render(summary: Mapping[str, Mapping[str, Any]], provenance: Mapping[str, Any]) -> str:
    """The summary as a Markdown table (``docs/bench/stress.md``)."""
    lines = ["# Stress over HTTP: FairBatching and stock SGLang on the same schedules", "",
             f"`{provenance.get('command', '')}` at {provenance.get('commit', '?')} "
             f"({provenance.get('date', '?')}, {provenance.get('wall_s', '?')} s)", "",
             "| configuration | runs | requests | crashes | without exactly one answer | retracted "
             "| KV leak warnings | stuck | TTFT p99, median over runs (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in summary.items():
        ttft = row["ttft_p99_s_median_over_runs"]
        lines.append(f"| {name} | {row['runs']} | {row['requests']} | {row['crashes']} | "
                     f"{row['not_one_answer']} | {row['retracted']:g} | {row['leak_warnings']} | "
                     f"{row['stuck']} | {'-' if ttft is None else f'{ttft:.2f}'} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.server.stress", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100, help="runs per configuration and pool (default 100)")
    parser.add_argument("--pools", default="8192,32768", help="KV pool sizes in tokens (default 8192,32768)")
    parser.add_argument("--concurrency", type=int, default=1024, help="most requests in one run (default 1024)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=("fairbatching", "stock-mixed-256"), help="run one configuration")
    parser.add_argument("--out", type=Path, help="write every run and the summary here (JSON), "
                        "and the table beside it (.md)")
    parser.add_argument("--render", type=Path, metavar="JSON", help="only write the table of a saved run")
    args = parser.parse_args(argv)
    if args.render is not None:
        saved = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(render(saved["summary"], saved["provenance"]))
        return 0
    try:
        pools = [int(p) for p in args.pools.split(",") if p]
    except ValueError:
        parser.error(f"--pools: expected comma-separated integers, got {args.pools!r}")
    if args.runs < 1 or args.concurrency < 4 or not pools or min(pools) < 1024:
        parser.error("--runs >= 1, --concurrency >= 4 and pools of at least 1024 tokens")
    from sglang_ext.adapter.emulated_gpu.tiny_model import write_tiny_model
    from sglang_ext.provenance import git_state

    code = git_state(REPO)  # the servers import the checkout as it is now, not at the end
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fb-stress-") as tmp:
        workdir = Path(tmp)
        model_dir = write_tiny_model(workdir / "tiny-model")
        seeds = range(args.seed, args.seed + args.runs)
        for pool in pools:
            try:
                results += run_pool(pool, seeds, args.concurrency, workdir, model_dir, args.only)
            except ServerFailed as exc:
                print(f"a server with a {pool}-token pool did not start: {exc}", file=sys.stderr)
                return 2
    summary = summarise(results)
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        provenance = {**code, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      "wall_s": round(time.perf_counter() - started),
                      "command": " ".join(["python -m benchmarks.server.stress", *(argv or sys.argv[1:])])}
        args.out.write_text(json.dumps({"provenance": provenance, "summary": summary, "runs": results},
                                       indent=1) + "\n")
        args.out.with_suffix(".md").write_text(render(summary, provenance))
    return 0


if __name__ == "__main__":
    sys.exit(main())
