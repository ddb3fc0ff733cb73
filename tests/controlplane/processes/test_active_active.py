"""Two daemons, active-active, on loopback: daemon processes, simulated rank processes that
serve both, and SDK clients that know both. One daemon is killed (SIGKILL) under load.

What must hold (docs/controlplane.md, "Several daemons"): each request is dispatched once,
by the daemon that received it; the killed daemon loses only what was in flight on it, and
each of those requests is answered, not hung: resubmitted to the other daemon with the same
id when no output had reached its client, a clear ``DaemonUnavailable`` when some had; the
ranks end what they ran for the dead daemon and serve on for the live one.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.controlplane.live_daemon import ProcessDaemon, loopback_config, start_process_daemon
from benchmarks.support.paths import REPO
from controlplane.client import AsyncClient
from controlplane.errors import DaemonUnavailable
from controlplane.protocol import SamplingParams

TIME_SCALE = "0.2"  # real seconds per simulated second
RANKS = ("sim-a", "sim-b")
UNSTREAMED = 24  # per client: no output before the finish, so a daemon loss is always retried
STREAMS = 4  # per client: long enough to be streaming when the daemon dies
STREAM_TOKENS = 3000
DROP_LINE = "the daemon connection dropped"


def start_rank(name: str, daemons: list[ProcessDaemon], tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "ab") as log:
        addresses = [arg for daemon in daemons for arg in ("--daemon", daemon.config.rank_address)]
        process = subprocess.Popen(
            [sys.executable, "-m", "sglang_ext.sim.rank", *addresses, "--agent-id", name,
             "--time-scale", TIME_SCALE, "--seed", str(sum(map(ord, name)))],
            stdout=log, stderr=log, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return process, log_path


@pytest.fixture
def two_daemons(tmp_path):
    configs = [loopback_config(policy="pab_least_loaded", on_no_budget="queue", queue_ttl_s=60.0,
                               stale_after_s=1.0, heartbeat_interval_s=0.2, lost_after_s=1.5)
               for _ in range(2)]
    daemons = [start_process_daemon(tmp_path, config, name=f"daemon-{i}") for i, config in enumerate(configs)]
    ranks = {name: start_rank(name, daemons, tmp_path) for name in RANKS}
    try:
        yield daemons, ranks
    finally:
        for process, _ in ranks.values():
            if process.poll() is None:
                process.kill()
                process.wait(10)
        for daemon in daemons:
            daemon.kill()


async def client_on(addresses: list[str], wanted: str) -> AsyncClient:
    """A client of both daemons whose random first pick is ``wanted``."""
    for _ in range(64):
        client = AsyncClient(addresses, max_retries=10)
        if client.address == wanted:
            return client
        await client.close()
    raise AssertionError(f"no client started on {wanted}")


async def until(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout_s:g} s"
        await asyncio.sleep(0.05)


def test_killing_one_daemon_under_load_loses_only_its_in_flight_requests_and_answers_each(two_daemons):
    daemons, ranks = two_daemons
    victim, survivor = daemons
    addresses = [daemon.config.client_address for daemon in daemons]

    async def scenario():
        on_victim = await client_on(addresses, victim.config.client_address)
        on_survivor = await client_on(addresses, survivor.config.client_address)
        async with on_victim, on_survivor:
            async def every_rank_reports(client: AsyncClient) -> bool:
                status = await client.status()
                return {rank.rank for rank in status.ranks if not rank.stale} >= set(RANKS)

            for client in (on_victim, on_survivor):
                await until(lambda client=client: every_rank_reports(client), "both daemons see both ranks")
            streaming: set[str] = set()

            async def generate(client: AsyncClient, request_id: str):
                try:
                    return await client.generate([5] * 300, request_id=request_id, slo="relaxed",
                                                 sampling=SamplingParams(max_new_tokens=600, ignore_eos=True))
                except DaemonUnavailable as error:
                    return error

            async def stream(client: AsyncClient, request_id: str):
                try:
                    async with client.stream([5] * 100, request_id=request_id, slo="relaxed",
                                             sampling=SamplingParams(max_new_tokens=STREAM_TOKENS,
                                                                     ignore_eos=True)) as chunks:
                        async for _ in chunks:
                            streaming.add(request_id)
                    return chunks.result
                except DaemonUnavailable as error:
                    return error

            tasks = {}
            for name, client in (("victim", on_victim), ("survivor", on_survivor)):
                for i in range(STREAMS):
                    tasks[f"{name}-stream-{i}"] = asyncio.create_task(stream(client, f"{name}-stream-{i}"))
                for i in range(UNSTREAMED):
                    tasks[f"{name}-gen-{i}"] = asyncio.create_task(generate(client, f"{name}-gen-{i}"))

            async def victim_busy() -> bool:
                status = await on_victim.status()
                return all(f"victim-stream-{i}" in streaming for i in range(STREAMS)) and status.in_flight >= 8

            await until(victim_busy, "the victim daemon streams and holds requests")
            in_flight_at_kill = (await on_victim.status()).in_flight
            victim.kill()
            outcomes = dict(zip(tasks, await asyncio.wait_for(asyncio.gather(*tasks.values()), 120)))
            survivor_status = await on_survivor.status()
            return outcomes, in_flight_at_kill, survivor_status, on_victim.address

    outcomes, in_flight_at_kill, survivor_status, victim_client_now = asyncio.run(scenario())
    results = {request_id: end for request_id, end in outcomes.items() if not isinstance(end, Exception)}
    failures = {request_id: end for request_id, end in outcomes.items() if isinstance(end, Exception)}

    # the survivor's own clients never noticed
    assert all(request_id in results and results[request_id].attempts == 1
               for request_id in outcomes if request_id.startswith("survivor-"))
    # an unstreamed request had no output when its daemon died: resubmitted, with its id, once
    moved = [request_id for request_id in outcomes
             if request_id.startswith("victim-gen-") and results[request_id].attempts == 2]
    assert all(request_id in results for request_id in outcomes if request_id.startswith("victim-gen-"))
    assert moved and len(moved) <= in_flight_at_kill
    assert all(results[request_id].request_id == request_id for request_id in moved)
    # a stream that had output ends with a clear error, never hangs or resumes elsewhere
    assert failures and set(failures) <= {f"victim-stream-{i}" for i in range(STREAMS)}
    assert all("after output was received" in str(error) for error in failures.values())
    assert victim_client_now == daemons[1].config.client_address  # its client moved to the survivor
    assert {rank.rank for rank in survivor_status.ranks} == set(RANKS)
    # the ranks ended what they ran for the dead daemon, and both still run
    for process, log_path in ranks.values():
        assert process.poll() is None
        assert DROP_LINE in log_path.read_text()
