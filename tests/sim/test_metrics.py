"""RequestRecord latency definitions and the per-load summary of results.json."""

from __future__ import annotations

import math

import pytest

from sglang_ext.policy.slo import Slo
from sglang_ext.sim.metrics import (
    RequestRecord, attainment_by_prompt_tokens, latency_samples, summarize,
)

# Binary fractions keep every expected value exact.
SLO = Slo(ttft_s=1.0, tpot_s=0.25)


def record(times, *, output=None, arrival=0.0, slo=SLO, req_id="r") -> RequestRecord:
    rec = RequestRecord(req_id, arrival, slo, prompt_tokens=100,
                        output_tokens=output if output is not None else len(times))
    for index, t in enumerate(times):
        rec.on_token(index, t)
    return rec


# ------------------------------------------------------------------ one request
def test_latencies_of_a_hand_example():
    # t0 = 0.5; gaps 0.75, 0.25, 0.25 -> per-token averages 0.75, 0.5, 0.4166..
    rec = record([0.5, 1.25, 1.5, 1.75])
    assert rec.ttft_s == 0.5
    assert rec.max_tpot_s == 0.75  # at j = 1, not at the last token
    assert rec.max_tpot_s > (1.75 - 0.5) / 3
    assert rec.mean_tpot_s == pytest.approx((1.75 - 0.5) / 3)
    assert rec.mean_tbt_s == rec.mean_tpot_s
    assert rec.max_tbt_s == 0.75
    assert rec.finished and rec.finish_s == 1.75 and rec.last_token_s == 1.75
    assert rec.tokens_emitted == 4


def test_max_tpot_is_the_worst_running_average_not_the_worst_gap():
    # a slow start then fast tokens: the max gap is late, the max average is early
    rec = record([0.25, 0.5, 0.75, 1.0, 2.0])
    assert rec.max_tbt_s == 1.0  # the last gap
    assert rec.max_tpot_s == pytest.approx((2.0 - 0.25) / 4)  # 0.4375
    rec = record([0.25, 0.75, 1.0, 1.25, 1.5])
    assert rec.max_tpot_s == 0.5  # j = 1
    assert rec.max_tbt_s == 0.5


def test_slo_met_needs_both_targets():
    assert record([1.0, 1.25, 1.5]).slo_met  # both exactly at target
    assert not record([1.0 + 2**-10, 1.25, 1.5]).slo_met  # TTFT over
    assert not record([0.5, 0.5 + 0.25 + 2**-10]).slo_met  # TPOT over at j = 1
    late_start = record([0.25, 1.0, 1.25])  # gap 0.75 at j=1 -> max TPOT 0.75
    assert late_start.envelope_met and not late_start.slo_met


def test_envelope_fails_when_one_token_misses_its_deadline():
    # deadlines: 1.0, 1.25, 1.5, 1.75 (arrival 0); token 2 is late, the rest on time
    rec = record([0.25, 0.5, 1.5 + 2**-10, 1.75])
    assert not rec.envelope_met
    assert record([1.0, 1.25, 1.5, 1.75]).envelope_met  # deadlines are inclusive
    # the envelope is relative to the arrival
    assert record([5.0, 5.25], arrival=4.0).envelope_met
    assert not record([5.0 + 2**-10, 5.25], arrival=4.0).envelope_met


def test_one_token_request_has_no_tpot_but_can_meet_the_slo():
    rec = record([0.75])
    assert rec.finished and rec.mean_tpot_s is None
    assert rec.max_tpot_s == 0.0 and rec.max_tbt_s == 0.0
    assert rec.slo_met
    assert not record([1.5]).slo_met


def test_rejected_aborted_and_unfinished_are_violated():
    rejected = RequestRecord("a", 0.0, SLO, 10, 3)
    rejected.rejected = True
    aborted = record([0.25, 0.5], output=3)
    aborted.aborted = True
    unfinished = record([0.25, 0.5], output=3)
    assert not unfinished.finished and unfinished.finish_s is None
    for rec in (rejected, aborted, unfinished):
        assert not rec.slo_met
    # an aborted request that had emitted everything is still violated
    done_then_aborted = record([0.25])
    done_then_aborted.aborted = True
    assert not done_then_aborted.slo_met


def test_no_tokens_means_no_latencies():
    rec = RequestRecord("a", 0.0, SLO, 10, 3)
    assert rec.ttft_s is None and rec.mean_tpot_s is None and not rec.finished


@pytest.mark.parametrize("indices", [[1], [0, 0], [0, 2], [0, 1, 1]])
def test_out_of_order_token_index_raises(indices):
    rec = RequestRecord("a", 0.0, SLO, 10, 5)
    *good, bad = indices
    for i, index in enumerate(good):
        rec.on_token(index, 0.1 * (i + 1))
    with pytest.raises(RuntimeError, match="token"):
        rec.on_token(bad, 1.0)


