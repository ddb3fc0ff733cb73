"""SGLang 0.5.23's own waiting orders as simulator baselines (``sglang_ext.sim.competitors
.sglang_orders``): ``sarathi-hrrn`` (highest response ratio next, token-based aging) and
``sarathi-spf`` (shortest-prefill-first with its chunk cap), on hand-built states and in a
simulation."""

from __future__ import annotations

import json

from sim_helpers import SLO, llama, make_policy

from sglang_ext.policy.step_shape import StepShape
from sglang_ext.policy.view import RequestView
from sglang_ext.sim.commands import main
from sglang_ext.sim.competitors.sglang_orders import WAITING_QUEUE_PREFIX_MATCH_MAX
from sglang_ext.sim.engine import SimEngine

NOW = 10.0


def waiting(req_id, seq: int, prompt: int, arrival: float | None = None) -> RequestView:
    arrival = NOW - 1.0 + seq * 0.01 if arrival is None else arrival
    return RequestView(req_id, arrival, SLO, 0, prompt, 0, prompt, seq)


def partial(req_id, seq: int, done: int, pending: int) -> RequestView:
    return RequestView(req_id, NOW - 1.0 + seq * 0.01, SLO, 0, pending, done, done + pending, seq)


def policy(name: str, budget: int = 100_000, **settings: float):
    return make_policy(name, llama(), token_budget=budget, settings=tuple(settings.items()))


def prefill_step(tokens: int) -> StepShape:
    return StepShape(tokens, tokens * (tokens + 1) / 2, 0, 0, 0, 1)


def order(decision) -> list:
    return [req_id for req_id, _ in decision.prefill_chunks]


def test_hrrn_ages_waiting_prompts_by_the_prefill_tokens_run_since_they_joined():
    hrrn = policy("sarathi-hrrn")
    old_long = waiting("old-long", 0, 1000)
    hrrn.form_batch([old_long], NOW)  # joins at 0 tokens launched
    hrrn.observe_step(prefill_step(2000), 0.1)
    young_short = waiting("young-short", 1, 100)
    # old-long: 2000 / 1000 = 2; young-short: 0 / 100
    assert order(hrrn.form_batch([old_long, young_short], NOW)) == ["old-long", "young-short"]
    hrrn.observe_step(prefill_step(1000), 0.05)
    # old-long: 3000 / 1000 = 3; young-short: 1000 / 100 = 10
    assert order(hrrn.form_batch([old_long, young_short], NOW)) == ["young-short", "old-long"]


def test_hrrn_continues_the_chunked_prompt_first():
    hrrn = policy("sarathi-hrrn", budget=1500)
    requests = [waiting("w", 0, 100), partial("chunked", 1, done=500, pending=2000)]
    hrrn.form_batch(requests, NOW)
    hrrn.observe_step(prefill_step(4000), 0.2)
    assert hrrn.form_batch(requests, NOW).prefill_chunks == (("chunked", 1500),)


def test_hrrn_keeps_its_last_order_when_the_queue_is_too_long_to_sort():
    hrrn = policy("sarathi-hrrn")
    first = [waiting(f"a{i}", i, 1000 - i) for i in range(10)]
    hrrn.form_batch(first, NOW)
    hrrn.observe_step(prefill_step(1000), 0.05)
    sorted_order = order(hrrn.form_batch(first, NOW))
    assert sorted_order == [f"a{i}" for i in range(9, -1, -1)]  # shortest has the highest ratio
    crowd = [waiting(f"b{i}", 100 + i, 10) for i in range(WAITING_QUEUE_PREFIX_MATCH_MAX)]
    hrrn.observe_step(prefill_step(5000), 0.2)
    unsorted = order(hrrn.form_batch(first + crowd, NOW))
    assert unsorted[:10] == sorted_order  # FCFS: the last sort's order, newcomers after it
    assert unsorted[10:] == [f"b{i}" for i in range(WAITING_QUEUE_PREFIX_MATCH_MAX)]


def test_spf_caps_the_chunk_so_shorter_waiting_prompts_fit_in_the_same_step():
    spf = policy("sarathi-spf", budget=1000)
    requests = [partial("chunked", 0, done=500, pending=2000), waiting("long", 1, 3000),
                waiting("mid", 2, 300), waiting("short", 3, 100)]
    decision = spf.form_batch(requests, NOW)
    assert decision.prefill_chunks == (("chunked", 600), ("short", 100), ("mid", 300))
    # stock SGLang's FCFS Sarathi gives the whole budget to the chunk
    assert policy("sarathi", budget=1000).form_batch(requests, NOW).prefill_chunks == (("chunked", 1000),)


def test_spf_cuts_a_second_prompt_only_once_the_chunked_one_finishes():
    spf = policy("sarathi-spf", budget=1000)
    finishing = [partial("chunked", 0, done=500, pending=300), waiting("big", 1, 5000)]
    assert spf.form_batch(finishing, NOW).prefill_chunks == (("chunked", 300), ("big", 700))
    continuing = [partial("chunked", 0, done=500, pending=2000), waiting("big", 1, 5000)]
    assert spf.form_batch(continuing, NOW).prefill_chunks == (("chunked", 1000),)


def test_the_timeout_variants_abort_like_sglangs_waiting_timeout():
    for name in ("sarathi-hrrn-queue-timeout", "sarathi-spf-queue-timeout"):
        requests = [waiting("stale", 0, 500, arrival=NOW - 3.0), waiting("fresh", 1, 500)]
        decision = policy(name, 100_000, timeout=2.0).form_batch(requests, NOW)
        assert decision.abort_ids == ("stale",) and order(decision) == ["fresh"]


def test_every_request_gets_exactly_its_tokens_in_a_simulation():
    for name in ("sarathi-hrrn@256", "sarathi-spf@256"):
        base, budget = name.split("@")
        engine = SimEngine(llama(), policy(base, int(budget)), check_invariants=True)
        for index in range(60):
            engine.submit(index, index * 0.02, 200 + (index * 997) % 3000, 8, SLO)
        engine.run_until_idle(60.0)
        records = list(engine.records.values())
        assert len(records) == 60 and all(r.finished for r in records)


def test_a_tiny_run_gives_a_table(tmp_path, capsys):
    out = tmp_path / "out"
    labels = ["sarathi-hrrn-queue-timeout@512,timeout=2", "sarathi-spf@512"]
    argv = ["run", "--rate", "12", "--head-seconds", "30", "--out", str(out)]
    for label in labels:
        argv += ["--policy", label]
    assert main(argv) == 0
    table = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    for label in labels:
        assert label in table and results["policies"][label]["loads"][0]["unfinished"] == 0
