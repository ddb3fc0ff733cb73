"""The admission forecast over a ``RequestTable``, compiled or by the reference. The
reference takes its rate from the columns and a long queue as columns too (running sums
where every entry fits, Moore-Hodgson's heap over plain lists, the scan entry by entry only
from the first that does not fit), a short one as the list's entries. Either way it must
stay bit for bit the forecast over the same requests as a list: the same hopeless
prefills and the same tables, every float with the same bits. Each test runs on the
compiled path and on both ways of taking the queue, whatever its length."""

from __future__ import annotations

import random
from dataclasses import replace
from functools import partial
from types import MappingProxyType

import numpy as np
import pytest

from sglang_ext.policy import admission
from sglang_ext.policy.admission import (
    KvOutlook,
    QueueForecast,
    _rate_and_queue,
    _running_sums,
    forecast,
    hopeless_prefills,
)
from sglang_ext.policy.knee_step_model import KneeStepModel
from sglang_ext.policy.request_table import RequestTable
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_model import StepCoefficients
from sglang_ext.policy.view import RequestView

NOW = 100.0
MODELS = {
    "knee": KneeStepModel(0.005, 5e-5, 1e-8, 3.3e-9, 1e-12, 256.0, 64.0),
    "linear": StepCoefficients(0.004, 6e-5, 3.1e-8),
}
SLOS = (Slo.from_ms(500, 50), Slo.from_ms(2000, 50), Slo.from_ms(5000, 200))
WEIGHTS = (None, 1.0, 0.5, 0.0)


@pytest.fixture(params=["compiled", "columns", "entries"])
def queue_taken_as(request, monkeypatch) -> str:
    """The table's forecast by the compiled path, or by the reference with its queue as
    columns or as entries at every length."""
    if request.param == "compiled":
        request.getfixturevalue("compiled_path")
    else:
        request.getfixturevalue("reference_path")
        monkeypatch.setattr(admission, "COLUMNS_FROM", 0 if request.param == "columns" else 10**9)
    return request.param


def bits(value: float) -> str:
    """A float's exact bits, as text (tells -0.0 from 0.0)."""
    return float(value).hex()


def forecast_bits(queue: QueueForecast) -> tuple:
    return (bits(queue.rate), queue.hopeless,
            *[tuple(map(bits, getattr(queue, name))) for name in (
                "deadlines", "work_through", "spare_after", "need_through", "kv_spare_after")])


def decodes(rng: random.Random, count: int, context: tuple[int, int] = (10, 3000)
            ) -> list[dict]:
    rows = []
    for _ in range(count):
        slo = rng.choice(SLOS)
        index = rng.randint(1, 300)
        prompt = rng.randint(*context)
        rows.append({"arrival": NOW - slo.ttft_s - slo.tpot_s * index + rng.uniform(-1, 2),
                     "slo": slo, "next_output_index": index, "pending_prefill": 0,
                     "context": prompt + index - 1, "prompt_tokens": prompt,
                     "first_token_time": None})
    return rows


def queued(rng: random.Random, count: int, waited: float = 1.5, longest: int = 8000
           ) -> list[dict]:
    """Prompts waiting up to ``waited`` of their TTFT (past it: late on their own), some
    half prefilled (started), some with the very deadline of an earlier one (a tie), a few
    recomputing after a preemption (a next output index past 0)."""
    rows: list[dict] = []
    for _ in range(count):
        slo = rng.choice(SLOS)
        arrival = NOW - rng.uniform(0.0, slo.ttft_s * waited)
        if rows and rng.random() < 0.25:
            slo, arrival = rows[-1]["slo"], rows[-1]["arrival"]
        prompt = rng.randint(1, longest)
        done = prompt // 2 if rng.random() < 0.25 else 0
        rows.append({"arrival": arrival, "slo": slo,
                     "next_output_index": rng.choice((0, 0, 0, 0, 0, 3)),
                     "pending_prefill": prompt - done, "context": done, "prompt_tokens": prompt,
                     "first_token_time": None})
    return rows


