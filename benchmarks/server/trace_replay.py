"""Replay a trace against a running SGLang server and report the simulator's metrics.

Each request is sent at its trace timestamp (after rescaling to the asked rate) to
``/generate`` with exactly the trace's prompt length (as token ids) and output length
(``max_new_tokens`` with ``ignore_eos``), streaming, with its SLO in
``sampling_params.custom_params``. Token arrival times are taken on the client, so the
numbers include HTTP and detokenizer overheads, as a user would see them::

    python -m benchmarks.server.trace_replay --url http://127.0.0.1:30000 --rate 4 --head 60 \\
        --slo-mix interactive:0.5,standard:0.5 --out results.json

A response other than 200 (a 429 of admission control, a 503) counts as a rejection, a
miss in the attainment, as in the simulator.

``--priority class`` sends each request with SGLang's ``priority`` from its SLO class
(tightest TTFT most urgent), ``--priority prompt-length`` with its prompt length (for a
server started with ``--schedule-low-priority-values-first``: shortest first); both need
``--enable-priority-scheduling`` on the server (``benchmarks/server/priority.py``).

The summary is the simulator's (``sglang_ext.sim.metrics.summarize``): attainment overall,
per SLO class and per prompt-length bucket, the worst bucket and the worst class (among
groups of at least 20 requests), token goodput (prompt + output tokens per second of the
requests that met their SLO), latency percentiles. It is printed as JSON, with a one-line
digest on stderr.

Needs ``aiohttp`` (installed with SGLang).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.server.priority import NONE, PRIORITY_MODES, request_priority
from benchmarks.support.sse import json_events_async
from sglang_ext.bundled import CONFIGS_DIR
from sglang_ext.policy.slo import Slo, SloCatalog, SloError
from sglang_ext.sim.metrics import RequestRecord, summarize
from sglang_ext.sim.workloads import Workload, WorkloadError, bundled_sample, load_workload


class ReplayError(ValueError):
    """Bad replay arguments (the CLI prints the message and exits 2)."""


@dataclass(frozen=True)
class ReplayRequest:
    rid: str
    at_s: float
    prompt_tokens: int
    output_tokens: int
    slo_class: str


def plan_requests(
    workload: Workload, slo_mix: Sequence[tuple[str, float]], seed: int, vocab: int = 1000
) -> list[ReplayRequest]:
    """Assign each trace request an SLO class (by ``slo_mix`` weights, seeded) and an id."""
    rng = random.Random(seed)
    names = [name for name, _ in slo_mix]
    weights = [weight for _, weight in slo_mix]
    start = workload.requests[0].arrival_s
    planned = []
    for index, request in enumerate(workload.requests):
        slo_class = request.slo_class or rng.choices(names, weights)[0]
        planned.append(ReplayRequest(f"replay-{seed}-{index}", request.arrival_s - start,
                                     request.prompt_tokens, request.output_tokens, slo_class))
    return planned


def parse_slo_mix(text: str, catalog: SloCatalog) -> list[tuple[str, float]]:
    mix = []
    for part in text.split(","):
        name, _, weight_text = part.strip().partition(":")
        if name not in catalog.classes:
            raise ReplayError(f"--slo-mix: unknown SLO class {name!r}; defined: {', '.join(catalog.classes)}")
        try:
            weight = float(weight_text) if weight_text else 1.0
        except ValueError:
            raise ReplayError(f"--slo-mix: weight of {name!r} must be a number, got {weight_text!r}") from None
        if weight <= 0:
            raise ReplayError(f"--slo-mix: weight of {name!r} must be > 0")
        mix.append((name, weight))
    if not mix:
        raise ReplayError("--slo-mix is empty")
    return mix


async def replay_to_server(
    url: str, requests: Sequence[ReplayRequest], catalog: SloCatalog, *,
    max_prompt_tokens: int | None = None, timeout_s: float = 600.0,
    token_times: dict[str, list[float]] | None = None, priority: str = NONE,
) -> list[RequestRecord]:
    """Send every request at its time; ``token_times``, when given, receives each
    request's send time followed by its token arrival times (``time.perf_counter()``);
    ``priority`` is a mode of :mod:`benchmarks.server.priority`."""
    import aiohttp

    records: list[RequestRecord] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        origin = time.perf_counter()
        tasks = []
        for request in requests:
            delay = origin + request.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            record = RequestRecord(
                request.rid, time.perf_counter() - origin, _server_slo(catalog, request),
                request.prompt_tokens, request.output_tokens, request.slo_class,
            )
            records.append(record)
            arrivals = None
            if token_times is not None:
                arrivals = token_times[request.rid] = [origin + record.arrival]
            prompt = _sent_prompt_tokens(request, max_prompt_tokens)
            tasks.append(asyncio.create_task(_one(
                session, url, request, record, origin, prompt, arrivals,
                request_priority(priority, catalog, request.slo_class, prompt))))
        await asyncio.gather(*tasks)
    return records


def _server_slo(catalog: SloCatalog, request: ReplayRequest) -> Slo:
    """The request's SLO as the server holds it: an end-to-end class's envelope is paced
    for the request's ``max_new_tokens`` (here its trace output length)."""
    return catalog.classes[request.slo_class].with_expected_output(request.output_tokens)


def _sent_prompt_tokens(request: ReplayRequest, max_prompt_tokens: int | None) -> int:
    return request.prompt_tokens if max_prompt_tokens is None else min(request.prompt_tokens, max_prompt_tokens)


