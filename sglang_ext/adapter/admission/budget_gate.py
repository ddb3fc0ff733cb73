"""The admission gate's decision (admission mode ``reject``), pure: which rank's published
budget a request is checked against, the debit between publications, staleness.

Each scheduler publishes, in its load snapshot, the prompt tokens a new request of each
SLO class may bring (``sglang_ext.policy.admission``; ``fairbatching_admission``). The
HTTP process reads those snapshots (:mod:`sglang_ext.adapter.admission.budget_refusal`) and asks
:meth:`BudgetGate.check`:

- the budget of the request's class; a request whose SLO is no class's (explicit
  ``ttft_ms`` or ``e2e_ms``) gets ``admission.budget_for`` over the classes' TTFTs, with
  the largest prefill rate the initial step model allows (``1 / b``: the most
  conservative extrapolation below the smallest class TTFT). An end-to-end SLO's TTFT,
  its class's or its own, is its envelope's first-token budget (``Slo.ttft_s``);
- less a local debit: the prompt tokens admitted to that rank that its snapshot does
  not count yet, so a burst between two publications is not all admitted on one value.
  Each admission the gate checked is numbered (``ADMISSION_STAMP_KEY`` in the request's
  ``custom_params``: the gate's token and the number); a scheduler echoes, per gate, the
  highest number among the requests its published budgets count
  (``fairbatching_admission_echo``). A debit ends when its rank echoes its number, or
  when that rank has published for ``max_budget_age_s`` after it without counting it
  (it was routed to another rank). A snapshot's time alone cannot end a debit: SGLang
  publishes after the step it launched, and a request admitted while that step ran is
  still on its way to the scheduler, so a debit reset on every newer snapshot let
  bursts through at up to twice the budget;
- a request pinned to a DP rank is checked against that rank; otherwise against the
  rank with the most budget left (the DP controller routes it on its own; the debit
  lands on the rank checked).

A rank publishes at every prefill step, every 15th decode step
(``--load-snapshot-publish-interval``), every 50 ms while it stalls with work queued,
and once when it goes idle; an idle rank then sleeps and publishes nothing until a
request arrives. So the snapshot of an idle rank (nothing running or waiting) stays
valid however old it is: nothing reaches the rank but through this gate, which debits
it. A busy rank's snapshot older than ``max_budget_age_s``, or one without budgets (a
rank that has not published yet, or runs without admission), is not trusted: the
request is admitted unchecked (fail open) and the verdict says why, for the caller to
count. Refusing on an
unknown load would turn a slow publisher (a long prefill step, a paused rank) into an
outage; admitting costs at most one stale interval of excess, which the scheduler's
deadline order absorbs.
"""

from __future__ import annotations

import math
import secrets
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sglang_ext.policy.admission import AdmissionSettings, budget_for
from sglang_ext.policy.slo import Slo, SloCatalog

#: ``Verdict.unchecked`` values
STALE = "stale"
UNPUBLISHED = "unpublished"
#: the metric label of a request whose SLO is no class's
CUSTOM_CLASS = "custom"
#: ``custom_params`` key of the gate's stamp: ``[gate token, admission number]``
ADMISSION_STAMP_KEY = "_fairbatching_admission"


@dataclass(frozen=True, slots=True)
class PublishedBudgets:
    """One rank's budgets as its last load snapshot carries them."""

    rank: int
    timestamp: float  # wall clock (time.time()) of the snapshot
    budgets: Mapping[str, int] | None  # SLO class -> prompt tokens; None: none published
    idle: bool = False  # nothing running or waiting there when it published
    echoed: int = 0  # the highest admission number of this gate the budgets count


@dataclass(frozen=True, slots=True)
class Verdict:
    admitted: bool
    slo_class: str
    rank: int | None = None  # the rank checked against (None: unchecked)
    budget: float | None = None  # tokens that rank had left for the class, before this prompt
    unchecked: str | None = None  # STALE or UNPUBLISHED: admitted without a trusted budget
    seq: int | None = None  # the admission's number (checked admissions only)


@dataclass(frozen=True, slots=True)
class _Debit:
    seq: int
    admitted_at: float
    prompt_tokens: int


