from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.balancer import RankView, make_balancer
from controlplane.ledger import DispatchLedger, PabLedger, RankBudget

REPO = Path(__file__).resolve().parents[2]


def test_pab_ledger_is_the_dispatch_ledger() -> None:
    assert PabLedger is DispatchLedger


def test_rank_keys_may_be_strings_or_ints() -> None:
    ledger = DispatchLedger()
    ledger.apply_report("rank-a", 1000, 0)
    ledger.apply_report(3, 500, 0)
    ledger.record_dispatch("rank-a", 100)
    assert ledger.budgets(["rank-a", 3, "unknown"]) == {"rank-a": 900, 3: 500}


def test_sequence_numbers_are_per_rank_and_start_at_one() -> None:
    ledger = DispatchLedger()
    assert [ledger.record_dispatch("a", 1), ledger.record_dispatch("a", 1)] == [1, 2]
    assert ledger.record_dispatch("b", 1) == 1


def test_unreported_rank_has_no_budget_but_counts_its_debits() -> None:
    ledger = DispatchLedger()
    ledger.record_dispatch("a", 100)
    assert ledger.effective_budget("a") is None
    assert ledger.reported_budget("a") is None
    assert ledger.outstanding_tokens("a") == 100
    assert ledger.outstanding_dispatches("a") == 1
    assert ledger.effective_budget("never-seen") is None
    assert ledger.outstanding_tokens("never-seen") == 0


def test_report_after_a_but_before_b_keeps_b_and_drops_a() -> None:
    ledger = DispatchLedger()
    ledger.apply_report("r", 10_000, 0)
    a = ledger.record_dispatch("r", 1000)
    b = ledger.record_dispatch("r", 2500)
    assert (a, b) == (1, 2)
    # The rank took this snapshot after ingesting A (echo 1) but before B reached it.
    ledger.apply_report("r", 8800, echoed_dispatch_seq=a)
    assert ledger.outstanding_dispatches("r") == 1
    assert ledger.outstanding_tokens("r") == 2500
    assert ledger.effective_budget("r") == 8800 - 2500
    ledger.apply_report("r", 6000, echoed_dispatch_seq=b)
    assert ledger.effective_budget("r") == 6000
    assert ledger.outstanding_dispatches("r") == 0


def test_a_stale_report_does_not_resurrect_dropped_debits() -> None:
    ledger = DispatchLedger()
    ledger.apply_report("r", 10_000, 0)
    ledger.record_dispatch("r", 1000)
    ledger.record_dispatch("r", 2000)
    ledger.apply_report("r", 7000, echoed_dispatch_seq=2)
    # A report that echoes less than the one held (a delayed or reordered one).
    ledger.apply_report("r", 9000, echoed_dispatch_seq=1)
    assert ledger.outstanding_dispatches("r") == 0
    assert ledger.effective_budget("r") == 9000
    # update() refuses it outright.
    held = DispatchLedger()
    held.update(RankBudget("r", 10_000, 0, 1.0))
    held.record_dispatch("r", 1000)
    held.record_dispatch("r", 2000)
    assert held.update(RankBudget("r", 7000, 2, 2.0))
    assert not held.update(RankBudget("r", 9000, 1, 3.0))
    assert held.effective_budget("r") == 7000
    assert held.outstanding_dispatches("r") == 0


def test_apply_report_accepts_reports_without_an_ordering_check() -> None:
    ledger = DispatchLedger()
    ledger.apply_report("r", 5000, 0)
    ledger.apply_report("r", 4000, 0)  # same echo, later in the rank's report sequence
    assert ledger.effective_budget("r") == 4000
    assert ledger.echoed_dispatch_seq("r") == 0


def test_release_undoes_only_an_outstanding_dispatch() -> None:
    ledger = DispatchLedger()
    ledger.apply_report("r", 5000, 0)
    first = ledger.record_dispatch("r", 1000)
    second = ledger.record_dispatch("r", 700)
    third = ledger.record_dispatch("r", 300)
    assert ledger.release("r", second)
    assert not ledger.release("r", second)
    assert ledger.effective_budget("r") == 5000 - 1000 - 300
    ledger.apply_report("r", 4200, echoed_dispatch_seq=first)
    assert not ledger.release("r", first)  # the report already included it
    assert not ledger.release("r", 99)
    assert not ledger.release("other", 1)
    assert ledger.record_dispatch("r", 1) == third + 1  # numbers are not reused
    assert ledger.effective_budget("r") == 4200 - 300 - 1


def test_reset_forgets_report_and_debits_but_numbers_keep_rising() -> None:
    ledger = DispatchLedger()
    ledger.apply_report("r", 5000, 0)
    ledger.record_dispatch("r", 1000)
    ledger.record_dispatch("r", 1000)
    ledger.reset("r")
    assert ledger.effective_budget("r") is None
    assert ledger.outstanding_dispatches("r") == 0
    assert ledger.echoed_dispatch_seq("r") == 0
    assert ledger.record_dispatch("r", 10) == 3
    ledger.forget("r")
    assert ledger.outstanding_tokens("r") == 0
    ledger.forget("never-seen")  # no error


def test_update_ordering_is_unchanged() -> None:
    ledger = DispatchLedger()
    assert ledger.update(RankBudget(0, 5000, 0, 1.0))
    seq = ledger.record_dispatch(0, 1000)
    assert ledger.update(RankBudget(0, 4800, 0, 2.0))  # before the rank ingested seq
    assert ledger.effective_budget(0) == 3800
    assert ledger.update(RankBudget(0, 3000, seq, 3.0))
    assert not ledger.update(RankBudget(0, 9999, seq, 2.5))
    assert ledger.update(RankBudget(0, 3000, seq, 3.0))  # the held report again: a no-op
    assert ledger.effective_budget(0) == 3000


