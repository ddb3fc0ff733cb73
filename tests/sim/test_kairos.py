"""Kairos (Algorithms 1-3), its FCFS baseline and the disaggregated engine they run on."""

from __future__ import annotations

import json

import pytest
from sim_helpers import CATALOG, SLO, llama, make_policy, small_kv_profile, synthetic_requests

from sglang_ext.policy.policies import POLICIES
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.policy.view import RequestView
from sglang_ext.sim.commands import main
from sglang_ext.sim.disagg import (
    DEFAULT_LINK_GBPS, Arrival, DisaggConfig, DisaggConfigError, kv_transfer_s, run_disaggregated,
)
from sglang_ext.sim.competitors.kairos import (
    OnlineDecodeStepTable, fill_chunks, slack_guided_batch, urgency_chunks,
)
from sglang_ext.sim.decode_step_table import TABLE_BATCH_SIZES, DecodeStepTable
from sglang_ext.sim.runner import PolicySpec, Scenario, parse_policy, simulate
from sglang_ext.sim.service_curve import make_gpu
from sglang_ext.sim.workloads import TraceRequest, Workload

TTFT_SLO = Slo.from_ms(2000, 50)


def prefill(req_id, arrival, prompt, pending=None, seq=0) -> RequestView:
    pending = prompt if pending is None else pending
    return RequestView(req_id, arrival, TTFT_SLO, 0, pending, prompt - pending, prompt, seq)


def decoding(req_id, context, next_index, first_token, tpot_ms=50.0) -> RequestView:
    slo = Slo.from_ms(2000, tpot_ms)
    return RequestView(req_id, 0.0, slo, next_index, 0, context, context, 0, first_token)


# ------------------------------------------------------------------ Algorithms 1-2
def test_urgency_puts_a_short_prompt_with_slack_before_an_earlier_long_one():
    long, short = prefill("long", -1.0, 4000, seq=0), prefill("short", -0.1, 200, seq=1)
    # FCFS at 10k tok/s: long ends at 0.4 s (urgency (2 - 1.4) / 2 / 4000 = 7.5e-5),
    # short at 0.42 s ((2 - 0.52) / 2 / 200 = 3.7e-3)
    chunks = urgency_chunks([long, short], 0.0, 10_000.0, 1000)
    assert chunks == (("short", 200), ("long", 800))


def test_urgency_without_slack_favours_the_long_prompt_as_printed():
    long, short = prefill("long", -1.0, 4000, seq=0), prefill("short", -0.1, 200, seq=1)
    # at 1k tok/s both miss: long (2 - 5) / 2 / 4000 = -3.75e-4 > short (2 - 4.3) / 2 / 200
    assert urgency_chunks([long, short], 0.0, 1000.0, 8192)[0] == ("long", 4000)


def test_fcfs_finish_prediction_counts_only_pending_tokens():
    started = prefill("a", -1.0, 10_000, pending=100, seq=0)
    late = prefill("b", -0.5, 300, seq=1)
    # a ends at 0.01 s: (2 - 1.01) / 2 / 10000 ~ 5e-5; b at 0.04 s: (2 - 0.54) / 2 / 300 ~ 2.4e-3
    assert urgency_chunks([started, late], 0.0, 10_000.0, 8192) == (("b", 300), ("a", 100))


def test_chunk_selection_fills_the_chunk_in_order_only_the_last_partial():
    queue = [prefill("a", 0, 500, pending=300), prefill("b", 0, 700), prefill("c", 0, 50)]
    assert fill_chunks(queue, 1000) == (("a", 300), ("b", 700))
    assert fill_chunks(queue, 900) == (("a", 300), ("b", 600))
    assert fill_chunks(queue, 200) == (("a", 200),)
    assert fill_chunks(queue, 5000) == (("a", 300), ("b", 700), ("c", 50))


