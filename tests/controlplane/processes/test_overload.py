"""The control plane past its own capacity: a real daemon process, the HTTP gateway and two
simulated ranks, driven by many more concurrent clients than the ranks' budgets, the daemon's
queue and the gateway's in-flight limit can hold.

Every request gets exactly one answer, 200 or 429 with ``Retry-After`` (nothing lost, nothing
left waiting), and the ranks stay alive and fresh throughout: their heartbeats and reports are
never drowned by the requests. The test waits for states, never for times.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections import Counter

import aiohttp
import pytest

from benchmarks.controlplane.live_daemon import loopback_config, start_process_daemon
from benchmarks.support.paths import REPO
from benchmarks.support.ports import free_ports
from controlplane.client import AsyncClient
from controlplane.gateway import GatewaySettings, serve

CLIENTS = 240  # concurrent HTTP clients, each one request
RANKS = ("over/0", "over/1")
STATE_WAIT_S = 120.0  # how long a state may take to come about on a busy machine before failing


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("overload")
    config = loopback_config(on_no_budget="queue", max_queued=32, queue_ttl_s=5.0, stale_after_s=2.0)
    daemon = start_process_daemon(tmp_path, config)
    with open(tmp_path / "ranks.log", "ab") as log:
        ranks = subprocess.Popen(
            [sys.executable, "-m", "sglang_ext.sim.rank", "--daemon", config.rank_address,
             "--report-address", config.report_address, "--agent-id", "over", "--ranks", "2",
             "--time-scale", "0.5", "--log-level", "warning"],
            cwd=REPO, stdout=log, stderr=log)
    try:
        yield config
    finally:
        ranks.kill()
        ranks.wait(10)
        daemon.kill()


async def wait_until(check, what: str):
    deadline = time.monotonic() + STATE_WAIT_S
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} never came about"
        await asyncio.sleep(0.05)


async def one_request(session: aiohttp.ClientSession, url: str, index: int
                      ) -> tuple[int, str | None, str, float]:
    # each client its own prompt: the simulated ranks cache no prefixes, while the daemon's
    # prefix tree would believe a repeated prompt cached and debit ~1 token of it
    body = {"prompt": [7 + index] * 3000, "max_tokens": 24, "ignore_eos": True,
            "slo": "interactive" if index % 2 else "standard", "stream": index % 3 == 0}
    started = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body,
                            headers={"X-Request-Id": f"over-{index}"}) as response:
        payload = await response.read()
        code = ""
        if response.status != 200:
            code = (await response.json())["error"]["code"]
        else:
            assert payload.endswith(b"data: [DONE]\n\n") if body["stream"] else b'"choices"' in payload
        return response.status, response.headers.get("Retry-After"), code, time.perf_counter() - started


@pytest.mark.parametrize("gateway_limit", [64, CLIENTS], ids=["gateway-sheds", "daemon-sheds"])
def test_past_its_capacity_every_request_gets_one_answer_and_ranks_stay_alive(stack, gateway_limit):
    config = stack
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"

    async def main():
        stop = asyncio.Event()
        async with AsyncClient(config.client_address) as client:
            async def fresh_ranks():
                status = await client.status()
                fresh = {rank.rank for rank in status.ranks if not rank.stale}
                return status if set(RANKS) <= fresh else None

            await wait_until(fresh_ranks, "both ranks reporting")
            settings = GatewaySettings("overload", max_in_flight=gateway_limit)
            server = asyncio.create_task(serve(client, settings, "127.0.0.1", port, stop))
            watching = True
            stale_seen: Counter[str] = Counter()
            largest_report_age = 0.0

            async def watch_ranks():
                nonlocal largest_report_age
                while watching:
                    status = await client.status()
                    for rank in status.ranks:
                        if rank.stale:
                            stale_seen[rank.rank] += 1
                        largest_report_age = max(largest_report_age, rank.report_age_s or 0.0)
                    assert {rank.rank for rank in status.ranks} == set(RANKS), "a rank was lost"
                    await asyncio.sleep(0.1)

            try:
                connector = aiohttp.TCPConnector(limit=CLIENTS)
                timeout = aiohttp.ClientTimeout(total=STATE_WAIT_S)
                async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                    async def healthy():
                        try:
                            async with session.get(f"{url}/health") as response:
                                return response.status == 200
                        except aiohttp.ClientConnectionError:
                            return False

                    await wait_until(healthy, "the gateway listening")
                    watcher = asyncio.create_task(watch_ranks())
                    answers = await asyncio.gather(*(one_request(session, url, i) for i in range(CLIENTS)))
                    watching = False
                    await watcher
                    async with session.get(f"{url}/metrics") as response:
                        metrics = await response.text()
            finally:
                stop.set()
                await server

            async def idle():
                status = await client.status()
                return status if status.in_flight == 0 and status.queued == 0 else None

            status = await wait_until(idle, "the daemon idle")
            return answers, stale_seen, largest_report_age, metrics, status

    answers, stale_seen, largest_report_age, metrics, status = asyncio.run(main())
    outcomes = Counter((status, code) for status, _, code, _ in answers)
    refused_after = sorted(seconds for status, _, _, seconds in answers if status == 429)
    gaps = {rank.rank: rank.seq_gaps for rank in status.ranks}
    print(f"answers {dict(outcomes)}; 429 after {refused_after[len(refused_after) // 2]:.2f} s median, "
          f"{refused_after[-1]:.2f} s at most; largest report age {largest_report_age:.2f} s; report seq "
          f"gaps {gaps}; daemon counters {dict(status.counters)}")
    assert len(answers) == CLIENTS  # every request answered once (gather: one result each)
    assert {status for status, _, _, _ in answers} <= {200, 429}, outcomes
    assert all(retry_after is not None and int(retry_after) >= 1
               for status, retry_after, _, _ in answers if status == 429)
    assert outcomes[(200, "")] > 0, "the ranks served requests"
    assert refused_after, "it shed load"
    assert not stale_seen, f"ranks went stale: {dict(stale_seen)}"
    counters = status.counters
    assert counters.get("ranks_lost", 0) == 0 and counters.get("rank_lost_requests", 0) == 0
    assert "fairbatching_gateway_refused_total" in metrics
