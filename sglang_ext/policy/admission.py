"""Admission: which arriving prompt a rank can still prefill within its TTFT, per SLO class.

One model for every path (the simulator's engine, the scheduler that publishes budgets,
the HTTP process that refuses with 429) and both modes:

- ``reject``: an arrival whose prompt exceeds its class's budget is refused.
- ``defer``: nothing is refused; a queued prefill the forecast cannot finish before its
  TTFT deadline is *hopeless* and joins the late requests of the lateness guard
  (``sglang_ext.policy.batch_former``): served after every request still in time, never
  setting the time budget, and ended if it still has no first token ``max_defer_s``
  after its TTFT deadline.

The forecast (the ``edf`` rule). FairBatching serves queued prefills in deadline order;
model that queue as one earliest-deadline-first server of rate ``R`` prompt tokens per
second, where ``R`` is what the step model leaves for prefill once every request gets a
token once per TPOT (a queued prefill counted as the decode it is about to become, its
context its prompt: the decode load that arrives after admission) and every step pays
its fixed cost, less a ``headroom`` fraction for the forecast's own error::

    R = (1 - a / period - sum_i (b + c * (context_i + pending_i)) / tpot_i) / b * (1 - headroom)

(``period`` is the smallest TPOT present, the step cadence FairBatching keeps under load).
Scanning the in-time prefills by deadline, each one that fits (work before it plus its
own pending tokens <= ``R * (deadline - now)``) is *feasible* and leaves ``spare`` tokens;
one that does not is hopeless and its work is not counted (it is served after the others).
Under ``defer`` the scan keeps the most prefills on time instead (Moore-Hodgson's rule
for the fewest late jobs on one machine): when an entry does not fit, the not-yet-started
entry so far with the largest eviction key is hopeless instead, which may be an earlier
one. The key weighs the entry's prompt against a fixed pseudo-random draw
(``length_weight``, :class:`GiveUp`): at weight 1 it is the pending tokens, so a long
prompt yields to several short ones that can all still make their TTFT (the most on
time); at 0 it is the draw alone, blind to length. A prefill already under way is dropped
only when it cannot finish in time itself.
A new request of TTFT ``T`` gets::

    budget(T) = min( R * T - work of feasible entries due by now + T,
                     min spare over feasible entries due after now + T )

so it is refused if its own prefill cannot finish in time, or if serving it first (its
deadline is earlier) would make a request already admitted miss its TTFT. An arrival that
already waited (admitted after the step under way) has that much less TTFT.

KV memory (a :class:`KvOutlook`, when the engine gives one). A prefill starts only when
its prompt and the outputs it reserves fit in the KV memory the rank has free; a rank
whose memory is committed to running requests prefills only as they finish, whatever the
step model leaves. Scanning the same queue, each feasible entry also needs the KV of the
entries before it plus its own by its latest start (deadline less its prefill at ``R``),
counting what running requests give back by then (each when its last token is due);
otherwise it is hopeless. An arrival's budget is then also at most::

    max over t in [now, now + T]:  min( A(t) - KV of feasible entries due by now + T - r,
                                        R * (now + T - t) )

(``A(t)`` the KV free by ``t``, ``r`` what a new arrival reserves for its outputs) and
the least KV spare of the feasible entries due after ``now + T``, less ``r``.

Why not the paper's PAB (measured in ``docs/admission.md``): PAB assumes every decode is
deferred until its slack runs out, so it credits the prefill with time the decodes
actually take, ignores the decodes that admitted prefills become, and subtracts queued
prompts without their deadlines.

The ``pab`` rule is the paper's Prefill Admission Budget (``sglang_ext.policy.pab``),
evaluated with each class's SLO as the global one; kept to measure against.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import compress, islice
from operator import eq, itemgetter

import numpy as np

from sglang_ext.policy import compiled
from sglang_ext.policy.knee_step_model import KneeStepModel
from sglang_ext.policy.pab import prefill_admission_budget
from sglang_ext.policy.request_table import RequestTable
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_model import StepCoefficients, StepPredictor
from sglang_ext.policy.view import RequestState

DEFAULT_MAX_DEFER_S = 2.0
DEFAULT_RETRY_AFTER_S = 1.0
DEFAULT_MAX_BUDGET_AGE_S = 0.5
DEFAULT_HEADROOM = 0.1


class AdmissionError(ValueError):
    """Contradictory or malformed admission settings."""


class AdmissionMode(str, Enum):
    OFF = "off"
    REJECT = "reject"
    DEFER = "defer"


class AdmissionRule(str, Enum):
    EDF = "edf"
    PAB = "pab"


class GiveUp(str, Enum):
    """Which queued prefill ``defer`` gives up when not all can make their TTFT, by name:
    ``longest`` (length weight 1: the most on time; long prompts pay), ``fair`` (weight 0:
    a not-yet-started one drawn without regard to length, each request's place in a fixed
    pseudo-random order, so every prompt length gives up about the same share of its
    requests) or ``latest`` (no eviction: the one that does not fit, in deadline order; a
    short prompt behind it may still fit where a long one would not, so long prompts
    still pay). A number between 0 and 1 is the weight itself (:func:`eviction_key`)."""

    LONGEST = "longest"
    LATEST = "latest"
    FAIR = "fair"


_NAMED_WEIGHTS = {GiveUp.LONGEST: 1.0, GiveUp.FAIR: 0.0, GiveUp.LATEST: None}


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """``[admission]`` of the extension's config and ``--admission`` of the simulator.

    ``max_budget_age_s`` bounds how stale a published budget the HTTP process may use
    (older: it refuses on "unknown load" only if ``reject_when_stale``, else admits);
    ``retry_after_s`` is the ``Retry-After`` of a refusal."""

    mode: AdmissionMode = AdmissionMode.OFF
    rule: AdmissionRule = AdmissionRule.EDF
    max_defer_s: float = DEFAULT_MAX_DEFER_S
    retry_after_s: float = DEFAULT_RETRY_AFTER_S
    max_budget_age_s: float = DEFAULT_MAX_BUDGET_AGE_S
    headroom: float = DEFAULT_HEADROOM
    give_up: GiveUp | float | None = None  # defer only; None: longest; a number: the length weight

    def __post_init__(self) -> None:
        if not isinstance(self.mode, AdmissionMode):
            raise AdmissionError(f"admission mode must be one of {_names(AdmissionMode)}")
        if not isinstance(self.rule, AdmissionRule):
            raise AdmissionError(f"admission rule must be one of {_names(AdmissionRule)}")
        if self.mode is AdmissionMode.DEFER and self.rule is AdmissionRule.PAB:
            raise AdmissionError(
                "admission rule 'pab' only rejects; defer needs the per-request forecast "
                "of rule 'edf'"
            )
        if self.give_up is not None:
            if not isinstance(self.give_up, GiveUp) and not _is_weight(self.give_up):
                raise AdmissionError(
                    f"admission give_up must be one of {_names(GiveUp)} or a length weight "
                    f"from 0 (blind to length) to 1 (longest), got {self.give_up!r}"
                )
            if self.mode is not AdmissionMode.DEFER:
                raise AdmissionError(
                    "admission give_up chooses what mode 'defer' serves last; "
                    f"mode {self.mode.value!r} gives nothing up"
                )
        for name in ("max_defer_s", "retry_after_s", "max_budget_age_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value > 0
            ):
                raise AdmissionError(f"admission {name} must be a finite number > 0, got {value!r}")
        if isinstance(self.headroom, bool) or not isinstance(self.headroom, (int, float)) or not (
            0.0 <= self.headroom < 1.0
        ):
            raise AdmissionError(f"admission headroom must be a number in [0, 1), got {self.headroom!r}")

    @classmethod
    def parse(
        cls, mode: str, rule: str = AdmissionRule.EDF.value, give_up: str | float | None = None,
        **numbers: float,
    ) -> AdmissionSettings:
        parsed_give_up = None if give_up is None else parse_give_up(give_up)
        try:
            parsed_mode = AdmissionMode(mode)
        except ValueError:
            raise AdmissionError(
                f"unknown admission mode {mode!r}; expected one of {_names(AdmissionMode)}"
            ) from None
        try:
            parsed_rule = AdmissionRule(rule)
        except ValueError:
            raise AdmissionError(
                f"unknown admission rule {rule!r}; expected one of {_names(AdmissionRule)}"
            ) from None
        return cls(parsed_mode, parsed_rule, give_up=parsed_give_up, **numbers)

    @property
    def length_weight(self) -> float | None:
        """The forecast's eviction under ``defer`` (:func:`eviction_key`): 1 (``longest``,
        the default) to 0 (``fair``); None where nothing is evicted (``latest``, or not
        ``defer``)."""
        if self.mode is not AdmissionMode.DEFER:
            return None
        if self.give_up is None:
            return 1.0
        if isinstance(self.give_up, GiveUp):
            return _NAMED_WEIGHTS[self.give_up]
        return float(self.give_up)

    @property
    def label(self) -> str:
        """``reject``, ``defer``, ``defer:latest``, ``defer:fair``, ``defer:0.5`` or
        ``reject:pab``, then ``:max_defer=S`` and ``:headroom=H`` where they are not the
        defaults (the simulator's policy-label suffix)."""
        parts = [self.mode.value]
        if self.rule is not AdmissionRule.EDF:
            parts.append(self.rule.value)
        if isinstance(self.give_up, GiveUp):
            if self.give_up is not GiveUp.LONGEST:
                parts.append(self.give_up.value)
        elif self.give_up is not None and self.give_up != 1.0:
            parts.append(f"{self.give_up:g}")
        if self.max_defer_s != DEFAULT_MAX_DEFER_S:
            parts.append(f"max_defer={self.max_defer_s:g}")
        if self.headroom != DEFAULT_HEADROOM:
            parts.append(f"headroom={self.headroom:g}")
        return ":".join(parts)


def parse_give_up(value: str | float) -> GiveUp | float:
    """A ``give_up`` as a config or the simulator names it: a :class:`GiveUp` name, or a
    length weight in [0, 1] (a number, or its text)."""
    if isinstance(value, str):
        try:
            return GiveUp(value)
        except ValueError:
            pass
        try:
            value = float(value)
        except ValueError:
            raise AdmissionError(
                f"unknown admission give_up {value!r}; expected one of {_names(GiveUp)} or a "
                "length weight from 0 (blind to length) to 1 (longest)"
            ) from None
    if not _is_weight(value):
        raise AdmissionError(
            f"admission give_up {value!r} is not a length weight from 0 (blind to length) "
            "to 1 (longest)"
        )
    return float(value)


def _is_weight(value: object) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value) and 0.0 <= value <= 1.0)


