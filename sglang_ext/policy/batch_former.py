"""FairBatching batch formation: Algorithm 1 of the paper, as a pure function.

Resolutions of the printed algorithm's ambiguities (each covered by a test):
- ``min_slack`` and ``min_tpot_slo`` (lines 18-19) range over *all* active requests,
  prefills included.
- A prefill chunk costs ``b * cp + c * context`` and that whole cost is subtracted
  (line 45 prints ``- b*cp + c*context``, a sign slip).
- ``cp`` is rounded down and a chunk below one token is skipped; only prefills are
  chunked (a decode is one token).
- Urgent decodes are always included, even past the time or token budget: under
  extreme load FairBatching degrades to Sarathi-like decode-first batching (§3.3).
- ``MAX_TOKEN_BUDGET`` caps new tokens per step (default 8192, a CUDA-graph limit).

Deviation from the paper (every policy runs with it; ``triage`` without a
:class:`ServiceFloor` is the printed algorithm, kept as the reference): a request that
is already late, or whose TPOT no rank can honour, does not set the time budget.
In the printed algorithm one late request makes the budget ``min TPOT`` for good (a
late prefill keeps ``min slack`` negative), and a client-chosen TPOT below the step's
fixed cost then leaves no time for any prefill: one request stops every other
request's prefill. With a floor, the budget and the urgent threshold come from the
*in-time* requests (TPOT at least :data:`MIN_TPOT_STEP_MULTIPLE` x the smallest
step, and slack >= 0); late requests are served best-effort from what is left: their
decodes ride every step (one token each, as urgent ones do), their prefills follow
the in-time prefills in arrival order, so a tiny TTFT does not jump every queue.
With no in-time request the budget is the floor's fallback (the default class's
TPOT, never below the serviceable minimum).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from bisect import bisect_left
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter

from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_model import StepPredictor
from sglang_ext.policy.view import BatchDecision, RequestState

DEFAULT_MAX_TOKEN_BUDGET = 8192
#: A TPOT below this multiple of the smallest step (one decode, no context) cannot be
#: honoured without taking more than half of every step from the other requests.
MIN_TPOT_STEP_MULTIPLE = 2.0
_by_slack = itemgetter(0)


def _arrival_order(pair: tuple[float, RequestState]) -> int:
    return pair[1].arrival_seq


@dataclass(frozen=True, slots=True)
class ServiceFloor:
    """What the lateness guard needs: the smallest serviceable TPOT, the budget used when
    no request is in time, and the shortest time budget worth a step.

    Serviceability is the door's (:func:`unserviceable_slo_reason`, from the initial step
    model) and stays fixed: a class the door admitted is never re-labelled unserviceable
    because the online model drifted. ``min_budget_s`` follows the online model: twice
    its smallest step (a decode-only step and a chunk as long), below which a deadline
    guard may not push a step's time budget."""

    min_serviceable_tpot_s: float
    fallback_budget_s: float
    min_budget_s: float = 0.0

    @classmethod
    def of(cls, coefficients: StepPredictor, default_tpot_s: float,
           online: StepPredictor | None = None) -> ServiceFloor:
        """From the door's model ``coefficients`` (and the ``online`` one, default the
        same)."""
        floor = MIN_TPOT_STEP_MULTIPLE * coefficients.usable().smallest_step_s
        learned = floor if online is None else MIN_TPOT_STEP_MULTIPLE * online.usable().smallest_step_s
        return cls(floor, max(default_tpot_s, floor), learned)


def min_serviceable_tpot_s(coefficients: StepPredictor) -> float:
    """The smallest TPOT a rank with this step model accepts (see :data:`MIN_TPOT_STEP_MULTIPLE`)."""
    return ServiceFloor.of(coefficients, 0.0).min_serviceable_tpot_s


