"""GPU smoke test: the stock SGLang server on a real CUDA GPU with FairBatching on.

Skipped without CUDA (this project's CI has none). On a GPU machine with the test
environment installed (``scripts/test.sh`` does it)::

    scripts/test.sh -m gpu tests/gpu -s

A tiny Llama with random weights (``--load-format dummy``, written locally: no download)
keeps it to a minute; it checks that per-request SLOs are accepted and honoured in
order of tightness, malformed ones get a 400, and every rank reports its PAB.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

if importlib.util.find_spec("torch") is None or importlib.util.find_spec("sglang") is None:
    pytest.skip("needs torch and sglang", allow_module_level=True)

import requests  # noqa: E402

from benchmarks.server.stock_server import server_env  # noqa: E402
from benchmarks.support.ports import free_port  # noqa: E402
from benchmarks.support.processes import spawn, stop_group  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sglang_ext.adapter.emulated_gpu.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    port = free_port()
    log = tmp_path_factory.mktemp("log") / "server.log"
    env = server_env({"FAIRBATCHING_CONFIG": str(REPO / "configs" / "fairbatching.toml")})
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
               "--load-format", "dummy", "--host", "127.0.0.1", "--port", str(port),
               "--enable-metrics", "--mem-fraction-static", "0.5"]
    process = spawn(command, log, env, cwd=None)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()[-4000:]
            try:
                if requests.get(f"{url}/health_generate", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(2)
        else:
            pytest.fail("server did not become healthy:\n" + log.read_text()[-4000:])
        yield url
    finally:
        stop_group(process, timeout=60)


def generate(url: str, rid: str, slo: dict | None, max_new_tokens: int = 64) -> dict:
    params: dict = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    if slo is not None:
        params["custom_params"] = {"slo": slo}
    body = {"rid": rid, "input_ids": list(range(10, 10 + 512)), "sampling_params": params}
    reply = requests.post(f"{url}/generate", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_slos_are_accepted_and_every_request_completes(gpu_server: str) -> None:
    slos = [{"class": "interactive"}, {"class": "relaxed"}, {"ttft_ms": 300, "tpot_ms": 30}, None] * 8
    with ThreadPoolExecutor(len(slos)) as pool:
        replies = list(pool.map(lambda i: generate(gpu_server, f"gpu-{i}", slos[i]), range(len(slos))))
    assert all(r["meta_info"]["completion_tokens"] == 64 for r in replies)


def test_malformed_slo_is_rejected(gpu_server: str) -> None:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "custom_params": {"slo": {"class": "nope"}}}}
    assert requests.post(f"{gpu_server}/generate", json=body, timeout=60).status_code == 400


def test_pab_and_step_model_are_reported(gpu_server: str) -> None:
    loads = requests.get(f"{gpu_server}/v1/loads", timeout=30).json()["loads"]
    assert all(rank.get("fairbatching_pab_tokens") is not None for rank in loads)
    metrics = requests.get(f"{gpu_server}/metrics", timeout=30).text
    assert "fairbatching:step_model_coefficient" in metrics
