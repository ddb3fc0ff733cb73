"""A decision's table from the view loops (the live requests' store plus what the loops
collect) holds exactly what the views say, and the KV outlook computed from it is the one
computed request by request."""

from __future__ import annotations

import importlib.util
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

pytestmark = pytest.mark.sglang

from test_scheduler_state import PLAIN_SAMPLING, REPO, FakeReq


def sglang_req(rid: str, rng: random.Random, *, decoding: bool) -> FakeReq:
    arrival = 100.0 + rng.random()
    prompt = rng.randint(1, 3000)
    produced = rng.randint(1, 300) if decoding else rng.choice([0, 0, 2])
    first = (arrival + 0.2) if decoding and rng.random() < 0.8 else None
    return FakeReq(
        rid=rid, origin_input_ids=[1] * prompt, output_ids=[7] * produced,
        prefix_len=rng.randint(0, prompt), finished_reason=None, to_finish=None,
        sampling_params=SimpleNamespace(
            **PLAIN_SAMPLING, max_new_tokens=rng.choice([None, 0, 1, 50, 400, 70000]), ignore_eos=rng.random() < 0.3,
            custom_params={"slo": {"class": rng.choice(["interactive", "standard", "relaxed"])}}),
        time_stats=SimpleNamespace(prefill_finished_time=first or 0.0, scheduler_recv_time=arrival,
                                   wait_queue_entry_time=arrival),
    )


def catalog():
    from sglang_ext.adapter.extension_config import ExtensionConfig

    return ExtensionConfig.load(REPO / "configs" / "fairbatching.toml").catalog


def collect(records, decoding, in_flight, chunked, waiting):
    from sglang_ext.adapter.scheduler.request_store import DecisionColumns

    collected = DecisionColumns()
    views = records.decode_views(decoding, in_flight, 9.5, collected)
    if chunked is not None:
        views += records.prefill_views((chunked,), collected)
    views += records.prefill_views(waiting, collected)
    return views, collected, collected.table(views, records.store)


def assert_same_columns(got, expected):
    for name in ("arrival", "ttft", "tpot", "next_index", "pending", "context", "prompt", "seq",
                 "first"):
        assert np.array_equal(getattr(got, name), getattr(expected, name), equal_nan=True), name
        assert getattr(got, name).dtype == getattr(expected, name).dtype, name


@pytest.mark.usefixtures("decision_path")
def test_the_collected_table_is_the_views_over_many_steps():
    from sglang_ext.adapter.scheduler.requests import RequestRecords
    from sglang_ext.policy.request_table import RequestColumns

    rng = random.Random(5)
    records = RequestRecords(catalog())
    decoding = [sglang_req(f"d{i}", rng, decoding=True) for i in range(50)]
    waiting = [sglang_req(f"w{i}", rng, decoding=False) for i in range(12)]
    for step in range(30):
        in_flight = set(decoding[step % 3::3])
        chunked = waiting[0] if step % 2 else None
        views, collected, table = collect(records, decoding, in_flight, chunked,
                                          waiting[1:] if chunked else waiting)
        assert list(table) == views
        assert_same_columns(table.columns, RequestColumns.of(views))
        assert collected.store_rows is not None
        for req, view in zip(decoding, views, strict=False):
            stamp = req.time_stats.prefill_finished_time
            assert view.first_token_time == (stamp or (9.5 if req in in_flight else None))
        for req in decoding:
            req.output_ids.append(7)
            if not req.time_stats.prefill_finished_time and rng.random() < 0.3:
                req.time_stats.prefill_finished_time = 110.0 + step  # its first token lands
        if step % 5 == 4:  # one finishes, one arrives, a prompt starts decoding
            decoding.pop(rng.randrange(len(decoding)))
            decoding.append(waiting.pop(rng.randrange(len(waiting))))
            waiting.append(sglang_req(f"n{step}", rng, decoding=False))


