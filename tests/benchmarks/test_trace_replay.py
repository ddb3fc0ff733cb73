""":mod:`benchmarks.server.trace_replay` against a fake SGLang ``/generate`` that streams
server-sent events: every token is counted, a refusal and a stream cut short are misses;
each request carries the priority of its mode."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from benchmarks.server.trace_replay import ReplayRequest, replay_to_server
from sglang_ext.bundled import CONFIGS_DIR
from sglang_ext.policy.slo import SloCatalog

BODIES: list[dict] = []


async def fake_generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    BODIES.append(body)
    if body["rid"] == "refused":
        return web.Response(status=429)
    produced = body["sampling_params"]["max_new_tokens"] - (body["rid"] == "cut")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for count in range(1, produced + 1):
        finish = {"type": "length"} if count == produced else None
        chunk = {"meta_info": {"completion_tokens": count, "finish_reason": finish}}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


def _serve(requests: list, catalog: SloCatalog, **options) -> tuple:
    async def main() -> tuple:
        app = web.Application()
        app.router.add_post("/generate", fake_generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            times: dict[str, list[float]] = {}
            records = await replay_to_server(f"http://127.0.0.1:{port}", requests, catalog,
                                             token_times=times, **options)
            return records, times
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_tokens_refusals_and_cut_streams() -> None:
    catalog = SloCatalog.from_toml(CONFIGS_DIR / "slo.toml")
    requests = [ReplayRequest(rid, 0.01 * i, 16, 5, "standard")
                for i, rid in enumerate(("whole", "refused", "cut"))]
    BODIES.clear()
    records, times = _serve(requests, catalog)
    assert all("priority" not in body for body in BODIES)
    whole, refused, cut = records
    assert whole.tokens_emitted == 5 and not whole.aborted and whole.finish_s is not None
    assert len(times["whole"]) == 1 + 5  # the send time, then one time per token
    assert refused.rejected and refused.tokens_emitted == 0
    assert cut.aborted and cut.tokens_emitted == 4 and cut.finish_s is None


def test_each_request_carries_the_priority_of_its_mode() -> None:
    catalog = SloCatalog.from_toml(CONFIGS_DIR / "slo.toml")
    requests = [ReplayRequest("short", 0.0, 16, 2, "standard"),
                ReplayRequest("long", 0.01, 9000, 2, "interactive")]
    sent = {}
    for mode in ("class", "prompt-length"):
        BODIES.clear()
        records, _ = _serve(requests, catalog, priority=mode, max_prompt_tokens=6144)
        assert all(r.finished for r in records)
        sent[mode] = {body["rid"]: body["priority"] for body in BODIES}
    assert sent["class"] == {"short": -2000, "long": -500}
    assert sent["prompt-length"] == {"short": 16, "long": 6144}  # the prompt sent, after the cap