def unserviceable_slo_reason(slo: Slo, coefficients: StepPredictor) -> str | None:
    """Why a request with ``slo`` is refused at the door, or ``None`` when it is not."""
    floor = min_serviceable_tpot_s(coefficients)
    if slo.tpot_s >= floor:
        return None
    smallest = coefficients.usable().smallest_step_s
    subject = f"tpot_ms {slo.tpot_s * 1e3:g}"
    if slo.is_end_to_end:
        subject = (f"e2e_ms {slo.e2e_s * 1e3:g} paces its expected output at "
                   f"{slo.tpot_s * 1e3:.1f} ms per token, which")
    return (
        f"{subject} is below this server's minimum of {floor * 1e3:.1f} ms: "
        f"{MIN_TPOT_STEP_MULTIPLE:g} x its smallest step (one decode token, "
        f"{smallest * 1e3:.1f} ms predicted), so that no request "
        "takes more than half of every step from the others"
    )


@dataclass(frozen=True, slots=True)
class Triage:
    """Lines 13-33: slack per request, the initial time budget, and the three groups."""

    init_time_budget_s: float  # max(min slack, min TPOT), seconds
    min_tpot_s: float
    # (slack_s, request) sorted by slack ascending
    urgent_decodes: list[tuple[float, RequestState]]
    prefills: list[tuple[float, RequestState]]
    deferrable_decodes: list[tuple[float, RequestState]]
    # with a ServiceFloor: late or unserviceable requests, in arrival order
    late_decodes: list[tuple[float, RequestState]] = field(default_factory=list)
    late_prefills: list[tuple[float, RequestState]] = field(default_factory=list)
    # the urgent and late decodes' KV context summed, when whoever built these groups
    # already had it (smooth_step), so that pack does not sum it again; None: not known
    always_context: int | None = None
    # the smallest TPOT of the late decodes, none below the serviceable minimum (inf: no
    # late decode): a late stream still paces the step
    late_decode_tpot_s: float = math.inf

    @property
    def step_tpot_s(self) -> float:
        """The TPOT a step of every decode must keep: in-time and late decodes alike."""
        return self.min_tpot_s if self.min_tpot_s < self.late_decode_tpot_s else self.late_decode_tpot_s

    def as_triage(self) -> Triage:
        """These groups as (slack, request) lists: they are."""
        return self

    def steady(self, time_budget_s: float) -> Triage:
        """Every in-time decode urgent, under ``time_budget_s`` (``fb-steady``'s step)."""
        return dataclasses.replace(
            self, init_time_budget_s=time_budget_s, deferrable_decodes=[],
            urgent_decodes=self.urgent_decodes + self.deferrable_decodes)


def token_deadline(request: RequestState, anchored: bool) -> float:
    """When the request's next token is due: ``arrival + ttft + tpot * j`` (the paper's
    envelope), or with ``anchored`` after the first token ``first_token_time + tpot * j``."""
    slo = request.slo
    index = request.next_output_index
    if anchored and index and request.first_token_time is not None:
        return request.first_token_time + slo.tpot_s * index
    return request.arrival + slo.ttft_s + slo.tpot_s * index