def state_of(rng: random.Random, rows: list[dict]) -> list[RequestView]:
    """The requests in a shuffled engine order: arrival numbers, not the table's order,
    break a tie in deadline."""
    seqs = list(range(len(rows)))
    rng.shuffle(seqs)
    return [RequestView(req_id=f"r{seq}", arrival_seq=seq, **row) for seq, row in zip(seqs, rows)]


def kv_outlook(rng: random.Random, state: list[RequestView], free: float) -> KvOutlook:
    releases = [(NOW + rng.uniform(-0.5, 4.0), float(r.context + 200))
                for r in state if not r.pending_prefill]
    reserves = {r.req_id: float(rng.randint(0, 400)) for r in state
                if r.pending_prefill and rng.random() < 0.7}
    return KvOutlook.of(free, releases, reserves, 150.0)


def assert_same_forecast(state: list[RequestView], model, kv: KvOutlook | None, now=NOW,
                         length_weights=WEIGHTS) -> None:
    table = RequestTable.of(state)
    for weight in length_weights:
        args = (now, model, 0.05, 0.1, kv, weight)
        listed = forecast(state, *args)
        assert forecast_bits(forecast(table, *args)) == forecast_bits(listed), weight
        assert hopeless_prefills(table, *args) == hopeless_prefills(state, *args) == listed.hopeless


@pytest.mark.usefixtures("queue_taken_as")
@pytest.mark.parametrize("form", sorted(MODELS))
def test_the_table_forecast_is_the_list_forecast_on_random_queues(form):
    model = MODELS[form]
    rng = random.Random(form)
    for case in range(60):
        rows = decodes(rng, rng.choice((0, 3, 40, 200))) + queued(rng, rng.choice((0, 1, 6, 40)))
        state = state_of(rng, rows)
        now = NOW if case % 2 else np.float64(NOW)  # the simulator's clock may be numpy's
        kv = kv_outlook(rng, state, rng.choice((0.0, 2e4, 1e6))) if case % 3 else None
        assert_same_forecast(state, model, kv, now)


def cases() -> dict[str, list[RequestView]]:
    """A state per path of the table forecast (each checked to take it below)."""
    rng = random.Random(5)
    few = decodes(rng, 3)
    fresh = [dict(row, arrival=NOW - 0.01) for row in queued(rng, 8, longest=400)]
    early = [dict(row, arrival=NOW - 0.2, slo=SLOS[0], next_output_index=0)
             for row in queued(rng, 4, longest=400)]
    crowd = [dict(row, arrival=NOW - 0.5, slo=SLOS[1], next_output_index=0,
                  pending_prefill=row["prompt_tokens"] - row["context"] + 3000,
                  prompt_tokens=row["prompt_tokens"] + 3000)
             for row in queued(rng, 30, longest=4000)]
    past = [dict(row, arrival=NOW - row["slo"].ttft_s - 0.5 - index * 0.01, next_output_index=0)
            for index, row in enumerate(queued(rng, 5, longest=400))]
    past[1] = dict(past[1], context=10, prompt_tokens=past[1]["pending_prefill"] + 10)
    tied = [dict(row, arrival=NOW - 1.2, slo=SLOS[1], next_output_index=0)
            for row in queued(rng, 12, longest=3000)]
    return {
        "empty queue": state_of(rng, few),
        "no requests": [],
        "all on time": state_of(rng, few + fresh),
        "late behind entries on time": state_of(rng, few + early + crowd),
        "first entries late on their own": state_of(rng, few + past + early + crowd),
        "every entry late on its own": state_of(rng, few + past),
        "ties in deadline": state_of(rng, few + tied),
        "no rate left": state_of(rng, decodes(rng, 900, (20_000, 30_000)) + crowd),
    }


@pytest.mark.usefixtures("queue_taken_as")
@pytest.mark.parametrize("name", sorted(cases()))
@pytest.mark.parametrize("form", sorted(MODELS))
def test_each_path_of_the_table_forecast_is_the_list_forecast(name, form):
    state = cases()[name]
    model = MODELS[form]
    rng = random.Random(name)
    for kv in (None, kv_outlook(rng, state, 1e6), kv_outlook(rng, state, 3e3)):
        assert_same_forecast(state, model, kv)


