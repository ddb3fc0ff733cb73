"""The OpenAI-compatible gateway: real HTTP (aiohttp) in front of a real daemon process
and one simulated rank process, through the SDK (the gateway's parts, and the gateway
in front of a daemon on a thread: ``tests/controlplane/test_gateway_parts.py``)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import aiohttp
import pytest

from benchmarks.controlplane.live_daemon import loopback_config, start_process_daemon
from benchmarks.support.paths import REPO
from benchmarks.support.ports import free_ports
from controlplane.client import AsyncClient
from controlplane.config import DaemonConfig
from controlplane.daemon import Daemon
from controlplane.embedded import serve_daemon_and_gateway
from controlplane.gateway import GatewaySettings, serve
from controlplane.openai_api import DEFAULT_CHAT_MAX_TOKENS

MODEL = "test-model"
API_KEY = "sk-test"


@dataclass(frozen=True)
class Cluster:
    """One simulated rank, and the daemon it reports to: a process with the gateway in
    front as a second SDK client (``embedded`` false), or, per test, a daemon on this loop
    that serves the gateway itself (``serve --http``)."""

    config: DaemonConfig
    embedded: bool = False


@pytest.fixture(scope="module", params=["gateway", "embedded"])
def cluster(request, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("gateway")
    config = loopback_config(stale_after_s=2.0)
    embedded = request.param == "embedded"
    daemon = None if embedded else start_process_daemon(tmp_path, config)
    rank = subprocess.Popen(
        [sys.executable, "-m", "sglang_ext.sim.rank", "--daemon", config.rank_address, "--report-address",
         config.report_address, "--agent-id", "gw", "--time-scale", "0.05", "--log-level", "warning"],
        cwd=REPO, stderr=subprocess.DEVNULL)
    try:
        yield Cluster(config, embedded)
    finally:
        rank.kill()
        rank.wait(10)
        if daemon is not None:
            daemon.kill()


def with_gateway(cluster: Cluster | DaemonConfig, scenario, *, api_key: str | None = None,
                 wait_for_rank: bool = True):
    """Run ``scenario(session, base_url, client)`` against a gateway served on a free port;
    ``client`` is an SDK client of the daemon over its socket."""
    cluster = cluster if isinstance(cluster, Cluster) else Cluster(cluster)
    config = cluster.config
    (port,) = free_ports(1)
    settings = GatewaySettings(MODEL, api_key)

    async def main():
        stop = asyncio.Event()
        finish = stop.set
        if cluster.embedded:
            daemon = Daemon(config)
            server = asyncio.create_task(serve_daemon_and_gateway(daemon, settings, "127.0.0.1", port))
            finish = daemon.request_drain
        async with AsyncClient(config.client_address) as client:
            deadline = time.monotonic() + 30
            while wait_for_rank and not [r for r in (await client.status()).ranks if not r.stale]:
                assert time.monotonic() < deadline, "the simulated rank never reported"
                await asyncio.sleep(0.1)
            if not cluster.embedded:
                server = asyncio.create_task(serve(client, settings, "127.0.0.1", port, stop))
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
                finish()
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


async def raw_stream(url: str, version: str, tokens: int, *, model: str = MODEL,
                     wait_before_reading: asyncio.Event | None = None,
                     receive_buffer: int | None = None) -> tuple[bytes, bytes]:
    """A streamed completion over a plain socket: the answer's head and body as sent."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": [4] * 16, "max_tokens": tokens, "ignore_eos": True, "stream": True,
                       "model": model}).encode()
    connection = socket.socket()
    if receive_buffer is not None:  # before connecting: the window the server sees stays small
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    connection.setblocking(False)
    await asyncio.get_running_loop().sock_connect(connection, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=connection, limit=receive_buffer or 2**16)
    writer.write(f"POST /v1/completions HTTP/{version}\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()
    if wait_before_reading is not None:
        await wait_before_reading.wait()
    raw = await reader.read(-1)
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    return head, rest


def dechunk(body: bytes) -> list[bytes]:
    """The chunks of an HTTP/1.1 chunked body, checked to end with the terminating chunk."""
    chunks = []
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert body == b"\r\n", body[:80]
            return chunks
        assert body[size:size + 2] == b"\r\n", body[:size + 2][-80:]
        chunks.append(body[:size])
        body = body[size + 2:]


def test_a_streamed_answer_is_well_framed_for_http_1_1_and_1_0_and_a_reader_that_lags(cluster):
    """Pushed events are HTTP chunks written straight to the connection: every chunk holds
    whole events, in order, then aiohttp's terminating chunk; an HTTP/1.0 client gets the
    same events unchunked; a client that reads nothing until the answer is over (the
    connection backs up past the push limit: a long model name, echoed in every event,
    makes the answer larger than the kernel's socket buffers) still gets every event
    once, in order."""
    tokens = 400
    long_name = "m" * 8192

    async def scenario(session, url, client):
        chunked = await raw_stream(url, "1.1", tokens)
        plain = await raw_stream(url, "1.0", tokens)
        finished = asyncio.Event()
        closed_before = (await client.status()).counters.get("closed", 0)
        lagging = asyncio.create_task(raw_stream(url, "1.1", 4 * tokens, model=long_name,
                                                 wait_before_reading=finished, receive_buffer=4096))
        deadline = time.monotonic() + 120
        while (await client.status()).counters.get("closed", 0) <= closed_before:  # the rank not done yet
            assert time.monotonic() < deadline, "the lagging request never finished at the daemon"
            await asyncio.sleep(0.05)
        finished.set()
        return chunked, plain, await lagging

    (head, body), (plain_head, plain_body), (lag_head, lag_body) = with_gateway(cluster, scenario)
    assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
    pieces = dechunk(body)
    assert all(piece.endswith(b"\n\n") and piece.startswith(b"data: ") for piece in pieces)
    joined = b"".join(pieces).decode()
    assert "".join(c["choices"][0]["text"] for c in events(joined) if c["choices"]) == " tok" * tokens
    assert plain_head.startswith(b"HTTP/1.0 200") and b"chunked" not in plain_head
    assert "".join(c["choices"][0]["text"] for c in events(plain_body.decode()) if c["choices"]) == " tok" * tokens
    lagged = events(b"".join(dechunk(lag_body)).decode())
    assert len(lag_body) > 4 * 8192 * tokens and all(c["model"] == long_name for c in lagged)
    assert "".join(c["choices"][0]["text"] for c in lagged if c["choices"]) == " tok" * (4 * tokens)


@pytest.mark.parametrize(("body", "status", "fragment"), [
    (b"{not json", 400, "not JSON"),
    (b'{"max_tokens": 4}', 400, "prompt"),
    (b'{"prompt": "hi", "n": 2}', 400, "n > 1"),
    (b'{"prompt": "hi", "logprobs": 3, "echo": true}', 400, "logprobs, echo"),
    (b'{"prompt": ["a", "b"]}', 400, "one prompt per request"),
    (b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "hi", "model": 5}', 400, "$.model"),
    (b'{"prompt": "hi", "temperature": -1}', 400, "temperature"),
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


def test_chat_completion_streamed_and_not(cluster):
    from controlplane.protocol import ChatMessage, Prompt
    from sglang_ext.sim.rank import prompt_tokens

    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]

    async def scenario(session, url, _):
        async with session.post(f"{url}/v1/chat/completions", json={
                "model": MODEL, "messages": conversation, "max_completion_tokens": 6, "ignore_eos": True,
                "slo": "relaxed", "user": "ignored"}, headers={"X-Request-Id": "chat-1"}) as response:
            whole = (response.status, await response.json())
        streamed = {}
        for include_usage in (True, False):
            async with session.post(f"{url}/v1/chat/completions", json={
                    "messages": conversation, "max_tokens": 5, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": include_usage}}) as response:
                streamed[include_usage] = (response.status, await response.text())
        async with session.post(f"{url}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True,
                "deadline_s": 30}) as response:
            unlimited = (response.status, await response.json())
        return whole, streamed, unlimited

    whole, streamed, unlimited = with_gateway(cluster, scenario)
    status, body = whole
    assert status == 200 and body["id"] == "chatcmpl-chat-1" and body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": " tok" * 6}
    assert choice["finish_reason"] == "length"
    rendered = Prompt(messages=[ChatMessage("system", "Be brief."), ChatMessage("user", "Hello\nthere")])
    assert body["usage"] == {"prompt_tokens": prompt_tokens(rendered), "completion_tokens": 6,
                             "total_tokens": prompt_tokens(rendered) + 6}
    for include_usage, (status, raw) in streamed.items():
        assert status == 200
        chunks = events(raw)
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        with_choices = [c for c in chunks if c["choices"]]
        deltas = [c["choices"][0]["delta"] for c in with_choices]
        assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
        assert "".join(d.get("content", "") for d in deltas) == " tok" * 5
        assert [c["choices"][0]["finish_reason"] for c in with_choices][-1] == "length"
        if include_usage:
            assert all(c["usage"] is None for c in with_choices)
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
        else:
            assert all("usage" not in c for c in chunks)
    assert unlimited[0] == 200
    assert unlimited[1]["usage"]["completion_tokens"] == DEFAULT_CHAT_MAX_TOKENS == 2048  # the default limit


@pytest.mark.parametrize(("body", "fragment"), [
    ({"messages": []}, "messages: at least one message"),
    ({}, "missing required field `messages`"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role: expected one of system"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]},
     "messages[1].content: expected a string or a list of text parts, got null"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]: images are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "audio are not supported"),
    ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "t"}]}, "messages[0].role: 'tool' messages need tools"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "t"}]}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools (function calling)"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n > 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
     "response_format other than text"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}},
     "stream_options without stream"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
])
def test_bad_chat_requests_get_openai_errors_naming_the_field(cluster, body, fragment):
    async def scenario(session, url, _):
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            return response.status, await response.json()

    status, payload = with_gateway(cluster, scenario)
    assert status == 400, payload
    assert fragment in payload["error"]["message"] and payload["error"]["type"]


