"""A decision over a ``RequestTable`` (the requests with their columns) is bit for bit the
decision over the same requests as a plain list: on random states of every kind the
triage distinguishes, for every FairBatching policy under every admission mode, and at
every step of simulated runs. Each test runs on the compiled decision path and on the
pure-Python reference."""

from __future__ import annotations

import random

import numpy as np
import pytest

import sglang_ext.sim.runner  # noqa: F401  (registers every policy)
from sglang_ext.policy.admission import (
    KvOutlook,
    _decode_cost_terms,
    _queue_of_rows,
    _rate_and_queue,
    _table_rate,
)
from sglang_ext.policy.batch_former import ServiceFloor, triage
from sglang_ext.policy.policies import POLICIES
from sglang_ext.policy.request_table import RequestColumns, RequestTable
from sglang_ext.policy.row_groups import RowGroups, triage_rows
from sglang_ext.policy.slo import Slo, SloCatalog
from sglang_ext.policy.view import RequestView
from sglang_ext.sim.policy_spec import parse_policy
from sglang_ext.sim.profile import bundled_profile_path, load_profile
from sglang_ext.sim.runner import Scenario, build_policy, replay
from sglang_ext.sim.workloads import TraceRequest, Workload

pytestmark = pytest.mark.usefixtures("decision_path")

THREE_CLASSES = SloCatalog("standard", {
    "interactive": Slo.from_ms(500, 50), "standard": Slo.from_ms(2000, 50),
    "relaxed": Slo.from_ms(5000, 200),
})

SLOS = (Slo.from_ms(500, 50), Slo.from_ms(2000, 50), Slo.from_ms(5000, 200), Slo.from_ms(2000, 1))
FAMILY = sorted(name for name in POLICIES.names() if POLICIES.get(name).takes_admission)
ADMISSIONS = ("", "+defer", "+defer:fair", "+defer:latest", "+reject")
#: each policy with each admission it accepts (a name that implies one takes only that)
LABELS = [name + ("@1024" if POLICIES.get(name).takes_token_budget else "") + admission
          for name in FAMILY for admission in ADMISSIONS
          if not (admission and getattr(POLICIES.get(name), "implied_admission", None))]


