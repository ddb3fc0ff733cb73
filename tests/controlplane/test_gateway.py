"""The OpenAI-compatible gateway: real HTTP (aiohttp) in front of a real daemon process
and one simulated rank process, through the SDK."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import aiohttp
import pytest

from controlplane.client import AsyncClient
from controlplane.gateway import GatewaySettings, parse_listen, serve

from live import REPO, free_ports, loopback_config, start_process_daemon, thread_daemon

MODEL = "test-model"
API_KEY = "sk-test"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("gateway")
    config = loopback_config(stale_after_s=2.0)
    daemon = start_process_daemon(tmp_path, config)
    rank = subprocess.Popen(
        [sys.executable, "-m", "sglang_ext.sim.rank", "--daemon", config.rank_address, "--report-address",
         config.report_address, "--agent-id", "gw", "--time-scale", "0.05", "--log-level", "warning"],
        cwd=REPO, stderr=subprocess.DEVNULL)
    try:
        yield config
    finally:
        rank.kill()
        rank.wait(10)
        daemon.kill()


def with_gateway(config, scenario, *, api_key: str | None = None, wait_for_rank: bool = True):
    """Run ``scenario(session, base_url, client)`` against a gateway served on a free port."""
    (port,) = free_ports(1)

    async def main():
        stop = asyncio.Event()
        async with AsyncClient(config.client_address) as client:
            deadline = time.monotonic() + 30
            while wait_for_rank and not [r for r in (await client.status()).ranks if not r.stale]:
                assert time.monotonic() < deadline, "the simulated rank never reported"
                await asyncio.sleep(0.1)
            server = asyncio.create_task(serve(client, GatewaySettings(MODEL, api_key), "127.0.0.1", port, stop))
            try:
                async with aiohttp.ClientSession() as session:
                    for _ in range(100):
                        try:
                            async with session.get(f"http://127.0.0.1:{port}/health"):
                                break
                        except aiohttp.ClientConnectionError:
                            await asyncio.sleep(0.05)
                    return await scenario(session, f"http://127.0.0.1:{port}", client)
            finally:
                stop.set()
                await server

    return asyncio.run(main())


def events(raw: str) -> list:
    lines = [line.removeprefix("data: ") for line in raw.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completion_models_and_health(cluster):
    async def scenario(session, url, _):
        async with session.post(f"{url}/v1/completions", json={
                "model": MODEL, "prompt": [5] * 40, "max_tokens": 7, "ignore_eos": True, "slo": "relaxed",
                "user": "ignored-field"}, headers={"X-Request-Id": "gw-1"}) as response:
            completion = (response.status, await response.json())
        async with session.post(f"{url}/v1/completions", json={
                "prompt": ["Hello there"], "max_tokens": 3, "ignore_eos": True,
                "custom_params": {"slo": {"ttft_ms": 5000, "tpot_ms": 500}}}) as response:
            text_prompt = (response.status, await response.json())
        async with session.post(f"{url}/v1/completions", json={
                "prompt": [3] * 20, "max_tokens": 5, "ignore_eos": True,
                "slo": {"e2e_ms": 60_000}}) as response:
            end_to_end = (response.status, await response.json())
        async with session.get(f"{url}/v1/models") as response:
            listed = await response.json()
        async with session.get(f"{url}/health") as response:
            healthy = (response.status, await response.json())
        return completion, text_prompt, end_to_end, listed, healthy

    completion, text_prompt, end_to_end, listed, healthy = with_gateway(cluster, scenario)
    status, body = completion
    assert status == 200 and body["id"] == "cmpl-gw-1" and body["object"] == "text_completion"
    assert body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and choice["text"] == " tok" * 7
    assert body["usage"] == {"prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47}
    assert text_prompt[0] == 200 and text_prompt[1]["usage"]["completion_tokens"] == 3
    assert end_to_end[0] == 200 and end_to_end[1]["usage"]["completion_tokens"] == 5
    assert [m["id"] for m in listed["data"]] == [MODEL]
    assert healthy[0] == 200 and healthy[1]["status"] == "ok"


def test_streamed_completion_sends_chunks_usage_and_done(cluster):
    async def scenario(session, url, _):
        async with session.post(f"{url}/v1/completions", json={
                "prompt": [9] * 30, "max_tokens": 12, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as response:
            return response.status, response.headers["Content-Type"], await response.text()

    status, content_type, raw = with_gateway(cluster, scenario)
    assert status == 200 and content_type.startswith("text/event-stream")
    chunks = events(raw)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == " tok" * 12
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize(("body", "status", "fragment"), [
    (b"{not json", 400, "not JSON"),
    (b'{"max_tokens": 4}', 400, "prompt"),
    (b'{"prompt": "hi", "n": 2}', 400, "n > 1"),
    (b'{"prompt": "hi", "logprobs": 3, "echo": true}', 400, "logprobs, echo"),
    (b'{"prompt": ["a", "b"]}', 400, "one prompt per request"),
    (b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "hi", "temperature": -1}', 400, "temperature"),
    (b'{"prompt": "hi", "model": "other"}', 404, "not served here"),
    (b'{"prompt": "hi", "slo": "no-such-class", "max_tokens": 2}', 400, "no-such-class"),
    (b'{"prompt": "hi", "slo": {"e2e_ms": 2000, "tpot_ms": 50}}', 400,
     "invalid request body: give e2e_ms (an end-to-end target) or tpot_ms, not both"),
    (b'{"prompt": "hi", "custom_params": {"slo": {"e2e_ms": 500, "ttft_ms": 600}}}', 400,
     "ttft_ms 600 must be below e2e_ms 500"),
    (b'{"prompt": "hi", "slo": {"e2e_ms": -1}}', 400, "e2e_ms"),
])
def test_bad_requests_get_openai_errors(cluster, body, status, fragment):
    async def scenario(session, url, _):
        async with session.post(f"{url}/v1/completions", data=body,
                                headers={"Content-Type": "application/json"}) as response:
            return response.status, await response.json()

    got, payload = with_gateway(cluster, scenario)
    assert got == status, payload
    assert fragment in payload["error"]["message"] and payload["error"]["type"]


def test_api_key_metrics_and_a_disconnect_that_cancels(cluster):
    async def scenario(session, url, client):
        async with session.post(f"{url}/v1/completions", json={"prompt": "hi"}) as response:
            unauthorized = response.status
        auth = {"Authorization": f"Bearer {API_KEY}"}
        async with session.get(f"{url}/health") as response:
            health = response.status  # no key needed
        cancelled_before = (await client.status()).counters.get("cancelled", 0)
        async with session.post(f"{url}/v1/completions", headers=auth, json={
                "prompt": [1] * 20, "max_tokens": 5000, "ignore_eos": True, "stream": True}) as response:
            assert response.status == 200
            await response.content.readuntil(b"\n\n")  # the first chunk, then hang up
        deadline = time.monotonic() + 10
        while (await client.status()).counters.get("cancelled", 0) == cancelled_before:
            assert time.monotonic() < deadline, "the disconnect never cancelled the request"
            await asyncio.sleep(0.05)
        async with session.get(f"{url}/metrics", headers=auth) as response:
            metrics = (response.status, await response.text())
        return unauthorized, health, metrics

    unauthorized, health, (status, text) = with_gateway(cluster, scenario, api_key=API_KEY)
    assert unauthorized == 401 and health == 200 and status == 200
    assert "# TYPE fairbatching_controlplane_rank_pab_tokens gauge" in text
    assert 'fairbatching_controlplane_rank_in_flight{rank="gw"}' in text
    assert 'fairbatching_controlplane_events_total{event="cancelled"}' in text
    assert 'fairbatching_gateway_responses_total{status="401"} 1' in text


def test_a_daemon_failing_the_request_is_a_500_with_an_openai_error(monkeypatch):
    with thread_daemon(retry_after_s=0.01) as running:
        core = running.daemon.core

        def failing(identity, submit, now):
            raise RuntimeError("injected failure")

        monkeypatch.setattr(core, "_submit", failing)

        async def scenario(session, url, _):
            outcomes = []
            for stream in (False, True):
                async with session.post(f"{url}/v1/completions", json={"prompt": "hi", "stream": stream},
                                        headers={"X-Request-Id": f"gw-internal-{stream}"}) as response:
                    outcomes.append((response.status, await response.json()))
            return outcomes

        outcomes = with_gateway(running.config, scenario, wait_for_rank=False)
        assert running.counters()["rejected_internal"] == 2 * 4  # the SDK's 3 retries, each time
    for status, payload in outcomes:
        assert status == 500, payload
        assert payload["error"]["type"] == "server_error" and payload["error"]["code"] == "internal"
        assert "the daemon failed handling Submit" in payload["error"]["message"]


def test_listen_addresses_are_loopback_unless_allowed():
    assert parse_listen("127.0.0.1:8000", False) == ("127.0.0.1", 8000)
    assert parse_listen("[::1]:9", False) == ("::1", 9)
    assert parse_listen("0.0.0.0:80", True) == ("0.0.0.0", 80)
    for bad in ("0.0.0.0:80", "8000", "host:", "127.0.0.1:99999"):
        with pytest.raises(ValueError):
            parse_listen(bad, False)
