"""End to end on CPU: admission control (``[admission]``) in the stock SGLang server with
the FairBatching plugin and the emulated GPU.

- ``reject``: a burst past capacity gets HTTP 429s (``Retry-After``, an OpenAI-style
  body) on ``/generate`` and the OpenAI routes, streamed or not, and the requests it
  admits meet their TTFT at least as often as the same burst on the server without
  admission (the two sides of one test, never an absolute timing); a refusal storm
  leaves nothing behind.
- ``defer``: nothing is refused; every request of a burst past capacity is served or
  ended with a status.
- SLO hints (``service_tier``, ``priority``, smg's and llm-d's headers) are read in front
  of the ``reject`` gate on every route.
"""

from __future__ import annotations

import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

import requests
from test_fairbatching_e2e import BASE_ARGS, emulated_env, loads, metric, wait_for_metric_above

from benchmarks.support.sse import json_events

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]

ROUTES = ("generate", "v1/completions", "v1/chat/completions")
STANDARD = {"class": "standard"}  # TTFT 2 s
#: a class of the reject server's SLO file whose TTFT (1 ms) no prompt of this test fits
#: in, whatever the step model learns (a budget of R x 1 ms: ~20 tokens)
IMPOSSIBLE = {"class": "instant"}
BURST = 24
BURST_PROMPT_TOKENS = 3000


def admission_config(fb_config: Path, directory: Path, table: str, extra_slo: str = "") -> Path:
    text = fb_config.read_text()
    start = text.index("[admission]")
    text = text[:start] + table
    if extra_slo:
        shipped = REPO / "configs" / "slo.toml"
        (directory / "slo.toml").write_text(shipped.read_text() + extra_slo)
        text = text.replace(f'slo_file = "{shipped}"', 'slo_file = "slo.toml"')
        assert 'slo_file = "slo.toml"' in text
    path = directory / "fairbatching.toml"
    path.write_text(text)
    (directory / "step_model.toml").write_text((fb_config.parent / "step_model.toml").read_text())
    return path


@pytest.fixture(scope="module")
def reject_server(sglang_server, fb_config, tmp_path_factory):
    config = admission_config(fb_config, tmp_path_factory.mktemp("reject"),
                              '[admission]\nmode = "reject"\nretry_after_s = 1.5\n',
                              "\n[classes.instant]\nttft_ms = 1\ntpot_ms = 50\n")
    return sglang_server(args=BASE_ARGS, env=emulated_env(config))


@pytest.fixture(scope="module")
def fb_server(sglang_server, fb_config):
    return sglang_server(args=BASE_ARGS, env=emulated_env(fb_config))


@pytest.fixture(scope="module")
def defer_server(sglang_server, fb_config, tmp_path_factory):
    config = admission_config(fb_config, tmp_path_factory.mktemp("defer"),
                              '[admission]\nmode = "defer"\nmax_defer_s = 2\n')
    return sglang_server(args=BASE_ARGS, env=emulated_env(config))


@dataclass
class Reply:
    status: int
    retry_after: str | None
    body: dict | None  # the error body of a refusal
    ttft_s: float | None  # client-side, to the first generated token
    finish: str | None  # the finish reason type of a served request


