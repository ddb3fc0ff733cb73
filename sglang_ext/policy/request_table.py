"""The active requests as columns: what lets a decision cost a few array operations
instead of Python work per request.

A :class:`RequestTable` is a list of request states (every policy reads it as the plain
sequence it is) that also carries the same requests as :class:`RequestColumns`, row
``i`` for item ``i``. The FairBatching decision's passes over every request (triage's
slack, the admission forecast's decode share and queue, the expiry check) run on the
columns when they are there, with the same floating-point operations in the same
order, so a decision is bit for bit the one the per-request loops make (``tests/policy/
test_request_table.py`` checks both paths against each other).

Engines build a table where they already touch every request each step (the SGLang
adapter, from its per-step views); :meth:`RequestTable.of` builds one from any
sequence of request states, reading each attribute once.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from sglang_ext.policy.view import RequestState

NO_FIRST_TOKEN = math.nan  # ``first`` of a request without a first token


@dataclass(frozen=True, slots=True)
class RequestColumns:
    """One array per field of :class:`~sglang_ext.policy.view.RequestState`, one row per
    request. Times and SLOs are float64, token counts and arrival numbers int64;
    ``first`` is :data:`NO_FIRST_TOKEN` for a request without a first token."""

    arrival: np.ndarray
    ttft: np.ndarray  # slo.ttft_s
    tpot: np.ndarray  # slo.tpot_s
    next_index: np.ndarray  # next_output_index
    pending: np.ndarray  # pending_prefill
    context: np.ndarray
    prompt: np.ndarray  # prompt_tokens
    seq: np.ndarray  # arrival_seq
    first: np.ndarray  # first_token_time

    @classmethod
    def of(cls, requests: Sequence[RequestState]) -> RequestColumns:
        slos = [request.slo for request in requests]
        return cls(
            np.array([request.arrival for request in requests], dtype=np.float64),
            np.array([slo.ttft_s for slo in slos], dtype=np.float64),
            np.array([slo.tpot_s for slo in slos], dtype=np.float64),
            _ints(request.next_output_index for request in requests),
            _ints(request.pending_prefill for request in requests),
            _ints(request.context for request in requests),
            _ints(request.prompt_tokens for request in requests),
            _ints(request.arrival_seq for request in requests),
            np.array([NO_FIRST_TOKEN if (first := request.first_token_time) is None else first
                      for request in requests], dtype=np.float64),
        )

    def take(self, rows: np.ndarray) -> RequestColumns:
        """The rows ``rows`` (indices or a mask), in that order."""
        return RequestColumns(
            self.arrival[rows], self.ttft[rows], self.tpot[rows], self.next_index[rows],
            self.pending[rows], self.context[rows], self.prompt[rows], self.seq[rows],
            self.first[rows],
        )

    def __len__(self) -> int:
        return len(self.arrival)


def _ints(values: Iterable[int]) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64)


class RequestTable(list):
    """The active requests, in the engine's order, with their :class:`RequestColumns`.

    ``columns`` must describe the items as they are when the decision reads them; an
    engine that changes a request rebuilds the table (the policy never mutates either).
    ``ids`` and ``objects`` are the items' request ids and the items as object arrays,
    for selecting rows without a Python loop."""

    __slots__ = ("_decoding", "_due", "_ids", "_objects", "_queued_rows", "columns")

    def __init__(self, requests: Iterable[RequestState], columns: RequestColumns | None = None):
        super().__init__(requests)
        if columns is None:
            columns = RequestColumns.of(self)
        elif len(columns) != len(self):
            raise ValueError(f"{len(columns)} rows of columns for {len(self)} requests")
        self.columns = columns
        self._ids: np.ndarray | None = None
        self._objects: np.ndarray | None = None
        self._due: np.ndarray | None = None
        self._decoding: np.ndarray | None = None
        self._queued_rows: np.ndarray | None = None

    @classmethod
    def of(cls, requests: Sequence[RequestState]) -> RequestTable:
        return cls(requests)

    @property
    def objects(self) -> np.ndarray:
        if self._objects is None:
            self._objects = np.fromiter(self, dtype=object, count=len(self))
        return self._objects

    @property
    def ids(self) -> np.ndarray:
        if self._ids is None:
            self._ids = np.fromiter([request.req_id for request in self], dtype=object,
                                    count=len(self))
        return self._ids

    @property
    def due(self) -> np.ndarray:
        """When each request's next token is due: ``arrival + ttft + tpot * next_index``
        (the paper's envelope, ``batch_former.token_deadline``), in that order."""
        if self._due is None:
            columns = self.columns
            self._due = columns.arrival + columns.ttft + columns.tpot * columns.next_index
        return self._due

    @property
    def decoding(self) -> np.ndarray:
        """Whether each request is decoding (no prompt tokens pending)."""
        if self._decoding is None:
            self._decoding = self.columns.pending == 0
        return self._decoding

    @property
    def queued_rows(self) -> np.ndarray:
        """The rows with prompt tokens pending, in order."""
        if self._queued_rows is None:
            self._queued_rows = (~self.decoding).nonzero()[0]
        return self._queued_rows

    def rows(self, rows: np.ndarray) -> RequestTable:
        """A table of the rows ``rows`` (indices or a mask), in that order."""
        return RequestTable(self.objects[rows].tolist(), self.columns.take(rows))

    def ids_at(self, rows: np.ndarray) -> list[Hashable]:
        return self.ids[rows].tolist()

    def at(self, rows: np.ndarray) -> list[RequestState]:
        return self.objects[rows].tolist()