def _names(enum: type[Enum]) -> str:
    return ", ".join(repr(member.value) for member in enum)


def prefill_rate(
    requests: Sequence[RequestState], coefficients: StepPredictor, default_tpot_s: float,
    headroom: float = 0.0,
) -> float:
    """Prompt tokens per second left for prefill (module docstring); >= 0."""
    usable = coefficients.usable()
    period = default_tpot_s
    decode_share = 0.0
    decodes = len(requests)
    terms = _decode_cost_terms(usable, decodes)
    if terms is None:
        decode_cost_s = usable.decode_cost_s
        for request in requests:
            tpot = request.slo.tpot_s
            if tpot < period:
                period = tpot
            decode_share += decode_cost_s(request.context + request.pending_prefill, decodes) / tpot
    else:
        # the model's decode_cost_s, inlined (two calls per request, every step)
        fixed, per_kv_token, scale = terms
        for request in requests:
            tpot = request.slo.tpot_s
            if tpot < period:
                period = tpot
            decode_share += (fixed + per_kv_token * (request.context + request.pending_prefill)
                             * scale) / tpot
    free = 1.0 - usable.a_s / period - decode_share
    return max(0.0, free) / usable.b_s_per_token * (1.0 - headroom)


def _decode_cost_terms(model: StepPredictor, decodes: int) -> tuple[float, float, float] | None:
    """``(fixed, per_kv_token, scale)`` with ``model.decode_cost_s(kv, decodes) == fixed +
    per_kv_token * kv * scale`` operation for operation (bit for bit: ``* 1.0`` is exact),
    for the two step models; ``None`` for any other predictor (call it)."""
    if type(model) is KneeStepModel:
        return model.b_s_per_token, model.d_s_per_decode_context_token, model._scale(decodes)
    if type(model) is StepCoefficients:
        return model.b_s_per_token, model.c_s_per_context_token, 1.0
    return None