class _RankDebits:
    """Admissions charged to one rank that its published budgets do not count yet.

    Not ``controlplane.ledger.DispatchLedger``: that numbers dispatches per rank and keeps
    a debit until echoed, which suits a dispatcher that decides the rank. Here the DP
    controller may route elsewhere, so numbers are per gate (one echo settles any rank)
    and a debit its rank keeps publishing without also ends (``settle``)."""

    __slots__ = ("debits", "tokens")

    def __init__(self) -> None:
        self.debits: deque[_Debit] = deque()
        self.tokens = 0

    def settle(self, published: PublishedBudgets, max_unseen_s: float) -> int:
        debits = self.debits
        while debits and (debits[0].seq <= published.echoed
                          or published.timestamp - debits[0].admitted_at > max_unseen_s):
            self.tokens -= debits.popleft().prompt_tokens
        return self.tokens


class BudgetGate:
    """Not thread-safe: one per TokenizerManager, called from its event loop."""

    def __init__(self, catalog: SloCatalog, settings: AdmissionSettings,
                 max_rate_tokens_per_s: float) -> None:
        if not (math.isfinite(max_rate_tokens_per_s) and max_rate_tokens_per_s > 0):
            raise ValueError(f"max_rate_tokens_per_s must be > 0, got {max_rate_tokens_per_s!r}")
        self.catalog = catalog
        self.settings = settings
        self.max_rate = max_rate_tokens_per_s
        self._class_of = {slo: name for name, slo in catalog.classes.items()}
        self.token = secrets.token_hex(8)  # names this gate in the schedulers' echoes
        self._next_seq = 1
        self._debits: dict[int, _RankDebits] = {}

    def class_of(self, slo: Slo) -> str:
        return self._class_of.get(slo, CUSTOM_CLASS)

    def budget(self, budgets: Mapping[str, int], slo: Slo) -> float:
        """The budget a request with ``slo`` gets from one rank's published ``budgets``."""
        name = self._class_of.get(slo)
        if name is not None and name in budgets:
            return budgets[name]
        by_ttft: dict[float, float] = {}
        for class_name, tokens in budgets.items():
            class_slo = self.catalog.classes.get(class_name)
            if class_slo is not None:
                ttft = class_slo.ttft_s
                by_ttft[ttft] = min(by_ttft.get(ttft, math.inf), tokens)
        if not by_ttft:
            return math.inf
        return budget_for(by_ttft, slo.ttft_s, self.max_rate)

    def debit_of(self, published: PublishedBudgets) -> int:
        """Prompt tokens admitted to ``published.rank`` that its budgets do not count."""
        debits = self._debits.get(published.rank)
        if debits is None:
            return 0
        return debits.settle(published, self.settings.max_budget_age_s)

    def stamp(self, seq: int) -> list[Any]:
        """The ``ADMISSION_STAMP_KEY`` value of admission ``seq``."""
        return [self.token, seq]

    def check(self, published: Sequence[PublishedBudgets], now: float, slo: Slo,
              prompt_tokens: int, pinned_rank: int | None = None) -> Verdict:
        slo_class = self.class_of(slo)
        fresh: list[tuple[float, PublishedBudgets]] = []
        unchecked = None
        for rank in published:
            if pinned_rank is not None and rank.rank != pinned_rank:
                continue
            if rank.budgets is None:
                unchecked = unchecked or UNPUBLISHED
                continue
            if not rank.idle and now - rank.timestamp > self.settings.max_budget_age_s:
                unchecked = STALE
                continue
            left = self.budget(rank.budgets, slo) - self.debit_of(rank)
            fresh.append((left, rank))
        if not fresh and unchecked is None:
            unchecked = UNPUBLISHED
        best = max(fresh, key=lambda item: item[0], default=None)
        if best is not None and prompt_tokens <= best[0]:
            left, rank = best
            seq = self._next_seq
            self._next_seq = seq + 1
            debits = self._debits.setdefault(rank.rank, _RankDebits())
            debits.debits.append(_Debit(seq, now, prompt_tokens))
            debits.tokens += prompt_tokens
            return Verdict(True, slo_class, rank.rank, left, seq=seq)
        if unchecked is not None:
            return Verdict(True, slo_class, unchecked=unchecked)
        left, rank = best
        return Verdict(False, slo_class, rank.rank, left)
