"""RequestRecord latency definitions and the per-load summary of results.json."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sglang_ext.policy.slo import Slo
from sglang_ext.sim.metrics import (
    UNCLASSED, RequestRecord, attainment_by_prompt_tokens, latency_samples, summarize,
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


# ------------------------------------------------------------------ the e2e kind
# an e2e SLO of 1 s whose envelope's first token is due at 0.25 s
E2E = Slo(0.25, 0.25, 1.0)


def test_an_e2e_slo_is_met_by_the_last_token_alone():
    late_first = record([0.75, 1.0], slo=E2E)  # TTFT 0.75 s, past its envelope's 0.25 s
    assert late_first.slo_met and not late_first.envelope_met
    assert late_first.e2e_s == 1.0  # inclusive
    slow_tokens = record([0.125, 0.875, 1.0], slo=E2E)  # max TPOT 0.75 s
    assert slow_tokens.max_tpot_s > E2E.tpot_s and slow_tokens.slo_met
    late = record([0.125, 0.25, 1.0 + 2**-10], slo=E2E)  # fast first token, finished late
    assert late.ttft_s <= E2E.ttft_s and not late.slo_met
    assert record([5.0, 5.5], arrival=4.5, slo=E2E).slo_met  # relative to its arrival
    assert not record([5.0, 5.5 + 2**-10], arrival=4.5, slo=E2E).slo_met


def test_an_e2e_request_rejected_aborted_or_unfinished_is_violated():
    unfinished = record([0.125, 0.25], output=3, slo=E2E)
    assert unfinished.e2e_s is None and not unfinished.slo_met
    aborted = record([0.125, 0.25], slo=E2E)
    aborted.aborted = True
    rejected = RequestRecord("x", 0.0, E2E, 10, 3, rejected=True)
    assert not aborted.slo_met and not rejected.slo_met


def test_a_ttft_tpot_slo_is_unchanged_by_the_e2e_kind():
    # TPOT 125 ms and TTFT in time, the last token long after arrival: still met
    assert record([1.0, 1.125, 1.25, 1.375, 1.5, 1.625]).slo_met


def _classed(times, slo_class, *, slo=SLO, output=None, req_id="r") -> RequestRecord:
    rec = record(times, slo=slo, output=output, req_id=req_id)
    rec.slo_class = slo_class
    return rec


def _chat_and_code() -> list[RequestRecord]:
    return [
        _classed([0.125, 0.25], "chat", req_id="c1"),  # met
        _classed([1.5, 1.625], "chat", req_id="c2"),  # TTFT over: violated
        _classed([0.75, 0.875, 1.0], "code", slo=E2E, req_id="k1"),  # late TTFT, met by e2e
        _classed([0.125, 0.25, 1.5], "code", slo=E2E, req_id="k2"),  # quick TTFT, e2e late
        _classed([0.125, 0.25], "code", slo=E2E, output=4, req_id="k3"),  # unfinished
    ]


def test_summarize_splits_attainment_by_slo_class():
    summary = summarize(_chat_and_code(), offered_rate=5.0, duration_s=2.0)
    assert summary["attainment"] == pytest.approx(2 / 5)
    classes = summary["by_slo_class"]
    assert list(classes) == ["chat", "code"]
    chat, code = classes["chat"], classes["code"]
    assert (chat["kind"], chat["requests"], chat["attainment"]) == ("ttft+tpot", 2, 0.5)
    assert (code["kind"], code["requests"], code["attainment"]) == ("e2e", 3, pytest.approx(1 / 3))
    assert code["ttft_ms"]["mean"] == pytest.approx((750 + 125 + 125) / 3)
    assert code["e2e_ms"]["mean"] == pytest.approx((1000 + 1500) / 2)  # finished ones only
    assert code["tpot_ms"]["p50"] == pytest.approx((125 + 687.5) / 2)
    assert chat["e2e_ms"]["mean"] == pytest.approx((250 + 1625) / 2)
    assert set(chat) == {"kind", "requests", "attainment", "ttft_ms", "tpot_ms", "e2e_ms"}


def test_ttft_and_tpot_attainment_count_ttft_tpot_requests_only():
    summary = summarize(_chat_and_code(), offered_rate=5.0, duration_s=2.0)
    assert summary["ttft_attainment"] == 0.5  # chat: c1 of c1, c2
    assert summary["tpot_attainment"] == 1.0  # both chat requests' TPOT is 125 ms
    # over every request, as the envelope and the latency percentiles are
    assert summary["envelope_attainment"] == pytest.approx(1 / 5)  # c1 alone
    assert summary["e2e_ms"]["mean"] == pytest.approx((250 + 1625 + 1000 + 1500) / 4)
    assert summary["ttft_ms"]["mean"] == pytest.approx((125 + 1500 + 750 + 125 + 125) / 5)
    only_code = summarize(_chat_and_code()[2:], 3.0, 2.0)
    assert only_code["ttft_attainment"] is None and only_code["tpot_attainment"] is None
    assert only_code["by_prompt_tokens"]["<512"]["ttft_attainment"] is None


def test_records_without_a_class_are_grouped_under_a_stated_label():
    records = [record([0.125], req_id="a"), record([0.75, 1.0], slo=E2E, req_id="b"),
               _classed([0.125], "chat", req_id="c")]
    classes = summarize(records, 1.0, 1.0)["by_slo_class"]
    assert UNCLASSED == "(no class)" and list(classes) == [UNCLASSED, "chat"]
    assert classes[UNCLASSED]["kind"] == "mixed" and classes[UNCLASSED]["requests"] == 2
    assert classes[UNCLASSED]["attainment"] == 1.0


def test_latency_samples_keep_the_e2e_latency_of_finished_requests():
    samples = latency_samples(_chat_and_code())
    assert sorted(samples.e2e_ms) == pytest.approx([250, 1000, 1500, 1625])


# ------------------------------------------------------------------ schema 1 regression
def _v1_summary(records, offered_rate, duration_s) -> dict:
    """summarize() as schema version 1 computed it (before the e2e kind), restated."""
    total = len(records)
    served = [r for r in records if not r.rejected and not r.aborted]
    finished = [r for r in served if r.finished]

    def ttft_met(r):
        return (not r.rejected and not r.aborted and r.ttft_s is not None
                and r.ttft_s <= r.slo.ttft_s)

    def met(r):
        return (not r.rejected and not r.aborted and r.finished and r.ttft_s <= r.slo.ttft_s
                and r.max_tpot_s <= r.slo.tpot_s)

    def percentiles(values):
        if not values:
            return {"p50": None, "p90": None, "p95": None, "p99": None, "mean": None}
        array = np.asarray(values, dtype=float) * 1e3
        return {**{f"p{p}": float(np.percentile(array, p)) for p in (50, 90, 95, 99)},
                "mean": float(array.mean())}

    buckets = {}
    for r in records:
        edges = (512, 1024, 2048, 4096)
        labels = ["<512", "512-1023", "1024-2047", "2048-4095", ">=4096"]
        buckets.setdefault(labels[sum(r.prompt_tokens >= e for e in edges)], []).append(r)
    attainment = sum(map(met, records)) / total
    multi = [r for r in finished if r.tokens_emitted >= 2]
    return {
        "rate": offered_rate, "requests": total, "attainment": attainment,
        "effective_rps": offered_rate * attainment,
        "envelope_attainment": sum(r.envelope_met and r.finished and not r.rejected
                                   for r in records) / total,
        "ttft_attainment": sum(map(ttft_met, records)) / total,
        "tpot_attainment": sum(r.max_tpot_s <= r.slo.tpot_s for r in finished) / total,
        "rejected": sum(r.rejected for r in records),
        "aborted": sum(r.aborted for r in records),
        "unfinished": len(served) - len(finished),
        "preemptions": sum(r.preemptions for r in records),
        "recomputed_tokens": sum(r.recomputed_tokens for r in records),
        "output_tokens_per_s": sum(r.tokens_emitted for r in records) / duration_s,
        "ttft_ms": percentiles([r.ttft_s for r in served if r.ttft_s is not None]),
        "tpot_ms": percentiles([r.max_tpot_s for r in multi]),
        "mean_tpot_ms": percentiles([r.mean_tpot_s for r in multi]),
        "max_tbt_ms": percentiles([r.max_tbt_s for r in multi]),
        "by_prompt_tokens": {
            label: {"requests": len(members),
                    "attainment": sum(map(met, members)) / len(members),
                    "ttft_attainment": sum(map(ttft_met, members)) / len(members)}
            for label, members in sorted(buckets.items(), key=lambda item: labels.index(item[0]))
        },
    }


def _assert_v1_fields_unchanged(records, rate, duration):
    summary = summarize(records, rate, duration)
    expected = _v1_summary(records, rate, duration)
    assert {key: summary[key] for key in expected} == expected  # exact, not approximate
    assert list(summary["by_prompt_tokens"]) == list(expected["by_prompt_tokens"])


def test_a_ttft_tpot_only_summary_keeps_every_version_1_value():
    records = _mixed_records()
    aborted = record([0.25, 0.5], output=3, req_id="g")
    aborted.aborted = True
    _assert_v1_fields_unchanged([*records, aborted], 7.0, 2.5)
    classed = [_classed([0.125 * (i + 1), 0.25 * (i + 1)], ("a", "b", None)[i % 3], req_id=i)
               for i in range(9)]
    _assert_v1_fields_unchanged(classed, 3.0, 2.0)