def last_token_due(request: RequestState, output_tokens: int) -> float:
    """When the last of ``output_tokens`` is due: one TPOT per token after the first
    token, or after the TTFT deadline before there is one."""
    slo = request.slo
    first = request.first_token_time
    anchor = first if first is not None else request.arrival + slo.ttft_s
    return anchor + max(0, output_tokens - 1) * slo.tpot_s


def release_time(last_token_due: float, now: float, tokens_left: int, cadence_s: float) -> float:
    """When a decoding request gives its KV memory back: when its last token is due, or
    sooner if it keeps the step cadence (one token per ``cadence_s``, the smallest TPOT
    present, as ``prefill_rate`` assumes). A relaxed TPOT is a deadline, not a pace: held
    to it, a mix of classes reads as memory committed for tens of seconds."""
    return min(last_token_due, now + tokens_left * cadence_s)


@dataclass(frozen=True, slots=True)
class KvOutlook:
    """A rank's KV memory as its prefill queue sees it (from the engine: SGLang's memory
    budget, the simulator's pool).

    ``free_tokens`` is what a new prefill may take now, after what running requests
    hold and have reserved for their outputs; a running request gives back what it holds
    and reserves when its last token is due (``release_times``, ascending, with the
    cumulative tokens in ``released_through``); a queued prefill needs its pending
    prompt tokens plus ``reserves[req_id]`` (``new_reserve`` for one not listed, and for
    an arrival)."""

    free_tokens: float
    release_times: tuple[float, ...] = ()
    released_through: tuple[float, ...] = ()
    reserves: Mapping[Hashable, float] = field(default_factory=dict)
    new_reserve: float = 0.0

    @classmethod
    def of(
        cls, free_tokens: float, releases: Iterable[tuple[float, float]] = (),
        reserves: Mapping[Hashable, float] | None = None, new_reserve: float = 0.0,
    ) -> KvOutlook:
        """From ``(time, tokens)`` releases in any order."""
        times: list[float] = []
        through: list[float] = []
        total = 0.0
        for time_s, tokens in _sorted_releases(releases):
            total += tokens
            times.append(time_s)
            through.append(total)
        return cls(float(free_tokens), tuple(times), tuple(through), dict(reserves or {}),
                   float(new_reserve))

    def available_at(self, time_s: float) -> float:
        """KV tokens free for prefills by ``time_s``."""
        index = bisect_right(self.release_times, time_s)  # _released_by, inlined
        return self.free_tokens + (self.released_through[index - 1] if index else 0.0)

    def need_of(self, request: RequestState) -> float:
        return request.pending_prefill + self.reserves.get(request.req_id, self.new_reserve)

    def arrival_budget(self, now: float, ttft_s: float, need_before: float, rate: float) -> float:
        """Prompt tokens an arrival due at ``now + ttft_s`` may bring, as far as KV goes:
        its prompt and reservation fit by some time ``t`` after the ``need_before`` of
        the entries due before it, and its prefill fits between ``t`` and its deadline."""
        deadline = now + ttft_s
        base = self.free_tokens - need_before - self.new_reserve
        best = min(base + self._released_by(now), rate * ttft_s)
        start = bisect_right(self.release_times, now)
        end = bisect_right(self.release_times, deadline)
        for index in range(start, end):
            best = max(best, min(base + self.released_through[index],
                                 rate * (deadline - self.release_times[index])))
        return best

    def _released_by(self, time_s: float) -> float:
        index = bisect_right(self.release_times, time_s)
        return self.released_through[index - 1] if index else 0.0


