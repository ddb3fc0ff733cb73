"""Two stock SGLang servers (emulated GPU, FairBatching on) join one real control-plane
daemon (``python -m controlplane serve``) as ranks ``cp-a/0`` and ``cp-b/0``; a raw
DEALER client speaks the wire protocol to the daemon. Each scheduler's reports pass
through a tap (``controlplane_peers.ReportTap``) that records them on their way.

The tests run in file order on module-scoped servers: the last three restart the daemon,
kill one server and drain the other with SIGTERM.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import time

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

from controlplane_peers import RawClient, ReportTap  # noqa: E402
from servers import EMULATED_PROFILE as PROFILE  # noqa: E402
from servers import EMULATED_TIME_SCALE as TIME_SCALE  # noqa: E402

from benchmarks.controlplane.live_daemon import (  # noqa: E402
    loopback_config,
    process_daemon,
    start_process_daemon,
)
from controlplane import protocol as p  # noqa: E402

pytestmark = pytest.mark.e2e

BASE_ARGS = ("--max-total-tokens", "200000", "--max-prefill-tokens", "16384")
RANKS = {"a": "cp-a/0", "b": "cp-b/0"}


def prompt(length: int, salt: int) -> list[int]:
    return [5 + (i * 37 + salt) % 900 for i in range(length)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    config = loopback_config(policy="pab", on_no_budget="queue", queue_ttl_s=60.0, stale_after_s=1.0,
                             heartbeat_interval_s=0.25, lost_after_s=1.5)
    with process_daemon(tmp_path_factory.mktemp("cp-daemon"), config) as running:
        yield running


@pytest.fixture(scope="module")
def tap(daemon):
    tap = ReportTap(daemon.config.report_address)
    yield tap
    tap.close()


@pytest.fixture(scope="module")
def servers(server_pool, sglang_server, fb_config, daemon, tap):
    if server_pool.limit < 2:
        pytest.skip("needs two servers alive at once (E2E_MAX_SERVERS >= 2)")
    started = {}
    try:
        for name, rank in RANKS.items():
            env = {
                "FAIRBATCHING_EMULATED_GPU": PROFILE,
                "FAIRBATCHING_EMULATED_GPU_TIME_SCALE": TIME_SCALE,
                "FAIRBATCHING_CONFIG": str(fb_config),
                "FAIRBATCHING_CONTROLPLANE": daemon.config.rank_address,
                "FAIRBATCHING_CONTROLPLANE_REPORTS": tap.address,
                "FAIRBATCHING_RANK_NAME": rank.split("/")[0],
            }
            started[name] = sglang_server(args=BASE_ARGS, env=env)
        yield started
    finally:
        for server in started.values():  # they point at this module's daemon: free the memory
            server.stop()


def run(coroutine):
    return asyncio.run(coroutine)


async def wait_for_ranks(client: RawClient, ranks: set[str], timeout: float = 30.0) -> p.StatusReply:
    deadline = time.monotonic() + timeout
    while True:
        status = await client.status()
        fresh = {r.rank for r in status.ranks if not r.stale and r.reported_pab_tokens is not None}
        if ranks <= fresh:
            return status
        assert time.monotonic() < deadline, f"ranks {ranks - fresh} never became fresh: {status}"
        await asyncio.sleep(0.1)


def test_each_server_joins_as_a_rank_and_its_scheduler_reports_pab(servers, daemon, tap) -> None:
    async def scenario() -> p.StatusReply:
        async with RawClient(daemon.config.client_address) as client:
            return await wait_for_ranks(client, set(RANKS.values()))

    status = run(scenario())
    by_rank = {r.rank: r for r in status.ranks}
    assert set(by_rank) == set(RANKS.values())
    assert {r.agent for r in status.ranks} == {"cp-a", "cp-b"}
    for rank, state in by_rank.items():
        reports = tap.reports(rank)
        assert reports, rank
        # one epoch per server: the ingress's Hello and the scheduler's reports agree
        assert {r.epoch for r in reports} == {state.epoch}
        seqs = [r.seq for r in reports]
        assert seqs == sorted(set(seqs)) and seqs[0] == 1
        assert reports[-1].pab_tokens > 0 and reports[-1].free_kv_tokens == 200000
        assert state.seq_gaps == 0
    assert by_rank["cp-a/0"].epoch != by_rank["cp-b/0"].epoch


def test_requests_complete_with_exact_token_counts_on_both_ranks(servers, daemon, tap) -> None:
    specs = {f"burst-{i}": (48 + 24 * (i % 6), 8 + 4 * (i % 5)) for i in range(40)}

    async def scenario():
        async with RawClient(daemon.config.client_address) as client:
            await wait_for_ranks(client, set(RANKS.values()))
            started = time.monotonic()
            for i, (rid, (length, new)) in enumerate(specs.items()):
                await client.submit(rid, prompt(length, i), new, ignore_eos=True,
                                    slo=p.SloSpec(slo_class="standard") if i % 2 else None)
            outcomes = [await client.wait(rid, 120) for rid in specs]
            elapsed = time.monotonic() - started
            await asyncio.sleep(0.5)  # let reports after the last step arrive
            return outcomes, elapsed, await client.status()

    outcomes, elapsed, status = run(scenario())
    for outcome in outcomes:
        length, new = specs[outcome.request_id]
        assert outcome.reject is None, outcome
        finish = outcome.finish
        assert finish.reason == p.FinishReason.LENGTH, outcome
        assert (finish.prompt_tokens, finish.completion_tokens) == (length, new)
        assert len(outcome.token_ids) == new
        assert [c.completion_tokens for c in outcome.chunks][-1] == new
        assert 0 < finish.ttft_s <= finish.latency_s
    per_rank = {rank: [o for o in outcomes if o.rank == rank] for rank in RANKS.values()}
    assert all(len(v) >= 5 for v in per_rank.values()), {k: len(v) for k, v in per_rank.items()}
    print(f"40 requests in {elapsed:.1f} s; per rank {[len(v) for v in per_rank.values()]}")

    by_rank = {r.rank: r for r in status.ranks}
    for rank, done in per_rank.items():
        reports = tap.reports(rank)
        echoes = [r.echoed_dispatch_seq for r in reports]
        assert echoes == sorted(echoes), "the echoed dispatch sequence never goes back"
        highest = max(d.dispatch_seq for o in done for d in o.dispatched)
        assert echoes[-1] == highest  # every dispatch was ingested and accounted for
        assert len({r.pab_tokens for r in reports}) > 1, "the PAB moves with the load"
        assert max(r.running for r in reports) > 0 and max(r.step_time_s for r in reports) > 0
        assert reports[-1].running == reports[-1].waiting == 0
        # the daemon's view: no debit left that a report has not covered
        assert by_rank[rank].pab_tokens == by_rank[rank].reported_pab_tokens
        assert by_rank[rank].in_flight == 0


def test_cancel_in_flight_stops_the_request_at_the_server(servers, daemon, tap) -> None:
    async def scenario():
        async with RawClient(daemon.config.client_address) as client:
            await wait_for_ranks(client, set(RANKS.values()))
            await client.submit("long-1", prompt(64, 1), 3000, ignore_eos=True)
            await client.wait("long-1", 60, until=lambda o: len(o.chunks) >= 3)
            await client.cancel("long-1")
            outcome = await client.wait("long-1", 10)
            cancelled_at = time.monotonic()
            rank = outcome.rank
            # the rank's own reports show the request gone, long before 3000 tokens
            deadline = cancelled_at + 5.0
            while True:
                after = [r for r in tap.reports(rank) if r.sent_at > cancelled_at]
                if after and after[-1].running == 0 and after[-1].waiting == 0:
                    break
                assert time.monotonic() < deadline, f"{rank} still runs the cancelled request: {after[-3:]}"
                await asyncio.sleep(0.1)
            return outcome

    outcome = run(scenario())
    assert outcome.finish is not None and outcome.finish.reason == p.FinishReason.CANCELLED
    assert 3 <= len(outcome.token_ids) < 3000


def test_an_unknown_slo_class_is_rejected_invalid(servers, daemon) -> None:
    async def scenario():
        async with RawClient(daemon.config.client_address) as client:
            await wait_for_ranks(client, set(RANKS.values()))
            await client.submit("bad-slo", prompt(16, 2), 8, slo=p.SloSpec(slo_class="no-such-class"))
            return await client.wait("bad-slo", 30)

    outcome = run(scenario())
    assert outcome.finish is None and outcome.reject is not None
    assert outcome.reject.reason == p.RejectReason.INVALID and not outcome.reject.retryable
    assert "no-such-class" in outcome.reject.detail


def with_gateway(daemon, scenario):
    """Run ``scenario(session, base_url)`` against a gateway in front of the daemon."""
    import aiohttp

    from benchmarks.support.ports import free_ports
    from controlplane.client import AsyncClient
    from controlplane.gateway import GatewaySettings, serve

    (port,) = free_ports(1)
    base_url = f"http://127.0.0.1:{port}"

    async def main():
        stop = asyncio.Event()
        async with AsyncClient(daemon.config.client_address) as client:
            server = asyncio.create_task(serve(client, GatewaySettings("emulated"), "127.0.0.1", port, stop))
            try:
                async with aiohttp.ClientSession() as session:
                    for _ in range(100):
                        try:
                            async with session.get(f"{base_url}/health") as response:
                                if response.status == 200:
                                    break
                        except aiohttp.ClientConnectionError:
                            pass
                        await asyncio.sleep(0.05)
                    return await scenario(session, base_url)
            finally:
                stop.set()
                await server

    return run(main())


def test_the_openai_gateway_serves_text_prompts_that_sglang_tokenizes(servers, daemon) -> None:
    async def scenario(session, base_url):
        url = f"{base_url}/v1/completions"
        async with session.post(url, json={"prompt": "The quick brown fox jumps over the lazy dog",
                                           "max_tokens": 8, "ignore_eos": True, "slo": "relaxed"}) as response:
            plain = response.status, await response.json()
        async with session.post(url, json={"prompt": "Once upon a time", "max_tokens": 6,
                                           "ignore_eos": True, "stream": True,
                                           "stream_options": {"include_usage": True}}) as response:
            streamed = response.status, await response.text()
        async with session.post(url, json={"prompt": "x", "slo": "no-such-class"}) as response:
            invalid = response.status, await response.json()
        return plain, streamed, invalid

    (status, body), (stream_status, raw), (invalid_status, invalid) = with_gateway(daemon, scenario)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["finish_reason"] == "length"
    assert 5 <= body["usage"]["prompt_tokens"] <= 16  # SGLang's tokenizer, not the daemon's estimate
    assert stream_status == 200 and raw.rstrip().endswith("data: [DONE]")
    assert '"completion_tokens":6' in raw
    assert invalid_status == 400 and "no-such-class" in invalid["error"]["message"]


def test_chat_through_the_gateway_is_rendered_by_the_servers_own_chat_template(servers, daemon) -> None:
    """The same conversation through the daemon and straight to SGLang's own
    ``/v1/chat/completions`` has the same prompt: the rank renders it as the server does."""
    conversation = [{"role": "system", "content": "You answer briefly."},
                    {"role": "user", "content": "What does a scheduler decide for the next batch?"}]

    async def scenario(session, base_url):
        body = {"messages": conversation, "max_tokens": 5, "ignore_eos": True}
        async with session.post(f"{base_url}/v1/chat/completions", json={**body, "slo": "relaxed"}) as response:
            through_daemon = response.status, await response.json()
        async with session.post(f"{servers['a'].url}/v1/chat/completions", json=body) as response:
            direct = response.status, await response.json()
        async with session.post(f"{base_url}/v1/chat/completions", json={
                **body, "stream": True, "stream_options": {"include_usage": True}}) as response:
            streamed = response.status, await response.text()
        return through_daemon, direct, streamed

    (status, body), (direct_status, direct), (stream_status, raw) = with_gateway(daemon, scenario)
    assert status == 200 and direct_status == 200, (body, direct)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert stream_status == 200 and raw.rstrip().endswith("data: [DONE]")
    assert '"role":"assistant"' in raw and '"completion_tokens":5' in raw


def test_daemon_restart_servers_rejoin_and_the_sdk_retries(servers, daemon, tmp_path) -> None:
    """SIGKILL the daemon mid-run and start it again on the same addresses: both servers'
    agents rejoin (the new daemon fences their heartbeats as unknown), and the SDK
    resubmits its in-flight requests under the same ids."""
    from controlplane.client import AsyncClient

    async def scenario():
        async with AsyncClient(daemon.config.client_address, max_retries=20, daemon_timeout_s=1.0,
                               connect_timeout_s=30.0) as client:
            async with RawClient(daemon.config.client_address) as raw:
                await wait_for_ranks(raw, set(RANKS.values()))
            before = client.daemon_id
            pending = [asyncio.create_task(client.generate(
                prompt(128, 70 + i), request_id=f"restart-{i}",
                sampling=p.SamplingParams(max_new_tokens=200, ignore_eos=True))) for i in range(6)]
            await asyncio.sleep(1.0)
            assert not any(task.done() for task in pending), "requests must still run at the kill"
            daemon.kill()
            restarted = await asyncio.to_thread(start_process_daemon, tmp_path, daemon.config, "daemon-2")
            daemon.process, daemon.log_path = restarted.process, restarted.log_path  # the fixture stops it
            results = await asyncio.gather(*pending)
            async with RawClient(daemon.config.client_address) as raw:
                status = await wait_for_ranks(raw, set(RANKS.values()))
            return before, client.daemon_id, results, status

    before, after, results, status = run(scenario())
    assert before != after
    assert [(r.finish_reason, r.completion_tokens) for r in results] == [(p.FinishReason.LENGTH, 200)] * 6
    assert any(r.attempts > 1 for r in results)
    assert {r.rank for r in status.ranks} == set(RANKS.values())
    assert status.counters.get("ranks_joined") == 2


def test_a_killed_server_fails_only_its_requests_and_the_other_keeps_serving(servers, daemon) -> None:
    victim, survivor = RANKS["a"], RANKS["b"]

    async def scenario():
        async with RawClient(daemon.config.client_address) as client:
            status = await wait_for_ranks(client, set(RANKS.values()))
            print("PAB before:", {r.rank: r.pab_tokens for r in status.ranks})
            # The pab policy sends each request to the largest budget: submit until the
            # debits have evened out the two ranks' budgets and each holds a few requests.
            rids: list[str] = []
            while min(sum(client.outcomes[r].rank == rank for r in rids) for rank in RANKS.values()) < 3:
                assert len(rids) < 100, {r: client.outcomes[r].rank for r in rids}
                rid = f"kill-{len(rids)}"
                rids.append(rid)
                await client.submit(rid, prompt(1024, len(rids)), 400, ignore_eos=True)
                await client.wait(rid, 30, until=lambda o: o.rank is not None or o.over)
            outcomes = [await client.wait(rid, 60, until=lambda o: len(o.chunks) >= 1) for rid in rids]
            assert {o.rank for o in outcomes} == {victim, survivor}
            os.killpg(servers["a"].process.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            servers["a"].process.wait(10)
            for outcome in outcomes:
                if outcome.rank == victim:
                    await client.wait(outcome.request_id, 30)
            lost_after = time.monotonic() - killed_at
            outcomes = [await client.wait(rid, 60) for rid in rids]
            status = await client.status()
            after = [f"after-{i}" for i in range(6)]
            for i, rid in enumerate(after):
                await client.submit(rid, prompt(64, 30 + i), 16, ignore_eos=True)
            return outcomes, [await client.wait(rid, 60) for rid in after], status, lost_after

    outcomes, later, status, lost_after = run(scenario())
    for outcome in outcomes:
        if outcome.rank == victim:
            assert outcome.finish is None and outcome.reject.reason == p.RejectReason.RANK_LOST, outcome
            assert not outcome.reject.retryable  # output had reached the client
        else:
            assert outcome.finish.reason == p.FinishReason.LENGTH, outcome
            assert outcome.finish.completion_tokens == len(outcome.token_ids) == 400
    assert lost_after < 5.0  # lost_after_s = 1.5
    assert [r.rank for r in status.ranks] == [survivor]
    assert status.counters.get("ranks_lost") == 1
    for outcome in later:
        assert outcome.rank == survivor and outcome.finish.reason == p.FinishReason.LENGTH, outcome
        assert len(outcome.token_ids) == 16


def test_sigterm_drains_the_server_its_request_finishes_then_goodbye(servers, daemon) -> None:
    survivor = RANKS["b"]

    async def scenario():
        async with RawClient(daemon.config.client_address) as client:
            await wait_for_ranks(client, {survivor})
            lost_before = (await client.status()).counters.get("rank_lost_requests", 0)
            await client.submit("drain-1", prompt(64, 99), 300, ignore_eos=True)
            await client.wait("drain-1", 60, until=lambda o: len(o.chunks) >= 1)
            servers["b"].process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while (held := [r for r in (await client.status()).ranks if r.rank == survivor]) \
                    and not held[0].draining:
                assert time.monotonic() < deadline, "the daemon never saw the server draining"
                await asyncio.sleep(0.02)
            await client.submit("during-drain", prompt(16, 5), 4, ignore_eos=True)
            refused = await client.wait("during-drain", 10)
            outcome = await client.wait("drain-1", 120)
            deadline = time.monotonic() + 10
            while (status := await client.status()).ranks:
                assert time.monotonic() < deadline, f"no Goodbye after the drain: {status}"
                await asyncio.sleep(0.05)
            return outcome, refused, status, lost_before

    outcome, refused, status, lost_before = run(scenario())
    assert outcome.finish is not None and outcome.finish.reason == p.FinishReason.LENGTH, outcome
    assert len(outcome.token_ids) == outcome.finish.completion_tokens == 300
    assert refused.reject is not None and refused.reject.reason == p.RejectReason.NO_RANKS, refused
    assert refused.reject.retryable
    assert status.counters.get("ranks_left") == 1  # Goodbye, not loss detection
    assert status.counters.get("rank_lost_requests", 0) == lost_before
    assert servers["b"].process.wait(60) is not None