def random_state(rng: random.Random, decodes: int, waiting: int, now: float = 100.0,
                 slos: tuple[Slo, ...] = SLOS) -> list[RequestView]:
    """Decodes ahead of and behind their deadlines (with and without a first token on
    record), queued prompts fresh, late and half prefilled, over SLO classes including
    one no rank serves; in arrival order, with a few out of order."""
    rows = []
    for _ in range(decodes):
        slo = rng.choice(slos)
        index = rng.randint(1, 400)
        arrival = now - slo.ttft_s - slo.tpot_s * index + rng.uniform(-1.0, 2.0)
        first = None if rng.random() < 0.1 else arrival + rng.uniform(0.05, slo.ttft_s)
        prompt = rng.randint(10, 6000)
        rows.append(dict(arrival=arrival, slo=slo, next_output_index=index, pending_prefill=0,
                         context=prompt + index - 1, prompt_tokens=prompt,
                         first_token_time=first))
    for _ in range(waiting):
        slo = rng.choice(slos)
        prompt = rng.randint(1, 8000)
        done = rng.choice((0, 0, 0, prompt // 2))
        rows.append(dict(arrival=now - rng.uniform(0.0, slo.ttft_s * 1.5), slo=slo,
                         next_output_index=0, pending_prefill=prompt - done, context=done,
                         prompt_tokens=prompt, first_token_time=None))
    rows.sort(key=lambda row: row["arrival"])
    for _ in range(len(rows) // 20):
        i, j = rng.randrange(len(rows)), rng.randrange(len(rows))
        rows[i], rows[j] = rows[j], rows[i]
    return [RequestView(req_id=f"r{seq}", arrival_seq=seq, **row) for seq, row in enumerate(rows)]


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    profile = load_profile(bundled_profile_path("llama3.1-8b-h100"))
    workload = Workload((TraceRequest(0.0, 100, 10),), "unused")
    return Scenario(workload=workload, profile=profile,
                    catalog=SloCatalog.single(Slo.from_ms(2000, 50), "standard"))


def kv_outlook(state: list[RequestView], free: float) -> KvOutlook:
    releases = [(r.arrival + 30.0, float(r.context + 200)) for r in state if not r.pending_prefill]
    reserves = {r.req_id: 100.0 for r in state if r.pending_prefill}
    return KvOutlook.of(free, releases, reserves, 150.0)


@pytest.mark.parametrize("label", LABELS)
def test_the_table_decides_as_the_list_on_random_states(scenario, label):
    policy = build_policy(scenario, parse_policy(label))
    rng = random.Random(f"{label}")
    for case in range(12):
        state = random_state(rng, rng.choice((0, 3, 64, 300)), rng.choice((0, 1, 5, 40)))
        if not state:
            continue
        now = 100.0 if case % 2 else np.float64(100.0)  # the simulator's clock may be numpy's
        policy.observe_kv(kv_outlook(state, rng.choice((1e3, 1e5, 1e7))) if case % 3 else None)
        table = RequestTable.of(state)
        assert policy.form_batch(table, now) == policy.form_batch(state, now), (label, case)
        classes = {"standard": SLOS[1], "interactive": SLOS[0]}
        assert (policy.form_batch_with_budgets(table, now, classes)
                == policy.form_batch_with_budgets(state, now, classes)), (label, case)


@pytest.mark.parametrize("anchored", [False, True])
@pytest.mark.parametrize("guard", [0.0, 0.004])
def test_row_groups_are_the_triage_groups(anchored, guard):
    rng = random.Random(7)
    floor = ServiceFloor(0.01, 0.05, 0.02)
    for _ in range(20):
        state = random_state(rng, 200, 30)
        hopeless = frozenset(r.req_id for r in state if r.pending_prefill and rng.random() < 0.3)
        for floor_used in (None, floor):
            listed = triage(state, 100.0, anchored=anchored, floor=floor_used, hopeless=hopeless,
                            deadline_guard_s=guard)
            rows = triage_rows(RequestTable.of(state), 100.0, anchored, floor_used, hopeless,
                               guard)
            assert isinstance(rows, RowGroups)
            assert rows.as_triage() == listed


def test_columns_read_every_field_and_take_rows():
    state = random_state(random.Random(3), 5, 3)
    columns = RequestColumns.of(state)
    assert columns.arrival.tolist() == [r.arrival for r in state]
    assert columns.tpot.tolist() == [r.slo.tpot_s for r in state]
    assert columns.context.dtype == np.int64
    assert [None if np.isnan(f) else f for f in columns.first.tolist()] == [
        r.first_token_time for r in state]
    taken = columns.take(np.array([2, 0]))
    assert taken.seq.tolist() == [state[2].arrival_seq, state[0].arrival_seq]
    table = RequestTable.of(state)
    assert table.rows(np.array([1, 4])) == [state[1], state[4]]
    assert table.ids_at(np.array([0, 7])) == [state[0].req_id, state[7].req_id]


def test_a_table_refuses_columns_of_other_requests():
    state = random_state(random.Random(4), 4, 0)
    with pytest.raises(ValueError, match="3 rows of columns for 4 requests"):
        RequestTable(state, RequestColumns.of(state[:3]))


class TableChecker:
    """A policy that decides every step over a table and over the list, and checks that
    both are the same decision."""

    def __init__(self, policy) -> None:
        self._policy = policy
        self.decisions = 0

    def __getattr__(self, name):
        return getattr(self._policy, name)

    def form_batch(self, requests, now):
        listed = self._policy.form_batch(list(requests), now)
        tabled = self._policy.form_batch(RequestTable.of(requests), now)
        assert tabled == listed, (now, tabled, listed)
        self.decisions += 1
        return listed


@pytest.mark.slow
@pytest.mark.parametrize("label", ["fb-smooth+defer", "fb-steady+defer:fair", "fb", "fb-anchor-margin"])
def test_the_table_decides_as_the_list_at_every_simulated_step(label):
    profile = load_profile(bundled_profile_path("llama3.1-8b-h100"))
    rng = random.Random(11)
    classes = sorted(THREE_CLASSES.classes)
    requests = tuple(TraceRequest(0.0, rng.randint(50, 6000), rng.randint(5, 400),
                                  rng.choice(classes)) for _ in range(600))
    scenario = Scenario(workload=Workload(requests, "random"), profile=profile,
                        catalog=THREE_CLASSES, arrivals="poisson", drain_s=30.0)
    checker = TableChecker(build_policy(scenario, parse_policy(label)))
    engine, _ = replay(scenario, checker, 40.0)
    assert checker.decisions > 500
    assert len(engine.records) == len(requests)


@pytest.mark.parametrize("form", ["knee", "linear"])
def test_the_forecast_rate_and_queue_are_the_lists(scenario, form):
    """The decode share summed left to right, each queue entry's deadline, work and KV
    need: exactly the per-request loop's."""
    policy = build_policy(scenario, parse_policy("fb-smooth+defer" if form == "knee" else "fb+defer"))
    usable = policy.step_model.coefficients.usable()
    rng = random.Random(form)
    rates = []
    for decodes in (3, 10, 20, 40, 300):
        state = random_state(rng, decodes, 8, slos=SLOS[:3])
        table = RequestTable.of(state)
        terms = _decode_cost_terms(usable, len(table))
        for kv in (None, kv_outlook(state, 1e5)):
            rate, listed = _rate_and_queue(state, usable, 0.05, 0.1, kv)
            assert _table_rate(table, usable, 0.05, 0.1, terms).hex() == rate.hex()
            fields = _queue_of_rows(table, table.queued_rows, usable, kv)
            assert list(zip(*[field.tolist() for field in fields])) == listed
            rates.append(rate)
    assert sum(rate > 0 for rate in rates) >= 4  # the decode share is summed, not dropped


@pytest.mark.parametrize("form", ["knee", "linear"])
def test_the_smooth_steps_prefill_check_is_bit_for_bit_at_its_boundary(scenario, form):
    """Each prefill's slack set to the very float at which the reference finds it on time,
    then one ulp lower: both paths must tell the two apart the same way."""
    from sglang_ext.policy.knee_step_model import KneeStepModel
    from sglang_ext.policy.row_groups import _prefills_late, prefill_costs_s
    from sglang_ext.policy.step_model import StepCoefficients

    model = (KneeStepModel(0.005, 5e-5, 1e-8, 3.3e-9, 1e-12, 256.0, 64.0) if form == "knee"
             else StepCoefficients(0.004, 6e-5, 3.1e-8))
    rng = random.Random(form)
    for _ in range(40):
        table = RequestTable.of(random_state(rng, rng.choice((0, 30, 200)), rng.choice((1, 9, 40))))
        rows = table.queued_rows
        base, pace, budget = rng.choice((0, 40, 300)), rng.uniform(1.0, 3.0), rng.uniform(0.02, 0.1)
        ends = (np.add.accumulate(prefill_costs_s(
            model, table.columns.pending[rows], table.columns.context[rows], base))
            * pace + budget)
        slack = np.full(len(table), np.inf)
        last = rng.randrange(len(rows))
        slack[rows[:last + 1]] = ends[:last + 1]
        assert not _prefills_late(model, table.columns, slack, rows, base, pace, budget)
        slack[rows[last]] = np.nextafter(ends[last], -np.inf)
        assert _prefills_late(model, table.columns, slack, rows, base, pace, budget)
