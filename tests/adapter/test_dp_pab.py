"""The pab load-balance method on SGLang's own objects, with sglang_ext.adapter.dp_pab's hooks
applied through HookRegistry: the real DataParallelController dispatch path (built
without launching schedulers), real shared-memory load snapshots, real ZMQ sockets
and the msgpack wire format, and the real Scheduler.init_load_inquirer / get_loads."""

from __future__ import annotations

import importlib.util
import logging
import math
from array import array
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

pytestmark = pytest.mark.sglang

from sglang_ext.adapter import dp_pab  # noqa: E402
from sglang_ext.policy.slo import Slo, SloCatalog  # noqa: E402

CATALOG = SloCatalog("standard", {"interactive": Slo(0.5, 0.03), "standard": Slo(2.0, 0.05),
                                  "relaxed": Slo(8.0, 0.1)})


@pytest.fixture(scope="module")
def sglang_modules():
    from sglang.srt.managers import data_parallel_controller as dpc
    from sglang.srt.managers import load_snapshot, scheduler
    from sglang.srt.managers import io_struct
    from sglang.srt.sampling import sampling_params

    return SimpleNamespace(
        dpc=dpc, load_snapshot=load_snapshot, scheduler=scheduler, io_struct=io_struct,
        sampling_params=sampling_params,
    )