def test_kairos_fcfs_prefills_in_arrival_order():
    policy = make_policy("kairos-fcfs", llama(), token_budget=600)
    queue = [prefill("late", 0.2, 100, seq=2), prefill("first", 0.0, 500, seq=0),
             prefill("second", 0.1, 400, seq=1)]
    decision = policy.form_batch(queue, 1.0)
    assert decision.decode_ids == ()
    assert decision.prefill_chunks == (("first", 500), ("second", 100))


def test_kairos_prefill_throughput_follows_measured_prefill_steps():
    policy = make_policy("kairos", llama())
    start = policy.prefill_tokens_per_s
    policy.observe_step(StepShape(1000, 5e5, 0, 0, 0, 1), 1000 / (2 * start))
    assert policy.prefill_tokens_per_s == pytest.approx(start + 0.1 * (2 * start - start))
    policy.observe_step(StepShape(0, 0.0, 0, 8, 8000), 0.02)  # a decode step: no sample
    assert policy.prefill_tokens_per_s == pytest.approx(1.1 * start)


# ------------------------------------------------------------------ the lookup table
def test_offline_table_is_the_gpu_model_noise_free_at_its_grid_points():
    gpu = make_gpu(llama(), 0)
    table = DecodeStepTable.offline(gpu.ideal_step_s, 100_000)
    assert table.batch_sizes == TABLE_BATCH_SIZES
    assert table.seq_lens[0] == 16 and table.seq_lens[-1] == 131072 and table.seq_lens[-2] < 100_000
    for batch in (1, 7, 64, 512):
        for seq in (16, 1024, 131072):
            expected = gpu.ideal_step_s(StepShape(0, 0.0, 0, batch, batch * seq))
            assert table.lookup(batch, seq) == pytest.approx(expected, rel=1e-12)
    # linear in between, clamped outside
    mid = table.lookup(1, 1536)
    assert mid == pytest.approx((table.lookup(1, 1024) + table.lookup(1, 2048)) / 2)
    assert table.lookup(1, 10) == table.lookup(1, 16)
    assert table.lookup(10_000, 10**7) == table.lookup(4096, 131072)
    assert gpu.steps == 0  # building it measured nothing (no noise drawn)


def test_table_rejects_a_malformed_grid():
    import numpy as np

    with pytest.raises(ValueError, match="shape"):
        DecodeStepTable((1, 2), (16, 32), np.ones((3, 2)))
    with pytest.raises(ValueError, match="increasing"):
        DecodeStepTable((2, 1), (16, 32), np.ones((2, 2)))
    with pytest.raises(ValueError, match="> 0"):
        DecodeStepTable((1, 2), (16, 32), np.zeros((2, 2)))


def test_online_table_corrects_the_cell_it_observed_by_the_mean_ratio():
    table = DecodeStepTable.offline(make_gpu(llama(), 0).ideal_step_s, 4096)
    online = OnlineDecodeStepTable(table)
    base = table.lookup(8, 1024)
    online.update(8, 1024, 1.2 * base)
    online.update(8, 1024, 1.4 * base)
    assert online.lookup(8, 1024) == pytest.approx(1.3 * base)
    assert online.lookup(8, 1100) == pytest.approx(1.3 * table.lookup(8, 1100))  # same cell
    assert online.lookup(64, 1024) == table.lookup(64, 1024)  # another cell: untouched


# ------------------------------------------------------------------ Algorithm 3
def _linear_table(fixed_s: float, per_request_s: float, per_token_s: float) -> DecodeStepTable:
    """step = fixed + per_request * batch + per_token * batch * seq (exact at any point)."""
    def step(shape: StepShape) -> float:
        return fixed_s + per_request_s * shape.decode_requests + per_token_s * shape.decode_context
    return DecodeStepTable.offline(step, 65536)


