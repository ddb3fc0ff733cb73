"""The dispatcher's view of each rank's Prefill Admission Budget between reports.

Each rank periodically reports its PAB (prompt tokens it can still absorb within the
TTFT SLO) together with the highest dispatch sequence number it has ingested. Between
reports the dispatcher debits every prompt it sends from its view of that rank::

    effective_budget(rank) = reported pab_tokens
                             - sum(prompt tokens dispatched to rank with seq > echoed_dispatch_seq)

A report therefore never wipes out debits it does not include yet (a snapshot taken
before a dispatch but read after it), and debits it does include are dropped; a debit
once dropped never comes back, whatever a later report echoes.

A report may also carry a budget per SLO class (``class_budgets``). A dispatched prompt
is debited from every class alike: once prefilled it delays the first token of every
request behind it, whatever its class. A class the last report did not name has the
default budget (``pab_tokens``). Sequence numbers are
per rank, start at 1, and follow the order in which the rank ingests its requests; an
echo of 0 means "nothing ingested yet".

Rank keys are any hashable value (``str`` in the daemon, ``int`` in SGLang's DP
controller). Stdlib only, no I/O: the daemon and SGLang's controller both use it, and
every field of a :class:`RankBudget` is a JSON value (``dataclasses.asdict`` /
``RankBudget(**d)`` round-trip it).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RankBudget:
    """One rank's reported budget; ``timestamp`` is the reporter's clock (seconds)."""

    rank: Hashable
    pab_tokens: float
    echoed_dispatch_seq: int
    timestamp: float
    class_budgets: dict[str, float] | None = None  # SLO class -> tokens; None: none reported


@dataclass(frozen=True, slots=True)
class _Debit:
    seq: int
    prompt_tokens: int


@dataclass(slots=True)
class _RankState:
    next_seq: int = 1
    debits: deque[_Debit] = field(default_factory=deque)
    outstanding_tokens: int = 0
    reported_pab_tokens: float | None = None
    reported_class_budgets: dict[str, float] = field(default_factory=dict)
    echoed_dispatch_seq: int = 0
    report_timestamp: float = -math.inf

    def drop_debits_through(self, echoed_dispatch_seq: int) -> None:
        debits = self.debits
        while debits and debits[0].seq <= echoed_dispatch_seq:
            self.outstanding_tokens -= debits.popleft().prompt_tokens


class DispatchLedger:
    """Latest report per rank plus the dispatches each report does not include yet.

    Reports come in one of two ways; a ledger should use one of them:

    - :meth:`update` (SGLang's controller) orders reports itself: one that echoes a
      lower sequence number than the held report, or the same one with an earlier
      timestamp, is ignored.
    - :meth:`apply_report` (the daemon) trusts the caller to have ordered reports
      already (per-rank report sequence numbers) and applies every one it is given.
    """

    def __init__(self, first_seq: int = 1) -> None:
        """``first_seq``: every rank's first dispatch number (and again after a reset).
        A daemon passes a clock-derived value so that its numbers exceed any a previous
        incarnation of it handed out, which ranks may still echo."""
        if first_seq < 1:
            raise ValueError(f"first_seq must be >= 1, got {first_seq}")
        self._first_seq = first_seq
        self._ranks: dict[Hashable, _RankState] = {}

    def _state(self, rank: Hashable) -> _RankState:
        state = self._ranks.get(rank)
        if state is None:
            state = self._ranks[rank] = _RankState(next_seq=self._first_seq)
        return state

    def record_dispatch(self, rank: Hashable, prompt_tokens: int) -> int:
        """Debit ``prompt_tokens`` from ``rank``; returns the dispatch's sequence number."""
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        state = self._state(rank)
        seq = state.next_seq
        state.next_seq = seq + 1
        state.debits.append(_Debit(seq, prompt_tokens))
        state.outstanding_tokens += prompt_tokens
        return seq

    def release(self, rank: Hashable, seq: int) -> bool:
        """Undo dispatch ``seq`` to ``rank`` that never reached it (the send failed).

        Returns whether its debit was still outstanding (False once a report included
        it, after a reset, or for a sequence number never dispatched). The number is
        not reused."""
        state = self._ranks.get(rank)
        if state is None:
            return False
        for debit in state.debits:
            if debit.seq == seq:
                state.debits.remove(debit)
                state.outstanding_tokens -= debit.prompt_tokens
                return True
            if debit.seq > seq:
                break
        return False

    def update(self, report: RankBudget) -> bool:
        """Apply a report; returns False when it is older than the one already held.

        A report is older when it echoes a lower sequence number, or the same one
        with an earlier timestamp. Re-applying the held report is a no-op.
        """
        state = self._state(report.rank)
        if state.reported_pab_tokens is not None and (
            report.echoed_dispatch_seq, report.timestamp
        ) < (state.echoed_dispatch_seq, state.report_timestamp):
            return False
        self._store(state, report.pab_tokens, report.echoed_dispatch_seq, report.class_budgets)
        state.report_timestamp = report.timestamp
        return True

    def apply_report(self, rank: Hashable, pab_tokens: float, echoed_dispatch_seq: int,
                     class_budgets: Mapping[str, float] | None = None) -> None:
        """Store ``rank``'s reported PAB (and its classes') and drop the debits with
        seq <= the echo.

        No ordering check: the caller applies a rank's reports in the order the rank
        sent them. An echo lower than an earlier one brings no dropped debit back."""
        state = self._state(rank)
        self._store(state, pab_tokens, echoed_dispatch_seq, class_budgets)
        state.report_timestamp = -math.inf

    @staticmethod
    def _store(state: _RankState, pab_tokens: float, echoed_dispatch_seq: int,
               class_budgets: Mapping[str, float] | None) -> None:
        state.reported_pab_tokens = pab_tokens
        state.reported_class_budgets = dict(class_budgets or {})
        state.echoed_dispatch_seq = echoed_dispatch_seq
        state.drop_debits_through(echoed_dispatch_seq)

    def reset(self, rank: Hashable) -> None:
        """Forget ``rank``'s report and debits (it restarted or left). Its dispatch numbers
        keep rising: a rank that rejoins may still echo ones handed out before."""
        state = self._ranks.pop(rank, None)
        if state is not None:
            self._ranks[rank] = _RankState(next_seq=state.next_seq)

    forget = reset

    def reported_budget(self, rank: Hashable) -> float | None:
        state = self._ranks.get(rank)
        return None if state is None else state.reported_pab_tokens

    def echoed_dispatch_seq(self, rank: Hashable) -> int:
        """The echo of the last report applied for ``rank`` (0: none)."""
        state = self._ranks.get(rank)
        return 0 if state is None else state.echoed_dispatch_seq

    def effective_budget(self, rank: Hashable, slo_class: str | None = None) -> float | None:
        """The reported budget of ``slo_class`` (None, or a class the report did not name:
        the default) minus outstanding debits; None if ``rank`` never reported."""
        state = self._ranks.get(rank)
        if state is None or state.reported_pab_tokens is None:
            return None
        reported = state.reported_class_budgets.get(slo_class, state.reported_pab_tokens)
        return reported - state.outstanding_tokens

    def effective_class_budgets(self, rank: Hashable) -> dict[str, float]:
        """Each class's reported budget minus outstanding debits (empty: none reported)."""
        state = self._ranks.get(rank)
        if state is None:
            return {}
        debit = state.outstanding_tokens
        return {name: tokens - debit for name, tokens in state.reported_class_budgets.items()}

    def reported_class_budgets(self, rank: Hashable) -> dict[str, float]:
        state = self._ranks.get(rank)
        return {} if state is None else dict(state.reported_class_budgets)

    def outstanding_tokens(self, rank: Hashable) -> int:
        state = self._ranks.get(rank)
        return 0 if state is None else state.outstanding_tokens

    def outstanding_dispatches(self, rank: Hashable) -> int:
        state = self._ranks.get(rank)
        return 0 if state is None else len(state.debits)

    def budgets(self, ranks: Iterable[Hashable],
                slo_class: str | None = None) -> dict[Hashable, float]:
        """Effective budgets (of ``slo_class``, as :meth:`effective_budget`) of those
        ``ranks`` that have reported."""
        out = {}
        for rank in ranks:
            budget = self.effective_budget(rank, slo_class)
            if budget is not None:
                out[rank] = budget
        return out


PabLedger = DispatchLedger
