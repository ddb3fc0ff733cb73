"""FairBatching's triage, smooth step and packing on a :class:`RequestTable`'s rows.

The same decision as :func:`~sglang_ext.policy.batch_former.triage`,
:func:`~sglang_ext.policy.batch_former.smooth_step` and
:func:`~sglang_ext.policy.batch_former.pack`, with the passes over every request done as
array operations: each slack and cost is the same floating-point operations on the same
values, sums of floats run left to right (a cumulative sum), and a stable sort of rows in
the table's order is the lists' stable sort. Only the queued prefills, the deferred
decodes that do not all fit and the final request ids leave the arrays. A policy given a
table triages it here (``_LatenessGuarded._triage``); ``smooth_step`` and ``pack`` hand
:class:`RowGroups` to their methods, and it reads as a :class:`Triage` (its groups as
(slack, request) lists) to any caller that needs the lists.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from sglang_ext.policy import compiled
from sglang_ext.policy.batch_former import (
    ServiceFloor,
    Triage,
    _misses_first_prefill,
    _pack_deferrable,
    _pack_prefills,
    _Step,
    initial_time_budget,
)
from sglang_ext.policy.knee_step_model import KneeStepModel
from sglang_ext.policy.request_table import RequestColumns, RequestTable
from sglang_ext.policy.step_model import StepCoefficients, StepPredictor
from sglang_ext.policy.view import BatchDecision, RequestState

_NO_ROWS = np.zeros(0, dtype=np.intp)
# the ufuncs' own reductions: the array methods add a Python call each
_sum, _min, _running_sum = np.add.reduce, np.minimum.reduce, np.add.accumulate


@dataclass(frozen=True, slots=True)
class RowGroups:
    """:class:`Triage`'s groups as rows of ``table``: urgent, prefill and deferrable rows
    by slack, late rows in arrival order. ``slack`` is per row: less the deadline guard
    for rows in time, as the deadline puts it for late ones."""

    table: RequestTable
    slack: np.ndarray
    init_time_budget_s: float
    min_tpot_s: float
    urgent_rows: np.ndarray
    prefill_rows: np.ndarray
    deferrable_rows: np.ndarray
    late_decode_rows: np.ndarray
    late_prefill_rows: np.ndarray
    late_decode_tpot_s: float = math.inf
    decoding_context: int | None = None  # of every decoding row; None: summed when needed

    @property
    def step_tpot_s(self) -> float:
        return self.min_tpot_s if self.min_tpot_s < self.late_decode_tpot_s else self.late_decode_tpot_s

    def _pairs(self, rows: np.ndarray) -> list[tuple[float, RequestState]]:
        return list(zip(self.slack[rows].tolist(), self.table.at(rows)))

    # Triage's groups, as (slack, request) lists
    urgent_decodes = property(lambda self: self._pairs(self.urgent_rows))
    prefills = property(lambda self: self._pairs(self.prefill_rows))
    deferrable_decodes = property(lambda self: self._pairs(self.deferrable_rows))
    late_decodes = property(lambda self: self._pairs(self.late_decode_rows))
    late_prefills = property(lambda self: self._pairs(self.late_prefill_rows))

    def as_triage(self) -> Triage:
        return Triage(self.init_time_budget_s, self.min_tpot_s, self.urgent_decodes,
                      self.prefills, self.deferrable_decodes, self.late_decodes,
                      self.late_prefills, late_decode_tpot_s=self.late_decode_tpot_s)

    def steady(self, time_budget_s: float) -> RowGroups:
        """:meth:`Triage.steady`."""
        return replace(self, init_time_budget_s=time_budget_s, deferrable_rows=_NO_ROWS,
                       urgent_rows=np.concatenate((self.urgent_rows, self.deferrable_rows)))

    def smooth_step(self, coefficients: StepPredictor, time_budget_s: float) -> RowGroups | None:
        """:func:`~sglang_ext.policy.batch_former.smooth_step`."""
        if not math.isfinite(time_budget_s) or time_budget_s <= 0.0:
            return None
        prefill_rows = self.prefill_rows
        if len(prefill_rows):
            table = self.table
            decode_tokens = (len(self.urgent_rows) + len(self.late_decode_rows)
                             + len(self.deferrable_rows))
            first = prefill_rows[0]
            if _misses_first_prefill((float(self.slack[first]), table[first]), coefficients,
                                     time_budget_s, decode_tokens):
                return None
            columns = table.columns
            context = self.decoding_context
            if context is None:
                context = int(_sum(columns.context[table.decoding]))
            spare = time_budget_s - coefficients.step_s(decode_tokens, 0, decode_tokens, context, 0.0)
            if spare <= 0.0:
                return None
            steps_per_second = time_budget_s / spare
            if _prefills_late(coefficients, columns, self.slack, prefill_rows, decode_tokens,
                              steps_per_second, time_budget_s):
                return None
        return self.steady(time_budget_s)

    def pack(self, coefficients: StepPredictor, *, token_budget: int,
             time_budget_s: float | None) -> BatchDecision:
        """:func:`~sglang_ext.policy.batch_former.pack`."""
        table = self.table
        contexts = table.columns.context
        always = np.concatenate((self.urgent_rows, self.late_decode_rows))
        decode_ids = table.ids_at(always)
        step = _Step(coefficients, len(always), int(_sum(contexts[always])))
        budget = math.inf if time_budget_s is None else time_budget_s
        chunks: list = []
        tokens_left = token_budget - len(always)
        room = tokens_left > 0
        for rows in (self.prefill_rows, self.late_prefill_rows):
            if not room:
                break
            pairs = zip(itertools.repeat(0.0), table.at(rows))  # _pack_prefills reads requests
            room, tokens_left = _pack_prefills(pairs, step, budget, tokens_left, chunks)
        deferrable = self.deferrable_rows
        if len(deferrable) and tokens_left > 0:
            count = len(deferrable)
            if count <= tokens_left and (coefficients.usable() is not coefficients
                                         or step.with_decodes(count, 0) <= budget):
                context = int(_sum(contexts[deferrable]))
                predicted = step.with_decodes(count, context)
                if predicted <= budget:
                    decode_ids.extend(table.ids_at(deferrable))
                    step.add_decodes(count, context, predicted)
                    deferrable = _NO_ROWS
            if len(deferrable):
                _pack_deferrable(self._pairs(deferrable), step, budget, tokens_left, decode_ids)
        return BatchDecision(tuple(decode_ids), tuple(chunks), step.predicted, time_budget_s)


def triage_rows(
    table: RequestTable, now: float, anchored: bool, floor: ServiceFloor | None,
    hopeless: frozenset, deadline_guard_s: float,
) -> RowGroups:
    """:func:`~sglang_ext.policy.batch_former.triage` of a non-empty table."""
    if compiled.triage is not None:
        return _compiled_triage(table, now, anchored, floor, hopeless, deadline_guard_s)
    columns = table.columns
    tpot = columns.tpot
    due = table.due
    if anchored:  # after a first token its deadline is first + tpot * j
        index, first = columns.next_index, columns.first
        anchor = (index != 0) & ~np.isnan(first)
        if np.count_nonzero(anchor):
            due = np.where(anchor, first + tpot * index, due)
    slack = due - now
    decoding = table.decoding
    serviceable = -math.inf
    late = None
    if floor is not None:
        serviceable = floor.min_serviceable_tpot_s
        late = (slack < 0.0) | (tpot < serviceable)
    if hopeless:
        queued = table.queued_rows
        marked = np.array([req_id in hopeless for req_id in table.ids_at(queued)], dtype=bool)
        if np.count_nonzero(marked):
            late = np.zeros(len(table), dtype=bool) if late is None else late
            late[queued[marked]] = True
    guarded = slack - deadline_guard_s if deadline_guard_s else slack
    if late is not None and np.count_nonzero(late):
        in_time = (~late).nonzero()[0]
        order = in_time[guarded[in_time].argsort(kind="stable")]
        late_rows = late.nonzero()[0]
        late_rows = late_rows[columns.seq[late_rows].argsort(kind="stable")]
        late_decoding = decoding[late_rows]
        late_decode_rows, late_prefill_rows = late_rows[late_decoding], late_rows[~late_decoding]
        if deadline_guard_s:
            guarded = guarded.copy()
            guarded[late_rows] = slack[late_rows]
    else:
        order = guarded.argsort(kind="stable")
        late_decode_rows = late_prefill_rows = _NO_ROWS
    order_decoding = decoding[order]
    decode_rows, prefill_rows = order[order_decoding], order[~order_decoding]
    min_tpot = float(_min(tpot[order])) if len(order) else math.inf
    late_tpot = math.inf
    if len(late_decode_rows):
        late_tpot = float(_min(np.maximum(tpot[late_decode_rows], serviceable)))
    min_slack = float(guarded[order[0]]) if len(order) else None
    init_time_budget = initial_time_budget(min_slack, min_tpot, late_tpot, floor, deadline_guard_s)
    split = int(np.searchsorted(guarded[decode_rows], init_time_budget + min_tpot, side="left"))
    return RowGroups(table, guarded, init_time_budget, min_tpot, decode_rows[:split], prefill_rows,
                     decode_rows[split:], late_decode_rows, late_prefill_rows, late_tpot)


def _compiled_triage(
    table: RequestTable, now: float, anchored: bool, floor: ServiceFloor | None,
    hopeless: frozenset, deadline_guard_s: float,
) -> RowGroups:
    """:func:`triage_rows` by the compiled path (``compiled.triage``): the rows in one
    array, in-time decodes, in-time prefills, late decodes, late prefills, each group a
    slice of it."""
    columns = table.columns
    count = len(table)
    slack = np.empty(count, dtype=np.float64)
    rows = np.empty(count, dtype=np.intp)
    init_time_budget, min_tpot, late_tpot, urgent, decodes, prefills, late_decodes, context = (
        compiled.triage(
            table, columns.arrival, columns.ttft, columns.tpot, columns.pending, columns.context,
            columns.seq, columns.next_index, columns.first, now, anchored,
            None if floor is None else (floor.min_serviceable_tpot_s, floor.fallback_budget_s,
                                        floor.min_budget_s),
            hopeless, deadline_guard_s, slack, rows))
    return RowGroups(table, slack, init_time_budget, min_tpot, rows[:urgent],
                     rows[decodes:prefills], rows[urgent:decodes],
                     rows[prefills:late_decodes], rows[late_decodes:], late_tpot, context)


def _prefills_late(
    coefficients: StepPredictor, columns: RequestColumns, slack: np.ndarray, rows: np.ndarray,
    base_tokens: int, steps_per_second: float, time_budget_s: float,
) -> bool:
    """Whether a prefill of ``rows``, served in that order at ``steps_per_second`` with its
    costs summed left to right, ends past its slack (compiled where it is built, for the
    two step models)."""
    prefills_late = compiled.prefills_late
    if prefills_late is not None:
        if type(coefficients) is KneeStepModel:
            return prefills_late(
                columns.pending, columns.context, slack, rows, coefficients.knee_tokens,
                coefficients.b_s_per_token, coefficients.c_s_per_prefill_context_token,
                coefficients.e_s_per_pair, base_tokens, steps_per_second, time_budget_s)
        if type(coefficients) is StepCoefficients:
            return prefills_late(
                columns.pending, columns.context, slack, rows, None, coefficients.b_s_per_token,
                coefficients.c_s_per_context_token, 0.0, base_tokens, steps_per_second,
                time_budget_s)
    queued = _running_sum(prefill_costs_s(
        coefficients, columns.pending[rows], columns.context[rows], base_tokens))
    return bool(np.count_nonzero(queued * steps_per_second + time_budget_s > slack[rows]))


def prefill_costs_s(coefficients: StepPredictor, chunks: np.ndarray, prefixes: np.ndarray,
                    base_tokens: int) -> np.ndarray:
    """``coefficients.prefill_cost_s(chunk, prefix, base_tokens)`` of each pair, by the
    model's own operations (the two step models; any other predictor is called)."""
    if type(coefficients) is KneeStepModel:
        knee = coefficients.knee_tokens
        before = base_tokens if base_tokens > knee else knee
        after = np.maximum(base_tokens + chunks, knee)
        return (coefficients.b_s_per_token * (after - before)
                + coefficients.c_s_per_prefill_context_token * prefixes
                + coefficients.e_s_per_pair * chunks * (prefixes + (chunks + 1) / 2.0))
    if type(coefficients) is StepCoefficients:
        return coefficients.b_s_per_token * chunks + coefficients.c_s_per_context_token * prefixes
    return np.array([coefficients.prefill_cost_s(chunk, prefix, base_tokens)
                     for chunk, prefix in zip(chunks.tolist(), prefixes.tolist())], dtype=np.float64)