def triage(
    requests: Sequence[RequestState],
    now: float,
    *,
    anchored: bool = False,
    floor: ServiceFloor | None = None,
    hopeless: frozenset = frozenset(),
    deadline_guard_s: float = 0.0,
) -> Triage | None:
    """Group active requests; ``None`` when there is nothing to run.

    ``anchored=True`` measures a request's slack after its first token against
    ``first_token_time + tpot * j`` (the ``fb-anchor`` variant) instead of the paper's
    ``arrival + ttft + tpot * j``; the first token keeps the TTFT deadline.
    ``floor`` turns on the lateness guard (module docstring); ``None`` is the printed
    algorithm. ``hopeless`` (request ids; admission mode ``defer``) are treated as late
    too: served after every request in time, never setting the time budget.
    ``deadline_guard_s`` plans every in-time token that much before its deadline
    (``fb-margin``), the time budget's ``min TPOT`` floor included (a just-prefilled
    request's first decode is due one TPOT after its first token, and a floor of a full
    TPOT would let that step end past it); lateness is still judged against the deadline.
    """
    if not requests:
        return None
    # One pass, every lookup bound to a local: this loop is most of a decision's time
    # (one iteration per active request). The arithmetic is token_deadline's, operation
    # for operation, so every slack is bit-for-bit the same.
    decodes: list[tuple[float, RequestState]] = []
    prefills: list[tuple[float, RequestState]] = []
    late_decodes: list[tuple[float, RequestState]] = []
    late_prefills: list[tuple[float, RequestState]] = []
    add_decode, add_prefill = decodes.append, prefills.append
    if floor is None:  # the printed algorithm: nobody is late
        late_before = serviceable = -math.inf
    else:
        late_before, serviceable = 0.0, floor.min_serviceable_tpot_s
    guard = deadline_guard_s
    min_tpot = late_tpot = math.inf
    # whether each late group came in arrival order already (an engine keeps its requests
    # so): then its sort by arrival, a Python key per request, would change nothing
    last_late_decode = last_late_prefill = -math.inf
    late_decodes_ordered = late_prefills_ordered = True
    for request in requests:
        slo = request.slo
        tpot = slo.tpot_s
        index = request.next_output_index
        if anchored and index and (first := request.first_token_time) is not None:
            slack = first + tpot * index - now
        else:
            slack = request.arrival + slo.ttft_s + tpot * index - now
        if slack < late_before or tpot < serviceable or (hopeless and request.req_id in hopeless):
            seq = request.arrival_seq
            if request.pending_prefill:
                late_prefills.append((slack, request))
                if seq < last_late_prefill:
                    late_prefills_ordered = False
                last_late_prefill = seq
            else:
                late_decodes.append((slack, request))
                paced = tpot if tpot > serviceable else serviceable
                if paced < late_tpot:
                    late_tpot = paced
                if seq < last_late_decode:
                    late_decodes_ordered = False
                last_late_decode = seq
            continue
        if tpot < min_tpot:
            min_tpot = tpot
        if guard:
            slack -= guard
        if request.pending_prefill:
            add_prefill((slack, request))
        else:
            add_decode((slack, request))
    return _grouped(decodes, prefills, late_decodes, late_prefills, min_tpot, floor, guard,
                    late_decodes_ordered, late_prefills_ordered, late_tpot)


def _grouped(
    decodes: list[tuple[float, RequestState]], prefills: list[tuple[float, RequestState]],
    late_decodes: list[tuple[float, RequestState]], late_prefills: list[tuple[float, RequestState]],
    min_tpot: float, floor: ServiceFloor | None, deadline_guard_s: float,
    late_decodes_ordered: bool = False, late_prefills_ordered: bool = False,
    late_tpot: float = math.inf,
) -> Triage:
    """Sorts the groups (each stably, from arrival order; a late group ``_ordered``
    already is), takes the time budget and splits the decodes at the urgent threshold.
    ``min_slack`` is the smallest in-time slack: the head of a sorted group. With a
    floor, the deadline guard never takes the budget below ``floor.min_budget_s`` (nor
    below ``min_tpot`` when that is shorter), and a late decode caps the budget at its
    own TPOT: it still gets a token every step of its pace."""
    decodes.sort(key=_by_slack)
    prefills.sort(key=_by_slack)
    min_slack = None
    if decodes and prefills:
        min_slack = decodes[0][0] if decodes[0][0] < prefills[0][0] else prefills[0][0]
    elif decodes or prefills:
        min_slack = (decodes or prefills)[0][0]
    init_time_budget = initial_time_budget(min_slack, min_tpot, late_tpot, floor, deadline_guard_s)
    split = bisect_left(decodes, init_time_budget + min_tpot, key=_by_slack)
    if len(late_decodes) > 1 and not late_decodes_ordered:
        late_decodes.sort(key=_arrival_order)
    if len(late_prefills) > 1 and not late_prefills_ordered:
        late_prefills.sort(key=_arrival_order)
    return Triage(
        init_time_budget, min_tpot, decodes[:split], prefills, decodes[split:],
        late_decodes, late_prefills, late_decode_tpot_s=late_tpot,
    )


