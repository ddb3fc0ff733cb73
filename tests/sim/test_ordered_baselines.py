"""The length- and class-aware Sarathi baselines: ``sarathi-sjf`` and ``sarathi-priority``,
each also with vLLM's queued-token cap and SGLang's waiting timeout (and SGLang's own
orders, ``sarathi-hrrn`` and ``sarathi-spf``, in the names and tuning tests).

Their orders on hand-built request states, the cap and timeout against their FCFS
counterparts', the names, the tuning, and a tiny run through the CLI.
"""

from __future__ import annotations

import json

import pytest
from sim_helpers import SLO, context_for, drive_search, llama, make_policy

from sglang_ext.policy.policies import POLICIES
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.view import RequestView
from sglang_ext.sim.commands import main
from sglang_ext.sim.competitors.baselines import (
    Sarathi,
    SarathiPriority,
    SarathiQueueCap,
    SarathiQueueTimeout,
    SarathiSjf,
    ShortestFirst,
    TightestClassFirst,
)
from sglang_ext.sim.engine import SimEngine
from sglang_ext.sim.fitting.tuning import tune
from sglang_ext.sim.runner import parse_policy

NOW = 10.0
#: each new family and its FCFS counterpart
COUNTERPARTS = {
    "sarathi-sjf": "sarathi",
    "sarathi-sjf-queue-cap": "sarathi-queue-cap",
    "sarathi-sjf-queue-timeout": "sarathi-queue-timeout",
    "sarathi-priority": "sarathi",
    "sarathi-priority-queue-cap": "sarathi-queue-cap",
    "sarathi-priority-queue-timeout": "sarathi-queue-timeout",
}
#: with SGLang's own orders (sglang_ext.sim.competitors.sglang_orders), named and tuned alike
ALL_COUNTERPARTS = {
    **COUNTERPARTS,
    "sarathi-hrrn": "sarathi",
    "sarathi-hrrn-queue-timeout": "sarathi-queue-timeout",
    "sarathi-spf": "sarathi",
    "sarathi-spf-queue-timeout": "sarathi-queue-timeout",
}
TIGHT = Slo.from_ms(500, 50)
TIGHT_TPOT = Slo.from_ms(500, 30)  # the same TTFT, a tighter TPOT
LOOSE = Slo.from_ms(2000, 50)


def waiting(req_id, seq: int, prompt: int, slo: Slo = SLO, arrival: float | None = None):
    arrival = NOW - 1.0 + seq * 0.01 if arrival is None else arrival  # inside the timeout
    return RequestView(req_id, arrival, slo, 0, prompt, 0, prompt, seq)


def partial(req_id, seq: int, done: int, pending: int, slo: Slo = SLO):
    return RequestView(req_id, NOW - 1.0 + seq * 0.01, slo, 0, pending, done, done + pending, seq)


def decoding(req_id, seq: int, context: int = 500):
    return RequestView(req_id, seq * 0.01, SLO, 3, 0, context, context - 2, seq)


def policy(name: str, budget: int = 100_000, **settings: float):
    return make_policy(name, llama(), token_budget=budget, settings=tuple(settings.items()))


def order(name: str, requests, budget: int = 100_000) -> list:
    return [req_id for req_id, _ in policy(name, budget).form_batch(requests, NOW).prefill_chunks]


# ------------------------------------------------------------------ the orders
@pytest.mark.parametrize(
    "name", ["sarathi-sjf", "sarathi-sjf-queue-cap", "sarathi-sjf-queue-timeout"]
)
def test_sjf_admits_the_shortest_waiting_prompt_first_after_the_partial_one(name):
    requests = [
        waiting("long", 0, 3000), waiting("short-a", 1, 100), waiting("mid", 2, 500),
        waiting("short-b", 3, 100), partial("chunked", 4, done=1000, pending=2000),
    ]
    # a partly prefilled prompt continues first, whatever its length; ties by arrival
    assert order(name, requests) == ["chunked", "short-a", "short-b", "mid", "long"]


def test_sjf_orders_by_tokens_not_yet_computed_and_partials_by_arrival():
    # a retracted request waits again with its recompute (prompt + outputs) to prefill
    retracted = RequestView("retracted", 0.0, SLO, 40, 340, 0, 300, 0)
    requests = [
        retracted, waiting("w", 1, 320), partial("p-late", 3, done=10, pending=50),
        partial("p-early", 2, done=500, pending=5000),
    ]
    assert order("sarathi-sjf", requests) == ["p-early", "p-late", "w", "retracted"]


