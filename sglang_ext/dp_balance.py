"""Routing on Prefill Admission Budgets across data-parallel ranks.

Each rank periodically reports its PAB (prompt tokens it can still absorb within the
TTFT SLO) together with the highest dispatch sequence number it has ingested. Between
reports the dispatcher debits every prompt it sends from its view of that rank::

    effective_budget(rank) = report.pab_tokens
                             - sum(prompt tokens dispatched to rank with seq > report.echoed_dispatch_seq)

A report therefore never wipes out debits it does not include yet (a snapshot taken
before a dispatch but read after it), and debits it does include are dropped.
Sequence numbers are per rank, start at 1, and follow the order in which the rank
ingests its requests; an echo of 0 means "nothing ingested yet".

Stdlib only: the control-plane daemon reuses the ledger, and every field of a report is
a JSON scalar (``dataclasses.asdict`` / ``RankBudget(**d)`` round-trip it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RankBudget:
    """One rank's reported budget; ``timestamp`` is the reporter's clock (seconds)."""

    rank: int
    pab_tokens: float
    echoed_dispatch_seq: int
    timestamp: float


@dataclass(frozen=True, slots=True)
class _Debit:
    seq: int
    prompt_tokens: int


class PabLedger:
    """Latest report per rank plus the dispatches each report does not include yet."""

    def __init__(self) -> None:
        self._next_seq: dict[int, int] = {}
        self._debits: dict[int, deque[_Debit]] = {}
        self._reports: dict[int, RankBudget] = {}

    def record_dispatch(self, rank: int, prompt_tokens: int) -> int:
        """Debit ``prompt_tokens`` from ``rank``; returns the dispatch's sequence number."""
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        seq = self._next_seq.get(rank, 0) + 1
        self._next_seq[rank] = seq
        self._debits.setdefault(rank, deque()).append(_Debit(seq, prompt_tokens))
        return seq

    def update(self, report: RankBudget) -> bool:
        """Apply a report; returns False when it is older than the one already held.

        A report is older when it echoes a lower sequence number, or the same one
        with an earlier timestamp. Re-applying the held report is a no-op.
        """
        held = self._reports.get(report.rank)
        if held is not None and (report.echoed_dispatch_seq, report.timestamp) < (
            held.echoed_dispatch_seq,
            held.timestamp,
        ):
            return False
        self._reports[report.rank] = report
        debits = self._debits.get(report.rank)
        while debits and debits[0].seq <= report.echoed_dispatch_seq:
            debits.popleft()
        return True

    def effective_budget(self, rank: int) -> float | None:
        """The reported budget minus outstanding debits; None if ``rank`` never reported."""
        report = self._reports.get(rank)
        if report is None:
            return None
        return report.pab_tokens - self.outstanding_tokens(rank)

    def outstanding_tokens(self, rank: int) -> int:
        return sum(debit.prompt_tokens for debit in self._debits.get(rank, ()))

    def outstanding_dispatches(self, rank: int) -> int:
        return len(self._debits.get(rank, ()))

    def budgets(self, ranks: Iterable[int]) -> dict[int, float]:
        """Effective budgets of those ``ranks`` that have reported."""
        out = {}
        for rank in ranks:
            budget = self.effective_budget(rank)
            if budget is not None:
                out[rank] = budget
        return out


def choose_rank(budgets: Mapping[int, float], prompt_tokens: int) -> int:
    """A rank whose budget covers the prompt, largest budget first; else the largest budget.

    Ties go to the lowest rank. (If any rank covers the prompt, the largest budget does,
    so both cases pick the largest budget; the covering rule is stated for the contract.)
    """
    if not budgets:
        raise ValueError("choose_rank needs at least one rank's budget")
    by_preference = sorted(budgets, key=lambda rank: (-budgets[rank], rank))
    covering = [rank for rank in by_preference if budgets[rank] >= prompt_tokens]
    return covering[0] if covering else by_preference[0]