CHAT = [{"role": "user", "content": "Hi"}]


def answer_text(chunks: list) -> str:
    def text(choice: dict) -> str:
        if "text" in choice:
            return choice["text"]
        return (choice.get("message") or choice.get("delta") or {}).get("content", "")

    return "".join(text(chunk["choices"][0]) for chunk in chunks if chunk["choices"])


def test_any_model_name_is_served_and_echoed_back(cluster):
    """A request may name any model; the answer echoes it (else the served name), and
    /v1/models still lists only the served name. The odd name holds quotes and the
    placeholder the streamed events splice their text into."""
    odd = 'org/"model" \x00text\x00'

    async def scenario(session, url, _):
        answers = {}
        for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": CHAT})):
            for model in ("gpt-4o-mini", odd, None):
                for stream in (False, True):
                    named = {} if model is None else {"model": model}
                    async with session.post(f"{url}{path}", json={
                            **body, **named, "max_tokens": 3, "ignore_eos": True, "stream": stream,
                            **({"stream_options": {"include_usage": True}} if stream else {})}) as response:
                        raw = await response.text()
                        answers[path, model, stream] = response.status, events(raw) if stream else [json.loads(raw)]
        async with session.get(f"{url}/v1/models") as response:
            listed = await response.json()
        return answers, listed

    answers, listed = with_gateway(cluster, scenario)
    assert len(answers) == 12
    for (path, model, stream), (status, chunks) in answers.items():
        assert status == 200, (path, model, stream, chunks)
        assert {chunk["model"] for chunk in chunks} == {model or MODEL}, (path, model, stream)
        assert answer_text(chunks) == " tok" * 3
        assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert [m["id"] for m in listed["data"]] == [MODEL]


