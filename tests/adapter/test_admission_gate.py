"""The admission gate (mode reject): its decision on published budgets (pure), and its
HTTP side on SGLang's own LoadSnapshot and response classes."""

from __future__ import annotations

import asyncio
import importlib.util
import time

import pytest

from sglang_ext.adapter.admission.budget_gate import STALE, UNPUBLISHED, BudgetGate, PublishedBudgets
from sglang_ext.policy.admission import AdmissionSettings
from sglang_ext.policy.slo import Slo, SloCatalog

CATALOG = SloCatalog("standard", {"standard": Slo(2.0, 0.05), "interactive": Slo(0.5, 0.05)})
SETTINGS = AdmissionSettings.parse("reject", max_budget_age_s=0.5, retry_after_s=1.5)
BUDGETS = {"standard": 10_000, "interactive": 2_000}


def gate() -> BudgetGate:
    return BudgetGate(CATALOG, SETTINGS, max_rate_tokens_per_s=40_000)


def test_class_budget_less_the_admissions_the_snapshot_does_not_count() -> None:
    g = gate()
    published = [PublishedBudgets(0, 100.0, BUDGETS)]
    interactive = CATALOG.classes["interactive"]
    first = g.check(published, 100.1, interactive, 1_500)
    assert first.admitted and first.seq == 1 and g.stamp(first.seq) == [g.token, 1]
    refused = g.check(published, 100.2, interactive, 1_000)
    assert not refused.admitted and refused.budget == 500 and refused.slo_class == "interactive"
    assert refused.seq is None
    assert g.check(published, 100.2, CATALOG.default, 8_000).seq == 2  # 10000 - 1500
    # A newer snapshot that does not count them yet (the requests were still on their way
    # to the scheduler when it published) keeps both debits ...
    newer = [PublishedBudgets(0, 100.3, BUDGETS)]
    assert g.debit_of(newer[0]) == 9_500
    assert not g.check(newer, 100.35, interactive, 1_000).admitted
    # ... one that counts the first ends its debit only ...
    assert g.debit_of(PublishedBudgets(0, 100.4, BUDGETS, echoed=1)) == 8_000
    # ... and one that counts both, both.
    counted = [PublishedBudgets(0, 100.5, BUDGETS, echoed=2)]
    assert g.check(counted, 100.55, interactive, 2_000).admitted


def test_a_debit_no_snapshot_of_its_rank_counts_ends_after_max_budget_age() -> None:
    g = gate()
    slo = CATALOG.default
    assert g.check([PublishedBudgets(0, 100.0, BUDGETS)], 100.0, slo, 6_000).admitted
    # the request went to another rank: this one keeps publishing without it
    assert g.debit_of(PublishedBudgets(0, 100.5, BUDGETS)) == 6_000
    assert g.debit_of(PublishedBudgets(0, 100.6, BUDGETS)) == 0
    # an idle rank publishes nothing new: its debit stays, however old
    idle = PublishedBudgets(1, 100.0, BUDGETS, idle=True)
    assert g.check([idle], 500.0, slo, 6_000).admitted
    assert not g.check([idle], 900.0, slo, 6_000).admitted


def test_custom_ttft_uses_the_classes_around_it() -> None:
    g = gate()
    published = [PublishedBudgets(0, 100.0, BUDGETS)]
    assert g.check(published, 100.0, Slo(1.0, 0.05), 2_000).slo_class == "custom"
    assert not g.check(published, 100.0, Slo(1.0, 0.05), 2_001).admitted  # interactive's budget
    # below every class: the smallest class's budget less the fastest prefill over the gap
    assert g.budget(BUDGETS, Slo(0.45, 0.05)) == pytest.approx(2_000 - 40_000 * 0.05)


E2E_CATALOG = SloCatalog.from_mapping({"default_class": "standard", "classes": {
    "standard": {"ttft_ms": 2_000, "tpot_ms": 50}, "interactive": {"ttft_ms": 500, "tpot_ms": 50},
    "code": {"e2e_ms": 20_000}}})
E2E_BUDGETS = {**BUDGETS, "code": 30_000}


