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


def test_a_late_hostile_prompt_does_not_stop_other_prefills(fb_server) -> None:
    """One long prompt that is late on arrival (TTFT 1 ms) and asks for the tightest TPOT
    the door accepts; six ordinary prompts arrive while it is being prefilled. In the
    printed algorithm its negative slack made the budget its TPOT for good and put its
    prefill first (the reproduced stall: the others timed out). With the guard the
    in-time prompts go first: every ordinary request gets its first token before the
    hostile one does, and all of them complete."""
    floor_probe = {"text": "x", "sampling_params": {"max_new_tokens": 1, "custom_params": {
        "slo": {"ttft_ms": 1, "tpot_ms": 1}}}}
    refusal = requests.post(f"{fb_server.url}/generate", json=floor_probe, timeout=60).text
    floor_ms = float(refusal.split("minimum of ")[1].split(" ms")[0])
    hostile_slo = {"ttft_ms": 1, "tpot_ms": floor_ms + 1}
    with ThreadPoolExecutor(7) as pool:
        hostile = pool.submit(stream_generate, fb_server.url, "hostile-late", 12_000, 8, hostile_slo)
        ordinary = [
            pool.submit(stream_generate, fb_server.url, f"ordinary-{i}", 1000, 8, ORDINARY)
            for i in range(6)
        ]
        hostile_stream = hostile.result(timeout=240)
        streams = [future.result(timeout=240) for future in ordinary]
    assert hostile_stream.finish_reason == "length"
    assert all(s.status == 200 and s.finish_reason == "length" for s in streams)
    hostile_first = hostile_stream.token_times[0]
    # the six are sent together with the hostile one: if any of them reached the server
    # after its last chunk had started, it could not overtake it; all six overtaking it
    # is what the guard guarantees for prompts that arrive while it is still queued
    overtook = sum(s.token_times[0] < hostile_first for s in streams)
    assert overtook >= 5, [round(s.token_times[0] - hostile_first, 3) for s in streams]
