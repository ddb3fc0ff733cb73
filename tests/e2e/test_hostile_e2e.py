"""End to end: a client-chosen SLO cannot stall the other users of a FairBatching server
(the lateness guard and the door's floor; ``sglang_ext.policy.batch_former``).

Shares the FairBatching server of ``test_fairbatching_e2e`` (same arguments and
environment, so the session pool hands out the same process)."""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

import requests
from test_fairbatching_e2e import BASE_ARGS, emulated_env, stream_generate

pytestmark = pytest.mark.e2e

ORDINARY = {"ttft_ms": 2000, "tpot_ms": 50}


@pytest.fixture(scope="module")
def fb_server(sglang_server, fb_config):
    return sglang_server(args=BASE_ARGS, env=emulated_env(fb_config))


def test_a_tpot_below_the_floor_is_a_400_that_says_why(fb_server) -> None:
    """The reproduced request ({"ttft_ms": 100, "tpot_ms": 4}) on both routes."""
    hostile = {"slo": {"ttft_ms": 100, "tpot_ms": 4}}
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 4, "custom_params": hostile}}
    reply = requests.post(f"{fb_server.url}/generate", json=body, timeout=60)
    assert reply.status_code == 400
    assert "below this server's minimum" in reply.text
    model = requests.get(f"{fb_server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": "hello", "max_tokens": 4, "stream": True,
            "custom_params": hostile}
    reply = requests.post(f"{fb_server.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400
    assert "below this server's minimum" in reply.text


def test_an_e2e_slo_that_cannot_cover_the_output_bound_is_a_400_that_says_why(fb_server) -> None:
    """An e2e SLO is paced for the request's max_new_tokens (SGLang's default without
    one; the context's room when it is null) and refused in those terms."""
    def generate(max_new_tokens: dict, e2e_ms: float) -> requests.Response:
        params = {**max_new_tokens, "custom_params": {"slo": {"e2e_ms": e2e_ms}}}
        return requests.post(f"{fb_server.url}/generate", timeout=60,
                             json={"text": "hello", "sampling_params": params})

    reply = generate({"max_new_tokens": 4096}, 2000)
    assert reply.status_code == 400 and "e2e_ms 2000 cannot cover max_new_tokens 4096" in reply.text
    assert "it needs e2e_ms >= " in reply.text
    reply = generate({}, 200)
    assert reply.status_code == 400 and "cannot cover max_new_tokens 128 (the default)" in reply.text
    reply = generate({"max_new_tokens": None}, 2000)
    assert reply.status_code == 400 and "cannot cover the context's room of" in reply.text
    reply = generate({"max_new_tokens": 4}, 60_000)
    assert reply.status_code == 200, reply.text


def test_late_hostile_prompts_do_not_stop_other_prefills(fb_server) -> None:
    """Three long prompts that are late on arrival (TTFT 1 ms) and ask for the tightest
    TPOT the door accepts, sent with six short ordinary prompts. In the printed algorithm
    their negative slack makes the budget their TPOT for good and puts their prefills
    first, so the ordinary prompts queue behind every hostile chunk at a few hundred
    tokens a step (the reproduced stall, with a TPOT below the step's fixed cost: they
    timed out). With the guard the in-time prompts go first under their own budget: all
    complete, and the ordinary prompts get their first tokens before the last hostile
    one does (one straggler allowed: a request the client's threads delay). Checked to
    fail with ``lateness_guard=False`` (0 of 6 ahead; with it, 6 of 6, 0.28-0.48 s ahead). Both sides are token times of the
    same run on the same client clock, compared by order, steps apart."""
    floor_probe = {"text": "x", "sampling_params": {"max_new_tokens": 1, "custom_params": {
        "slo": {"ttft_ms": 1, "tpot_ms": 1}}}}
    refusal = requests.post(f"{fb_server.url}/generate", json=floor_probe, timeout=60).text
    floor_ms = float(refusal.split("minimum of ")[1].split(" ms")[0])
    hostile_slo = {"ttft_ms": 1, "tpot_ms": floor_ms + 1}
    # stream_generate's prompt depends on len(rid): distinct lengths, no shared prefix
    # for the radix cache to skip
    with ThreadPoolExecutor(9) as pool:
        hostile = [
            pool.submit(stream_generate, fb_server.url, "hostile" + "-" * (i + 1), 7_000, 8,
                        hostile_slo)
            for i in range(3)
        ]
        ordinary = [
            pool.submit(stream_generate, fb_server.url, "ordinary" + "-" * (i + 4), 300, 8,
                        ORDINARY)
            for i in range(6)
        ]
        hostile_streams = [future.result(timeout=240) for future in hostile]
        streams = [future.result(timeout=240) for future in ordinary]
    assert all(s.status == 200 and s.finish_reason == "length" for s in hostile_streams + streams)
    last_hostile_first = max(s.token_times[0] for s in hostile_streams)
    ahead = sum(s.token_times[0] < last_hostile_first for s in streams)
    assert ahead >= 5, [round(s.token_times[0] - last_hostile_first, 3) for s in streams]