def test_rows_of_finished_requests_are_reused_and_a_returning_view_gets_a_new_row():
    from sglang_ext.adapter.scheduler.request_store import SWEEP_EVERY
    from sglang_ext.adapter.scheduler.requests import RECORD_ATTR, RequestRecords
    from sglang_ext.policy.request_table import RequestColumns

    rng = random.Random(8)
    records = RequestRecords(catalog())
    gone = [sglang_req(f"g{i}", rng, decoding=True) for i in range(300)]
    kept = [sglang_req(f"k{i}", rng, decoding=True) for i in range(20)]
    collect(records, gone + kept, set(), None, [])
    assert records.store.rows_in_use == 320
    for _ in range(2 * SWEEP_EVERY):  # unseen since the last sweep by the next one
        collect(records, kept, set(), None, [])
    assert records.store.rows_in_use == 20
    assert getattr(gone[0], RECORD_ATTR).row == -1
    for _ in range(3):  # far more live requests than ever: the store grows
        views, _, table = collect(records, gone + kept + [
            sglang_req(f"x{i}", rng, decoding=True) for i in range(700)], set(), None, [])
        assert_same_columns(table.columns, RequestColumns.of(views))


def test_a_view_whose_arrival_moves_moves_in_the_table():
    from sglang_ext.adapter.scheduler.requests import RequestRecords

    rng = random.Random(2)
    records = RequestRecords(catalog())
    records.hold_arrivals()
    waiting = [sglang_req(f"w{i}", rng, decoding=False) for i in range(4)]
    collect(records, [], set(), None, waiting)
    records.ready(500.0)
    views, _, table = collect(records, [], set(), None, waiting)
    assert table.columns.arrival.tolist() == [view.arrival for view in views]
    assert 500.0 in table.columns.arrival.tolist()


@pytest.mark.usefixtures("decision_path")
@pytest.mark.parametrize("with_chunked", [False, True])
def test_the_kv_outlook_of_the_table_is_the_one_request_by_request(with_chunked):
    from sglang_ext.adapter.scheduler.kv_outlook import kv_outlook, kv_outlook_of_table
    from sglang_ext.adapter.scheduler.requests import RequestRecords

    rng = random.Random(11)
    records = RequestRecords(catalog())
    for trial in range(60):
        decoding = [sglang_req(f"d{trial}-{i}", rng, decoding=True)
                    for i in range(rng.choice([0, 1, 7, 90]))]
        waiting = [sglang_req(f"w{trial}-{i}", rng, decoding=False)
                   for i in range(rng.choice([0, 1, 9]))]
        chunked = sglang_req(f"c{trial}", rng, decoding=False) if with_chunked else None
        views, collected, table = collect(records, decoding, set(decoding[::2]), chunked, waiting)
        split = len(decoding)
        queued = views[split + with_chunked:]
        ratio = rng.choice([0.4, 0.7, 1.0])
        free = rng.randint(0, 400_000)
        expected = kv_outlook(free, ratio, list(zip(decoding, views[:split])),
                              list(zip(waiting, queued)),
                              (chunked, views[split]) if with_chunked else None)
        got = kv_outlook_of_table(free, ratio, table, records.store, collected.store_rows,
                                  collected.outputs, split, chunked)
        assert got == expected
        assert all(type(t) is float for t in got.release_times + got.released_through)
        assert math.isfinite(got.free_tokens)


@pytest.mark.usefixtures("compiled_path")
def test_the_compiled_columns_refuse_a_row_outside_the_store_and_a_wrong_buffer():
    from sglang_ext.adapter.scheduler.request_store import RequestStore
    from sglang_ext.policy import compiled

    store = RequestStore(rows=4)
    lists = ([5], [3], [math.nan], [], [], [], [], [])
    with pytest.raises(IndexError, match="store row"):
        compiled.decision_columns(*lists, store.arrival, store.ttft, store.tpot, store.prompt,
                                  store.seq, np.empty((6, 1), dtype=np.int64), np.empty((4, 1)))
    with pytest.raises(TypeError, match="ints_out"):
        compiled.decision_columns(*lists, store.arrival, store.ttft, store.tpot, store.prompt,
                                  store.seq, np.empty((6, 2), dtype=np.int64), np.empty((4, 1)))
