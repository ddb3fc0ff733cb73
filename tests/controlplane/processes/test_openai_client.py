"""The ``openai`` package's clients, unmodified, against the gateway.

``OpenAI`` and ``AsyncOpenAI`` get only ``base_url``, ``api_key`` and a ``timeout`` (so a
broken gateway fails the test instead of hanging it); no custom HTTP client, no patched
parsing. The gateway is the real one (``python -m controlplane gateway``, a process, with
``--api-key-file``) in front of a daemon process, or the daemon serving it itself
(``serve --http``), and one simulated rank process (the ``cluster`` fixture of
``test_gateway.py``; the simulated rank answers every request with
one ``" tok"`` per output token). Each route is checked against the response shapes
OpenAI documents, as the package's typed models parse them:

- ``client.completions.create``: a ``text_completion`` with ``usage``; streamed, chunks
  whose texts add up, the last with ``finish_reason``, and a final usage chunk with
  ``choices == []`` only when ``stream_options={"include_usage": True}``;
- ``client.chat.completions.create(messages=...)``: a ``chat.completion`` whose
  ``choices[0].message`` is the assistant's; streamed, ``chat.completion.chunk``s with
  ``choices[0].delta`` (the first naming the assistant's role), the same usage rule;
  ``max_completion_tokens`` (what SGLang's serving benchmark sends) as well as
  ``max_tokens``;
- refusals surface as the package's typed exceptions with the gateway's message
  (``BadRequestError`` for ``n=2``, ``AuthenticationError`` for a wrong key);
- any model name is served, and echoed in the answers;
- docs/controlplane.md's ``openai`` snippet runs as written (but for the address and the key).

The ``openai`` package comes with the ``sglang`` extra (SGLang depends on it); without it
the module is skipped.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from test_gateway import MODEL, cluster  # noqa: F401  (the fixture: a daemon and one simulated rank)

from benchmarks.controlplane.live_daemon import write_config
from benchmarks.support.paths import REPO
from benchmarks.support.ports import free_ports
from controlplane.client import Client
from controlplane.errors import DaemonUnavailable

openai = pytest.importorskip("openai")

API_KEY = "sk-openai-client-test"
TIMEOUT_S = 60.0
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
#: the shipped table, and a tier naming a class no rank defines (so its refusal shows the
#: hint reached the rank)
HINT_TABLE = 'service_tier = { flex = "relaxed", priority = "interactive", scale = "no-such-class" }\n'


@pytest.fixture(scope="module")
def gateway(cluster, tmp_path_factory):  # noqa: F811  (pytest injects the imported fixture)
    """``python -m controlplane gateway --model test-model --api-key-file F`` on a free port
    in front of the cluster's daemon, or (the embedded cluster) the daemon itself serving
    it, ``serve --config C --http ...``; once the simulated rank reports, yields the
    ``base_url`` for the clients."""
    scratch = tmp_path_factory.mktemp("openai-client")
    key_file = scratch / "api.key"
    key_file.write_text(API_KEY + "\n")
    (port,) = free_ports(1)
    hints = scratch / "slo_hints.toml"
    hints.write_text(HINT_TABLE)
    http = ["--model", MODEL, "--api-key-file", str(key_file), "--slo-hints", str(hints)]
    config = cluster.config
    if cluster.embedded:
        command = ["serve", "--config", str(write_config(scratch / "daemon.toml", config)),
                   "--http", f"127.0.0.1:{port}", *http]
    else:
        command = ["gateway", "--daemon", config.client_address, "--listen", f"127.0.0.1:{port}", *http]
    process = subprocess.Popen([sys.executable, "-m", "controlplane", *command], cwd=REPO,
                               stderr=subprocess.PIPE)
    try:
        with Client(config.client_address) as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if [rank for rank in client.status().ranks if not rank.stale]:
                        break
                except DaemonUnavailable:  # serve --http still starting: seconds on a busy machine
                    pass
                assert time.monotonic() < deadline, "the simulated rank never reported"
                time.sleep(0.1)
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, process.stderr.read().decode()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline, "the gateway never answered /health"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def sync_client(base_url: str, api_key: str = API_KEY):
    return openai.OpenAI(base_url=base_url, api_key=api_key, timeout=TIMEOUT_S)


def async_client(base_url: str):
    return openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, timeout=TIMEOUT_S)


# ---------------------------------------------------------------------- /v1/completions
def test_models_lists_the_served_model(gateway):
    with sync_client(gateway) as client:
        assert [model.id for model in client.models.list()] == [MODEL]


def test_completion(gateway):
    with sync_client(gateway) as client:
        completion = client.completions.create(
            model=MODEL, prompt=[5] * 40, max_tokens=7, temperature=0.0,
            extra_body={"ignore_eos": True, "slo": "relaxed"}, extra_headers={"X-Request-Id": "oa-1"})
    assert isinstance(completion, openai.types.Completion)
    assert completion.object == "text_completion" and completion.id == "cmpl-oa-1"
    assert completion.model == MODEL
    (choice,) = completion.choices
    assert choice.index == 0 and choice.text == " tok" * 7 and choice.finish_reason == "length"
    assert completion.usage.prompt_tokens == 40 and completion.usage.completion_tokens == 7
    assert completion.usage.total_tokens == 47


def test_streamed_completion_with_and_without_usage(gateway):
    with sync_client(gateway) as client:
        with_usage = list(client.completions.create(
            model=MODEL, prompt=[9] * 30, max_tokens=12, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        without_usage = list(client.completions.create(
            model=MODEL, prompt="Hello there", max_tokens=5, stream=True, extra_body={"ignore_eos": True}))

    assert all(isinstance(chunk, openai.types.Completion) for chunk in with_usage + without_usage)
    *text_chunks, usage_chunk = with_usage
    assert "".join(chunk.choices[0].text for chunk in text_chunks) == " tok" * 12
    finishes = [chunk.choices[0].finish_reason for chunk in text_chunks]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert all(chunk.usage is None for chunk in text_chunks)
    assert usage_chunk.choices == []
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (30, 12)

    assert all(chunk.choices and chunk.usage is None for chunk in without_usage)
    assert "".join(chunk.choices[0].text for chunk in without_usage) == " tok" * 5
    assert without_usage[-1].choices[0].finish_reason == "length"


def test_async_completion_streamed_and_not(gateway):
    async def main():
        async with async_client(gateway) as client:
            completion = await client.completions.create(
                model=MODEL, prompt=[3] * 20, max_tokens=4, extra_body={"ignore_eos": True})
            stream = await client.completions.create(
                model=MODEL, prompt=[3] * 20, max_tokens=6, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            chunks = [chunk async for chunk in stream]
        return completion, chunks

    completion, chunks = asyncio.run(main())
    assert completion.choices[0].text == " tok" * 4 and completion.usage.completion_tokens == 4
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == " tok" * 6
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_completion_refusals_are_typed_exceptions(gateway):
    with sync_client(gateway) as client:
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL, prompt="hi", n=2)
        with pytest.raises(openai.BadRequestError) as bad_stream:
            client.completions.create(model=MODEL, prompt="hi", n=2, stream=True)
    with sync_client(gateway, api_key="sk-wrong") as client, \
            pytest.raises(openai.AuthenticationError) as wrong_key:
        client.completions.create(model=MODEL, prompt="hi")

    for error in (bad.value, bad_stream.value):
        assert error.status_code == 400 and error.type == "invalid_request_error"
        assert "not supported by this gateway: n > 1" in error.message
    assert wrong_key.value.status_code == 401 and wrong_key.value.code == "invalid_api_key"


# ---------------------------------------------------------------------- /v1/chat/completions
def test_chat_completion(gateway):
    with sync_client(gateway) as client:
        completion = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=5, temperature=0.0,
            extra_body={"ignore_eos": True, "slo": "relaxed"}, extra_headers={"X-Request-Id": "oa-chat-1"})
        by_completion_tokens = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_completion_tokens=6, extra_body={"ignore_eos": True})
    assert isinstance(completion, openai.types.chat.ChatCompletion)
    assert completion.object == "chat.completion" and completion.model == MODEL
    assert completion.id.endswith("oa-chat-1")
    (choice,) = completion.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.message.role == "assistant" and choice.message.content == " tok" * 5
    assert completion.usage.completion_tokens == 5 and completion.usage.prompt_tokens > 0
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 5
    assert by_completion_tokens.choices[0].message.content == " tok" * 6
    assert by_completion_tokens.usage.completion_tokens == 6


def test_streamed_chat_completion_with_and_without_usage(gateway):
    with sync_client(gateway) as client:
        with_usage = list(client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=8, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        without_usage = list(client.chat.completions.create(
            model=MODEL, messages=CHAT, max_completion_tokens=4, stream=True, extra_body={"ignore_eos": True}))

    for chunks, tokens in ((with_usage, 8), (without_usage, 4)):
        assert all(isinstance(chunk, openai.types.chat.ChatCompletionChunk) for chunk in chunks)
        assert {chunk.object for chunk in chunks} == {"chat.completion.chunk"}
        deltas = [chunk.choices[0] for chunk in chunks if chunk.choices]
        assert deltas[0].delta.role == "assistant", "the first delta names the assistant's role"
        assert "".join(choice.delta.content or "" for choice in deltas) == " tok" * tokens
        finishes = [choice.finish_reason for choice in deltas]
        assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
        assert len({chunk.id for chunk in chunks}) == 1

    *content_chunks, usage_chunk = with_usage
    assert all(chunk.usage is None for chunk in content_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 8
    assert usage_chunk.usage.prompt_tokens > 0
    assert all(chunk.choices and chunk.usage is None for chunk in without_usage)


def test_async_chat_completion_streamed_and_not(gateway):
    async def main():
        async with async_client(gateway) as client:
            completion = await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=3, extra_body={"ignore_eos": True})
            stream = await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=5, stream=True, extra_body={"ignore_eos": True})
            chunks = [chunk async for chunk in stream]
        return completion, chunks

    completion, chunks = asyncio.run(main())
    assert completion.choices[0].message.content == " tok" * 3
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == " tok" * 5


def test_chat_refusals_are_typed_exceptions(gateway):
    with sync_client(gateway) as client:
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=MODEL, messages=CHAT, n=2)
        with pytest.raises(openai.BadRequestError) as bad_stream:
            client.chat.completions.create(model=MODEL, messages=CHAT, n=2, stream=True)
        with pytest.raises(openai.BadRequestError) as no_messages:
            client.chat.completions.create(model=MODEL, messages=[])

    for error in (bad.value, bad_stream.value):
        assert error.status_code == 400 and error.type == "invalid_request_error"
        assert "n > 1" in error.message
    assert no_messages.value.status_code == 400 and "messages" in no_messages.value.message


# ---------------------------------------------------------------------- SLO hints
def test_service_tier_and_the_routers_headers_name_the_slo(gateway):
    """``service_tier`` as the package sends it, and smg's and llm-d's headers, reach the
    rank as an SLO (``--slo-hints``); an explicit ``slo`` wins over them."""
    with sync_client(gateway) as client:
        flex = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, service_tier="flex")
        assert flex.choices[0].message.content == " tok" * 3
        explicit = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, service_tier="scale", extra_body={"slo": "standard"})
        assert explicit.choices[0].message.content == " tok" * 2
        with pytest.raises(openai.BadRequestError) as unknown_class:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, service_tier="scale")
        with pytest.raises(openai.BadRequestError) as conflict:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, service_tier="flex",
                                           extra_headers={"x-smg-priority": "interactive"})
        with pytest.raises(openai.BadRequestError) as header_class:
            client.completions.create(model=MODEL, prompt=[5] * 8, max_tokens=2,
                                      extra_headers={"x-smg-priority": "no-such-class"})
        with pytest.raises(openai.BadRequestError) as malformed:
            client.completions.create(model=MODEL, prompt=[5] * 8, max_tokens=2,
                                      extra_headers={"x-llm-d-slo-ttft-ms": "soon"})
        ttft = client.completions.create(model=MODEL, prompt=[5] * 8, max_tokens=2,
                                         extra_headers={"x-llm-d-slo-ttft-ms": "5000"})
        assert ttft.choices[0].text == " tok" * 2
    for refused in (unknown_class, header_class):
        assert refused.value.status_code == 400 and "no-such-class" in refused.value.message
    assert "conflicting SLO hints" in conflict.value.message and "x-smg-priority" in conflict.value.message
    assert malformed.value.status_code == 400 and "x-llm-d-slo-ttft-ms" in malformed.value.message


# ---------------------------------------------------------------------- any model, the documented snippet
def test_any_model_name_is_served_and_echoed(gateway):
    with sync_client(gateway) as client:
        completion = client.completions.create(model="gpt-4o-mini", prompt="hi", max_tokens=2)
        chat = client.chat.completions.create(model="meta-llama/Llama-3.1-8B-Instruct", messages=CHAT,
                                              max_tokens=2)
        chunks = list(client.chat.completions.create(model="my-model", messages=CHAT, max_tokens=2,
                                                     stream=True))
        raw = client.chat.completions.with_raw_response.create(messages=CHAT, max_tokens=2, model="x",
                                                                extra_headers={"X-Request-Id": "oa-raw"})
    assert completion.model == "gpt-4o-mini" and completion.choices[0].text == " tok" * 2
    assert chat.model == "meta-llama/Llama-3.1-8B-Instruct" and chat.choices[0].message.content == " tok" * 2
    assert {chunk.model for chunk in chunks} == {"my-model"}
    assert raw.headers["X-Request-Id"] == "oa-raw" and raw.parse().model == "x"


def test_the_documented_snippet_runs_as_written(gateway):
    """docs/controlplane.md's ``openai`` snippet, with this gateway's address and key."""
    page = (REPO / "docs" / "controlplane.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.DOTALL)
    (snippet,) = [block for block in blocks if "from openai" in block]
    snippet = snippet.replace('"http://127.0.0.1:8000/v1"', repr(gateway))
    snippet, keys = re.subn(r'api_key="[^"]*"', f"api_key={API_KEY!r}, timeout={TIMEOUT_S}", snippet)
    assert keys == 1 and repr(gateway) in snippet
    ran = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=TIMEOUT_S,
                         check=False)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout == " tok" * 64 + "\n64 tokens\n"