def test_an_e2e_slo_is_admitted_on_its_first_token_budget() -> None:
    g = BudgetGate(E2E_CATALOG, SETTINGS, max_rate_tokens_per_s=40_000)
    published = [PublishedBudgets(0, 100.0, E2E_BUDGETS)]
    code = E2E_CATALOG.resolve({"class": "code"})
    assert g.check(published, 100.0, code, 30_000).slo_class == "code"
    assert E2E_CATALOG.resolve({"e2e_ms": 20_000}) == code  # the class's targets: the class
    # explicit targets: between the classes around its first-token budget (a quarter of e2e_ms)
    explicit = E2E_CATALOG.resolve({"e2e_ms": 4_000})
    assert explicit.ttft_s == 1.0 and g.class_of(explicit) == "custom"
    assert g.budget(E2E_BUDGETS, explicit) == g.budget(E2E_BUDGETS, Slo(1.0, 0.05)) == 2_000
    assert g.budget(E2E_BUDGETS, E2E_CATALOG.resolve({"e2e_ms": 24_000})) == 30_000


def test_stale_or_unpublished_budgets_admit_unchecked_but_an_idle_rank_stays_valid() -> None:
    g = gate()
    slo = CATALOG.classes["interactive"]
    stale = g.check([PublishedBudgets(0, 100.0, BUDGETS)], 101.0, slo, 5_000)
    assert stale.admitted and stale.unchecked == STALE
    idle = g.check([PublishedBudgets(0, 100.0, BUDGETS, idle=True)], 1_000.0, slo, 5_000)
    assert not idle.admitted and idle.unchecked is None
    none = g.check([PublishedBudgets(0, 100.0, None)], 100.0, slo, 5_000)
    assert none.admitted and none.unchecked == UNPUBLISHED
    assert g.check([], 100.0, slo, 5_000).unchecked == UNPUBLISHED


def test_dp_ranks_pinned_or_the_one_with_most_budget() -> None:
    g = gate()
    published = [PublishedBudgets(0, 100.0, {"standard": 1_000, "interactive": 100}),
                 PublishedBudgets(1, 100.0, {"standard": 9_000, "interactive": 900})]
    slo = CATALOG.default
    assert g.check(published, 100.0, slo, 5_000).rank == 1
    assert not g.check(published, 100.0, slo, 5_000, pinned_rank=0).admitted
    assert g.debit_of(published[1]) == 5_000 and g.debit_of(published[0]) == 0


sglang_only = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                 reason="sglang is not installed")


class _Reader:
    def __init__(self, snapshots: list) -> None:
        self.snapshots = snapshots

    def read_all(self) -> list:
        return self.snapshots


def _tokenized(n: int, custom_params: dict | None = None):
    from types import SimpleNamespace

    from sglang.srt.sampling.sampling_params import SamplingParams

    return SimpleNamespace(input_ids=list(range(n)), routed_dp_rank=None,
                           sampling_params=SamplingParams(custom_params=custom_params))


@sglang_only
@pytest.mark.sglang
def test_http_gate_reads_sglang_snapshots_and_refuses_with_a_429() -> None:
    import orjson
    from sglang.srt.managers.load_snapshot import LoadSnapshot

    from sglang_ext.adapter.admission.budget_refusal import AdmissionRefused, HttpGate, refusal_response

    snapshot = LoadSnapshot(dp_rank=0, timestamp=time.time(), num_running_reqs=3,
                            fairbatching_admission=BUDGETS)
    http_gate = HttpGate(gate(), _Reader([snapshot]))
    assert http_gate.check(_tokenized(1_000, {"slo": {"class": "interactive"}})).admitted
    with pytest.raises(AdmissionRefused) as excinfo:
        http_gate.check(_tokenized(1_001, {"slo": {"class": "interactive"}}))
    refusal = excinfo.value
    assert refusal.status_code == 429 and refusal.headers == {"Retry-After": "2"}
    assert http_gate.refused == {"interactive": 1}
    response = refusal_response(refusal)
    body = orjson.loads(response.body)
    assert response.status_code == 429 and response.headers["retry-after"] == "2"
    assert body["code"] == body["error"]["code"] == 429 and body["error"]["type"] == "rate_limit_error"
    assert "1001 tokens exceed the 1000" in body["message"] and body["error"]["reason"] == "admission_budget"
    assert http_gate.check(_tokenized(5)) is not None  # no SLO: the default class
    assert http_gate.check(_tokenized(5, {"slo": {"class": "gold"}})) is None  # the 400 is not ours