def test_the_cases_take_the_paths_they_are_named_after():
    model = MODELS["knee"]
    usable = model.usable()
    for name, state in cases().items():
        rate, queue = _rate_and_queue(state, usable, 0.05, 0.1, None)
        queue.sort(key=lambda entry: (entry[0], entry[1]))
        capacities = [rate * (entry[0] - NOW) for entry in queue]
        works = [entry[2] for entry in queue]
        alone_late = [work > capacity for work, capacity in zip(works, capacities)]
        late_from = partial(late_behind, works, capacities)
        hopeless = hopeless_prefills(state, NOW, model, 0.05, 0.1, None, 1.0)
        if name in ("empty queue", "no requests"):
            assert not queue
        elif name == "all on time":
            assert queue and not any(late_from(0))
        elif name == "late behind entries on time":
            assert not late_from(0)[0] and any(late_from(0))
        elif name == "first entries late on their own":
            assert alone_late[:5] == [True] * 5 and not alone_late[5]
            assert not late_from(5)[0] and any(late_from(5))
            assert any(entry[5] for entry in queue[:5])  # a started one among them
        elif name == "every entry late on its own":
            assert all(alone_late)
        elif name == "ties in deadline":
            deadlines = [entry[0] for entry in queue]
            assert len(set(deadlines)) < len(deadlines) and hopeless
        elif name == "no rate left":
            assert rate == 0.0 and len(hopeless) == len(queue)


def late_behind(works: list[float], capacities: list[float], start: int) -> list[bool]:
    """Whether each entry from ``start`` on is late behind those from ``start``."""
    sums = loop_sums(works[start:])[1:]
    return [total > capacity for total, capacity in zip(sums, capacities[start:])]


@pytest.mark.usefixtures("queue_taken_as")
def test_a_kv_outlook_that_is_short_drops_prefills_the_work_would_keep():
    state = cases()["late behind entries on time"]
    rng = random.Random(1)
    model = MODELS["knee"]
    short = kv_outlook(rng, state, 3e3)
    without = hopeless_prefills(RequestTable.of(state), NOW, model, 0.05, 0.1, None, 1.0)
    assert hopeless_prefills(RequestTable.of(state), NOW, model, 0.05, 0.1, short, 1.0) > without


def loop_sums(values: list[float]) -> list[float]:
    sums, total = [0.0], 0.0
    for value in values:
        total += value
        sums.append(total)
    return sums


def test_running_sums_add_left_to_right_bit_for_bit():
    rng = random.Random(3)
    pairwise_differs = False
    for _ in range(300):
        values = [rng.choice((1.0, 1e-3, 1e8, 3.3)) * rng.random() * rng.choice((1, -1))
                  for _ in range(rng.choice((0, 1, 7, 64, 300)))]
        array = np.array(values)
        assert [bits(v) for v in _running_sums(array).tolist()] == [
            bits(v) for v in loop_sums(values)]
        if values and float(np.sum(array)) != loop_sums(values)[-1]:
            pairwise_differs = True
    assert pairwise_differs  # a pairwise sum would not do


@pytest.mark.usefixtures("compiled_path")
def test_the_compiled_forecast_reads_reserves_from_any_mapping():
    state = cases()["late behind entries on time"]
    rng = random.Random(2)
    kv = kv_outlook(rng, state, 3e3)
    proxied = KvOutlook(kv.free_tokens, kv.release_times, kv.released_through,
                        MappingProxyType(dict(kv.reserves)), kv.new_reserve)
    table = RequestTable.of(state)
    args = (NOW, MODELS["knee"], 0.05, 0.1)
    assert forecast_bits(forecast(table, *args, proxied, 1.0)) == forecast_bits(
        forecast(table, *args, kv, 1.0))


@pytest.mark.usefixtures("compiled_path")
def test_the_compiled_forecast_refuses_columns_of_the_wrong_type():
    state = cases()["all on time"]
    table = RequestTable.of(state)
    columns = table.columns
    broken = RequestTable(state, replace(columns, pending=columns.pending.astype(np.float64)))
    with pytest.raises(TypeError, match="column pending: expected a 1-d int64 array"):
        hopeless_prefills(broken, NOW, MODELS["knee"], 0.05, 0.1, None, 1.0)