def test_decode_packs_short_requests_while_the_step_fits_the_minimum_slack():
    table = _linear_table(0.005, 0.0, 1e-7)
    now = 1.0
    # next token j = 10 due at first + 0.5 s; shorts are 30 ms ahead, the long one 40 ms
    shorts = [decoding(f"s{i}", 512, 10, now - 0.47) for i in range(3)]
    long = decoding("long", 60_000, 10, now - 0.46)
    slack = {r.req_id: 0.05 * 10 - (now - r.first_token_time) - table.lookup(1, r.context)
             for r in [*shorts, long]}
    assert min(slack.values()) == pytest.approx(0.03 - table.lookup(1, 512))
    assert table.lookup(3, 512) <= min(slack.values()) < table.lookup(4, 60_000)
    assert slack_guided_batch([long, *shorts], now, table.lookup) == ("s0", "s1", "s2")


def test_decode_runs_everything_when_no_request_fits_the_slack():
    table = _linear_table(0.005, 0.0, 1e-7)
    now = 1.0
    late = [decoding("a", 512, 10, now - 0.499), decoding("b", 60_000, 10, now - 0.3)]
    assert slack_guided_batch(late, now, table.lookup) == ("a", "b")


def test_decode_stops_packing_when_throughput_does_not_improve():
    # no fixed cost: (|B| + 1) / t_step == |B| / t_cur, not strictly better
    table = _linear_table(0.0, 0.002, 0.0)
    now = 1.0
    ahead = [decoding(f"r{i}", 100, 100, now) for i in range(4)]  # seconds of slack
    assert slack_guided_batch(ahead, now, table.lookup) == ("r0",)
    with_fixed = _linear_table(0.004, 0.002, 0.0)
    assert slack_guided_batch(ahead, now, with_fixed.lookup) == ("r0", "r1", "r2", "r3")


def test_kairos_fcfs_decodes_every_request():
    policy = make_policy("kairos-fcfs", llama())
    ahead = [decoding(f"r{i}", 100 * (i + 1), 5, 0.9) for i in range(5)]
    assert policy.form_batch(ahead, 1.0).decode_ids == tuple(f"r{i}" for i in range(5))


def test_kairos_needs_its_decode_table():
    policy = make_policy("kairos", llama())
    with pytest.raises(RuntimeError, match="decode table"):
        policy.form_batch([decoding("a", 100, 1, 0.0)], 0.01)


# ------------------------------------------------------------------ the engine
def test_kv_transfer_time_is_prompt_kv_bytes_over_the_link():
    profile = llama()
    per_token = profile.model.kv_bytes_per_token
    assert per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, dim 128, bf16
    assert kv_transfer_s(1000, per_token, 400.0) == pytest.approx(1000 * 131072 * 8 / 400e9)
    at_400 = kv_transfer_s(1000, per_token, 400.0)
    assert kv_transfer_s(1000, per_token, 100.0) == pytest.approx(4 * at_400)


def test_config_validation():
    assert DisaggConfig().gpus == 2 and DisaggConfig().link_gbps == DEFAULT_LINK_GBPS
    assert DisaggConfig.parse_split("2:3") == (2, 3)
    for text in ("2", "a:b", "1:2:3", "0:1", "1:-1"):
        with pytest.raises(DisaggConfigError):
            DisaggConfig.parse_split(text)
    with pytest.raises(DisaggConfigError):
        DisaggConfig(1, 0)
    with pytest.raises(DisaggConfigError):
        DisaggConfig(link_gbps=float("inf"))


def _factory(name: str, profile, **overrides):
    return lambda: make_policy(name, profile, **overrides)


def _arrivals(requests) -> list[Arrival]:
    return [Arrival(r.req_id, r.arrival, r.prompt, r.output, SLO) for r in requests]


