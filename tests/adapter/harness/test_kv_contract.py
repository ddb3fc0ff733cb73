"""The adapter's memory contract (docs/sglang.md, *Memory contract*) on a real SGLang
``Scheduler``: a fast seeded subset of :mod:`benchmarks.server.kv_campaign`, checked
after every step. The seeds include scenarios where the scheduler runs out of KV unless
the planned adder holds a cut prompt's remainder in its budget (a long prompt cut beside
short ones admitted whole), and one whose queue stalls behind a request no pool can hold
unless that request is refused."""

from __future__ import annotations

import pytest

from benchmarks.server.kv_campaign import campaign, random_scenario, summarise

pytest.importorskip("sglang")

pytestmark = pytest.mark.sglang

#: 114, 128 and 139 need a cut prompt's remainder held for KV to suffice; 1168 queues a
#: request no pool can hold; 1107 asks for more output than the model's context leaves
SEEDS = (114, 128, 139, 1168, 1107, 3)


def test_seeded_scenarios_keep_the_memory_contract_after_every_step() -> None:
    results = campaign(SEEDS, jobs=1, timeout_s=600)
    summary = summarise(results)
    assert summary["scenarios"] == len(SEEDS)
    assert summary["violations"] == {}, summary["failing"]
    assert summary["steps"] > 100 * len(SEEDS)


def test_the_generator_covers_what_the_contract_is_about() -> None:
    scenarios = [random_scenario(seed) for seed in range(200)]
    assert {s.overlap for s in scenarios} == {False, True}
    assert {(s.admission_mode, s.give_up) for s in scenarios} == {
        ("off", None), ("reject", None), ("defer", "longest"), ("defer", "fair"), ("defer", "latest")}
    assert {s.prefill_piece_tokens for s in scenarios} == {None, 64, 256}
    assert {target for s in scenarios for _, target in s.aborts} == {"waiting", "chunked", "parked", "decoding"}
    assert any(r["prompt_tokens"] > s.pool_tokens for s in scenarios for r in s.requests)
    assert any("prefix_group" in r for s in scenarios for r in s.requests)
    assert random_scenario(5) == random_scenario(5)


def test_never_fits_follows_sglangs_two_admission_rules() -> None:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_ext.adapter.scheduler.hooks import never_fits

    req = Req("r", None, list(range(4074)), SamplingParams(max_new_tokens=924, ignore_eos=True))
    # a page (one token) beside prompt and outputs: 4,999 of 5,000, which the plain rule grants...
    assert never_fits(req, 5000, 1, ignore_eos_admission=False) is None
    # ...and the ignore-EOS rule, one reserve token more, refuses
    assert never_fits(req, 5000, 1, ignore_eos_admission=True) == 5000
    assert never_fits(req, 5001, 1, ignore_eos_admission=True) is None
