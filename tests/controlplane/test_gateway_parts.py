"""The OpenAI-compatible gateway without processes: its listen addresses, server-sent
events and stepped awaits, its in-flight limit against a stub client, and its 500 in
front of a daemon on a thread whose handler fails (a daemon process and a simulated
rank: ``tests/controlplane/processes/test_gateway.py``)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from live import thread_daemon

from benchmarks.support.ports import free_ports
from controlplane.cli import parse_listen
from controlplane.client import AsyncClient
from controlplane.config import DaemonConfig
from controlplane.gateway import GatewaySettings, serve

MODEL = "test-model"


async def _until_serving(session: aiohttp.ClientSession, url: str) -> None:
    """Return once ``url`` answers (the gateway is listening), polling for up to 5 s."""
    for _ in range(100):
        try:
            async with session.get(url):
                return
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.05)


def with_gateway(config: DaemonConfig, scenario):
    """Run ``scenario(session, base_url)`` against a gateway served on a free port in front
    of the daemon at ``config``."""
    (port,) = free_ports(1)

    async def main():
        stop = asyncio.Event()
        async with AsyncClient(config.client_address) as client:
            server = asyncio.create_task(serve(client, GatewaySettings(MODEL), "127.0.0.1", port, stop))
            try:
                async with aiohttp.ClientSession() as session:
                    await _until_serving(session, f"http://127.0.0.1:{port}/health")
                    return await scenario(session, f"http://127.0.0.1:{port}")
            finally:
                stop.set()
                await server

    return asyncio.run(main())


def test_a_daemon_failing_the_request_is_a_500_with_an_openai_error(monkeypatch):
    with thread_daemon(retry_after_s=0.01) as running:
        core = running.daemon.core

        def failing(identity, submit, now):
            raise RuntimeError("injected failure")

        monkeypatch.setattr(core, "_submit", failing)

        async def scenario(session, url):
            outcomes = []
            for stream in (False, True):
                async with session.post(f"{url}/v1/completions", json={"prompt": "hi", "stream": stream},
                                        headers={"X-Request-Id": f"gw-internal-{stream}"}) as response:
                    assert response.headers["X-Request-Id"] == f"gw-internal-{stream}"
                    outcomes.append((response.status, await response.json()))
            return outcomes

        outcomes = with_gateway(running.config, scenario)
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


# ---------------------------------------------------------------------- a stream read in two halves
@pytest.mark.parametrize("text", ["", " tok", 'a "quoted" \\ line\n', "\x00text\x00", "é ✓ 🙂"])
def test_a_spliced_event_is_the_encoded_chunk_byte_for_byte(text):
    from controlplane.gateway_sse import ChatEvents, TextEvents, sse
    from controlplane.openai_api import chat_chunk, text_chunk

    odd_model = 'm "\x00text\x00"'
    for include_usage in (True, False):
        usage = {"usage": None} if include_usage else {}
        completion = TextEvents("r-1", odd_model, 7, include_usage)
        assert completion.piece(text) == sse({**text_chunk("r-1", odd_model, 7, text), **usage})
        chat = ChatEvents("r-2", odd_model, 7, include_usage)
        first, second = chat.piece(text), chat.piece(text)
        assert first == sse({**chat_chunk("r-2", odd_model, 7, {"role": "assistant", "content": text}), **usage})
        assert second == sse({**chat_chunk("r-2", odd_model, 7, {"content": text}), **usage})


def test_a_stream_step_run_until_it_waits_then_resumed_cancelled_or_unwound():
    """How the gateway takes a stream's next chunk (``gateway_sse.relay``): run at once when it
    is ready, else stopped at its first wait, the events held written, and then resumed;
    a cancellation meanwhile, or a write that fails, unwinds it as an ``await`` would.
    The source waits as the SDK's inbox does (``asyncio.wait_for`` on an event)."""
    from controlplane.stepped_await import Waiting, resume, run_until_wait, unwind

    async def main():
        gate = asyncio.Event()
        finished = []

        async def source():
            try:
                yield "ready"
                while True:
                    await asyncio.wait_for(gate.wait(), 30)
                    gate.clear()
                    yield "after a wait"
            finally:
                finished.append(True)

        async def left_behind():
            await asyncio.sleep(0)  # a cancelled task ends on the loop's next turn
            return asyncio.all_tasks() - {asyncio.current_task()}

        items = source()
        assert run_until_wait(anext(items)) == "ready"
        waiting = run_until_wait(anext(items))
        assert isinstance(waiting, Waiting)
        asyncio.get_running_loop().call_later(0.01, gate.set)
        assert await resume(waiting) == "after a wait"

        waiting = run_until_wait(anext(items))
        reader = asyncio.create_task(resume(waiting))
        await asyncio.sleep(0)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert finished == [True] and not await left_behind()

        finished.clear()
        items = source()
        assert run_until_wait(anext(items)) == "ready"
        await unwind(run_until_wait(anext(items)))
        assert finished == [True] and not await left_behind()
        with pytest.raises(StopAsyncIteration):
            await anext(items)

    asyncio.run(main())


class _HeldClient:
    """An SDK stand-in whose requests wait until released; only what the gateway calls."""

    address = "tcp://stub"

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.waiting = 0

    async def generate(self, prompt, **options):
        from controlplane.errors import QueueTimeout
        from controlplane.protocol import RejectReason

        self.waiting += 1
        await self.release.wait()
        raise QueueTimeout(RejectReason.QUEUE_TIMEOUT, "stub", retry_after_s=None)


def test_past_its_in_flight_limit_the_gateway_answers_429_with_retry_after_at_once():
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}/v1/completions"

    async def main():
        client, stop = _HeldClient(), asyncio.Event()
        server = asyncio.create_task(serve(client, GatewaySettings(MODEL, max_in_flight=2), "127.0.0.1", port,
                                           stop))
        try:
            async with aiohttp.ClientSession() as session:
                await _until_serving(session, f"http://127.0.0.1:{port}/v1/models")
                held = [asyncio.create_task(session.post(url, json={"prompt": "hi"})) for _ in range(2)]
                while client.waiting < 2:
                    await asyncio.sleep(0.01)
                async with session.post(url, json={"prompt": "one too many"}) as response:
                    refused = (response.status, response.headers.get("Retry-After"), await response.json())
                client.release.set()
                answers = []
                for task in held:
                    async with await task as response:
                        answers.append((response.status, response.headers.get("Retry-After")))
                return refused, answers
        finally:
            stop.set()
            await server

    refused, answers = asyncio.run(main())
    status, retry_after, payload = refused
    assert (status, retry_after, payload["error"]["code"]) == (429, "1", "gateway_overloaded")
    assert "--max-in-flight" in payload["error"]["message"]
    assert answers == [(429, "1"), (429, "1")]  # a 429 the daemon gave without one still says when


def test_the_gateway_in_flight_limit_must_be_positive_and_the_cli_default_is_the_gateway_default():
    from controlplane.cli import GATEWAY_MAX_IN_FLIGHT
    from controlplane.gateway import DEFAULT_MAX_IN_FLIGHT

    assert GATEWAY_MAX_IN_FLIGHT == DEFAULT_MAX_IN_FLIGHT
    with pytest.raises(ValueError, match="max_in_flight must be >= 1"):
        GatewaySettings(max_in_flight=0)