def test_transfers_take_the_link_time_one_at_a_time_per_link():
    profile = llama()
    arrivals = [Arrival(0, 0.0, 4000, 3, SLO), Arrival(1, 0.0, 4000, 3, SLO)]
    run = run_disaggregated(arrivals, profile, _factory("kairos-fcfs", profile),
                            DisaggConfig(link_gbps=1.0), record_tokens=True)
    transfer = kv_transfer_s(4000, profile.model.kv_bytes_per_token, 1.0)  # ~4.2 s
    assert run.transfer_s == pytest.approx((transfer, transfer))
    first = {e.req_id: e.time_s for e in run.tokens if e.index == 0}
    second = {e.req_id: e.time_s for e in run.tokens if e.index == 1}
    # both prompts are prefilled in one step, so the second transfer queues behind the first
    assert first[0] == first[1]
    assert second[0] > first[0] + transfer
    assert second[1] > first[1] + 2 * transfer


def test_decode_admission_waits_for_kv_room():
    profile = small_kv_profile(3000)
    # a holds 1000 + 1000 - 1 tokens on the decode rank, b 1000 + 10 - 1: 3008 > 3000
    arrivals = [Arrival("a", 0.0, 1000, 1000, SLO), Arrival("b", 0.01, 1000, 10, SLO)]
    run = run_disaggregated(arrivals, profile, _factory("kairos-fcfs", profile), DisaggConfig(),
                            record_tokens=True, check_invariants=True)
    a, b = run.records["a"], run.records["b"]
    assert a.finished and b.finished
    assert b.first_token_s < a.finish_s  # b's prefill ended long before a was done
    second_of_b = next(e.time_s for e in run.tokens if e.req_id == "b" and e.index == 1)
    assert second_of_b > a.finish_s
    assert max(run.decode_wait_s) == pytest.approx(a.finish_s - b.first_token_s)


def test_a_request_no_decode_rank_can_hold_is_rejected():
    profile = small_kv_profile(3000)
    arrivals = [Arrival("big", 0.0, 2000, 1002, SLO), Arrival("ok", 0.0, 2000, 1001, SLO)]
    run = run_disaggregated(arrivals, profile, _factory("kairos", profile), DisaggConfig())
    assert run.records["big"].rejected and run.records["big"].prefill_tokens_computed == 0
    assert run.records["ok"].finished


@pytest.mark.parametrize("name", ["kairos", "kairos-fcfs", "kairos-online"])
@pytest.mark.parametrize("split", [(1, 1), (2, 3)])
def test_token_accounting(name, split):
    profile = small_kv_profile(40_000)
    requests = synthetic_requests(80, 12.0, seed=5, prompt=(10, 3000), output=(1, 200))
    run = run_disaggregated(_arrivals(requests), profile, _factory(name, profile),
                            DisaggConfig(*split), seed=2, record_tokens=True,
                            check_invariants=True)
    by_request: dict = {}
    for event in run.tokens:
        by_request.setdefault(event.req_id, []).append(event)
    for r in requests:
        record = run.records[r.req_id]
        assert record.finished and not record.rejected and not record.aborted
        assert record.prefill_tokens_computed == r.prompt + record.recomputed_tokens
        assert record.tokens_emitted == r.output and record.decode_steps == r.output - 1
        events = by_request[r.req_id]
        assert [e.index for e in events] == list(range(r.output))
        assert events[0].time_s == record.first_token_s > r.arrival
        assert all(e.time_s > events[0].time_s for e in events[1:])  # after prefill + transfer
        assert [e.finished for e in events] == [False] * (r.output - 1) + [True]
    assert all(rank.reserved == 0 and not rank.active for rank in run.decode_ranks)
    assert all(not engine.has_work and engine.kv_used == 0 for engine in run.prefill_engines)
    assert len(run.transfer_s) == sum(r.output > 1 for r in requests)
    assert all(rank.steps > 0 for rank in run.decode_ranks)
    assert all(engine.steps > 0 for engine in run.prefill_engines)


def _decode_steps(name: str, rate: float) -> tuple[int, int]:
    profile = small_kv_profile(200_000)
    requests = synthetic_requests(120, rate, seed=7, prompt=(10, 6000), output=(50, 300))
    run = run_disaggregated(_arrivals(requests), profile, _factory(name, profile), DisaggConfig())
    (rank,) = run.decode_ranks
    return rank.steps, rank.partial_steps


