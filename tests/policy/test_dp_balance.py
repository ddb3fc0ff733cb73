from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.ledger import PabLedger, RankBudget
from sglang_ext.adapter.dp_balance import choose_rank

REPO = Path(__file__).resolve().parents[2]


def report(rank: int, pab: float, echoed: int, timestamp: float) -> RankBudget:
    return RankBudget(rank=rank, pab_tokens=pab, echoed_dispatch_seq=echoed, timestamp=timestamp)


def test_choose_prefers_the_largest_covering_budget() -> None:
    assert choose_rank({0: 500, 1: 3000, 2: 1200}, prompt_tokens=1000) == 1


def test_choose_falls_back_to_the_largest_budget_when_none_covers() -> None:
    assert choose_rank({0: -50, 1: 400, 2: 10}, prompt_tokens=1000) == 1


def test_choose_breaks_ties_by_lowest_rank() -> None:
    assert choose_rank({3: 800, 1: 800, 2: 800}, prompt_tokens=100) == 1
    assert choose_rank({3: -5, 2: -5}, prompt_tokens=100) == 2


def test_choose_needs_a_rank() -> None:
    with pytest.raises(ValueError, match="at least one"):
        choose_rank({}, prompt_tokens=1)


@given(
    budgets=st.dictionaries(st.integers(0, 7), st.integers(-10_000, 10_000), min_size=1),
    prompt=st.integers(0, 10_000),
)
def test_choose_matches_the_contract(budgets: dict[int, int], prompt: int) -> None:
    chosen = choose_rank(budgets, prompt)
    covering = {r: b for r, b in budgets.items() if b >= prompt}
    pool = covering or budgets
    best = max(pool.values())
    assert chosen == min(r for r, b in pool.items() if b == best)


def test_unreported_rank_has_no_budget() -> None:
    ledger = PabLedger()
    ledger.record_dispatch(0, 100)
    assert ledger.effective_budget(0) is None
    assert ledger.budgets([0, 1]) == {}


def test_sequence_numbers_are_per_rank_and_start_at_one() -> None:
    ledger = PabLedger()
    assert [ledger.record_dispatch(0, 1), ledger.record_dispatch(0, 1)] == [1, 2]
    assert ledger.record_dispatch(1, 1) == 1


def test_debits_accumulate_between_reports() -> None:
    ledger = PabLedger()
    ledger.update(report(0, 5000, echoed=0, timestamp=1.0))
    ledger.record_dispatch(0, 1200)
    ledger.record_dispatch(0, 300)
    assert ledger.effective_budget(0) == 3500
    assert ledger.outstanding_dispatches(0) == 2


def test_snapshot_taken_before_a_dispatch_but_read_after_it_keeps_the_debit() -> None:
    ledger = PabLedger()
    ledger.update(report(0, 5000, echoed=0, timestamp=1.0))
    seq = ledger.record_dispatch(0, 1200)
    # Published by the rank before it ingested `seq` (echo 0), read after the dispatch.
    assert ledger.update(report(0, 4800, echoed=0, timestamp=2.0))
    assert ledger.effective_budget(0) == 4800 - 1200
    assert ledger.outstanding_dispatches(0) == 1
    # The rank ingests it: its next snapshot includes it and echoes its seq.
    assert ledger.update(report(0, 3500, echoed=seq, timestamp=3.0))
    assert ledger.effective_budget(0) == 3500
    assert ledger.outstanding_dispatches(0) == 0


def test_echo_drops_only_the_debits_it_includes() -> None:
    ledger = PabLedger()
    ledger.update(report(0, 9000, echoed=0, timestamp=1.0))
    first = ledger.record_dispatch(0, 1000)
    ledger.record_dispatch(0, 2000)
    ledger.record_dispatch(0, 4000)
    ledger.update(report(0, 8000, echoed=first, timestamp=2.0))
    assert ledger.effective_budget(0) == 8000 - 2000 - 4000


def test_a_report_older_than_the_held_one_is_ignored() -> None:
    ledger = PabLedger()
    ledger.update(report(0, 5000, echoed=0, timestamp=1.0))
    seq = ledger.record_dispatch(0, 1000)
    assert ledger.update(report(0, 3000, echoed=seq, timestamp=3.0))
    assert not ledger.update(report(0, 9999, echoed=0, timestamp=2.0))
    assert not ledger.update(report(0, 9999, echoed=seq, timestamp=2.5))
    assert ledger.effective_budget(0) == 3000


def test_reapplying_the_same_report_is_a_no_op() -> None:
    ledger = PabLedger()
    ledger.update(report(0, 5000, echoed=0, timestamp=1.0))
    ledger.record_dispatch(0, 700)
    ledger.update(report(0, 5000, echoed=0, timestamp=1.0))
    assert ledger.effective_budget(0) == 4300


def test_ranks_are_independent() -> None:
    ledger = PabLedger()
    ledger.update(report(0, 1000, echoed=0, timestamp=1.0))
    ledger.update(report(1, 1000, echoed=0, timestamp=1.0))
    ledger.record_dispatch(0, 600)
    ledger.update(report(1, 900, echoed=0, timestamp=2.0))
    assert ledger.budgets([0, 1]) == {0: 400, 1: 900}


def test_negative_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt_tokens"):
        PabLedger().record_dispatch(0, -1)


def test_a_burst_spreads_over_ranks_between_snapshots() -> None:
    ledger = PabLedger()
    for rank in range(3):
        ledger.update(report(rank, 3000, echoed=0, timestamp=1.0))
    chosen = []
    for _ in range(6):
        rank = choose_rank(ledger.budgets(range(3)), 1000)
        ledger.record_dispatch(rank, 1000)
        chosen.append(rank)
    assert chosen == [0, 1, 2, 0, 1, 2]


def test_report_round_trips_through_json() -> None:
    original = report(2, 1234.5, echoed=7, timestamp=1700000000.25)
    wire = json.dumps(dataclasses.asdict(original))
    assert RankBudget(**json.loads(wire)) == original


def test_module_is_stdlib_only() -> None:
    code = (
        "import sys, sglang_ext.adapter.dp_balance\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'torch', 'numpy')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