def initial_time_budget(
    min_slack: float | None, min_tpot: float, late_tpot: float, floor: ServiceFloor | None,
    deadline_guard_s: float,
) -> float:
    """``max(min slack, min TPOT)`` of the in-time requests (``min_slack``: None when
    none is in time, then the floor's fallback), with the guard's floor (module and
    :func:`_grouped` docstrings), capped at a late decode's TPOT (``late_tpot``)."""
    if min_tpot == math.inf:  # nobody in time
        init_time_budget = math.inf if floor is None else floor.fallback_budget_s
    else:
        lowest = min_tpot - deadline_guard_s
        if floor is not None and lowest < floor.min_budget_s:
            lowest = min_tpot if min_tpot < floor.min_budget_s else floor.min_budget_s
        init_time_budget = max(min_slack, lowest)
    if late_tpot < init_time_budget:
        init_time_budget = late_tpot
    return init_time_budget


def smooth_step(
    groups: Triage, coefficients: StepPredictor, time_budget_s: float
) -> Triage | None:
    """The step that spends no request's slack, if it keeps every in-time deadline.

    Algorithm 1 stretches the step to the smallest slack and packs prefills before the
    deferrable decodes, so a queued prompt parks every decode that ran ahead of its
    deadlines, and lengthens every step while all are ahead: a stream that ran fast
    then stalls for all the slack it gathered. This step runs every decode within
    ``time_budget_s`` (the smallest TPOT, less the guard) and prefills the rest of it.
    It is taken when that leaves each in-time prefill (earliest deadline first, at the
    prefill rate this step leaves, plus one step of rounding) before its deadline;
    ``None`` otherwise, and Algorithm 1 spends slack where it is needed."""
    if type(groups) is not Triage:
        return groups.smooth_step(coefficients, time_budget_s)
    if not math.isfinite(time_budget_s) or time_budget_s <= 0.0:
        return None
    context = None  # the decodes' KV context: needed only to pace queued prefills
    if groups.prefills:
        decode_groups = (groups.urgent_decodes, groups.late_decodes, groups.deferrable_decodes)
        decode_tokens = sum(map(len, decode_groups))
        if _misses_first_prefill(groups.prefills[0], coefficients, time_budget_s, decode_tokens):
            return None
        context = sum([request.context for group in decode_groups for _, request in group])
        spare = time_budget_s - coefficients.step_s(decode_tokens, 0, decode_tokens, context, 0.0)
        if spare <= 0.0:
            return None
        steps_per_second = time_budget_s / spare
        queued = 0.0  # seconds of prefill, each chunk costed past the step's decodes
        for slack, request in groups.prefills:
            queued += coefficients.prefill_cost_s(request.pending_prefill, request.context, decode_tokens)
            if queued * steps_per_second + time_budget_s > slack:
                return None
    # triage split one slack-sorted list at a threshold: the concatenation stays sorted
    urgent = groups.urgent_decodes + groups.deferrable_decodes
    # pack sums the same decodes' context in another order: reuse it only when exact (ints)
    return Triage(time_budget_s, groups.min_tpot_s, urgent, groups.prefills, [],
                  groups.late_decodes, groups.late_prefills,
                  context if type(context) is int else None, groups.late_decode_tpot_s)