@pytest.mark.parametrize(
    "name", ["sarathi-priority", "sarathi-priority-queue-cap", "sarathi-priority-queue-timeout"]
)
def test_priority_admits_the_tightest_class_first_after_the_partial_one(name):
    requests = [
        waiting("loose", 0, 100, LOOSE), waiting("tight-a", 1, 3000, TIGHT),
        waiting("tight-tpot", 2, 3000, TIGHT_TPOT), waiting("tight-b", 3, 100, TIGHT),
        partial("chunked", 4, done=1000, pending=2000, slo=LOOSE),
    ]
    # class by TTFT, ties by TPOT, then arrival (not length); the partial continues first
    assert order(name, requests) == ["chunked", "tight-tpot", "tight-a", "tight-b", "loose"]


def test_priority_with_one_class_is_fcfs():
    requests = [waiting("a", 2, 3000), waiting("b", 0, 100), waiting("c", 1, 900),
                partial("p", 3, done=10, pending=20), decoding("d", 5)]
    fcfs = policy("sarathi", 2000).form_batch(requests, NOW)
    assert policy("sarathi-priority", 2000).form_batch(requests, NOW) == fcfs
    assert fcfs.prefill_chunks == (("p", 20), ("b", 100), ("c", 900), ("a", 979))


def test_the_batch_is_sarathis_only_the_order_differs():
    """Decodes run every step, past the budget; prefill chunks fill what the decodes leave,
    the last one cut."""
    requests = [decoding("d1", 0), decoding("d2", 1), waiting("long", 2, 1500),
                waiting("short", 3, 300)]
    decision = policy("sarathi-sjf", 1024).form_batch(requests, NOW)
    assert decision.decode_ids == ("d1", "d2")
    assert decision.prefill_chunks == (("short", 300), ("long", 722))
    fcfs = policy("sarathi", 1024).form_batch(requests, NOW)
    assert fcfs.prefill_chunks == (("long", 1022),)
    only_decodes = [decoding(f"d{i}", i) for i in range(20)] + [waiting("w", 30, 10)]
    assert policy("sarathi-sjf", 16).form_batch(only_decodes, NOW).prefill_chunks == ()


def test_the_order_is_one_seam_on_sarathi():
    for name, counterpart in COUNTERPARTS.items():
        factory, fcfs = POLICIES.get(name), POLICIES.get(counterpart)
        mixin = ShortestFirst if "sjf" in name else TightestClassFirst
        assert issubclass(factory, fcfs) and issubclass(factory, mixin)
        assert factory.prefill_order is mixin.prefill_order
        assert factory.form_batch is fcfs.form_batch
    assert Sarathi.prefill_order is not ShortestFirst.prefill_order
    assert POLICIES.get("sarathi-sjf") is SarathiSjf
    assert POLICIES.get("sarathi-priority") is SarathiPriority


def test_priority_serves_the_tight_class_first_in_a_simulation():
    profile = llama()
    engine = SimEngine(profile, policy("sarathi-priority", 256), check_invariants=True)
    for index in range(12):
        engine.submit(index, 0.0, 1500, 4, LOOSE if index % 2 == 0 else TIGHT)
    engine.run_until_idle(60.0)
    records = list(engine.records.values())
    assert all(r.finished for r in records)
    tight = [r.first_token_s for r in records if r.slo == TIGHT]
    loose = [r.first_token_s for r in records if r.slo == LOOSE]
    assert max(tight) < min(loose)


# ------------------------------------------------------------------ cap and timeout
@pytest.mark.parametrize("name", ["sarathi-sjf-queue-cap", "sarathi-priority-queue-cap"])
def test_queue_cap_refuses_as_vllms_cap_does(name):
    ordered = policy(name, 512, cap=1000.0)
    fcfs = policy("sarathi-queue-cap", 512, cap=1000.0)
    half_done = partial("a", 0, done=700, pending=100)  # counted whole: 800
    cases = [
        ([half_done], 5000),  # 800 <= 1000: admitted, whatever its size
        ([half_done, waiting("b", 1, 300, TIGHT)], 1),  # 1100 > 1000: refused
        ([half_done, decoding("c", 2, 5000)], 1),  # decodes do not count
    ]
    verdicts = [ordered.admit(requests, NOW, prompt, SLO) for requests, prompt in cases]
    assert verdicts == [fcfs.admit(requests, NOW, prompt, SLO) for requests, prompt in cases]
    assert verdicts == [True, False, True]
    assert isinstance(ordered, SarathiQueueCap)
    assert policy(name, 1024).cap == policy("sarathi-queue-cap", 1024).cap  # the same default


