"""The forecast's fast paths (it runs over every request at every decision under admission
``defer``): ``prefill_rate`` inlines the step models' ``decode_cost_s``, the forecast takes
the rate and its queue in one pass (the knee model's ``prefill_work`` and the KV need
inlined), Moore-Hodgson starts its heap at the first late entry, and a decision computes
only the hopeless prefills. Each must stay bit for bit what the plain form gives."""

from __future__ import annotations

import heapq
import random

import pytest

from sglang_ext.policy.admission import (
    KvOutlook,
    _drawn,
    _evicted,
    _longest,
    _on_time,
    _rate_and_queue,
    eviction_key,
    forecast,
    hopeless_prefills,
    prefill_rate,
)
from sglang_ext.policy.knee_step_model import KneeStepModel
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_model import StepCoefficients
from sglang_ext.policy.view import RequestView


def called(requests, coefficients, default_tpot_s, headroom):
    """``prefill_rate`` as written before the inlining: the model called per request."""
    usable = coefficients.usable()
    period = default_tpot_s
    decode_share = 0.0
    decodes = len(requests)
    for request in requests:
        tpot = request.slo.tpot_s
        if tpot < period:
            period = tpot
        decode_share += usable.decode_cost_s(request.context + request.pending_prefill, decodes) / tpot
    free = 1.0 - usable.a_s / period - decode_share
    return max(0.0, free) / usable.b_s_per_token * (1.0 - headroom)


class OtherPredictor:
    """A predictor of neither known type: called, not inlined."""

    def __init__(self, linear: StepCoefficients) -> None:
        self.linear = linear
        self.a_s, self.b_s_per_token = linear.a_s, linear.b_s_per_token

    def usable(self):
        return self

    def decode_cost_s(self, kv_tokens: float, decodes: int) -> float:
        return self.linear.decode_cost_s(kv_tokens, decodes) * 1.5

    def prefill_work(self, pending: int, prefix: int) -> float:
        return self.linear.prefill_work(pending, prefix) * 1.25


MODELS = [
    StepCoefficients(0.004, 6e-5, 3.1e-8),
    StepCoefficients(-0.001, 1e-9, -2e-8),  # usable() clamps it
    KneeStepModel(0.005, 5e-5, 1e-8, 3.3e-9, 1e-12, 256.0, 64.0),
    KneeStepModel(0.005, 5e-5, 1e-8, 3.3e-9, 1e-12, 256.0, 500.0),  # saturation above the count
    KneeStepModel(0.005, 5e-5, 1e-8, -3e-9, 1e-12, 0.0, 0.0),
]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: f"{type(m).__name__}")
def test_the_inlined_decode_cost_is_the_models(model):
    rng = random.Random(11)
    slos = [Slo(2.0, 0.05), Slo(0.5, 0.03), Slo(5.0, 0.2), Slo(1.0, 0.0173)]
    for trial in range(200):
        count = rng.choice([0, 1, 7, 63, 64, 65, 300])
        requests = [RequestView(i, rng.uniform(0, 100), rng.choice(slos), rng.randint(0, 400),
                                rng.choice([0, 0, rng.randint(1, 4000)]), rng.randint(0, 9000),
                                rng.randint(1, 4000), i)
                    for i in range(count)]
        default_tpot = rng.choice([0.05, 0.01, 0.2])
        headroom = rng.choice([0.0, 0.1])
        assert prefill_rate(requests, model, default_tpot, headroom) == called(
            requests, model, default_tpot, headroom)


def test_another_predictor_is_called():
    model = OtherPredictor(StepCoefficients(0.004, 6e-5, 3.1e-8))
    requests = [RequestView(i, 0.0, Slo(2.0, 0.05), 3, 0, 1000 + i, 900, i) for i in range(50)]
    assert prefill_rate(requests, model, 0.05) == called(requests, model, 0.05, 0.0)


def random_requests(rng: random.Random, count: int) -> list[RequestView]:
    slos = [Slo(2.0, 0.05), Slo(0.5, 0.03), Slo(5.0, 0.2), Slo(1.0, 0.0173)]
    return [RequestView(i, rng.uniform(0, 100), rng.choice(slos), rng.randint(0, 400),
                        rng.choice([0, 0, rng.randint(1, 4000)]), rng.randint(0, 9000),
                        rng.randint(1, 4000), rng.randint(0, 10_000))
            for i in range(count)]