def _misses_first_prefill(
    first: tuple[float, RequestState], coefficients: StepPredictor, time_budget_s: float,
    decode_tokens: int,
) -> bool:
    """Whether :func:`smooth_step` is refused at its first prefill whatever the decodes'
    context, known without summing it: with weights >= 0 (``usable()`` is the model
    itself) the step's decodes cost at least their cost at zero context, so the time
    left for prefill is at most what it is then, the pace no faster, and a first prefill
    late at that pace is late at the real one (each rounding is monotone, so the float
    comparison is decided the same way). ``False``: not known, check exactly."""
    if coefficients.usable() is not coefficients:
        return False
    spare = time_budget_s - coefficients.step_s(decode_tokens, 0, decode_tokens, 0, 0.0)
    if spare <= 0.0:
        return True
    slack, request = first
    queued = coefficients.prefill_cost_s(request.pending_prefill, request.context, decode_tokens)
    return queued * (time_budget_s / spare) + time_budget_s > slack


def pack(
    groups: Triage,
    coefficients: StepPredictor,
    *,
    token_budget: int,
    time_budget_s: float | None,
) -> BatchDecision:
    """Lines 34-48: fill the step from the urgent, prefill and deferrable groups in turn
    (with the lateness guard: late decodes ride with the urgent ones, late prefills
    follow the in-time prefills). A prefill chunk is the longest that the predictor puts
    within the time left (``max_chunk``).

    ``time_budget_s=None`` packs under the token budget alone (the ``fb-fb`` / ``fb-tb``
    variants); ``coefficients`` then only feed the prediction.
    """
    if type(groups) is not Triage:
        return groups.pack(coefficients, token_budget=token_budget, time_budget_s=time_budget_s)
    always = groups.urgent_decodes + groups.late_decodes
    decode_ids: list[Hashable] = [request.req_id for _, request in always]
    context = groups.always_context
    if context is None:
        context = sum([request.context for _, request in always])
    step = _Step(coefficients, len(always), context)
    budget = math.inf if time_budget_s is None else time_budget_s
    chunks: list[tuple[Hashable, int]] = []
    tokens_left = token_budget - len(always)
    room = tokens_left > 0
    if room:
        room, tokens_left = _pack_prefills(groups.prefills, step, budget, tokens_left, chunks)
    if room:
        room, tokens_left = _pack_prefills(groups.late_prefills, step, budget, tokens_left, chunks)

    deferrable = groups.deferrable_decodes
    if deferrable and tokens_left > 0:
        count = len(deferrable)
        # All of them at once, if they fit. With weights >= 0 (``usable()`` is the model
        # itself) a step is no shorter with more decode context, so when they do not fit
        # even at zero context the sum of their contexts is not needed.
        if count <= tokens_left and (coefficients.usable() is not coefficients
                                     or step.with_decodes(count, 0) <= budget):
            context = sum([request.context for _, request in deferrable])
            predicted = step.with_decodes(count, context)
            if predicted <= budget:
                decode_ids.extend([request.req_id for _, request in deferrable])
                step.add_decodes(count, context, predicted)
                deferrable = None
        if deferrable:
            _pack_deferrable(deferrable, step, budget, tokens_left, decode_ids)

    return BatchDecision(tuple(decode_ids), tuple(chunks), step.predicted, time_budget_s)


class _Step:
    """The step being packed: its features so far and their predicted time."""

    __slots__ = ("model", "new_tokens", "prefill_context", "decodes", "decode_context", "pairs",
                 "predicted")

    def __init__(self, model: StepPredictor, decodes: int, decode_context: int) -> None:
        self.model = model
        self.new_tokens = decodes
        self.prefill_context = 0
        self.decodes = decodes
        self.decode_context = decode_context
        self.pairs = 0.0
        self.predicted = model.step_s(decodes, 0, decodes, decode_context, 0.0)

    def with_decodes(self, count: int, context: int) -> float:
        return self.model.step_s(self.new_tokens + count, self.prefill_context, self.decodes + count,
                                 self.decode_context + context, self.pairs)

    def add_decodes(self, count: int, context: int, predicted: float) -> None:
        """Adds ``count`` decodes over ``context`` tokens, ``predicted`` by :meth:`with_decodes`."""
        self.predicted = predicted
        self.new_tokens += count
        self.decodes += count
        self.decode_context += context

    def add_chunk(self, chunk: int, prefix: int, cost: float | None = None) -> None:
        """Adds a chunk; ``cost``: its ``prefill_cost_s`` when already computed."""
        self.predicted += self.model.prefill_cost_s(chunk, prefix, self.new_tokens) if cost is None else cost
        self.new_tokens += chunk
        self.prefill_context += prefix
        self.pairs += chunk * (prefix + (chunk + 1) / 2.0)


