"""The live requests' columns, kept across steps, so a decision's
:class:`~sglang_ext.policy.request_table.RequestTable` costs a few appends per request
instead of reading every field of every view.

A :class:`RequestStore` holds what does not change while a request lives (arrival, SLO,
prompt, arrival number, ``max_new_tokens``, ``ignore_eos``) in one row per request,
written once when a decision first collects its view. A :class:`DecisionColumns` collects, in the
per-step view loops of ``sglang_ext.adapter.scheduler.requests``, what changes (the row,
the next output index, the first token's time, the outputs so far, and for a prefill its
pending and cached tokens); :meth:`DecisionColumns.table` joins the two. A row whose
request has not been seen for :data:`SWEEP_EVERY` decisions is reused; the view that held
it gets a new one if it is ever seen again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sglang_ext.policy import compiled
from sglang_ext.policy.request_table import RequestColumns, RequestTable

_NO_ROWS = np.zeros(0, dtype=np.intp)
INITIAL_ROWS = 512
SWEEP_EVERY = 256  # decisions between sweeps of the rows no decision has seen since the last
#: the fewest requests a decision reads as a table, on the compiled decision path and on
#: the pure-Python one: below, the per-request loops cost less than collecting the columns
#: and the array operations' fixed cost (measured: docs/results/decision-cost.md)
COMPILED_TABLE_MIN_REQUESTS = 128
PURE_TABLE_MIN_REQUESTS = 512


def table_min_requests() -> int:
    """The fewest requests a decision reads as a table on this process's decision path."""
    return COMPILED_TABLE_MIN_REQUESTS if compiled.built() else PURE_TABLE_MIN_REQUESTS


class RequestStore:
    """One row per live request view (``view.row``; -1: none yet)."""

    __slots__ = ("arrival", "ignore_eos", "last_seen", "max_new", "owners", "prompt", "seq",
                 "tpot", "ttft", "_decisions", "_free")

    def __init__(self, rows: int = INITIAL_ROWS) -> None:
        self.arrival = np.zeros(rows)
        self.ttft = np.zeros(rows)
        self.tpot = np.zeros(rows)
        self.prompt = np.zeros(rows, dtype=np.int64)
        self.seq = np.zeros(rows, dtype=np.int64)
        self.max_new = np.zeros(rows, dtype=np.int64)
        self.ignore_eos = np.zeros(rows, dtype=bool)
        self.last_seen = np.zeros(rows, dtype=np.int64)
        self.owners: list[Any] = [None] * rows
        self._free = list(range(rows - 1, -1, -1))
        self._decisions = 0

    def add(self, view: Any, max_new_tokens: int, ignore_eos: bool) -> int:
        """Gives ``view`` a row and writes its fields; returns the row."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.owners[row] = view
        view.row = row
        self.arrival[row] = view.arrival
        self.ttft[row] = view.slo.ttft_s
        self.tpot[row] = view.slo.tpot_s
        self.prompt[row] = view.prompt_tokens
        self.seq[row] = view.arrival_seq
        self.max_new[row] = max_new_tokens
        self.ignore_eos[row] = ignore_eos
        self.last_seen[row] = self._decisions
        return row

    def add_row(self, view: Any, req: Any) -> int:
        """:meth:`add` with the ``max_new_tokens`` and ``ignore_eos`` of SGLang's ``req``."""
        params = req.sampling_params
        return self.add(view, params.max_new_tokens or 0, bool(params.ignore_eos))

    def moved(self, view: Any) -> None:
        """``view.arrival`` changed (a request that came during the start-up calibration)."""
        if view.row >= 0:
            self.arrival[view.row] = view.arrival

    def seen(self, rows: np.ndarray = _NO_ROWS) -> None:
        """A decision read ``rows`` (none: it read no table); every :data:`SWEEP_EVERY`
        decisions the rows none has read since the last sweep are freed (their requests
        finished or were aborted)."""
        self._decisions += 1
        self.last_seen[rows] = self._decisions
        if self._decisions % SWEEP_EVERY:
            return
        stale = np.flatnonzero(self.last_seen <= self._decisions - SWEEP_EVERY)
        owners = self.owners
        for row in stale.tolist():
            view = owners[row]
            if view is not None:
                view.row = -1
                owners[row] = None
                self._free.append(row)

    @property
    def rows_in_use(self) -> int:
        return len(self.owners) - len(self._free)

    def _grow(self) -> None:
        old = len(self.owners)
        for name in ("arrival", "ttft", "tpot", "prompt", "seq", "max_new", "ignore_eos",
                     "last_seen"):
            column = getattr(self, name)
            setattr(self, name, np.concatenate((column, np.zeros_like(column))))
        self.owners.extend([None] * old)
        self._free.extend(range(2 * old - 1, old - 1, -1))


