"""What the policy sees of an SGLang ``Req``: one live view per request, attached as it
joins the waiting queue (or on first sight, for one that reached a decision another way)
and refreshed in place each step.

The view is deliberately mutable: building a fresh frozen view for every request every
step cost more than the policy's decision itself (about 5 us per request on the
reference CPU); refreshing three integers costs a fraction of that. The policy reads
views within one decision and never keeps them.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Container, Iterable
from typing import Any

from sglang_ext.adapter.admission.budget_gate import ADMISSION_STAMP_KEY
from sglang_ext.adapter.controlplane_agent import CONTROLPLANE_SEQ_KEY, MAX_DAEMONS
from sglang_ext.adapter.custom_params import custom_param
from sglang_ext.adapter.dp_pab import dispatch_seq_of
from sglang_ext.adapter.ingress_time import arrival_time
from sglang_ext.adapter.scheduler.request_store import DecisionColumns, RequestStore
from sglang_ext.policy.request_table import NO_FIRST_TOKEN
from sglang_ext.policy.slo import Slo, SloCatalog, SloError
from sglang_ext.policy.startup_calibration import is_calibration_rid

logger = logging.getLogger(__name__)

RECORD_ATTR = "_fairbatching_record"  # decode_views and prefill_views read it by name
MAX_ECHOED_GATES = 64


class LiveRequestView:
    """Implements ``sglang_ext.policy.view.RequestState`` for one SGLang request."""

    __slots__ = ("req_id", "arrival", "slo", "arrival_seq", "dispatch_seq", "prompt_tokens",
                 "next_output_index", "pending_prefill", "context", "first_token_time",
                 "late", "expired", "row", "stamped_first", "pinned")

    def __init__(self, req_id: Any, arrival: float, slo: Slo, arrival_seq: int,
                 dispatch_seq: int | None, prompt_tokens: int) -> None:
        self.req_id = req_id
        self.arrival = arrival  # ingress_time.arrival_time: the HTTP process's receive time
        self.slo = slo  # an e2e SLO: its envelope paced for max_new_tokens (paced_for_output)
        self.arrival_seq = arrival_seq
        self.dispatch_seq = dispatch_seq  # stamped by the DP controller's pab method
        self.prompt_tokens = prompt_tokens
        self.next_output_index = 0
        self.pending_prefill = prompt_tokens
        self.context = 0
        self.first_token_time: float | None = None
        self.late = False  # counted once: past its TTFT deadline without a first token
        self.expired = False  # counted once: ended under admission mode defer
        self.row = -1  # its row in the RequestStore (request_store); -1: none
        self.stamped_first = 0.0  # SGLang's first-token stamp once a decode view read it
        self.pinned = False  # never parked: pinned_by_sampling, read on first sight


class RequestRecords:
    """Attaches a :class:`LiveRequestView` to each ``Req`` and refreshes it per step.

    While the start-up calibration runs (:meth:`hold_arrivals` until :meth:`ready`), the
    server is not ready: a request that arrived meanwhile counts its deadlines from the
    moment it became ready, so the wait for the calibration never makes it late or ends
    it under admission ``defer`` (SGLang's own readiness warm-up is such a request).

    After the calibration the rank keeps a door of its own (:meth:`ready`'s ``door``):
    the HTTP process judged each SLO with the step-model file, this rank knows the
    device. Each request that arrives after the calibration is shown to the door on first
    sight (``FairBatchingState`` refuses one the calibrated model cannot serve). Requests
    that arrived while the calibration ran were admitted before the device was known and
    are served."""

    def __init__(self, catalog: SloCatalog) -> None:
        self.catalog = catalog
        self._sequence = itertools.count()
        self.highest_dispatch_seq = 0
        # per admission gate (its token), the highest admission number seen: echoed in the
        # load snapshot so the gate can end its debits (sglang_ext.adapter.admission.budget_gate)
        self.admission_echo: dict[str, int] = {}
        # per control-plane daemon (its slot), the highest dispatch seq seen: echoed in
        # that daemon's reports (sglang_ext.adapter.scheduler.controlplane_reports)
        self.controlplane_echo: dict[int, int] = {}
        self.ready_at = -math.inf
        self._calibrating = False
        self._held: list[LiveRequestView] = []
        self._door: Callable[[Any, Slo], None] | None = None
        self._unechoed: list[tuple[Any, int | None]] = []
        self.store = RequestStore()

    def hold_arrivals(self) -> None:
        """The calibration started: requests that arrive wait for :meth:`ready`."""
        self._calibrating = True

    def ready(self, at: float, door: Callable[[Any, Slo], None] | None = None) -> None:
        """The calibration ended at ``at``: requests that came during it, and still have
        no token, arrived at ``at``. ``door`` is called with the rid and SLO of each request
        that arrives after."""
        self._calibrating = False
        self.ready_at = at
        self._door = door
        for view in self._held:
            if view.next_output_index == 0 and view.arrival < at:
                view.arrival = at
                self.store.moved(view)
        self._held = []

    def of(self, req: Any) -> LiveRequestView:
        view = getattr(req, RECORD_ATTR, None)
        if view is None:
            view = self._attach(req)
        return view

    def arrived(self, req: Any) -> None:
        """``req`` joined the waiting queue: its view and its store row are made now, on
        the request path, rather than by the first decision that reads it; its stamps are
        echoed by :meth:`echo_arrivals`. The view loops make the views of requests that
        reached a decision another way."""
        view = getattr(req, RECORD_ATTR, None) or self._attach(req, echo=False)
        if view.row < 0:
            self.store.add_row(view, req)

    def _attach(self, req: Any, echo: bool = True) -> LiveRequestView:
        custom_params = getattr(req.sampling_params, "custom_params", None)
        try:
            slo = self.catalog.resolve_custom_params(custom_params)
        except SloError as exc:
            # The HTTP front door rejects malformed SLOs with a 400; a request that
            # reached the scheduler another way falls back rather than crash it.
            logger.warning("request %s: %s; using the default SLO class", req.rid, exc)
            slo = self.catalog.default
        slo = paced_for_output(slo, req.sampling_params)
        dispatch_seq = dispatch_seq_of(req)
        if echo:
            self._echo(req, dispatch_seq)
        else:
            self._unechoed.append((req, dispatch_seq))
        arrival = arrival_time(req)
        if arrival < self.ready_at:
            arrival = self.ready_at
        elif self._door is not None and not is_calibration_rid(req.rid):
            self._door(req.rid, slo)
        view = LiveRequestView(req.rid, arrival, slo,
                               next(self._sequence), dispatch_seq, len(req.origin_input_ids))
        view.pinned = pinned_by_sampling(req)
        if self._calibrating and not is_calibration_rid(req.rid):
            self._held.append(view)
        setattr(req, RECORD_ATTR, view)
        return view

    def echo_arrivals(self) -> None:
        """Echo the stamps of the requests :meth:`arrived` made views of. Callers echo them
        in the pass whose views include those requests, so an echo never runs ahead of the
        budgets computed from the views (``controlplane_reports``)."""
        if self._unechoed:
            for req, dispatch_seq in self._unechoed:
                self._echo(req, dispatch_seq)
            self._unechoed = []

    def _echo(self, req: Any, dispatch_seq: int | None) -> None:
        if dispatch_seq is not None:
            self.highest_dispatch_seq = max(self.highest_dispatch_seq, dispatch_seq)
        self._echo_admission(custom_param(req, ADMISSION_STAMP_KEY))
        self._echo_controlplane(custom_param(req, CONTROLPLANE_SEQ_KEY))

    def _echo_admission(self, stamp: Any) -> None:
        if not (isinstance(stamp, list) and len(stamp) == 2):
            return
        token, seq = stamp
        if not isinstance(token, str) or isinstance(seq, bool) or not isinstance(seq, int):
            return
        echo = self.admission_echo
        if token not in echo and len(echo) >= MAX_ECHOED_GATES:
            del echo[next(iter(echo))]  # the gate seen first: at most one per TokenizerManager
        if seq > echo.get(token, 0):
            echo[token] = seq

    def _echo_controlplane(self, stamp: Any) -> None:
        if not (isinstance(stamp, list) and len(stamp) == 2):
            return
        slot, seq = stamp
        if any(isinstance(v, bool) or not isinstance(v, int) for v in stamp) or not 0 <= slot < MAX_DAEMONS:
            return
        if seq > self.controlplane_echo.get(slot, 0):
            self.controlplane_echo[slot] = seq

    def decode_view(self, req: Any, in_flight: bool, in_flight_ends_at: float) -> LiveRequestView:
        """A decoding request. Under the overlap scheduler ``in_flight`` requests have a
        token being computed that ``output_ids`` does not show yet: the next token this
        step can produce is one further on. If that in-flight token is the first one,
        SGLang has not stamped it yet; it is expected when the in-flight step ends
        (``in_flight_ends_at``) — without this, the anchored variants would measure the
        second token against the TTFT envelope and allow a long step right after it."""
        view = getattr(req, RECORD_ATTR, None) or self._attach(req)
        produced = len(req.output_ids) + in_flight
        view.next_output_index = produced
        view.pending_prefill = 0
        view.context = view.prompt_tokens + produced
        first = req.time_stats.prefill_finished_time
        view.first_token_time = first if first else (in_flight_ends_at if in_flight else None)
        return view

    def decode_views(self, reqs: Iterable[Any], in_flight: Container[Any],
                     in_flight_ends_at: float,
                     columns: DecisionColumns | None = None) -> list[LiveRequestView]:
        """:meth:`decode_view` of each of ``reqs``, in order, with ``req in in_flight``: one
        loop with its lookups bound, as it runs for every decoding request every step.
        ``columns``: also collected there, for the decision's table."""
        views: list[LiveRequestView] = []
        add = views.append
        attach = self._attach
        if columns is not None:
            rows, nexts = columns.decode_rows.append, columns.decode_next.append
            firsts, outputs = columns.decode_first.append, columns.decode_outputs.append
            add_row = self.store.add_row
        for req in reqs:
            try:
                view = req._fairbatching_record  # RECORD_ATTR, read without getattr's call
            except AttributeError:
                view = attach(req)
            produced = len(req.output_ids)
            first = view.stamped_first
            if not first:
                first = view.stamped_first = req.time_stats.prefill_finished_time
            if columns is not None:
                outputs(produced)
            if in_flight and req in in_flight:
                produced += 1
                first = view.first_token_time = first if first else in_flight_ends_at
            else:
                first = view.first_token_time = first if first else None
            view.next_output_index = produced
            view.pending_prefill = 0
            view.context = view.prompt_tokens + produced
            add(view)
            if columns is not None:
                rows(view.row if view.row >= 0 else add_row(view, req))
                nexts(produced)
                firsts(NO_FIRST_TOKEN if first is None else first)
        return views

    def prefill_views(self, reqs: Iterable[Any],
                      columns: DecisionColumns | None = None) -> list[LiveRequestView]:
        """:meth:`prefill_view` of each of ``reqs``, in order, in one loop (``columns``:
        also collected there)."""
        views: list[LiveRequestView] = []
        add = views.append
        attach = self._attach
        if columns is not None:
            rows, nexts, firsts = (columns.prefill_rows.append, columns.prefill_next.append,
                                   columns.prefill_first.append)
            pendings, contexts = columns.prefill_pending.append, columns.prefill_context.append
            outputs, add_row = columns.prefill_outputs.append, self.store.add_row
        for req in reqs:
            try:
                view = req._fairbatching_record  # RECORD_ATTR
            except AttributeError:
                view = attach(req)
            produced = len(req.output_ids)
            total = view.prompt_tokens + produced
            cached = req.prefix_len
            if cached > total - 1:
                cached = total - 1
            view.next_output_index = produced
            view.pending_prefill = total - cached
            view.context = cached
            first = view.first_token_time = req.time_stats.prefill_finished_time or None
            add(view)
            if columns is not None:
                rows(view.row if view.row >= 0 else add_row(view, req))
                nexts(produced)
                pendings(total - cached)
                contexts(cached)
                firsts(NO_FIRST_TOKEN if first is None else first)
                outputs(produced)
        return views

    def prefill_view(self, req: Any) -> LiveRequestView:
        """A request with prompt (or, after retraction, recompute) tokens not in KV yet."""
        view = getattr(req, RECORD_ATTR, None) or self._attach(req)
        produced = len(req.output_ids)
        total = view.prompt_tokens + produced
        cached = min(req.prefix_len, total - 1)
        view.next_output_index = produced
        view.pending_prefill = total - cached
        view.context = cached
        view.first_token_time = req.time_stats.prefill_finished_time or None
        return view


def paced_for_output(slo: Slo, sampling_params: Any) -> Slo:
    """An end-to-end SLO's envelope paced for the request's ``max_new_tokens``: the only
    bound on its output the server knows at arrival. By the time a request is queued,
    SGLang's scheduler has set it (``Scheduler.init_req_max_new_tokens``: the client's
    value, else up to the context, cut to ``SGLANG_MAX_NEW_TOKENS_LIMIT`` and to what KV
    memory holds). Not an integer (never, past that point): the nominal envelope."""
    max_new_tokens = getattr(sampling_params, "max_new_tokens", None)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        return slo
    return slo.with_expected_output(max_new_tokens)


def must_decode(req: Any, view: LiveRequestView) -> bool:
    """Requests that are never parked: ones being finished or aborted, and pinned ones
    (:func:`pinned_by_sampling`, read into ``req``'s view when it was made)."""
    return req.finished() or req.to_finish is not None or view.pinned


def pinned_by_sampling(req: Any) -> bool:
    """Whether ``req``'s sampling state lives in the batch (penalties, grammars, logprobs,
    custom logit processors), which a rebuilt batch would not carry over. All are fixed
    by the time a request is queued (a grammar is compiled before it joins the queue), so
    its view reads this once, on first sight."""
    params = req.sampling_params
    return bool(
        req.return_logprob
        or req.grammar is not None
        or params.frequency_penalty
        or params.presence_penalty
        or params.repetition_penalty != 1.0
        or params.min_new_tokens
        or getattr(params, "custom_logit_processor", None)
    )