def _pack_deferrable(
    deferrable: list[tuple[float, RequestState]], step: _Step, budget: float, tokens_left: int,
    decode_ids: list[Hashable],
) -> None:
    """Adds the deferrable decodes in order while each still fits the budget. Each one's
    exact prediction while the model says a decode may cost less than its increment (below
    the knee or the saturation, a decode can be free or even lower the mean-context
    estimate); from where every further decode costs exactly ``fixed + per_kv_token *
    context`` (``decode_increment``), that sum, and the loop stops once not even ``fixed``
    is left."""
    model = step.model
    position = 0
    increment = model.decode_increment(step.new_tokens, step.decodes)
    while increment is None:
        if position == len(deferrable) or tokens_left < 1:
            return
        request = deferrable[position][1]
        position += 1
        predicted = step.with_decodes(1, request.context)
        if predicted <= budget:
            decode_ids.append(request.req_id)
            step.add_decodes(1, request.context, predicted)
            tokens_left -= 1
            increment = model.decode_increment(step.new_tokens, step.decodes)
    fixed, per_kv_token = increment
    predicted = step.predicted
    count = context = 0
    for _, request in itertools.islice(deferrable, position, None):
        if count == tokens_left or budget - predicted < fixed:
            break
        cost = fixed + per_kv_token * request.context
        if predicted + cost <= budget:
            decode_ids.append(request.req_id)
            predicted += cost
            count += 1
            context += request.context
    if count:
        step.add_decodes(count, context, predicted)


def _pack_prefills(
    prefills: list[tuple[float, RequestState]], step: _Step, budget: float, tokens_left: int,
    chunks: list[tuple[Hashable, int]],
) -> tuple[bool, int]:
    """Chunk ``prefills`` in order into what is left; returns whether another prefill
    could still fit, and the tokens left."""
    model = step.model
    for _, request in prefills:
        pending = request.pending_prefill
        limit = pending if pending < tokens_left else tokens_left
        time_left = budget - step.predicted
        cost = model.prefill_cost_s(limit, request.context, step.new_tokens)
        if cost <= time_left:
            chunk = limit
        else:
            cost = None
            chunk = model.max_chunk(time_left, request.context, step.new_tokens, limit - 1)
            if chunk < 1:
                if model.max_chunk(time_left, 0, step.new_tokens, 1) < 1:
                    return False, tokens_left  # nothing that costs at least one token fits
                continue
        chunks.append((request.req_id, chunk))
        step.add_chunk(chunk, request.context, cost)
        tokens_left -= chunk
        if tokens_left <= 0 or chunk < pending:
            return False, tokens_left  # only the last chunk of a step may be partial
    return True, tokens_left


def form_batch(
    requests: Sequence[RequestState],
    now: float,
    coefficients: StepPredictor,
    *,
    max_token_budget: int = DEFAULT_MAX_TOKEN_BUDGET,
) -> BatchDecision:
    """Algorithm 1 with the adaptive time budget (the ``fb`` policy) and the lateness
    guard, its floor taken from ``coefficients`` and the smallest TPOT present."""
    default_tpot = min((request.slo.tpot_s for request in requests), default=0.0)
    groups = triage(requests, now, floor=ServiceFloor.of(coefficients, default_tpot))
    if groups is None:
        return BatchDecision.make_empty()
    return pack(
        groups, coefficients, token_budget=max_token_budget, time_budget_s=groups.init_time_budget_s
    )