@pytest.fixture(scope="module")
def hooks(sglang_modules):
    """install_dp_pab_hooks() + apply_hooks(), undone afterwards (class attributes and
    the registry), so other tests in this process see stock SGLang classes."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    m = sglang_modules
    targets = [
        (m.dpc.DataParallelController, "init_pab_dispatch"),
        (m.dpc.DataParallelController, "pab_scheduler"),
        (m.dpc.DPBudget, "update_budget"),
        (m.scheduler.Scheduler, "init_load_inquirer"),
    ]
    originals = {(cls, name): cls.__dict__[name] for cls, name in targets}
    saved_hooks = {target: list(entries) for target, entries in HookRegistry._hooks.items()}
    saved_patched = set(HookRegistry._patched)
    HookRegistry.reset()
    dp_pab._installed = False
    try:
        dp_pab.install_dp_pab_hooks(CATALOG)
        dp_pab.install_dp_pab_hooks()  # idempotent
        HookRegistry.apply_hooks()
        for cls, name in targets:
            assert cls.__dict__[name] is not originals[cls, name], f"{cls.__name__}.{name}"
        yield
    finally:
        for (cls, name), original in originals.items():
            setattr(cls, name, original)
        HookRegistry.reset()
        HookRegistry._hooks.update(saved_hooks)
        HookRegistry._patched.update(saved_patched)
        dp_pab._installed = False


@pytest.fixture
def topology():
    from sglang.test.test_utils import published_topology

    with published_topology(dp_size=2, load_balance_method="pab") as server_args:
        yield server_args


class Cluster:
    """A DataParallelController wired to real SHM snapshot slots and ZMQ sockets."""

    def __init__(self, m, tmp_path, num_ranks: int) -> None:
        import zmq

        self.m = m
        path = str(tmp_path / "loads.shm")
        self.writers = [
            m.load_snapshot.ShmLoadSnapshotWriter(path, num_ranks, r) for r in range(num_ranks)
        ]
        self.context = zmq.Context()
        self.inboxes, workers = [], []
        for rank in range(num_ranks):
            inbox = self.context.socket(zmq.PULL)
            inbox.bind(f"inproc://rank{rank}")
            push = self.context.socket(zmq.PUSH)
            push.connect(f"inproc://rank{rank}")
            self.inboxes.append(inbox)
            workers.append(push)

        controller = object.__new__(m.dpc.DataParallelController)
        controller.load_balance_method = m.dpc.LoadBalanceMethod.PAB
        controller.dispatching = controller.pab_scheduler
        controller.refresh_load_budget_on_dispatch = True
        controller.round_robin_counter = 0
        controller.health_round_robin_counter = 0
        controller.workers = workers
        controller.status = [True] * num_ranks
        controller.dp_active = [True] * num_ranks
        controller._active_workers = list(range(num_ranks))
        controller.dp_budget = m.dpc.DPBudget(num_ranks)
        controller.load_snapshot_reader = m.load_snapshot.ShmLoadSnapshotReader(path, num_ranks)
        controller._last_refresh_time = 0.0
        controller.init_dispatcher()
        self.controller = controller
        self.clock = 1000.0

    def publish(self, rank: int, pab: int | None, echoed: int,
                admission: dict[str, int] | None = None) -> None:
        self.clock += 1.0
        self.writers[rank].write(self.m.load_snapshot.LoadSnapshot(
            dp_rank=rank, timestamp=self.clock,
            fairbatching_pab_tokens=pab, fairbatching_dispatch_seq=echoed,
            fairbatching_admission=admission,
        ))

    def request(self, rid: str, prompt_tokens: int, **fields):
        io, sp = self.m.io_struct, self.m.sampling_params
        return io.TokenizedGenerateReqInput(
            rid=rid, input_text=None, input_ids=array("q", range(prompt_tokens)),
            input_embeds=None, mm_inputs=None, token_type_ids=None,
            sampling_params=fields.pop("sampling_params", sp.SamplingParams(max_new_tokens=4)),
            return_logprob=False, logprob_start_len=-1, top_logprobs_num=0,
            token_ids_logprob=None, stream=False, **fields,
        )

    def dispatch(self, req) -> tuple[int, object]:
        """Through the controller's real entry (its TypeBasedDispatcher), as event_loop
        does; the refresh throttle is reset so every dispatch reads the snapshots."""
        import zmq

        self.controller._last_refresh_time = 0.0
        self.controller._request_dispatcher(req)
        arrived = []
        for rank, inbox in enumerate(self.inboxes):
            if inbox.poll(timeout=0 if arrived else 200, flags=zmq.POLLIN):
                arrived.append((rank, self.m.io_struct.sock_recv(inbox)))
        assert len(arrived) == 1, f"{req.rid} arrived at {[r for r, _ in arrived]}"
        return arrived[0]

    def close(self) -> None:
        self.controller.load_snapshot_reader.close()
        for writer in self.writers:
            writer.close()
        self.context.destroy(linger=0)


@pytest.fixture
def cluster(sglang_modules, hooks, topology, tmp_path):
    cluster = Cluster(sglang_modules, tmp_path, num_ranks=2)
    yield cluster
    cluster.close()


def test_routing_and_debit_reconciliation_through_the_controller(cluster) -> None:
    cluster.publish(0, pab=3000, echoed=0)
    cluster.publish(1, pab=2000, echoed=0)
    cluster.controller.init_pab_dispatch()

    rank, a = cluster.dispatch(cluster.request("a", 1500))
    assert (rank, dp_pab.dispatch_seq_of(a), len(a.input_ids)) == (0, 1, 1500)
    rank, b = cluster.dispatch(cluster.request("b", 1500))  # budgets 1500 / 2000
    assert (rank, dp_pab.dispatch_seq_of(b)) == (1, 1)
    rank, c = cluster.dispatch(cluster.request("c", 1000))  # budgets 1500 / 500
    assert (rank, dp_pab.dispatch_seq_of(c)) == (0, 2)

    # Rank 0's snapshot was taken before it ingested a and c (echo 0), and is read
    # after both were dispatched: their debits survive it (2900 - 2500 = 400 < 500).
    cluster.publish(0, pab=2900, echoed=0)
    rank, d = cluster.dispatch(cluster.request("d", 100))
    assert (rank, dp_pab.dispatch_seq_of(d)) == (1, 2)

    # Rank 0 has ingested a and c (echo 2): their debits are dropped (600 > 400).
    cluster.publish(0, pab=600, echoed=2)
    rank, e = cluster.dispatch(cluster.request("e", 100))
    assert (rank, dp_pab.dispatch_seq_of(e)) == (0, 3)

    ledger = cluster.controller.fairbatching_pab.ledger
    assert ledger.budgets([0, 1]) == {0: 500, 1: 400}


def slo_request(cluster, rid: str, prompt_tokens: int, slo: dict | None):
    custom_params = None if slo is None else {"slo": slo}
    sp = cluster.m.sampling_params.SamplingParams(max_new_tokens=4, custom_params=custom_params)
    return cluster.request(rid, prompt_tokens, sampling_params=sp)


def test_a_request_routes_on_its_slo_class_budget(cluster) -> None:
    cluster.publish(0, pab=5000, echoed=0,
                    admission={"interactive": 100, "standard": 5000, "relaxed": 9000})
    cluster.publish(1, pab=3000, echoed=0,
                    admission={"interactive": 2000, "standard": 3000, "relaxed": 4000})
    cluster.controller.init_pab_dispatch()

    # more default-class budget on rank 0, but only rank 1 can start an interactive prompt in time
    assert cluster.dispatch(slo_request(cluster, "tight", 1000, {"class": "interactive"}))[0] == 1
    assert cluster.dispatch(slo_request(cluster, "plain", 1000, None))[0] == 0
    assert cluster.dispatch(slo_request(cluster, "loose", 1000, {"class": "relaxed"}))[0] == 0
    # explicit TTFT: the class with the largest TTFT not above it; below every class, the smallest
    assert cluster.dispatch(slo_request(cluster, "ttft", 500, {"ttft_ms": 900, "tpot_ms": 50}))[0] == 1
    assert cluster.dispatch(slo_request(cluster, "fast", 100, {"ttft_ms": 100}))[0] == 1

    # each dispatch debits every class of its rank
    ledger = cluster.controller.fairbatching_pab.ledger
    assert ledger.budgets([0, 1], "interactive") == {0: -1900, 1: 400}
    assert ledger.budgets([0, 1], "relaxed") == {0: 7000, 1: 2400}
    assert ledger.budgets([0, 1]) == {0: 3000, 1: 1400}


def test_a_rank_without_class_budgets_is_judged_by_its_default_pab(cluster) -> None:
    cluster.publish(0, pab=5000, echoed=0, admission={"interactive": 100, "standard": 5000})
    cluster.publish(1, pab=3000, echoed=0)
    cluster.controller.init_pab_dispatch()
    assert cluster.dispatch(slo_request(cluster, "tight", 1000, {"class": "interactive"}))[0] == 1
    assert cluster.dispatch(slo_request(cluster, "named", 1000, {"class": "standard"}))[0] == 0


def test_request_class_resolution() -> None:
    carrier = lambda slo: SimpleNamespace(sampling_params=SimpleNamespace(  # noqa: E731
        custom_params=None if slo is None else {"slo": slo, "other": 1}))
    assert dp_pab.request_class(CATALOG, carrier(None)) is None
    assert dp_pab.request_class(CATALOG, carrier({})) is None
    assert dp_pab.request_class(CATALOG, carrier({"tpot_ms": 20})) is None
    assert dp_pab.request_class(CATALOG, carrier({"class": "relaxed", "tpot_ms": 20})) == "relaxed"
    assert dp_pab.request_class(CATALOG, carrier({"ttft_ms": 2000})) == "standard"
    assert dp_pab.request_class(CATALOG, carrier({"ttft_ms": 1999})) == "interactive"
    assert dp_pab.request_class(CATALOG, carrier({"class": "relaxed", "ttft_ms": 50})) == "interactive"
    assert dp_pab.request_class(CATALOG, carrier({"class": "nope"})) is None  # refused at the door
    assert dp_pab.request_class(None, carrier({"class": "relaxed"})) is None
    # an e2e SLO routes on its first-token budget: ttft_ms, else a quarter of e2e_ms
    assert dp_pab.request_class(CATALOG, carrier({"e2e_ms": 8_000})) == "standard"  # 2000 ms
    assert dp_pab.request_class(CATALOG, carrier({"e2e_ms": 7_999})) == "interactive"
    assert dp_pab.request_class(CATALOG, carrier({"e2e_ms": 40_000})) == "relaxed"
    assert dp_pab.request_class(CATALOG, carrier({"e2e_ms": 40_000, "ttft_ms": 600})) == "interactive"
    assert dp_pab.request_class(CATALOG, carrier({"class": "relaxed", "e2e_ms": 9_000})) == "standard"
    assert dp_pab.request_class(CATALOG, carrier({"e2e_ms": 9_000, "tpot_ms": 5})) is None  # a 400
    e2e_classes = SloCatalog.from_mapping({"default_class": "chat", "classes": {
        "chat": {"ttft_ms": 500, "tpot_ms": 50}, "code": {"e2e_ms": 20_000}}})
    assert dp_pab.request_class(e2e_classes, carrier({"class": "code"})) == "code"
    assert dp_pab.request_class(e2e_classes, carrier({"e2e_ms": 20_000})) == "code"  # 5000 ms
    assert dp_pab.request_class(e2e_classes, carrier({"e2e_ms": 1_000})) == "chat"  # below both


def test_no_rank_covers_the_prompt_goes_to_the_largest_budget(cluster) -> None:
    cluster.publish(0, pab=-300, echoed=0)
    cluster.publish(1, pab=200, echoed=0)
    cluster.controller.init_pab_dispatch()
    assert cluster.dispatch(cluster.request("big", 5000))[0] == 1


def test_pinned_requests_go_where_pinned_unstamped_and_undebited(cluster) -> None:
    sp = cluster.m.sampling_params.SamplingParams(
        max_new_tokens=4, custom_params={dp_pab.DISPATCH_SEQ_KEY: 10**9, "user": "kept"}
    )
    cluster.publish(0, pab=3000, echoed=0)
    cluster.publish(1, pab=1000, echoed=0)
    cluster.controller.init_pab_dispatch()
    rank, pinned = cluster.dispatch(cluster.request("p", 800, routed_dp_rank=1, sampling_params=sp))
    assert rank == 1
    assert dp_pab.dispatch_seq_of(pinned) is None  # a client-supplied stamp is removed
    assert pinned.sampling_params.custom_params == {"user": "kept"}
    assert cluster.controller.fairbatching_pab.ledger.budgets([0, 1]) == {0: 3000, 1: 1000}


def test_start_up_fails_when_a_rank_reports_no_pab(cluster) -> None:
    cluster.publish(0, pab=3000, echoed=0)
    cluster.publish(1, pab=None, echoed=0)
    with pytest.raises(RuntimeError, match=r"DP rank\(s\) \[1\].*FairBatching must be enabled"):
        cluster.controller.init_pab_dispatch()


def test_a_silent_rank_means_round_robin_until_it_reports(cluster, monkeypatch, caplog) -> None:
    monkeypatch.setattr(dp_pab, "STARTUP_SNAPSHOT_TIMEOUT_S", 0.1)
    cluster.publish(0, pab=5000, echoed=0)
    with caplog.at_level(logging.WARNING, logger=dp_pab.__name__):
        cluster.controller.init_pab_dispatch()
        ranks = [cluster.dispatch(cluster.request(f"rr{i}", 100))[0] for i in range(3)]
    assert ranks == [0, 1, 0]
    assert "no load snapshot from DP rank(s) [1]" in caplog.text
    assert caplog.text.count("DP rank 1 has not reported a PAB yet") == 1

    cluster.publish(1, pab=9000, echoed=0)
    rank, req = cluster.dispatch(cluster.request("pab", 100))
    assert (rank, dp_pab.dispatch_seq_of(req)) == (1, 1)


def fake_scheduler(m):
    """What Scheduler.init_load_inquirer and get_loads() read, and nothing more."""
    stats = SimpleNamespace(
        gen_throughput=0.0, cache_hit_rate=0.0, utilization=0.0, spec_accept_rate=0.0,
        kv_transfer_speed_gb_s=0.0, kv_transfer_latency_ms=0.0, num_grammar_queue_reqs=0,
        num_paused_reqs=0, num_retracted_reqs=0,
    )
    pool_stats = SimpleNamespace(get_kv_token_stats=lambda: (0, 0.0))
    return SimpleNamespace(
        disaggregation_mode=m.scheduler.DisaggregationMode.NULL,
        server_args=None,
        max_total_num_tokens=4096,
        kv_shard_widening=1,
        max_running_requests=64,
        pool_stats_observer=SimpleNamespace(get_pool_stats=lambda: pool_stats),
        tp_worker=SimpleNamespace(),
        token_to_kv_pool_allocator=SimpleNamespace(),
        spec_algorithm=SimpleNamespace(is_none=lambda: True),
        tree_cache=SimpleNamespace(waiting_storage_span=None),
        running_batch=SimpleNamespace(reqs=[]),
        waiting_queue=[],
        chunked_req=None,
        policy=SimpleNamespace(waiting_queue_prefix_matched=lambda queue: False),
        metrics_reporter=SimpleNamespace(recent_cache_hit_rate=0.0, stats=stats),
    )


def test_scheduler_snapshots_carry_pab_and_dispatch_seq(sglang_modules, hooks, topology) -> None:
    m = sglang_modules
    scheduler = fake_scheduler(m)
    m.scheduler.Scheduler.init_load_inquirer(scheduler)  # the real method, hooked

    snapshot = scheduler.load_inquirer.get_loads()
    assert (snapshot.fairbatching_pab_tokens, snapshot.fairbatching_dispatch_seq) == (None, 0)

    scheduler.fairbatching = SimpleNamespace(pab_tokens=1234.9, highest_dispatch_seq=17)
    snapshot = scheduler.load_inquirer.get_loads()
    assert (snapshot.fairbatching_pab_tokens, snapshot.fairbatching_dispatch_seq) == (1234, 17)
    scheduler.fairbatching = SimpleNamespace(pab_tokens=-0.5, highest_dispatch_seq=18)
    assert scheduler.load_inquirer.get_loads().fairbatching_pab_tokens == -1

    decoded = m.load_snapshot.snapshot_decoder.decode(
        m.load_snapshot.snapshot_encoder.encode(snapshot)
    )
    report = dp_pab.rank_budget_of(decoded)
    assert (report.pab_tokens, report.echoed_dispatch_seq) == (1234, 17)
    assert report.timestamp > 0 and report.class_budgets is None

    scheduler.fairbatching = SimpleNamespace(pab_tokens=900, highest_dispatch_seq=19,
                                             class_budgets={"interactive": -40, "standard": 900},
                                             admission_echo={"gate-a": 7})
    decoded = m.load_snapshot.snapshot_decoder.decode(
        m.load_snapshot.snapshot_encoder.encode(scheduler.load_inquirer.get_loads())
    )
    assert dp_pab.rank_budget_of(decoded).class_budgets == {"interactive": -40, "standard": 900}
    assert decoded.fairbatching_admission_echo == {"gate-a": 7}


def test_non_finite_pab_is_refused() -> None:
    state = SimpleNamespace(pab_tokens=math.inf, highest_dispatch_seq=0)
    with pytest.raises(ValueError, match="finite"):
        dp_pab.fill_snapshot(SimpleNamespace(), state)


def test_dispatch_seq_of_reads_a_scheduler_req(sglang_modules, topology) -> None:
    from sglang.srt.managers.schedule_batch import Req

    sp = sglang_modules.sampling_params.SamplingParams(max_new_tokens=4)
    assert dp_pab.dispatch_seq_of(Req("r", None, [1, 2, 3], sp)) is None
    carrier = SimpleNamespace(sampling_params=sp)
    dp_pab.stamp_dispatch_seq(carrier, 42)
    assert dp_pab.dispatch_seq_of(Req("r", None, [1, 2, 3], sp)) == 42
    sp.custom_params = {dp_pab.DISPATCH_SEQ_KEY: True}
    assert dp_pab.dispatch_seq_of(Req("r", None, [1, 2, 3], sp)) is None


def test_scheduler_echoes_the_admission_gates_stamps(sglang_modules, topology) -> None:
    from sglang.srt.managers.schedule_batch import Req

    from sglang_ext.adapter.admission.budget_gate import ADMISSION_STAMP_KEY
    from sglang_ext.policy.slo import Slo, SloCatalog
    from sglang_ext.adapter.scheduler.requests import MAX_ECHOED_GATES, RequestRecords

    records = RequestRecords(SloCatalog("standard", {"standard": Slo(2.0, 0.05)}))

    def seen(custom_params):
        sp = sglang_modules.sampling_params.SamplingParams(max_new_tokens=4,
                                                           custom_params=custom_params)
        records.prefill_view(Req(f"r{len(seen.rids)}", None, [1, 2, 3], sp))
        seen.rids.append(1)

    seen.rids = []
    for stamp in (["a", 3], ["a", 2], ["b", 1], None, ["a", True], ["a"], "a:9"):
        seen(None if stamp is None else {ADMISSION_STAMP_KEY: stamp})
    assert records.admission_echo == {"a": 3, "b": 1}
    for gate in range(MAX_ECHOED_GATES):
        seen({ADMISSION_STAMP_KEY: [f"g{gate}", 1]})
    assert len(records.admission_echo) == MAX_ECHOED_GATES and "a" not in records.admission_echo



def test_a_request_viewed_on_arrival_is_echoed_by_the_pass_that_reads_it(sglang_modules, topology) -> None:
    """The view and store row are made as the request is queued; its stamps wait for the
    next pass over the views, so no echo runs ahead of the budgets computed from them."""
    from sglang.srt.managers.schedule_batch import Req

    from sglang_ext.adapter.admission.budget_gate import ADMISSION_STAMP_KEY
    from sglang_ext.adapter.controlplane_agent import CONTROLPLANE_SEQ_KEY
    from sglang_ext.adapter.scheduler.requests import RECORD_ATTR, RequestRecords
    from sglang_ext.policy.slo import Slo, SloCatalog

    records = RequestRecords(SloCatalog("standard", {"standard": Slo(2.0, 0.05)}))
    sp = sglang_modules.sampling_params.SamplingParams(
        max_new_tokens=9, custom_params={ADMISSION_STAMP_KEY: ["gate", 4], CONTROLPLANE_SEQ_KEY: [0, 11]})
    dp_pab.stamp_dispatch_seq(SimpleNamespace(sampling_params=sp), 6)
    req = Req("queued", None, [1, 2, 3], sp)
    records.arrived(req)
    view = getattr(req, RECORD_ATTR)
    assert view.row >= 0 and records.store.max_new[view.row] == 9 and view.prompt_tokens == 3
    assert (records.admission_echo, records.controlplane_echo, records.highest_dispatch_seq) == ({}, {}, 0)
    records.arrived(req)  # queued again (a retraction): the same view, nothing echoed twice
    assert getattr(req, RECORD_ATTR) is view
    assert records.prefill_views([req]) == [view]
    records.echo_arrivals()
    assert (records.admission_echo, records.controlplane_echo, records.highest_dispatch_seq) == (
        {"gate": 4}, {0: 11}, 6)
    records.echo_arrivals()
    assert records.admission_echo == {"gate": 4}


def test_an_e2e_slo_is_paced_for_the_requests_max_new_tokens(sglang_modules, topology) -> None:
    from sglang.srt.managers.schedule_batch import Req

    from sglang_ext.adapter.scheduler.requests import RequestRecords

    catalog = SloCatalog.from_mapping({"default_class": "code", "classes": {
        "code": {"e2e_ms": 20_000, "ttft_ms": 1_000}, "chat": {"ttft_ms": 500, "tpot_ms": 50}}})
    records = RequestRecords(catalog)

    def view(rid, max_new_tokens, slo=None):
        sp = sglang_modules.sampling_params.SamplingParams(
            max_new_tokens=max_new_tokens, custom_params=None if slo is None else {"slo": slo})
        return records.prefill_view(Req(rid, None, [1, 2, 3], sp))

    paced = view("code", 96, {"class": "code"}).slo
    assert (paced.ttft_s, paced.e2e_s) == (1.0, 20.0) and paced.tpot_s == pytest.approx(19.0 / 95)
    assert paced.token_deadline(0.0, 95) == pytest.approx(20.0)  # the last token, at e2e
    explicit = view("explicit", 11, {"e2e_ms": 4_000}).slo
    assert (explicit.ttft_s, explicit.tpot_s) == (1.0, pytest.approx(0.3))
    assert view("default", 20).slo == catalog.default.with_expected_output(20)
    # a malformed SLO falls back to the default class, paced all the same
    assert view("bad", 20, {"e2e_ms": 1_000, "tpot_ms": 5}).slo == view("default", 20).slo
    assert view("chat", 96, {"class": "chat"}).slo == catalog.classes["chat"]  # not e2e: as is
    assert view("unset", None, {"class": "code"}).slo == catalog.classes["code"]  # nominal


def test_scheduler_echoes_each_control_plane_daemons_dispatches_apart(sglang_modules, topology) -> None:
    from sglang.srt.managers.schedule_batch import Req

    from sglang_ext.adapter.controlplane_agent import CONTROLPLANE_SEQ_KEY, MAX_DAEMONS
    from sglang_ext.adapter.scheduler.requests import RequestRecords
    from sglang_ext.policy.slo import Slo, SloCatalog

    records = RequestRecords(SloCatalog("standard", {"standard": Slo(2.0, 0.05)}))
    stamps = ([0, 10**15 + 5], [1, 7], [0, 10**15 + 2], [1, True], [MAX_DAEMONS, 3], [-1, 3], [0], "0:9")
    for index, stamp in enumerate(stamps):
        sp = sglang_modules.sampling_params.SamplingParams(max_new_tokens=4,
                                                           custom_params={CONTROLPLANE_SEQ_KEY: stamp})
        records.prefill_view(Req(f"r{index}", None, [1, 2, 3], sp))
    assert records.controlplane_echo == {0: 10**15 + 5, 1: 7}
    assert records.highest_dispatch_seq == 0  # the DP controller's numbering is another one

