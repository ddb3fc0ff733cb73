"""The load generator: open-loop streamed completions through a router, one
:class:`~benchmarks.routers.records.Record` per request, and the unloaded probes."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence

from benchmarks.routers.records import DEFAULT_CLASS, SLO, Record, added_latency
from benchmarks.routers.stack import SMG_PRIORITY_CLASS, SMG_PRIORITY_HEADER
from benchmarks.routers.traffic import Request, words_text
from benchmarks.support.sse import json_events_async

REQUEST_TIMEOUT_S = 60.0
PROBES = 16
PROBE_PROMPT_TOKENS = 32
PROBE_OUTPUT_TOKENS = 2


async def run_requests(url: str, model: str | None, requests: Sequence[Request], texts: Sequence[str],
                       timeout_s: float = REQUEST_TIMEOUT_S,
                       headers: Callable[[Request], dict[str, str]] | None = None) -> list[Record]:
    """Send every request at its time (open loop), streamed, with ``headers(request)``;
    one Record each."""
    import aiohttp

    records = [Record(r.index, r.at_s, r.output_tokens, slo_class=r.slo_class or DEFAULT_CLASS) for r in requests]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        origin = time.perf_counter()
        tasks = []
        for request, text, record in zip(requests, texts, records):
            delay = origin + request.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            record.sent_s = time.perf_counter() - origin
            tasks.append(asyncio.create_task(_one(session, url, model, request, text, record, origin,
                                                  None if headers is None else headers(request))))
        await asyncio.gather(*tasks)
    return records


def completion_body(model: str | None, prompt: str, max_tokens: int, slo_class: str | None = None) -> dict:
    """The request's body; its SLO in ``custom_params``, as SGLang's server and the daemon's
    gateway both read it: the standard class's targets, or the named class of
    ``configs/slo.toml`` (which the servers and the daemon load)."""
    slo = dict(SLO) if slo_class is None else {"class": slo_class}
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
            "custom_params": {"slo": slo}}
    if model is not None:
        body["model"] = model
    return body


def smg_priority_headers(request: Request) -> dict[str, str]:
    """smg's priority scheduler's header: the request's SLO class as smg names it."""
    return {SMG_PRIORITY_HEADER: SMG_PRIORITY_CLASS[request.slo_class or DEFAULT_CLASS]}


async def _one(session, url: str, model: str | None, request: Request, text: str, record: Record,
               origin: float, headers: dict[str, str] | None = None) -> None:
    import aiohttp

    body = completion_body(model, text, request.output_tokens, request.slo_class)
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
            record.status = response.status
            if response.status != 200:
                record.error = f"http {response.status}: {(await response.text())[:120]}"
                return
            async for chunk in json_events_async(response.content):
                now = time.perf_counter() - origin
                if "error" in chunk:
                    record.error = f"stream error: {str(chunk['error'])[:120]}"
                    continue
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    record.events += 1
                    if record.first_token_s is None:
                        record.first_token_s = now
                    record.last_token_s = now
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    record.completion_tokens = usage["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
        record.error = f"client: {type(error).__name__}"
        return
    if record.completion_tokens == 0:
        record.completion_tokens = record.events  # no usage event: one token per event


async def probe(router_url: str, router_model: str | None, direct: Sequence[tuple[str, str | None]],
                words: Sequence[str], n: int = PROBES) -> dict:
    """Sequential probes, alternately through the router and straight to a server."""
    import aiohttp

    via: list[float] = []
    straight: list[float] = []
    rng = random.Random(f"probe-{time.time_ns()}")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for i in range(2 * n):
            through = i % 2 == 0
            url, model = (router_url, router_model) if through else direct[(i // 2) % len(direct)]
            text = words_text(rng, words, PROBE_PROMPT_TOKENS)
            request = Request(i, 0.0, PROBE_PROMPT_TOKENS, PROBE_OUTPUT_TOKENS)
            record = Record(i, 0.0, PROBE_OUTPUT_TOKENS)
            origin = time.perf_counter()
            await _one(session, url, model, request, text, record, origin)
            if record.ok and record.ttft_s is not None:
                (via if through else straight).append(record.ttft_s)
    return {"router_ttft_s": [round(v, 6) for v in via], "direct_ttft_s": [round(v, 6) for v in straight],
            **(added_latency(via, straight) or {})}