def random_kv(rng: random.Random, requests: list[RequestView]) -> KvOutlook:
    releases = [(rng.uniform(0.0, 40.0), float(rng.randint(1, 5000)))
                for _ in range(rng.randint(0, 30))]
    reserves = {r.req_id: float(rng.randint(0, 500)) for r in requests if rng.random() < 0.5}
    return KvOutlook.of(rng.choice([0, 5000, 400_000]), releases, reserves,
                        rng.choice([0.0, 128.0]))


@pytest.mark.parametrize("model", [*MODELS, OtherPredictor(MODELS[0])],
                         ids=lambda m: f"{type(m).__name__}")
def test_the_one_pass_rate_and_queue_are_the_separate_ones(model):
    rng = random.Random(12)
    usable = model.usable()
    for trial in range(100):
        requests = random_requests(rng, rng.choice([0, 1, 64, 320]))
        kv = random_kv(rng, requests) if trial % 2 else None
        rate, queue = _rate_and_queue(requests, usable, 0.05, 0.1, kv)
        assert rate == prefill_rate(requests, model, 0.05, 0.1)
        assert queue == [
            (r.arrival + r.slo.ttft_s + r.slo.tpot_s * r.next_output_index, r.arrival_seq,
             usable.prefill_work(r.pending_prefill, r.context),
             0.0 if kv is None else kv.need_of(r), r.req_id,
             r.pending_prefill < r.prompt_tokens)
            for r in requests if r.pending_prefill > 0]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: f"{type(m).__name__}")
@pytest.mark.parametrize("length_weight", [None, 1.0, 0.5, 0.0], ids=["each", "longest", "half", "fair"])
def test_a_decision_finds_the_hopeless_prefills_of_the_whole_forecast(model, length_weight):
    rng = random.Random(14)
    for trial in range(100):
        requests = random_requests(rng, rng.choice([0, 1, 64, 320]))
        kv = random_kv(rng, requests) if trial % 2 else None
        args = (requests, 50.0, model, 0.05, rng.choice([0.0, 0.1]), kv, length_weight)
        assert hopeless_prefills(*args) == forecast(*args).hopeless


def plain_on_time(queue, rate, now, hopeless, victim_key):
    """Moore-Hodgson as first written: every not-started entry enters the heap."""
    dropped, victims, work = set(), [], 0.0
    for position, (deadline, arrival_seq, pending, _, _, started) in enumerate(queue):
        work += pending
        if not started:
            heapq.heappush(victims, (-victim_key(arrival_seq, pending), -position))
        capacity = rate * (deadline - now)
        while work > capacity and victims:
            victim = -heapq.heappop(victims)[1]
            work -= queue[victim][2]
            dropped.add(victim)
        if work > capacity and position not in dropped:
            work -= pending
            dropped.add(position)
    hopeless.update(queue[position][4] for position in dropped)
    return [entry for position, entry in enumerate(queue) if position not in dropped]


@pytest.mark.parametrize("victim_key", [_longest, _drawn, eviction_key(0.5)],
                         ids=["longest", "drawn", "half"])
def test_moore_hodgson_from_the_first_late_entry_is_the_plain_one(victim_key):
    """With entries late on their own first (past their deadline, or too long for it),
    started ones among them, on time ones, ties, and none; the evictions over fields
    (what a table's forecast runs) and over entries."""
    rng = random.Random(13)
    for trial in range(500):
        queue = sorted(
            (rng.uniform(-1.0, 3.0), seq, float(rng.randint(1, 4000)), 0.0, seq,
             rng.random() < 0.2)
            for seq in range(rng.choice([0, 1, 5, 64])))
        rate = rng.choice([0.0, 500.0, 4000.0, 20_000.0, 1e6])
        fast, plain = set(), set()
        assert _on_time(queue, rate, 0.0, fast, victim_key) == plain_on_time(
            queue, rate, 0.0, plain, victim_key)
        assert fast == plain
        dropped = _evicted([rate * entry[0] for entry in queue], [entry[2] for entry in queue],
                           [entry[1] for entry in queue], [entry[5] for entry in queue],
                           victim_key)
        assert {queue[position][4] for position in dropped} == plain