@pytest.mark.slow
def test_slack_guided_decode_is_continuous_batching_while_slack_is_abundant():
    # at 2 req/s every step is far shorter than a TPOT: the whole batch always fits
    assert _decode_steps("kairos", 2.0) == _decode_steps("kairos-fcfs", 2.0)
    assert _decode_steps("kairos", 2.0)[1] == 0


def test_slack_guided_decode_leaves_long_requests_out_under_pressure():
    steps, partial = _decode_steps("kairos", 10.0)
    assert partial > 0.1 * steps
    assert _decode_steps("kairos-fcfs", 10.0)[1] == 0


# ------------------------------------------------------------------ runner and CLI
def _scenario(**fields) -> Scenario:
    requests = synthetic_requests(40, 4.0, seed=3, prompt=(10, 2000), output=(1, 120))
    workload = Workload(tuple(TraceRequest(r.arrival, r.prompt, r.output) for r in requests), "syn")
    return Scenario(workload=workload, profile=llama(), catalog=CATALOG, **fields)


@pytest.mark.slow
def test_simulate_routes_disaggregated_policies_and_reports_per_gpu():
    scenario = _scenario(disagg=DisaggConfig(2, 2))
    assert POLICIES.get("kairos").disaggregated and not POLICIES.get("fb").disaggregated
    load = simulate(scenario, parse_policy("kairos@2048"), 4.0).load
    assert load["gpus"] == 4
    assert load["effective_rps_per_gpu"] == pytest.approx(load["effective_rps"] / 4)
    assert load["disaggregated"]["prefill_ranks"] == 2 and load["unfinished"] == 0
    colocated = simulate(scenario, PolicySpec("sarathi", 512), 4.0).load
    assert "gpus" not in colocated and "disaggregated" not in colocated


def test_cli_runs_each_policy_on_its_defaults(tmp_path, capsys):
    for name in ("kairos", "kairos-fcfs"):
        out = tmp_path / name
        assert main(["run", "--policy", name, "--rate", "3", "--head-seconds", "20",
                     "--out", str(out)]) == 0
        text = capsys.readouterr().out
        assert "2 GPUs (1 prefill + 1 decode, KV link 400 Gb/s)" in text and "per GPU" in text
        document = json.loads((out / "results.json").read_text())
        assert document["disaggregated"] == {"gpus": 2, "split": "1:1", "prefill_ranks": 1,
                                             "decode_ranks": 1, "link_gbps": 400.0}
        load = document["policies"][name]["loads"][0]
        assert load["gpus"] == 2 and load["requests"] > 10 and load["unfinished"] == 0


def test_cli_split_and_link(tmp_path, capsys):
    out = tmp_path / "k"
    assert main(["run", "--policy", "kairos", "--rate", "3", "--head-seconds", "20",
                 "--split", "2:1", "--link-gbps", "100", "--out", str(out)]) == 0
    assert "3 GPUs (2 prefill + 1 decode, KV link 100 Gb/s)" in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text())["disaggregated"]["split"] == "2:1"


@pytest.mark.parametrize("argv, fragment", [
    (["run", "--policy", "fb", "--split", "1:1"], "--split applies to disaggregated policies"),
    (["run", "--policy", "sarathi@512", "--split", "1:1", "--link-gbps", "10"],
     "--split and --link-gbps apply"),
    (["cluster", "--policy", "kairos", "--ranks", "2"], "runs disaggregated"),
])
def test_cli_refuses_disaggregation_flags_where_they_do_not_apply(argv, fragment, capsys, tmp_path):
    assert main([*argv, "--head-seconds", "10", "--out", str(tmp_path)]) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize("argv, fragment", [
    (["--split", "2"], "split must be P:D"),
    (["--split", "0:2"], "must be >= 1"),
    (["--link-gbps", "0"], "expected a number > 0"),
])
def test_cli_bad_split_or_link_is_an_argparse_error(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--policy", "kairos", *argv])
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err