def test_every_answer_carries_the_request_id(cluster):
    """``X-Request-Id`` on every answer, streamed, unstreamed and errors alike: the
    client's when it sent one, else a fresh one per request."""
    cases = (
        ("POST", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": 2}}, 200),
        ("POST", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": 2, "stream": True}}, 200),
        ("POST", "/v1/chat/completions", {"json": {"messages": CHAT, "max_tokens": 2}}, 200),
        ("POST", "/v1/chat/completions", {"json": {"messages": CHAT, "max_tokens": 2, "stream": True}}, 200),
        ("POST", "/v1/completions", {"json": {"prompt": "hi", "n": 2}}, 400),
        ("POST", "/v1/completions", {"json": {"prompt": "hi", "slo": "no-such-class", "stream": True}}, 400),
        ("POST", "/v1/chat/completions", {"data": b"{not json"}, 400),
        ("POST", "/v1/embeddings", {}, 404),
        ("GET", "/v1/completions", {}, 405),
        ("POST", "/v1/completions", {"data": b"x" * (5 * 1024 * 1024)}, 413),
        ("GET", "/v1/models", {}, 200),
        ("GET", "/health", {}, 200),
        ("GET", "/metrics", {}, 200),
    )

    async def scenario(session, url, _):
        answers = []
        for given in (True, False):
            for index, (method, path, options, _status) in enumerate(cases):
                headers = {"X-Request-Id": f"rid-{index}"} if given else {}
                async with session.request(method, f"{url}{path}", headers=headers, **options) as response:
                    await response.read()
                    answers.append((given, index, response.status, response.headers.get("X-Request-Id")))
        headers = {"X-Request-Id": "has a space"}  # refused by the SDK: still echoed
        async with session.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers=headers) as response:
            refused = response.status, await response.json(), response.headers.get("X-Request-Id")
        return answers, refused

    answers, refused = with_gateway(cluster, scenario)
    generated = set()
    for given, index, status, request_id in answers:
        assert status == cases[index][3], (cases[index], status)
        if given:
            assert request_id == f"rid-{index}", cases[index]
        else:
            assert request_id is not None and len(request_id) == 32 and int(request_id, 16) >= 0, cases[index]
            generated.add(request_id)
    assert len(generated) == len(cases), "a fresh id per request"
    status, body, request_id = refused
    assert status == 400 and "request_id" in body["error"]["message"] and request_id == "has a space"


def test_a_wrong_api_key_answer_carries_the_request_id(cluster):
    async def scenario(session, url, _):
        async with session.post(f"{url}/v1/completions", json={"prompt": "hi"},
                                headers={"X-Request-Id": "unauthorized-1"}) as response:
            return response.status, response.headers.get("X-Request-Id")

    assert with_gateway(cluster, scenario, api_key=API_KEY) == (401, "unauthorized-1")


def test_unknown_endpoints_and_methods_get_openai_errors(cluster):
    async def scenario(session, url, _):
        answers = []
        for method, path in (("POST", "/v1/embeddings"), ("GET", "/v1/chat/completions")):
            async with session.request(method, f"{url}{path}") as response:
                answers.append((response.status, await response.json()))
        async with session.post(f"{url}/v1/chat/completions", data=b"x" * (5 * 1024 * 1024)) as response:
            answers.append((response.status, await response.json()))
        return answers

    (missing, missing_body), (wrong_method, wrong_body), (too_big, too_big_body) = with_gateway(cluster, scenario)
    assert missing == 404 and "no such endpoint" in missing_body["error"]["message"]
    assert wrong_method == 405 and wrong_body["error"]["code"] == "method_not_allowed"
    assert too_big == 413 and "bytes" in too_big_body["error"]["message"]


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