def test_negative_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt_tokens"):
        DispatchLedger().record_dispatch("r", -1)


def _views(ledger: DispatchLedger, ranks: list[str]) -> list[RankView]:
    return [
        RankView(rank, ledger.effective_budget(rank), 0, ledger.outstanding_dispatches(rank),
                 ledger.outstanding_tokens(rank), ledger.outstanding_dispatches(rank))
        for rank in ranks
    ]


def test_a_burst_between_two_reports_never_over_commits_a_rank() -> None:
    ranks = ["r0", "r1", "r2"]
    ledger = DispatchLedger()
    for rank in ranks:
        ledger.apply_report(rank, 10_000, 0)
    balancer = make_balancer("pab")
    placed: dict[str, int] = dict.fromkeys(ranks, 0)
    refused = 0
    for _ in range(30):
        rank = balancer.choose(_views(ledger, ranks), 1000)
        if rank is None:
            refused += 1
            continue
        assert ledger.effective_budget(rank) >= 1000
        ledger.record_dispatch(rank, 1000)
        placed[rank] += 1000
    assert placed == dict.fromkeys(ranks, 10_000)
    assert refused == 0
    assert all(ledger.effective_budget(rank) == 0 for rank in ranks)
    assert balancer.choose(_views(ledger, ranks), 1) is None  # the next prompt must wait


def test_a_burst_larger_than_the_cluster_budget_is_refused_not_over_committed() -> None:
    ranks = ["r0", "r1", "r2"]
    ledger = DispatchLedger()
    for rank, pab in zip(ranks, (10_000, 4_500, 2_000), strict=True):
        ledger.apply_report(rank, pab, 0)
    balancer = make_balancer("pab")
    refused = 0
    for _ in range(30):
        rank = balancer.choose(_views(ledger, ranks), 1000)
        if rank is None:
            refused += 1
        else:
            ledger.record_dispatch(rank, 1000)
    assert refused == 30 - (10 + 4 + 2)
    assert all(ledger.effective_budget(rank) >= 0 for rank in ranks)


@st.composite
def _operations(draw: st.DrawFn) -> list[tuple]:
    operations = []
    dispatched = 0
    for _ in range(draw(st.integers(0, 60))):
        kind = draw(st.sampled_from(("dispatch", "dispatch", "report", "release")))
        if kind == "dispatch":
            operations.append(("dispatch", draw(st.integers(0, 5000))))
            dispatched += 1
        elif kind == "report":
            pab = draw(st.integers(-20_000, 20_000))
            operations.append(("report", pab, draw(st.integers(0, dispatched))))
        else:
            operations.append(("release", draw(st.integers(0, dispatched + 1))))
    return operations


@settings(max_examples=150, deadline=None)
@given(_operations())
def test_effective_budget_is_reported_minus_unreleased_dispatches_past_the_echo(
    operations: list[tuple],
) -> None:
    ledger = DispatchLedger()
    prompts: dict[int, int] = {}
    released: set[int] = set()
    reported: float | None = None
    highest_echo = 0
    for operation in operations:
        if operation[0] == "dispatch":
            seq = ledger.record_dispatch("r", operation[1])
            assert seq == len(prompts) + 1
            prompts[seq] = operation[1]
        elif operation[0] == "report":
            _, reported, echo = operation
            ledger.apply_report("r", reported, echo)
            highest_echo = max(highest_echo, echo)
        else:
            seq = operation[1]
            expected = seq in prompts and seq > highest_echo and seq not in released
            assert ledger.release("r", seq) == expected
            if expected:
                released.add(seq)
        outstanding = [
            tokens for seq, tokens in prompts.items() if seq > highest_echo and seq not in released
        ]
        assert ledger.outstanding_tokens("r") == sum(outstanding)
        assert ledger.outstanding_dispatches("r") == len(outstanding)
        expected_budget = None if reported is None else reported - sum(outstanding)
        assert ledger.effective_budget("r") == expected_budget


def test_controlplane_core_modules_are_stdlib_only() -> None:
    code = (
        "import sys, controlplane.ledger, controlplane.balancer\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('sglang', 'sglang_ext', 'torch', 'numpy', 'msgspec', 'zmq')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_a_dispatch_debits_every_class_and_a_report_replaces_them() -> None:
    ledger = DispatchLedger()
    ledger.apply_report("r", 5000, 0, {"interactive": 800, "relaxed": 12_000})
    seq = ledger.record_dispatch("r", 300)
    assert ledger.effective_class_budgets("r") == {"interactive": 500, "relaxed": 11_700}
    assert ledger.effective_budget("r") == 4700
    assert ledger.effective_budget("r", "interactive") == 500
    assert ledger.effective_budget("r", "unreported") == 4700  # the default class's
    assert ledger.budgets(["r"], "relaxed") == {"r": 11_700}
    ledger.apply_report("r", 4000, seq, {"interactive": 100})
    assert ledger.effective_class_budgets("r") == {"interactive": 100}
    assert ledger.effective_budget("r", "relaxed") == 4000
    ledger.apply_report("r", 4000, seq)  # a report without classes clears them
    assert ledger.effective_class_budgets("r") == {} and ledger.reported_class_budgets("r") == {}


def test_ordered_updates_carry_class_budgets() -> None:
    ledger = DispatchLedger()
    assert ledger.update(RankBudget(0, 5000, 0, 1.0, {"interactive": 700}))
    assert not ledger.update(RankBudget(0, 9000, 0, 0.5, {"interactive": 9000}))
    assert ledger.effective_budget(0, "interactive") == 700