def send(url: str, route: str, stream: bool, prompt_tokens: int, slo: dict, seed: int,
         max_tokens: int = 8) -> Reply:
    ids = [5 + (seed * 131 + i * 37) % 900 for i in range(prompt_tokens)]
    custom = {"slo": slo}
    if route == "generate":
        body = {"input_ids": ids, "stream": stream, "sampling_params": {
            "max_new_tokens": max_tokens, "ignore_eos": True, "custom_params": custom}}
    elif route == "v1/completions":
        body = {"model": "default", "prompt": ids, "max_tokens": max_tokens, "stream": stream,
                "ignore_eos": True, "custom_params": custom}
    else:
        body = {"model": "default", "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
                "messages": [{"role": "user", "content": "x " * (prompt_tokens - 8)}],
                "custom_params": custom}
    started = time.perf_counter()
    with requests.post(f"{url}/{route}", json=body, stream=stream, timeout=300) as reply:
        if reply.status_code != 200:
            return Reply(reply.status_code, reply.headers.get("Retry-After"), reply.json(), None, None)
        if not stream:
            payload = reply.json()
            finish = (payload.get("meta_info", {}).get("finish_reason") or {}).get("type") \
                if route == "generate" else payload["choices"][0]["finish_reason"]
            return Reply(200, None, None, None, finish)
        ttft, finish = None, None
        for chunk in json_events(reply.iter_lines(decode_unicode=True)):
            if "error" in chunk:
                finish = "error"
                continue
            if route == "generate":
                if ttft is None and chunk["meta_info"]["completion_tokens"]:
                    ttft = time.perf_counter() - started
                finish = (chunk["meta_info"].get("finish_reason") or {}).get("type") or finish
            else:
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                if ttft is None and (choice.get("text") or choice.get("delta", {}).get("content")):
                    ttft = time.perf_counter() - started
                finish = choice.get("finish_reason") or finish
        return Reply(200, None, None, ttft, finish)


def burst(url: str, slo: dict, *, routes=("generate",), streamed=(True,)) -> list[Reply]:
    with ThreadPoolExecutor(BURST) as pool:
        futures = [pool.submit(send, url, routes[i % len(routes)], streamed[i % len(streamed)],
                               BURST_PROMPT_TOKENS, slo, i) for i in range(BURST)]
        return [f.result() for f in futures]


