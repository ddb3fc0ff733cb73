"""The per-step state the scheduler hooks keep: request views refreshed in one loop, and
the PAB computed when read from the last decision's inputs (the same value as computing
it at the decision)."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parents[2]
#: the sampling parameters of a request FairBatching may park (no penalties)
PLAIN_SAMPLING = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                  "min_new_tokens": 0}
VIEW_FIELDS = ("req_id", "arrival", "slo", "arrival_seq", "prompt_tokens", "next_output_index",
               "pending_prefill", "context", "first_token_time")


@pytest.fixture
def state():
    from sglang_ext.adapter.extension_config import ExtensionConfig
    from sglang_ext.adapter.scheduler.state import FairBatchingState

    return FairBatchingState(ExtensionConfig.load(REPO / "configs" / "fairbatching.toml"))


class FakeReq:
    """What the views read of an SGLang ``Req`` (hashable by identity, as a ``Req`` is)."""

    return_logprob = False
    grammar = None

    def __init__(self, **attributes) -> None:
        self.__dict__.update(attributes)


def fake_req(rid: str, rng: random.Random, *, decoding: bool) -> FakeReq:
    arrival = 100.0 + rng.random()
    prompt = rng.randint(1, 3000)
    produced = rng.randint(1, 300) if decoding else rng.choice([0, 0, 2])
    first = (arrival + 0.2) if decoding and rng.random() < 0.8 else None
    slo_class = rng.choice(["interactive", "standard", "relaxed"])
    return FakeReq(
        rid=rid, origin_input_ids=[1] * prompt, output_ids=[7] * produced,
        prefix_len=rng.randint(0, prompt), finished_reason=None, to_finish=None,
        sampling_params=SimpleNamespace(max_new_tokens=400, ignore_eos=False, **PLAIN_SAMPLING,
                                        custom_params={"slo": {"class": slo_class}}),
        time_stats=SimpleNamespace(prefill_finished_time=first or 0.0, scheduler_recv_time=arrival,
                                   wait_queue_entry_time=arrival),
    )


def fields(view) -> tuple:
    return tuple(getattr(view, name) for name in VIEW_FIELDS)


def test_views_refreshed_in_one_loop_equal_one_by_one():
    from sglang_ext.adapter.extension_config import ExtensionConfig
    from sglang_ext.adapter.scheduler.requests import RequestRecords

    catalog = ExtensionConfig.load(REPO / "configs" / "fairbatching.toml").catalog
    rng = random.Random(3)
    decoding = [fake_req(f"d{i}", rng, decoding=True) for i in range(40)]
    waiting = [fake_req(f"w{i}", rng, decoding=False) for i in range(10)]
    in_flight = set(decoding[::3])
    one, batch = RequestRecords(catalog), RequestRecords(catalog)
    twins = {id(req): FakeReq(**{**vars(req), "output_ids": list(req.output_ids)})
             for req in decoding + waiting}
    for _ in range(2):  # first sight (attach), then a refresh
        expected = [fields(one.decode_view(twins[id(r)], r in in_flight, 9.5)) for r in decoding]
        expected += [fields(one.prefill_view(twins[id(r)])) for r in waiting]
        got = [fields(v) for v in batch.decode_views(decoding, in_flight, 9.5)]
        got += [fields(v) for v in batch.prefill_views(waiting)]
        assert got == expected
        for req in decoding:
            req.output_ids.append(7)
            twins[id(req)].output_ids.append(7)


@pytest.mark.parametrize("publishes", [False, True])
def test_a_decision_publishing_budgets_is_the_two_calls(state, publishes):
    from sglang_ext.adapter.scheduler.requests import RequestRecords
    from sglang_ext.adapter.scheduler.state import whole_budget_tokens

    rng = random.Random(6)
    records = RequestRecords(state.config.catalog)
    views = records.decode_views([fake_req(f"d{i}", rng, decoding=True) for i in range(60)], set(), 0.0)
    views += records.prefill_views([fake_req(f"w{i}", rng, decoding=False) for i in range(12)])
    now = 100.9
    state.publishes_budgets = publishes  # as behind a control plane or the DP pab method
    classes = state.config.catalog.classes
    expected = {name: whole_budget_tokens(tokens)
                for name, tokens in state.policy.class_budgets(views, now, classes).items()}
    assert state.decide(views, now) == state.policy.form_batch(views, now)
    assert state.class_budgets == (expected if publishes else {})
    assert state.decision_inputs == (views, now)


def test_pab_read_later_is_the_decisions_pab(state):
    from sglang_ext.adapter.scheduler.requests import RequestRecords
    from sglang_ext.policy.step_shape import StepShape

    assert state.pab_tokens == 0  # before any decision
    rng = random.Random(5)
    records = RequestRecords(state.config.catalog)
    views = records.decode_views([fake_req(f"d{i}", rng, decoding=True) for i in range(30)], set(), 0.0)
    views += records.prefill_views([fake_req(f"w{i}", rng, decoding=False) for i in range(5)])
    now = 101.0
    budget = state.policy.prefill_admission_budget(views, now)
    expected = int(budget) if math.isfinite(budget) else 0
    state.update_budgets(views, now)
    # the step model moves on after the step; the PAB read then is still the decision's
    state.policy.observe_step(StepShape(2048, 2048 * 1024.5, 0, 30, 30 * 900, 1), 0.09)
    assert state.policy.step_model.coefficients is not state._budget_inputs[2]
    assert state.pab_tokens == expected
    assert state.snapshot()["pab_tokens"] == expected
    state.pab_tokens = 17  # set directly (as tests of the readers do)
    assert state.pab_tokens == 17


def reference_kv_outlook(free_and_evictable, new_token_ratio, decoding, queued):
    """``kv_outlook`` written plainly: output_reserve and last_token_due called per
    request, releases sorted as tuples."""
    import statistics

    from sglang_ext.adapter.scheduler.kv_outlook import output_reserve
    from sglang_ext.policy.admission import KvOutlook, last_token_due

    free = float(free_and_evictable)
    releases, initial = [], []
    for req, view in decoding:
        reserve = output_reserve(req, new_token_ratio)
        free -= reserve
        initial.append(output_reserve(req, 1.0, from_start=True))
        releases.append((last_token_due(view, req.sampling_params.max_new_tokens or 0),
                         view.context + reserve))
    reserves = {}
    for req, view in queued:
        reserves[view.req_id] = output_reserve(req, 1.0)
        initial.append(output_reserve(req, 1.0, from_start=True))
    times, through, total = [], [], 0.0
    for time_s, tokens in sorted(releases):
        total += tokens
        times.append(time_s)
        through.append(total)
    return KvOutlook(free, tuple(times), tuple(through), reserves,
                     float(statistics.median(initial) if initial else 0.0))


def test_kv_outlook_matches_its_plain_reference():
    from sglang_ext.adapter.scheduler.kv_outlook import kv_outlook
    from sglang_ext.policy.slo import Slo
    from sglang_ext.policy.view import RequestView

    rng = random.Random(7)
    for trial in range(300):
        pairs = []
        for i in range(rng.choice([0, 1, 5, 80])):
            max_new = rng.choice([None, 0, 1, 2, 50, 400, 5000, 70000])
            req = SimpleNamespace(
                output_ids=[0] * rng.randint(0, 600),
                sampling_params=SimpleNamespace(max_new_tokens=max_new, ignore_eos=rng.random() < 0.3))
            arrival = rng.choice([10.0, 10.5, rng.uniform(0, 20)])  # repeated times: tied releases
            first = rng.choice([None, arrival + 0.25, arrival + rng.random()])
            view = RequestView(f"r{i}", arrival, rng.choice([Slo(2.0, 0.05), Slo(0.5, 0.02)]),
                               rng.randint(0, 300), 0, rng.choice([100, 2000, rng.randint(1, 9000)]),
                               100, i, first)
            pairs.append((req, view))
        split = rng.randint(0, len(pairs))
        decoding, queued = pairs[:split], pairs[split:]
        ratio = rng.choice([0.4, 0.7, 1.0])
        free = rng.randint(0, 400_000)
        assert kv_outlook(free, ratio, decoding, queued) == reference_kv_outlook(
            free, ratio, decoding, queued)


def test_the_step_models_learning_is_timed_after_each_step(state):
    from sglang_ext.adapter.scheduler.state import StepLaunch
    from sglang_ext.policy.step_shape import StepShape

    assert state.snapshot()["learning_us"] == {}
    shape = StepShape(2048, 2048 * 1024.5, 0, 30, 30 * 900, 1)
    for step in range(3):
        state.launched(10.0 + step, 0.05)
        assert state.observe_completion(StepLaunch(10.0 + step, shape, 0.05), 10.06 + step) > 0
    assert len(state.learning_s) == state.counters.steps == 3
    assert all(seconds > 0 for seconds in state.learning_s)
    assert set(state.snapshot()["learning_us"]) == {"p50", "p99"}