@pytest.mark.parametrize("name", ["sarathi-sjf-queue-timeout", "sarathi-priority-queue-timeout"])
def test_queue_timeout_aborts_as_sglangs_timeout_does(name):
    requests = [
        waiting("old-long", 0, 3000, LOOSE, arrival=NOW - 2.0),  # queued past the timeout
        waiting("old-short", 1, 50, TIGHT, arrival=NOW - 1.6),  # queued past the timeout
        partial("old-started", 2, done=10, pending=90),  # started: never aborted
        waiting("new-long", 3, 2000, LOOSE, arrival=NOW - 0.5),
        waiting("new-short", 4, 100, TIGHT, arrival=NOW - 0.1),
    ]
    ordered = policy(name, 100_000, timeout=1.5).form_batch(requests, NOW)
    fcfs = policy("sarathi-queue-timeout", 100_000, timeout=1.5).form_batch(requests, NOW)
    assert ordered.abort_ids == fcfs.abort_ids == ("old-long", "old-short")
    assert [r for r, _ in ordered.prefill_chunks] == ["old-started", "new-short", "new-long"]
    assert [r for r, _ in fcfs.prefill_chunks] == ["old-started", "new-long", "new-short"]
    assert isinstance(policy(name), SarathiQueueTimeout)
    default = policy(name, 1024).timeout_s
    assert default == policy("sarathi-queue-timeout", 1024).timeout_s == SLO.ttft_s


def test_sjf_timeout_aborts_only_requests_never_started_in_a_simulation():
    profile = llama()
    engine = SimEngine(profile, policy("sarathi-sjf-queue-timeout", 256, timeout=0.05),
                       record_steps=True, check_invariants=True)
    for index in range(40):
        engine.submit(index, 0.0, 500 + 100 * index, 4, SLO)
    engine.run_until_idle(30.0)
    records = list(engine.records.values())
    aborted = [r for r in records if r.aborted]
    assert aborted and all(r.prefill_tokens_computed == 0 for r in aborted)
    assert all(r.finished for r in records if not r.aborted)
    finished = [r.prompt_tokens for r in records if r.finished]
    assert finished and max(finished) < min(r.prompt_tokens for r in aborted)  # the long ones wait


# ------------------------------------------------------------------ names and tuning
@pytest.mark.parametrize("name", ALL_COUNTERPARTS)
def test_each_name_parses_and_is_tunable_like_its_counterpart(name):
    counterpart = POLICIES.get(ALL_COUNTERPARTS[name])
    factory = POLICIES.get(name)
    assert factory.takes_token_budget and factory.setting_names == counterpart.setting_names
    assert parse_policy(name).is_tunable
    assert parse_policy(f"{name}@1024").label == f"{name}@1024"
    assert not parse_policy(f"{name}@1024").is_tunable


def test_settings_parse():
    spec = parse_policy("sarathi-sjf-queue-timeout@1024,timeout=1.75")
    assert spec.token_budget == 1024 and spec.settings == (("timeout", 1.75),)
    assert spec.label == "sarathi-sjf-queue-timeout@1024,timeout=1.75"
    assert parse_policy("sarathi-priority-queue-cap@512,cap=32768").settings == (("cap", 32768.0),)


@pytest.mark.parametrize("name", ALL_COUNTERPARTS)
def test_tuned_exactly_like_the_fcfs_counterpart(name):
    """The same labels tried in the same order (budget axis, cap or timeout axis around
    the same default), given the same scores."""
    context = context_for(llama())
    counterpart = ALL_COUNTERPARTS[name]

    def peaked(spec):  # a peak inside every axis: budget 1500, timeout 3 s, cap 50k tokens
        value = -abs(spec.token_budget / 1500 - 1)
        for setting, at in spec.settings:
            value -= abs(at / (3.0 if setting == "timeout" else 50_000) - 1)
        return (value, 0.0)

    ours = drive_search(tune(name, context, None), peaked)
    theirs = drive_search(tune(counterpart, context, None), peaked)
    def rename(label: str) -> str:
        return label.replace(counterpart, name, 1)

    assert ours.tried == [rename(label) for label in theirs.tried]
    assert ours.best == rename(theirs.best) and ours.edge == theirs.edge
    assert len(ours.tried) > 5


# ------------------------------------------------------------------ the CLI
@pytest.mark.parametrize("label", [
    "sarathi-sjf@1024", "sarathi-priority-queue-timeout@1024,timeout=1.75",
    "sarathi-sjf-queue-cap@1024,cap=30000",
])
def test_a_tiny_run_gives_a_table(label, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", "--policy", label, "--rate", "12", "--head-seconds", "30",
                 "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "peak eff RPS" in table and label in table
    results = json.loads((out / "results.json").read_text())
    load = results["policies"][label]["loads"][0]
    assert load["rate"] == 12.0 and load["requests"] > 10 and load["unfinished"] == 0