@sglang_only
@pytest.mark.sglang
def test_http_gate_refuses_an_e2e_request_naming_its_first_token_budget() -> None:
    from sglang.srt.managers.load_snapshot import LoadSnapshot

    from sglang_ext.adapter.admission.budget_refusal import AdmissionRefused, HttpGate

    snapshot = LoadSnapshot(dp_rank=0, timestamp=time.time(), num_running_reqs=3,
                            fairbatching_admission=E2E_BUDGETS)
    http_gate = HttpGate(BudgetGate(E2E_CATALOG, SETTINGS, 40_000), _Reader([snapshot]))
    long = _tokenized(30_000, {"slo": {"class": "code"}})
    long.sampling_params.max_new_tokens = 4096  # the scheduler paces for it; the class stays
    assert http_gate.check(long).slo_class == "code"
    with pytest.raises(AdmissionRefused, match=r"the 0 that DP rank 0 can still prefill within "
                       r"the first-token budget \(5000 ms of the 20000 ms end-to-end target\) "
                       r"of SLO class 'code'"):
        http_gate.check(_tokenized(1, {"slo": {"class": "code"}}))
    with pytest.raises(AdmissionRefused, match=r"within the TTFT \(500 ms\) of SLO class 'interactive'"):
        http_gate.check(_tokenized(2_001, {"slo": {"class": "interactive"}}))
    with pytest.raises(AdmissionRefused, match=r"first-token budget \(1000 ms of the 4000 ms .* 'custom'"):
        http_gate.check(_tokenized(2_001, {"slo": {"e2e_ms": 4_000}}))


@sglang_only
@pytest.mark.sglang
def test_http_gate_stamps_its_admissions_and_reads_the_echo() -> None:
    from sglang.srt.managers.load_snapshot import LoadSnapshot

    from sglang_ext.adapter.admission.budget_gate import ADMISSION_STAMP_KEY
    from sglang_ext.adapter.admission.budget_refusal import HttpGate

    g = gate()
    snapshot = LoadSnapshot(dp_rank=0, timestamp=time.time(), num_running_reqs=3,
                            fairbatching_admission=BUDGETS)
    http_gate = HttpGate(g, _Reader([snapshot]))
    admitted = _tokenized(6_000, {"slo": {"class": "standard"}})
    assert http_gate.check(admitted).seq == 1
    assert admitted.sampling_params.custom_params == {
        "slo": {"class": "standard"}, ADMISSION_STAMP_KEY: [g.token, 1]}
    snapshot.fairbatching_admission_echo = {g.token: 1, "another-gate": 99}
    assert http_gate.published()[0].echoed == 1
    # a stamp a client sent is never passed on: an unchecked admission carries none
    forged = _tokenized(10, {ADMISSION_STAMP_KEY: [g.token, 10**9]})
    stale = HttpGate(gate(), _Reader([LoadSnapshot(dp_rank=0, timestamp=time.time() - 60,
                                                   num_running_reqs=3,
                                                   fairbatching_admission=BUDGETS)]))
    assert stale.check(forged).unchecked == "stale"
    assert forged.sampling_params.custom_params is None


@sglang_only
@pytest.mark.sglang
def test_streamed_generate_answers_the_refusal_before_any_byte_is_sent() -> None:
    from types import SimpleNamespace

    from fastapi.responses import StreamingResponse

    from sglang_ext.adapter.admission import budget_refusal
    from sglang_ext.adapter.admission.budget_refusal import AdmissionRefused, around_generate

    async def refused_body():
        raise AdmissionRefused("no room", 1.0, "standard", 0)
        yield b""  # pragma: no cover

    async def served_body():
        pending = budget_refusal._PENDING.get()
        pending.decided.set_result(True)  # what the gate does once the request is dispatched
        await asyncio.sleep(0)
        yield b"data: 1\n\n"
        yield b"data: [DONE]\n\n"

    async def route(body):
        async def original(obj, request):
            return StreamingResponse(body(), media_type="text/event-stream")

        return await around_generate(original, SimpleNamespace(stream=True), None)

    async def main():
        refused = await route(refused_body)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        served = await route(served_body)
        assert isinstance(served, StreamingResponse)
        return [chunk async for chunk in served.body_iterator]

    assert asyncio.run(main()) == [b"data: 1\n\n", b"data: [DONE]\n\n"]
