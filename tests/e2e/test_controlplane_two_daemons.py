"""One stock SGLang server (emulated GPU, FairBatching on) serves two control-plane daemons
at once (``FAIRBATCHING_CONTROLPLANE`` with two addresses), its reports tapped on their way
to each (``controlplane_peers.ReportTap``). Then one daemon is killed while a request it
dispatched streams: the server ends that request and serves on for the other daemon.

The tests run in file order on module-scoped servers: the last one kills a daemon.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

from controlplane_peers import RawClient, ReportTap  # noqa: E402
from servers import EMULATED_PROFILE as PROFILE  # noqa: E402
from servers import EMULATED_TIME_SCALE as TIME_SCALE  # noqa: E402

from benchmarks.controlplane.live_daemon import loopback_config, start_process_daemon  # noqa: E402
from controlplane import protocol as p  # noqa: E402

pytestmark = pytest.mark.e2e

RANK = "cp-two/0"
DROPPED = "the daemon connection dropped; ending 1 running requests"


def prompt(length: int, salt: int) -> list[int]:
    return [5 + (i * 41 + salt) % 900 for i in range(length)]


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cp-two-daemons")
    started = []
    try:
        for name in ("first", "second"):
            config = loopback_config(policy="pab", on_no_budget="queue", queue_ttl_s=60.0, stale_after_s=1.0,
                                     heartbeat_interval_s=0.25, lost_after_s=1.5)
            started.append(start_process_daemon(directory, config, name=name))
        yield started
    finally:
        for daemon in started:
            daemon.kill()


@pytest.fixture(scope="module")
def taps(daemons):
    taps = [ReportTap(daemon.config.report_address) for daemon in daemons]
    yield taps
    for tap in taps:
        tap.close()


@pytest.fixture(scope="module")
def server(server_pool, sglang_server, fb_config, daemons, taps):
    env = {
        "FAIRBATCHING_EMULATED_GPU": PROFILE,
        "FAIRBATCHING_EMULATED_GPU_TIME_SCALE": TIME_SCALE,
        "FAIRBATCHING_CONFIG": str(fb_config),
        "FAIRBATCHING_CONTROLPLANE": ",".join(d.config.rank_address for d in daemons),
        "FAIRBATCHING_CONTROLPLANE_REPORTS": ",".join(tap.address for tap in taps),
        "FAIRBATCHING_RANK_NAME": RANK.split("/")[0],
    }
    started = sglang_server(args=("--max-total-tokens", "200000"), env=env)
    yield started
    started.stop()  # it points at this module's daemons: free the memory


async def fresh(client: RawClient, timeout: float = 60.0) -> p.StatusReply:
    deadline = time.monotonic() + timeout
    while True:
        status = await client.status()
        if any(r.rank == RANK and not r.stale and r.reported_pab_tokens is not None for r in status.ranks):
            return status
        assert time.monotonic() < deadline, f"{RANK} never became fresh: {status}"
        await asyncio.sleep(0.1)


def test_both_daemons_dispatch_to_the_server_and_each_sees_its_own_numbering_echoed(server, daemons, taps) -> None:
    async def scenario():
        clients = [RawClient(daemon.config.client_address) for daemon in daemons]
        async with clients[0], clients[1]:
            epochs = [next(r.epoch for r in (await fresh(c)).ranks if r.rank == RANK) for c in clients]
            for i in range(6):
                for which, client in enumerate(clients):
                    await client.submit(f"d{which}-{i}", prompt(64 + 16 * i, i), 6, ignore_eos=True)
            outcomes = [[await client.wait(f"d{which}-{i}", 120) for i in range(6)]
                        for which, client in enumerate(clients)]
            await asyncio.sleep(0.5)  # the reports after the last step
            return epochs, outcomes

    epochs, outcomes = asyncio.run(scenario())
    assert epochs[0] == epochs[1]  # one server incarnation, joined to both
    for which, tap in enumerate(taps):
        for outcome in outcomes[which]:
            assert outcome.finish is not None and outcome.finish.completion_tokens == 6, outcome
        highest = max(d.dispatch_seq for o in outcomes[which] for d in o.dispatched)
        echoes = [r.echoed_dispatch_seq for r in tap.reports(RANK)]
        assert echoes == sorted(echoes) and echoes[-1] == highest  # this daemon's numbering only
    first, second = (max(d.dispatch_seq for o in outs for d in o.dispatched) for outs in outcomes)
    assert first != second


def test_a_killed_daemons_request_ends_at_the_server_and_the_other_daemon_serves_on(server, daemons, taps) -> None:
    victim, survivor = daemons

    async def scenario():
        async with RawClient(victim.config.client_address) as doomed, \
                RawClient(survivor.config.client_address) as client:
            await fresh(client)
            await doomed.submit("orphan", prompt(64, 1), 3000, ignore_eos=True)
            await doomed.wait("orphan", 60, until=lambda o: len(o.chunks) >= 3)
            victim.kill()
            killed_at = time.monotonic()
            deadline = killed_at + 30.0
            while DROPPED not in server.log_text():  # its agent for the dead daemon ended the orphan
                assert time.monotonic() < deadline, "the server never noticed the daemon's death"
                await asyncio.sleep(0.1)
            while True:  # and the server's reports to the survivor show it gone
                after = [r for r in taps[1].reports(RANK) if r.sent_at > killed_at]
                if after and after[-1].running == 0 and after[-1].waiting == 0:
                    break
                assert time.monotonic() < deadline, f"the orphan still runs: {after[-3:]}"
                await asyncio.sleep(0.1)
            await client.submit("after", prompt(80, 2), 12, ignore_eos=True)
            return await client.wait("after", 120), await client.status()

    outcome, status = asyncio.run(scenario())
    assert outcome.finish is not None and outcome.finish.completion_tokens == 12
    assert [r.rank for r in status.ranks] == [RANK] and not status.ranks[0].stale