def _sorted_releases(releases: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """``sorted(releases)``, faster: ordered by time alone (a float key compares much
    faster than a tuple), which is the same order when no two times are equal; when some
    are, the tuples' own order (by tokens among equal times)."""
    ordered = sorted(releases, key=itemgetter(0))
    times = [release[0] for release in ordered]
    if any(map(eq, times, islice(times, 1, None))):
        ordered.sort()
    return ordered


@dataclass(frozen=True, slots=True)
class QueueForecast:
    """The EDF forecast of one rank's prefill queue at ``now`` (module docstring)."""

    now: float
    rate: float  # prompt tokens (work, see StepPredictor.prefill_work) per second
    deadlines: tuple[float, ...]  # feasible entries, ascending
    work_through: tuple[float, ...]  # cumulative pending work up to and including each
    spare_after: tuple[float, ...]  # min spare over entries i.. (len + 1; last is inf)
    hopeless: frozenset[Hashable]
    kv: KvOutlook | None = None
    need_through: tuple[float, ...] = ()  # cumulative KV needs, as work_through
    kv_spare_after: tuple[float, ...] = ()  # as spare_after, in KV tokens
    # the prompt a budget of work buys (None: work is prompt tokens, the linear model)
    prompt_for_work: Callable[[float], float] | None = None

    def budget(self, ttft_s: float) -> float:
        """Prompt tokens a request arriving now with TTFT ``ttft_s`` may bring (may be < 0)."""
        deadline = self.now + ttft_s
        index = bisect_right(self.deadlines, deadline)
        work_before = self.work_through[index - 1] if index else 0.0
        own = self.rate * ttft_s - work_before
        budget = min(own, self.spare_after[index])
        if self.prompt_for_work is not None:
            budget = self.prompt_for_work(budget)
        kv = self.kv
        if kv is None:
            return budget
        need_before = self.need_through[index - 1] if index else 0.0
        return min(budget, kv.arrival_budget(self.now, ttft_s, need_before, self.rate),
                   self.kv_spare_after[index] - kv.new_reserve)


def forecast(
    requests: Sequence[RequestState], now: float, coefficients: StepPredictor,
    default_tpot_s: float, headroom: float = DEFAULT_HEADROOM, kv: KvOutlook | None = None,
    length_weight: float | None = None,
) -> QueueForecast:
    """The forecast at ``now``. Which prefills ``defer`` gives up when not all fit: by
    :func:`eviction_key` of ``length_weight`` (``AdmissionSettings.length_weight``), or
    with None each that does not fit."""
    usable = coefficients.usable()
    prompt_for_work = None if isinstance(usable, StepCoefficients) else usable.prompt_for_work
    computed = _compiled_forecast(requests, now, usable, default_tpot_s, headroom, kv,
                                  length_weight, with_tables=True)
    if computed is not None:
        rate, ids, deadlines, work_through, spare_after, need_through, kv_spare_after = computed
        return QueueForecast(now, rate, deadlines, work_through, spare_after, ids, kv,
                             need_through, kv_spare_after, prompt_for_work)
    rate, kept, hopeless = _kept(requests, now, usable, default_tpot_s, headroom, kv,
                                 length_weight)
    tables = _Tables()
    _scan(kept, rate, now, kv, hopeless, tables)
    return QueueForecast(
        now, rate, tuple(tables.deadlines), tuple(tables.work_through),
        _suffix_minima(tables.spares), frozenset(hopeless), kv, tuple(tables.need_through),
        _suffix_minima(tables.kv_spares) if kv is not None else (), prompt_for_work,
    )


def hopeless_prefills(
    requests: Sequence[RequestState], now: float, coefficients: StepPredictor,
    default_tpot_s: float, headroom: float = DEFAULT_HEADROOM, kv: KvOutlook | None = None,
    length_weight: float | None = None,
) -> frozenset[Hashable]:
    """``forecast(...).hopeless`` and nothing else: what a decision under ``defer`` reads
    (the scan runs the same, without the tables the budgets need)."""
    usable = coefficients.usable()
    computed = _compiled_forecast(requests, now, usable, default_tpot_s, headroom, kv,
                                  length_weight, with_tables=False)
    if computed is not None:
        return computed[1]
    rate, kept, hopeless = _kept(requests, now, usable, default_tpot_s, headroom, kv,
                                 length_weight)
    _scan(kept, rate, now, kv, hopeless)
    return frozenset(hopeless)


def _compiled_forecast(
    requests: Sequence[RequestState], now: float, usable: StepPredictor, default_tpot_s: float,
    headroom: float, kv: KvOutlook | None, length_weight: float | None, *, with_tables: bool,
) -> tuple | None:
    """The forecast of a table by the compiled path (``compiled.queue_forecast``): ``(rate,
    hopeless)``, and with tables the :class:`QueueForecast` fields after them. None where
    the reference runs: no compiled module, a list, or a step model other than the two."""
    queue_forecast = compiled.queue_forecast
    if queue_forecast is None or type(requests) is not RequestTable:
        return None
    terms = _decode_cost_terms(usable, len(requests))
    if terms is None:
        return None
    knee = type(usable) is KneeStepModel
    columns = requests.columns
    return queue_forecast(
        requests, columns.arrival, columns.ttft, columns.next_index, columns.seq,
        columns.pending, columns.context, columns.prompt, columns.tpot, now, default_tpot_s,
        usable.a_s, usable.b_s_per_token, headroom, *terms, usable.knee_tokens if knee else None,
        usable.c_s_per_prefill_context_token if knee else 0.0,
        usable.e_s_per_pair if knee else 0.0, length_weight,
        None if kv is None else (kv.free_tokens, kv.release_times, kv.released_through,
                                 kv.reserves, kv.new_reserve),
        with_tables,
    )


def _kept(
    requests: Sequence[RequestState], now: float, usable: StepPredictor, default_tpot_s: float,
    headroom: float, kv: KvOutlook | None, length_weight: float | None,
) -> tuple[float, Iterable[tuple] | _QueueColumns, set[Hashable]]:
    """The rate, the queue in deadline order less what ``defer`` gives up (entries, or a
    table's long queue as columns), and the request ids it gave up."""
    if type(requests) is RequestTable:
        terms = _decode_cost_terms(usable, len(requests))
        if terms is not None:
            return _kept_of_table(requests, now, usable, default_tpot_s, headroom, kv,
                                  length_weight, terms)
    rate, queue = _rate_and_queue(requests, usable, default_tpot_s, headroom, kv)
    return rate, *_kept_entries(queue, rate, now, length_weight)


def _kept_entries(
    queue: list[tuple], rate: float, now: float, length_weight: float | None,
) -> tuple[list[tuple], set[Hashable]]:
    """:func:`_kept` from the queue's entries in any order: the kept and the request ids
    given up."""
    hopeless: set[Hashable] = set()
    if rate <= 0.0 and all(entry[2] > 0.0 for entry in queue):
        # no prefill rate left: the scan would find every queued prefill late
        hopeless.update([entry[4] for entry in queue])
        return [], hopeless
    queue.sort(key=itemgetter(0, 1))  # deadline, then arrival order
    if length_weight is not None:
        return _on_time(queue, rate, now, hopeless, eviction_key(length_weight)), hopeless
    return queue, hopeless


#: queued prefills from which a table's forecast takes them as columns: below, array
#: operations cost more than the loops over their entries
COLUMNS_FROM = 32


def _kept_of_table(
    table: RequestTable, now: float, usable: StepPredictor, default_tpot_s: float,
    headroom: float, kv: KvOutlook | None, length_weight: float | None,
    terms: tuple[float, float, float],
) -> tuple[float, Iterable[tuple] | _QueueColumns, set[Hashable]]:
    """:func:`_kept` on a table: the rate from its columns; its queue, from
    :data:`COLUMNS_FROM` queued prefills, from its columns too and kept as columns in
    deadline order, below as the entries of its requests (as a list's)."""
    rate = _table_rate(table, usable, default_tpot_s, headroom, terms)
    rows = table.queued_rows
    if len(rows) < COLUMNS_FROM:
        return rate, *_kept_entries(_queue(table.at(rows), usable, kv), rate, now, length_weight)
    rows = rows[np.lexsort((table.columns.seq[rows], table.due[rows]))]
    deadline, *rest = _queue_of_rows(table, rows, usable, kv)
    return rate, *_kept_columns(_QueueColumns(deadline, *rest, rate * (deadline - now)), rate,
                                length_weight)


def _kept_columns(
    queue: _QueueColumns, rate: float, length_weight: float | None,
) -> tuple[_QueueColumns | Iterable[tuple], set[Hashable]]:
    """:func:`_kept` from a table's queue, in deadline order: the kept and the request ids
    given up."""
    hopeless: set[Hashable] = set()
    if rate <= 0.0 and np.all(queue.work > 0.0):
        hopeless.update(queue.ids.tolist())
        return [], hopeless
    if length_weight is not None:
        return _on_time_columns(queue, hopeless, eviction_key(length_weight)), hopeless
    return queue, hopeless


@dataclass(slots=True)
class _Tables:
    """What a :class:`QueueForecast` keeps of the feasible entries, in deadline order."""

    deadlines: list[float] = field(default_factory=list)
    work_through: list[float] = field(default_factory=list)
    spares: list[float] = field(default_factory=list)
    need_through: list[float] = field(default_factory=list)
    kv_spares: list[float] = field(default_factory=list)


def _scan(
    kept: Iterable[tuple] | _QueueColumns, rate: float, now: float, kv: KvOutlook | None,
    hopeless: set[Hashable], tables: _Tables | None = None, work: float = 0.0,
) -> None:
    """The EDF scan (module docstring) over the deadline-ordered ``kept`` (entries, or a
    table's columns), after feasible entries of ``work``: an entry whose work does not fit
    by its deadline, or whose KV does not by its latest start, joins ``hopeless`` and is
    not counted; each feasible one goes into ``tables`` when given."""
    if type(kept) is _QueueColumns:
        _scan_columns(kept, rate, now, kv, hopeless, tables)
        return
    needed = 0.0
    for deadline, _, pending, need, req_id, _ in kept:
        capacity = rate * (deadline - now)
        if work + pending > capacity:
            hopeless.add(req_id)
            continue
        if kv is not None:
            kv_spare = kv.available_at(deadline - pending / rate) - needed - need
            if kv_spare < 0:
                hopeless.add(req_id)
                continue
            needed += need
            if tables is not None:
                tables.need_through.append(needed)
                tables.kv_spares.append(kv_spare)
        work += pending
        if tables is not None:
            tables.deadlines.append(deadline)
            tables.work_through.append(work)
            tables.spares.append(capacity - work)


def _scan_columns(
    kept: _QueueColumns, rate: float, now: float, kv: KvOutlook | None,
    hopeless: set[Hashable], tables: _Tables | None,
) -> None:
    """:func:`_scan` over columns: without a KV outlook, the entries before the first that
    does not fit are feasible by a running sum, and the loop goes on from that one; with
    one (a lookup per entry), the loop throughout."""
    if kv is not None:
        _scan(kept.entries(), rate, now, kv, hopeless, tables)
        return
    capacity = kept.capacity
    work_sums = _running_sums(kept.work)
    work_through = work_sums[1:]
    first = _first(work_through > capacity)
    fit = len(capacity) if first is None else first
    if tables is not None:
        tables.deadlines += kept.deadline[:fit].tolist()
        tables.work_through += work_through[:fit].tolist()
        tables.spares += (capacity[:fit] - work_through[:fit]).tolist()
    if first is not None:
        _scan(kept.entries(first), rate, now, kv, hopeless, tables, float(work_sums[first]))


_ZERO = np.zeros(1)


def _running_sums(values: np.ndarray) -> np.ndarray:
    """``out[k]``: what a loop adding ``values`` one by one to 0.0 holds after ``k`` of
    them (``len(values) + 1`` sums), bit for bit (``np.add.accumulate`` adds left to
    right)."""
    return np.add.accumulate(np.concatenate((_ZERO, values)))


def _first(mask: np.ndarray) -> int | None:
    """The index of the first true in ``mask``; None if none is."""
    if not len(mask):
        return None
    index = int(mask.argmax())
    return index if mask[index] else None


def _rate_and_queue(
    requests: Sequence[RequestState], usable: StepPredictor, default_tpot_s: float,
    headroom: float, kv: KvOutlook | None,
) -> tuple[float, list[tuple]]:
    """:func:`prefill_rate` and :func:`_queue`, with one pass over the requests for the
    rate and the prefills queued (the forecast runs at every decision under ``defer``);
    the rate is the same sum in the same order, bit for bit."""
    terms = _decode_cost_terms(usable, len(requests))
    if terms is None:
        return prefill_rate(requests, usable, default_tpot_s, headroom), _queue(
            [request for request in requests if request.pending_prefill > 0], usable, kv)
    fixed, per_kv_token, scale = terms
    period = default_tpot_s
    decode_share = 0.0
    waiting = []
    for request in requests:
        tpot = request.slo.tpot_s
        if tpot < period:
            period = tpot
        pending = request.pending_prefill
        decode_share += (fixed + per_kv_token * (request.context + pending) * scale) / tpot
        if pending > 0:
            waiting.append(request)
    free = 1.0 - usable.a_s / period - decode_share
    return max(0.0, free) / usable.b_s_per_token * (1.0 - headroom), _queue(waiting, usable, kv)


@dataclass(frozen=True, slots=True)
class _QueueColumns:
    """Queued prefills as columns: :func:`_queue`'s entries, one array per field, and each
    one's ``capacity``, the work the rate serves by its deadline."""

    deadline: np.ndarray
    seq: np.ndarray  # arrival_seq
    work: np.ndarray
    need: np.ndarray  # KV need; zeros without a KV outlook
    ids: np.ndarray  # req_id, objects
    started: np.ndarray
    capacity: np.ndarray  # rate * (deadline - now)

    def entries(self, start: int = 0) -> Iterator[tuple]:
        """The rows from ``start`` on as :func:`_queue`'s tuples."""
        rest = slice(start, None)
        return zip(self.deadline[rest].tolist(), self.seq[rest].tolist(),
                   self.work[rest].tolist(), self.need[rest].tolist(),
                   self.ids[rest].tolist(), self.started[rest].tolist())


def _table_rate(
    table: RequestTable, usable: StepPredictor, default_tpot_s: float, headroom: float,
    terms: tuple[float, float, float],
) -> float:
    """:func:`prefill_rate` on the table's columns: each request's decode share by the same
    operations, the shares summed in the table's order (a cumulative sum adds left to
    right, as the loop does)."""
    columns = table.columns
    fixed, per_kv_token, scale = terms
    tpot = columns.tpot
    period = default_tpot_s
    decode_share = 0.0
    if len(table):
        smallest = np.minimum.reduce(tpot)
        if smallest < period:
            period = float(smallest)
        shares = (fixed + per_kv_token * (columns.context + columns.pending) * scale) / tpot
        decode_share = float(np.add.accumulate(shares)[-1])
    free = 1.0 - usable.a_s / period - decode_share
    return max(0.0, free) / usable.b_s_per_token * (1.0 - headroom)


def _queue_of_rows(
    table: RequestTable, rows: np.ndarray, usable: StepPredictor, kv: KvOutlook | None,
) -> tuple[np.ndarray, ...]:
    """:func:`_queue`'s entries of the table's queued ``rows``, field by field (deadline,
    arrival number, work, KV need, request id, whether started), by the same operations,
    in the order of ``rows``."""
    columns = table.columns
    pending = columns.pending[rows]
    context = columns.context[rows]
    if type(usable) is KneeStepModel:  # _queue's work, elementwise
        knee_tokens, b = usable.knee_tokens, usable.b_s_per_token
        after = np.maximum(knee_tokens + pending, knee_tokens)
        work = (b * (after - knee_tokens) + usable.c_s_per_prefill_context_token * context
                + usable.e_s_per_pair * pending * (context + (pending + 1) / 2.0)) / b
    else:
        work = np.array([usable.prefill_work(n, prefix)
                         for n, prefix in zip(pending.tolist(), context.tolist())],
                        dtype=np.float64)
    ids = table.ids[rows]
    if kv is None:
        needs = np.zeros(len(rows), dtype=np.float64)
    else:
        reserve_of, new_reserve = kv.reserves.get, kv.new_reserve
        needs = np.array([n + reserve_of(req_id, new_reserve)
                          for n, req_id in zip(pending.tolist(), ids.tolist())],
                         dtype=np.float64)
    return (table.due[rows], columns.seq[rows], work, needs, ids,
            pending < columns.prompt[rows])


def _queue(
    waiting: Sequence[RequestState], usable: StepPredictor, kv: KvOutlook | None,
) -> list[tuple]:
    """The queued prefills ``(deadline, arrival_seq, work, kv need, req_id, started)``, in
    the order given. The knee model's ``prefill_work`` and ``KvOutlook.need_of`` are
    inlined, operation for operation."""
    queue = []
    add = queue.append
    knee = type(usable) is KneeStepModel
    if knee:
        knee_tokens, b, c, e = (usable.knee_tokens, usable.b_s_per_token,
                                usable.c_s_per_prefill_context_token, usable.e_s_per_pair)
    work_of = usable.prefill_work
    reserve_of = None if kv is None else kv.reserves.get
    new_reserve = 0.0 if kv is None else kv.new_reserve
    for request in waiting:
        slo = request.slo
        pending = request.pending_prefill
        context = request.context
        req_id = request.req_id
        if knee:  # prefill_cost_s(pending, context, knee_tokens) / b
            after = knee_tokens + pending
            if after < knee_tokens:
                after = knee_tokens
            work = (b * (after - knee_tokens) + c * context
                    + e * pending * (context + (pending + 1) / 2.0)) / b
        else:
            work = work_of(pending, context)
        add((
            request.arrival + slo.ttft_s + slo.tpot_s * request.next_output_index,
            request.arrival_seq, work,
            0.0 if reserve_of is None else pending + reserve_of(req_id, new_reserve), req_id,
            pending < request.prompt_tokens,
        ))
    return queue


_FIBONACCI = 0x9E3779B97F4A7C15
_MASK_64 = (1 << 64) - 1


def _longest(arrival_seq: int, pending: float) -> float:
    return pending


def _drawn(arrival_seq: int, pending: float) -> float:
    """The request's place in a fixed pseudo-random order (Fibonacci hashing of its arrival
    number): the same at every decision, and blind to its length."""
    return float((arrival_seq * _FIBONACCI) & _MASK_64)


def eviction_key(length_weight: float) -> Callable[[int, float], float]:
    """Which not-yet-started prefill ``defer`` gives up first (the largest key), from its
    arrival number and pending work::

        key = w * ln(pending) + (1 - w) * E,   E = -ln(1 - draw)

    ``draw`` in [0, 1) is the request's place in :func:`_drawn`'s order, so ``E`` is a
    unit exponential fixed per request. ``w = 1`` orders by pending work alone (the
    longest first), ``w = 0`` by the draw alone (blind to length); between, a prompt
    ``k`` times longer is given up first unless its draw is ``w / (1 - w) * ln k`` lower."""
    if length_weight >= 1.0:
        return _longest
    if length_weight <= 0.0:
        return _drawn
    weight, rest = length_weight, 1.0 - length_weight
    log, scale = math.log, 1.0 / (_MASK_64 + 1)

    def key(arrival_seq: int, pending: float) -> float:
        draw = ((arrival_seq * _FIBONACCI) & _MASK_64) * scale
        return weight * log(max(pending, 1.0)) - rest * log(1.0 - draw)

    return key


def _on_time(
    queue: list[tuple], rate: float, now: float, hopeless: set[Hashable],
    victim_key: Callable[[int, float], float] = _longest,
) -> list[tuple]:
    """Moore-Hodgson over the deadline-ordered queue: when an entry would finish past its
    deadline, drop the not-yet-started entry so far with the largest ``victim_key`` (into
    ``hopeless``): with ``_longest`` the one with the most pending tokens, which keeps the
    most entries on time. Returns the kept, in order."""
    dropped = _evicted([rate * (entry[0] - now) for entry in queue], [entry[2] for entry in queue],
                       [entry[1] for entry in queue], [entry[5] for entry in queue], victim_key)
    if not dropped:
        return queue  # every entry on time: nobody to drop
    for position in dropped:
        hopeless.add(queue[position][4])
    return [entry for position, entry in enumerate(queue) if position not in dropped]


def _on_time_columns(
    queue: _QueueColumns, hopeless: set[Hashable], victim_key: Callable[[int, float], float],
) -> _QueueColumns | Iterator[tuple]:
    """:func:`_on_time` over columns, its heap over their fields as lists: the queue
    itself where every entry is kept, else the kept as entries."""
    works, seqs, started = queue.work.tolist(), queue.seq.tolist(), queue.started.tolist()
    dropped = _evicted(queue.capacity.tolist(), works, seqs, started, victim_key)
    if not dropped:
        return queue
    ids = queue.ids.tolist()
    hopeless.update([ids[position] for position in dropped])
    kept = [True] * len(works)
    for position in dropped:
        kept[position] = False
    return compress(zip(queue.deadline.tolist(), seqs, works, queue.need.tolist(), ids, started),
                    kept)


def _evicted(
    capacities: Sequence[float], works: Sequence[float], seqs: Sequence[int],
    started: Sequence[bool], victim_key: Callable[[int, float], float],
) -> set[int]:
    """The positions Moore-Hodgson drops (:func:`_on_time`), over deadline-ordered entries
    given field by field (``capacities[i]``: the work that fits by entry ``i``'s deadline).

    Before its heap: the leading entries that do not fit even alone are dropped one by one
    (each leaves the work at zero and the heap empty, as they began), and the entries on
    time after them need no heap until the first that does not fit."""
    count = len(works)
    start = 0
    while start < count and works[start] > capacities[start]:
        start += 1
    dropped = set(range(start))
    work = 0.0
    for first_late in range(start, count):
        pending = works[first_late]
        if work + pending > capacities[first_late]:
            break
        work += pending
    else:
        return dropped
    victims = [(-victim_key(seqs[position], works[position]), -position)
               for position in range(start, first_late) if not started[position]]
    heapq.heapify(victims)
    push, pop = heapq.heappush, heapq.heappop
    longest = victim_key is _longest  # its key is the pending work: no call
    for position in range(first_late, count):
        pending = works[position]
        work += pending
        if not started[position]:
            push(victims, (-pending if longest else -victim_key(seqs[position], pending),
                           -position))
        capacity = capacities[position]
        while work > capacity and victims:
            victim = -pop(victims)[1]
            work -= works[victim]
            dropped.add(victim)
        if work > capacity and position not in dropped:
            work -= pending
            dropped.add(position)
    return dropped


def _suffix_minima(values: Sequence[float]) -> tuple[float, ...]:
    """``out[i] = min(values[i:])``, one longer than ``values`` (its last is inf)."""
    out = [math.inf] * (len(values) + 1)
    for index in range(len(values) - 1, -1, -1):
        out[index] = min(values[index], out[index + 1])
    return tuple(out)


def class_budgets(
    rule: AdmissionRule,
    requests: Sequence[RequestState],
    now: float,
    coefficients: StepPredictor,
    classes: Mapping[str, Slo],
    default_tpot_s: float,
    headroom: float = DEFAULT_HEADROOM,
    kv: KvOutlook | None = None,
    length_weight: float | None = None,
) -> dict[str, float]:
    """Each SLO class's admission budget in prompt tokens, from one rank state (``kv``:
    the ``edf`` rule's KV term and ``length_weight`` its queue under ``defer``; the paper's
    PAB has neither)."""
    if rule is AdmissionRule.PAB:
        return {
            name: prefill_admission_budget(requests, now, coefficients, slo)
            for name, slo in classes.items()
        }
    queue = forecast(requests, now, coefficients, default_tpot_s, headroom, kv, length_weight)
    return {name: queue.budget(slo.ttft_s) for name, slo in classes.items()}


def budget_for(budgets: Mapping[float, float], ttft_s: float, rate: float) -> float:
    """A request's budget from budgets published at class TTFTs (``{ttft_s: tokens}``):
    the class with the largest TTFT not above the request's; below every class, the
    smallest class's budget less ``rate`` tokens per second of TTFT it lacks."""
    below = [t for t in budgets if t <= ttft_s]
    if below:
        return budgets[max(below)]
    smallest = min(budgets)
    return budgets[smallest] - rate * (smallest - ttft_s)