def wait_idle(url: str, timeout: float = 60.0) -> dict:
    """The rank's load once nothing runs, waits or holds KV (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        (rank,) = loads(url)
        if (rank["num_running_reqs"], rank["num_waiting_reqs"], rank["num_used_tokens"]) == (0, 0, 0):
            return rank
        if time.monotonic() > deadline:
            return rank
        time.sleep(0.1)


def attainment(replies: list[Reply], ttft_s: float) -> float:
    served = [r for r in replies if r.status == 200]
    return sum(r.ttft_s is not None and r.ttft_s <= ttft_s for r in served) / len(served)


def test_burst_past_capacity_gets_429s_and_the_admitted_meet_their_ttft(reject_server, fb_server) -> None:
    wait_idle(reject_server.url)
    admitted = burst(reject_server.url, STANDARD)
    wait_idle(fb_server.url)
    unchecked = burst(fb_server.url, STANDARD)
    refused = [r for r in admitted if r.status == 429]
    assert refused and len(refused) < BURST, [r.status for r in admitted]
    assert all(r.status in (200, 429) for r in admitted)
    assert all(r.status == 200 for r in unchecked)
    assert {r.retry_after for r in refused} == {"2"}
    # the same burst: what reject admits meets the 2 s TTFT at least as often as without it
    assert attainment(admitted, 2.0) >= attainment(unchecked, 2.0), (admitted, unchecked)
    assert attainment(admitted, 2.0) > 0
    assert metric(reject_server.url, "fairbatching:admission_refused_total") >= len(refused)


def test_refusal_storm_on_every_route_leaves_nothing_behind(reject_server) -> None:
    before = metric(reject_server.url, "fairbatching:admission_refused_total")
    wait_idle(reject_server.url)
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(send, reject_server.url, route, stream, 500, IMPOSSIBLE, i)
                   for i in range(8) for route in ROUTES for stream in (False, True)]
        replies = [f.result() for f in futures]
    assert {r.status for r in replies} == {429}
    assert {r.retry_after for r in replies} == {"2"}
    for reply in replies:  # streamed or not, any route: the same body
        assert reply.body["code"] == reply.body["error"]["code"] == 429
        assert reply.body["error"]["type"] == "rate_limit_error"
        assert reply.body["error"]["reason"] == "admission_budget"
        assert "SLO class 'instant'" in reply.body["message"]
    assert wait_for_metric_above(reject_server.url, "fairbatching:admission_refused_total",
                                 before + len(replies) - 1) == before + len(replies)
    rank = wait_idle(reject_server.url)
    assert (rank["num_running_reqs"], rank["num_waiting_reqs"], rank["num_used_tokens"]) == (0, 0, 0)
    served = send(reject_server.url, "generate", True, 100, STANDARD, 99)
    assert (served.status, served.finish) == (200, "length")


def test_slo_hints_are_read_in_front_of_the_gate_on_every_route(reject_server) -> None:
    """The hints (``[slo_hints]``, the shipped table) chained before the 429 gate: OpenAI's
    ``service_tier``, SGLang's ``priority`` and smg's and llm-d's headers become the
    request's SLO, which the door then checks as an explicit one; a class the SLO file
    lacks, a conflict and a malformed header are 400s naming what is wrong. (It comes
    before the defer test: the pool keeps two servers, and starting ``defer_server``
    stops this one.)"""
    url = reject_server.url
    chat = {"model": "default", "max_tokens": 2, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}]}
    generate = {"input_ids": [5] * 16, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}

    def post(route: str, body: dict, headers: dict | None = None) -> requests.Response:
        return requests.post(f"{url}/{route}", json=body, headers=headers or {}, timeout=300)

    served = [post("v1/chat/completions", {**chat, "service_tier": "flex"}),
              post("v1/completions", {"model": "default", "prompt": [5] * 16, "max_tokens": 2,
                                      "ignore_eos": True}, {"x-llm-d-slo-ttft-ms": "5000"}),
              post("generate", {**generate, "priority": 2}),
              post("generate", generate, {"x-smg-priority": "relaxed"})]
    assert [reply.status_code for reply in served] == [200] * 4, [reply.text for reply in served]
    refused = {
        "no-such-class": post("v1/chat/completions", chat, {"x-smg-priority": "no-such-class"}),
        "conflicting SLO hints": post("v1/chat/completions", {**chat, "service_tier": "flex"},
                                      {"x-smg-priority": "interactive"}),
        "x-llm-d-slo-ttft-ms": post("generate", generate, {"x-llm-d-slo-ttft-ms": "soon"}),
        "service_tier": post("v1/chat/completions", {**chat, "service_tier": "turbo"}),
    }
    for words, reply in refused.items():
        assert reply.status_code == 400 and words in reply.text, (words, reply.status_code, reply.text)
    impossible = post("generate", {"input_ids": [5] * BURST_PROMPT_TOKENS, "sampling_params": {
        "max_new_tokens": 2, "custom_params": {"slo": IMPOSSIBLE}}}, {"x-smg-priority": "relaxed"})
    assert impossible.status_code == 429  # an explicit slo wins over the hint: the gate refuses it


def test_defer_serves_or_ends_every_request_with_a_status(defer_server) -> None:
    url = defer_server.url
    wait_idle(url)
    expired_before = metric(url, "fairbatching:deferred_expired_total")
    replies = burst(url, {"class": "interactive"}, routes=("generate", "v1/completions"),
                    streamed=(True, False))
    outcomes = [(r.status, r.finish) for r in replies]
    # served in full, or ended after max_defer_s: a 503 (unstreamed) or an abort (streamed)
    assert set(outcomes) <= {(200, "length"), (503, None), (200, "abort")}, outcomes
    assert (200, "length") in outcomes
    ended = sum(outcome != (200, "length") for outcome in outcomes)
    if ended:
        assert wait_for_metric_above(url, "fairbatching:deferred_expired_total",
                                     expired_before + ended - 1) - expired_before == ended
    assert metric(url, "fairbatching:late_prefills_total") > 0
    rank = wait_idle(url)
    assert (rank["num_running_reqs"], rank["num_waiting_reqs"], rank["num_used_tokens"]) == (0, 0, 0)