class DecisionColumns:
    """What one decision's view loops collect: decodes first, then prefills, in the order
    of the views (``sglang_ext.adapter.scheduler.requests``)."""

    __slots__ = ("decode_first", "decode_next", "decode_outputs", "decode_rows", "prefill_context",
                 "prefill_first", "prefill_next", "prefill_outputs", "prefill_pending",
                 "prefill_rows", "store_rows")

    def __init__(self) -> None:
        self.decode_rows: list[int] = []
        self.decode_next: list[int] = []
        self.decode_first: list[float] = []
        self.decode_outputs: list[int] = []
        self.prefill_rows: list[int] = []
        self.prefill_next: list[int] = []
        self.prefill_pending: list[int] = []
        self.prefill_context: list[int] = []
        self.prefill_first: list[float] = []
        self.prefill_outputs: list[int] = []
        self.store_rows: np.ndarray | None = None  # set by table(), when collected whole

    def table(self, views: list[Any], store: RequestStore) -> RequestTable:
        """``views`` (the decode views, then the prefill views, as collected) as a table;
        views collected otherwise (some left out after the loops) are read one by one."""
        decodes = len(self.decode_rows)
        count = decodes + len(self.prefill_rows)
        if len(views) != count:
            return RequestTable(views)
        if compiled.decision_columns is not None:
            ints = np.empty((6, count), dtype=np.int64)
            floats = np.empty((4, count), dtype=np.float64)
            compiled.decision_columns(
                self.decode_rows, self.decode_next, self.decode_first, self.prefill_rows,
                self.prefill_next, self.prefill_pending, self.prefill_context, self.prefill_first,
                store.arrival, store.ttft, store.tpot, store.prompt, store.seq, ints, floats)
            rows, next_index, pending, context, prompt, seq = ints
            arrival, ttft, tpot, first = floats
            columns = RequestColumns(arrival, ttft, tpot, next_index, pending, context, prompt,
                                     seq, first)
        else:
            rows = np.array(self.decode_rows + self.prefill_rows, dtype=np.intp)
            columns = self._reference_columns(rows, store)
        store.seen(rows)
        self.store_rows = rows
        return RequestTable(views, columns)

    def _reference_columns(self, rows: np.ndarray, store: RequestStore) -> RequestColumns:
        """What ``compiled.decision_columns`` fills, in numpy."""
        decodes = len(self.decode_rows)
        prompt = store.prompt[rows]
        next_index = np.array(self.decode_next + self.prefill_next, dtype=np.int64)
        pending = np.zeros(len(rows), dtype=np.int64)
        pending[decodes:] = self.prefill_pending
        context = np.empty(len(rows), dtype=np.int64)
        context[:decodes] = prompt[:decodes] + next_index[:decodes]
        context[decodes:] = self.prefill_context
        return RequestColumns(
            store.arrival[rows], store.ttft[rows], store.tpot[rows], next_index, pending, context,
            prompt, store.seq[rows],
            np.array(self.decode_first + self.prefill_first, dtype=np.float64),
        )

    @property
    def outputs(self) -> list[int]:
        """``len(req.output_ids)`` of each view, decodes then prefills."""
        return self.decode_outputs + self.prefill_outputs