def request_body(request: ReplayRequest, prompt: int, priority: int | None = None) -> dict:
    """The ``/generate`` body of one request (``priority`` left out when ``None``)."""
    body = {
        "rid": request.rid,
        # Distinct per request (seeded by its id): a prompt shared by every request would be
        # served from SGLang's prefix cache, and its prefill would cost (almost) nothing.
        "input_ids": random.Random(request.rid).choices(range(11, 911), k=prompt),
        "sampling_params": {
            "max_new_tokens": request.output_tokens,
            "ignore_eos": True,
            "custom_params": {"slo": {"class": request.slo_class}},
        },
        "stream": True,
    }
    if priority is not None:
        body["priority"] = priority
    return body


async def _one(session: Any, url: str, request: ReplayRequest, record: RequestRecord,
               origin: float, prompt: int, arrivals: list[float] | None,
               priority: int | None) -> None:
    from aiohttp import ClientError  # a dropped connection (ServerDisconnectedError) too

    body = request_body(request, prompt, priority)
    try:
        async with session.post(f"{url}/generate", json=body) as response:
            if response.status != 200:
                record.rejected = True
                return
            async for chunk in json_events_async(response.content):
                now = time.perf_counter() - origin
                produced = chunk.get("meta_info", {}).get("completion_tokens", 0)
                while record.tokens_emitted < produced:
                    record.on_token(record.tokens_emitted, now)
                    if arrivals is not None:
                        arrivals.append(origin + now)
                if chunk.get("meta_info", {}).get("finish_reason") is not None:
                    record.finish_s = now
    except (OSError, asyncio.TimeoutError, ClientError):
        record.aborted = True
        return
    if record.tokens_emitted < record.output_tokens:
        # ended by the server before its last token (an abort: a queue limit, a waiting
        # timeout, admission's defer deadline), or the stream broke off
        record.aborted = True
        record.finish_s = None


def write_token_times(path: Path, requests: Sequence[ReplayRequest],
                      token_times: dict[str, list[float]]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for request in requests:
            times = token_times.get(request.rid)
            if times:
                handle.write(json.dumps({"rid": request.rid, "slo_class": request.slo_class,
                                         "sent_at": times[0], "tokens": times[1:]}) + "\n")


def summary_line(summary: dict) -> str:
    """A one-line digest of a summary: attainment, the worst prompt bucket and SLO class,
    token goodput."""
    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.1f}%"

    def worst(group: dict) -> str:
        if group["label"] is None:
            return f"- (no group of >= {group['min_requests']} requests)"
        return f"{group['label']} {pct(group['attainment'])} (n={group['requests']})"

    return (f"attainment {pct(summary['attainment'])} of {summary['requests']}, "
            f"effective RPS {summary['effective_rps']:.2f}; worst prompt bucket "
            f"{worst(summary['worst_prompt_bucket'])}; worst SLO class "
            f"{worst(summary['worst_slo_class'])}; token goodput "
            f"{summary['token_goodput']:,.0f} tok/s")


def _load(args: argparse.Namespace) -> Workload:
    try:
        workload = bundled_sample() if args.trace is None else load_workload(args.trace, args.format)
        if args.head is not None:
            workload = workload.head(args.head)
        return workload.with_arrivals(args.arrivals, args.rate, args.seed)
    except WorkloadError as exc:
        raise ReplayError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.server.trace_replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--trace", help="trace file (default: the bundled Azure conversation sample)")
    parser.add_argument("--format", default="azure", choices=["azure", "burstgpt", "mooncake", "jsonl"])
    parser.add_argument("--rate", type=float, required=True, help="mean requests per second after rescaling")
    parser.add_argument("--head", type=float, help="keep the first N seconds of the trace (before rescaling)")
    parser.add_argument("--arrivals", default="trace",
                        help="trace (timestamps rescaled to --rate), poisson, or gamma:CV (bursty), "
                        "drawn with --seed as the simulator does")
    parser.add_argument("--slo-file", default=str(CONFIGS_DIR / "slo.toml"))
    parser.add_argument("--slo-mix", default="standard:1", help="CLASS:WEIGHT,... for requests the trace leaves unclassed")
    parser.add_argument("--max-prompt-tokens", type=int, help="cap prompt lengths (server context limit)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--priority", choices=PRIORITY_MODES, default=NONE,
                        help="SGLang's per-request priority: none (left out), class (minus the "
                        "class's TTFT target in ms: tightest first, SGLang's default sign) or "
                        "prompt-length (the prompt's tokens: shortest first, for a server with "
                        "--schedule-low-priority-values-first); needs --enable-priority-scheduling")
    parser.add_argument("--out", help="write the summary JSON here")
    parser.add_argument("--token-times", metavar="PATH",
                        help="write each request's send and token arrival times (perf_counter "
                        "seconds, one JSON line per request), to join with the server's "
                        "[trace] step_log with python -m benchmarks.server.step_trace_report")
    args = parser.parse_args(argv)
    try:
        catalog = SloCatalog.from_toml(args.slo_file)
        mix = parse_slo_mix(args.slo_mix, catalog)
        requests = plan_requests(_load(args), mix, args.seed)
    except (ReplayError, SloError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    token_times: dict[str, list[float]] | None = {} if args.token_times else None
    records = asyncio.run(replay_to_server(args.url, requests, catalog,
                                           max_prompt_tokens=args.max_prompt_tokens,
                                           token_times=token_times, priority=args.priority))
    duration = time.perf_counter() - started
    summary = summarize(records, args.rate, duration)
    summary["per_class"] = {
        name: summarize([r for r in records if r.slo_class == name], args.rate, duration)
        for name, _ in mix
        if any(r.slo_class == name for r in records)
    }
    if token_times is not None:
        write_token_times(Path(args.token_times), requests, token_times)
    text = json.dumps(summary, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    print(summary_line(summary), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