# ------------------------------------------------------------------ summarize
def _mixed_records() -> list[RequestRecord]:
    met_a = record([0.125, 0.25, 0.375], req_id="a")  # TTFT 125 ms, TPOT 125 ms
    met_b = record([0.375], req_id="b")  # one token: met, no TPOT
    slow_tpot = record([0.25, 0.75, 1.0], req_id="c")  # max TPOT 500 ms: violated
    slow_ttft = record([1.5, 1.625], req_id="d")  # TTFT 1.5 s: violated
    rejected = RequestRecord("e", 0.0, SLO, 10, 4)
    rejected.rejected = True
    unfinished = record([0.5, 0.625], output=5, req_id="f")
    return [met_a, met_b, slow_tpot, slow_ttft, rejected, unfinished]


def test_summarize_counts_and_attainment():
    summary = summarize(_mixed_records(), offered_rate=6.0, duration_s=2.0)
    assert summary["rate"] == 6.0 and summary["requests"] == 6
    assert summary["attainment"] == pytest.approx(2 / 6)
    assert summary["effective_rps"] == pytest.approx(6.0 * 2 / 6)
    assert summary["rejected"] == 1 and summary["aborted"] == 0 and summary["unfinished"] == 1
    # TTFT within target: a, b, c, f (the unfinished one had its first token in time)
    assert summary["ttft_attainment"] == pytest.approx(4 / 6)
    # TPOT within target among finished: a, b, d
    assert summary["tpot_attainment"] == pytest.approx(3 / 6)
    # envelope among finished: a, b, c (c's slow token 1 is still before 1.25 s); d is late
    assert summary["envelope_attainment"] == pytest.approx(3 / 6)
    emitted = 3 + 1 + 3 + 2 + 0 + 2
    assert summary["output_tokens_per_s"] == pytest.approx(emitted / 2.0)


def test_attainment_by_prompt_length_bucket():
    records = _mixed_records()  # prompts of 100 tokens but the rejected one (10)
    long_met = RequestRecord("g", 0.0, SLO, prompt_tokens=4096, output_tokens=1)
    long_met.on_token(0, 0.5)
    long_late = RequestRecord("h", 0.0, SLO, prompt_tokens=1500, output_tokens=1)
    long_late.on_token(0, 1.5)
    buckets = attainment_by_prompt_tokens([*records, long_met, long_late])
    assert list(buckets) == ["<512", "1024-2047", ">=4096"]
    assert buckets["<512"] == {"requests": 6, "attainment": pytest.approx(2 / 6),
                               "ttft_attainment": pytest.approx(4 / 6)}
    assert buckets["1024-2047"] == {"requests": 1, "attainment": 0.0, "ttft_attainment": 0.0}
    assert buckets[">=4096"] == {"requests": 1, "attainment": 1.0, "ttft_attainment": 1.0}
    assert summarize(records, 6.0, 2.0)["by_prompt_tokens"] == attainment_by_prompt_tokens(records)


def test_summarize_percentiles_in_ms():
    summary = summarize(_mixed_records(), offered_rate=6.0, duration_s=2.0)
    keys = {"p50", "p90", "p95", "p99", "mean"}
    for name in ("ttft_ms", "tpot_ms", "mean_tpot_ms", "max_tbt_ms"):
        assert set(summary[name]) == keys
    # TTFT over served requests with a first token: 125, 375, 250, 1500, 500 ms
    ttft = summary["ttft_ms"]
    assert ttft["mean"] == pytest.approx((125 + 375 + 250 + 1500 + 500) / 5)
    assert ttft["p50"] == pytest.approx(375)
    assert ttft["p99"] <= 1500 and ttft["p99"] > ttft["p90"] > ttft["p50"]
    # max TPOT over finished requests with >= 2 tokens: a 125, c 500, d 125
    tpot = summary["tpot_ms"]
    assert tpot["mean"] == pytest.approx((125 + 500 + 125) / 3)
    assert tpot["p50"] == pytest.approx(125)
    assert summary["max_tbt_ms"]["mean"] == pytest.approx((125 + 500 + 125) / 3)


def test_summarize_with_only_one_token_requests_has_no_tpot():
    summary = summarize([record([0.25]), record([0.5], req_id="b")], 1.0, 1.0)
    assert summary["attainment"] == 1.0
    assert all(v is None for v in summary["tpot_ms"].values())
    assert summary["ttft_ms"]["mean"] == pytest.approx(375)


def test_summarize_edge_cases():
    with pytest.raises(ValueError):
        summarize([], 1.0, 1.0)
    assert math.isnan(summarize([record([0.25])], 1.0, 0.0)["output_tokens_per_s"])
    rejected = RequestRecord("a", 0.0, SLO, 10, 4)
    rejected.rejected = True
    summary = summarize([rejected], 3.0, 1.0)
    assert summary["attainment"] == 0.0 and summary["effective_rps"] == 0.0
    assert all(v is None for v in summary["ttft_ms"].values())


def test_latency_samples_skip_rejected_and_single_tokens():
    samples = latency_samples(_mixed_records())
    assert sorted(samples.ttft_ms) == pytest.approx([125, 250, 375, 500, 1500])
    assert sorted(samples.tpot_ms) == pytest.approx([125, 125, 500])
