"""End to end on CPU: a request the admission gate refuses inside an SGLang server reached
through the control plane ends as the daemon's ``no_budget`` (retryable, with a retry
hint), and the same daemon still serves what the rank's budget covers.

The daemon routes round robin, so it dispatches without checking budgets itself: the
refusal comes from the server's ingress agent (``TokenizerManager.generate_request``,
the gate's hook), not from the daemon's balancer.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

from controlplane_peers import RawClient  # noqa: E402
from test_admission_e2e import admission_config  # noqa: E402
from test_fairbatching_e2e import BASE_ARGS, emulated_env  # noqa: E402

from benchmarks.controlplane.live_daemon import loopback_config, process_daemon  # noqa: E402
from controlplane import protocol as p  # noqa: E402

pytestmark = pytest.mark.e2e

RANK = "cp-admit/0"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    config = loopback_config(policy="round_robin", stale_after_s=1.0, heartbeat_interval_s=0.25,
                             lost_after_s=3.0)
    with process_daemon(tmp_path_factory.mktemp("cp-admission"), config) as running:
        yield running


@pytest.fixture(scope="module")
def rank_server(sglang_server, fb_config, daemon, tmp_path_factory):
    config = admission_config(fb_config, tmp_path_factory.mktemp("cp-reject"),
                              '[admission]\nmode = "reject"\n',
                              "\n[classes.instant]\nttft_ms = 1\ntpot_ms = 50\n")
    env = emulated_env(config) | {
        "FAIRBATCHING_CONTROLPLANE": daemon.config.rank_address,
        "FAIRBATCHING_CONTROLPLANE_REPORTS": daemon.config.report_address,
        "FAIRBATCHING_RANK_NAME": RANK.split("/")[0],
    }
    server = sglang_server(args=BASE_ARGS, env=env)
    yield server
    server.stop()  # it points at this module's daemon


async def wait_for_rank(client: RawClient, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        status = await client.status()
        if any(r.rank == RANK and not r.stale and r.reported_pab_tokens is not None
               for r in status.ranks):
            return
        assert time.monotonic() < deadline, f"{RANK} never became fresh: {status}"
        await asyncio.sleep(0.1)


def test_a_request_the_gate_refuses_is_no_budget_and_a_covered_one_is_served(rank_server, daemon):
    ids = [5 + (i * 37) % 900 for i in range(600)]

    async def scenario():
        async with RawClient(daemon.config.client_address) as client:
            await wait_for_rank(client)
            await client.submit("refused", ids, 4, slo=p.SloSpec(slo_class="instant"), ignore_eos=True)
            refused = await client.wait("refused", 60)
            await client.submit("served", ids, 4, slo=p.SloSpec(slo_class="standard"), ignore_eos=True)
            served = await client.wait("served", 60)
            status = await client.status()
            return refused, served, status

    refused, served, status = asyncio.run(scenario())
    assert refused.reject is not None, refused
    assert refused.reject.reason == p.RejectReason.NO_BUDGET, refused.reject
    assert refused.reject.retryable and refused.reject.retry_after_s
    assert refused.finish is None and not refused.token_ids
    assert [d.rank for d in refused.dispatched] == [RANK], "the daemon dispatched it; the rank refused"
    assert served.reject is None and served.finish is not None, served
    assert served.finish.completion_tokens == 4
    rank = next(r for r in status.ranks if r.rank == RANK)
    assert rank.in_flight == 0
