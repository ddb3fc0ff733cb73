"""The daemon's state machine, without I/O: events in, messages to send out.

Every handler takes the current time and returns the sends it causes; the asyncio layer
(:mod:`controlplane.daemon`) owns the sockets and reports failed sends back through
:meth:`DispatcherCore.on_send_failed`. Every request leaves the table through
:meth:`DispatcherCore._close`, the one place that releases its in-flight slot, so each
exit path (finish, error, cancel, deadline, client gone, rank lost, drain, internal
error) releases it exactly once.

Every entry point (``on_client``, ``on_agent``, ``on_report``, ``on_tick``,
``on_send_failed``) is guarded: a bug in a handler is counted (``internal_errors``),
logged (rate-limited), and the requests the message concerned, or that the handler
left half-done, end with ``Reject internal`` (:meth:`DispatcherCore._recover`); those it
had already closed still get their answers. So an accepted request always gets exactly
one final answer, and the daemon serves on.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from msgspec import Struct

from controlplane.balancer import (
    PREFIX_TREE_POLICIES,
    RankView,
    least_in_flight,
    make_balancer,
    routing_class,
)
from controlplane.config import DaemonConfig
from controlplane.ledger import DispatchLedger
from controlplane.prefix_affinity import Prompt as AffinityPrompt
from controlplane.protocol import (
    Abort, AgentMessage, Cancel, Chunk, ClientReply, ClientRequest, DaemonToAgent, Dispatch,
    Dispatched, Done, DrainRank, DrainReply, Draining, Fenced, Finish, FinishReason, Goodbye,
    Heartbeat, Hello, Output, Ping, Pong, Prompt, RankOutputs, RankStatus, Reject, RejectReason,
    Report, StatusReply, StatusRequest, Submit, Welcome, PROTOCOL_VERSION, client_refusal,
    protocol_refusal, retryable,
)
from controlplane.prompt_estimate import estimate_prompt_tokens
from controlplane.ratelimited_log import RateLimitedLog
from controlplane.registry import Departure, HelloOutcome, RankRegistry, RankState, ReportOutcome

UNKNOWN_AGENT = "unknown agent"
UNKNOWN_RANK = "unknown rank"


class ToClient(Struct, frozen=True):
    identity: bytes
    message: ClientReply


class ToAgent(Struct, frozen=True):
    identity: bytes
    message: DaemonToAgent


Send = ToClient | ToAgent


@dataclass(slots=True)
class Pending:
    """A request the daemon holds: queued (``rank is None``) or dispatched."""

    submit: Submit
    client: bytes
    prompt_tokens: int
    received_at: float  # its first arrival: a resubmission after a queue timeout keeps it
    deadline_at: float | None
    queued_until: float | None = None
    rank: str | None = None
    epoch: int = 0
    agent: bytes = b""
    dispatch_seq: int = 0
    output_sent: bool = False
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    tried: set[str] = field(default_factory=set)
    affinity_prompt: AffinityPrompt | None = None  # what the prefix-tree balancers match on


def affinity_prompt(prompt: Prompt) -> AffinityPrompt:
    """What a cache-aware balancer matches a prompt on: its token ids, its text, or a chat
    conversation as one text (each turn's role and content, in order), so that two
    conversations sharing their first turns share a prefix."""
    if prompt.token_ids is not None:
        return prompt.token_ids
    if prompt.messages is not None:
        return "".join(f"<|{m.role}|>{m.content}<|end|>" for m in prompt.messages)
    return prompt.text or ""


@dataclass(slots=True)
class _Step:
    """What the current call into the core has done so far, for :meth:`DispatcherCore._recover`."""

    closed: list[Send] = field(default_factory=list)  # everything _close returned (final answers, aborts)
    dispatched: set[str] = field(default_factory=set)  # dispatched in this call: the rank has not got it
    working: str | None = None  # the request a loop is working on
    ending: list[str] = field(default_factory=list)  # requests the call ends anyway (drain, abort all)


class DispatcherCore:
    def __init__(self, config: DaemonConfig, daemon_id: str, started_at: float,
                 first_dispatch_seq: int = 1, log: RateLimitedLog | None = None) -> None:
        self.config = config
        self.daemon_id = daemon_id
        self.started_at = started_at
        self.registry = RankRegistry()
        self.ledger = DispatchLedger(first_dispatch_seq)
        self.balancer = make_balancer(config.policy, config.seed)
        # the prompt can change a choice (what a rank holds of it)
        self._routes_on_prompt = config.policy in PREFIX_TREE_POLICIES
        self.counters: Counter[str] = Counter()
        self.log = log if log is not None else RateLimitedLog(logging.getLogger(__name__))
        self.draining = False
        self.saturated = False  # the daemon's own event loop cannot keep up (set by the daemon)
        self._requests: dict[str, Pending] = {}
        self._queue: deque[str] = deque()
        # first arrivals of requests refused queue_timeout: a resubmission (the SDK's retry)
        # keeps its age, so it is not queued for another TTFT it has already missed
        self._timed_out: OrderedDict[str, float] = OrderedDict()
        self._deadlines: list[tuple[float, str]] = []
        self._step = _Step()

    # ------------------------------------------------------------------ queries
    @property
    def in_flight(self) -> int:
        return len(self._requests) - len(self._queue)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def idle(self) -> bool:
        return not self._requests

    def status(self, now: float) -> StatusReply:
        ranks = []
        for state in self.registry.ranks():
            report = state.report
            ranks.append(RankStatus(
                rank=state.rank, agent=state.agent.decode(errors="replace"), epoch=state.epoch,
                pab_tokens=self.ledger.effective_budget(state.rank),
                reported_pab_tokens=report.pab_tokens if report else None,
                running=report.running if report else 0, waiting=report.waiting if report else 0,
                free_kv_tokens=report.free_kv_tokens if report else 0,
                in_flight=len(state.in_flight), report_age_s=state.report_age(now),
                stale=not state.fresh(now, self.config.stale_after_s), reports=state.reports,
                seq_gaps=state.seq_gaps, dispatched=state.dispatched, draining=state.draining,
                class_budgets=self.ledger.effective_class_budgets(state.rank),
            ))
        return StatusReply(self.daemon_id, self.config.policy, now - self.started_at, self.draining,
                           self.in_flight, self.queued, ranks, dict(self.counters))

    # ------------------------------------------------------------------ clients
    def on_client(self, identity: bytes, message: ClientRequest, now: float) -> list[Send]:
        return self._guarded("client", identity, message, self._client_message, identity, message, now)

    def _client_message(self, identity: bytes, message: ClientRequest, now: float) -> list[Send]:
        match message:
            case Submit():
                return self._submit(identity, message, now)
            case Cancel(request_id=request_id):
                return self._cancel(identity, request_id, now)
            case Ping(nonce=nonce):
                return [ToClient(identity, Pong(nonce, self.daemon_id, self.draining, PROTOCOL_VERSION))]
            case StatusRequest():
                return [ToClient(identity, self.status(now))]
            case DrainRank(rank=rank, drain=drain):
                return self._drain_rank(identity, rank, drain, now)
        return []

    def _submit(self, identity: bytes, submit: Submit, now: float) -> list[Send]:
        self.counters["submits"] += 1
        reject = self._refusal(submit)
        if reject is not None:
            self.counters[f"rejected_{reject.reason}"] += 1
            return [ToClient(identity, reject)]
        prompt_tokens = estimate_prompt_tokens(submit.prompt, self.config.chars_per_token,
                                               self.config.chat_tokens_per_message)
        deadline_at = now + submit.deadline_s if submit.deadline_s is not None else None
        arrived = self._timed_out.pop(submit.request_id, None)
        if arrived is None or now - arrived > self.config.queue_ttl_s:
            arrived = now
        pending = Pending(submit, identity, prompt_tokens, arrived, deadline_at)
        if self._routes_on_prompt:
            pending.affinity_prompt = affinity_prompt(submit.prompt)
        self._requests[submit.request_id] = pending
        if deadline_at is not None:
            heapq.heappush(self._deadlines, (deadline_at, submit.request_id))
        return self._place(submit.request_id, pending, now)

    def _refusal(self, submit: Submit) -> Reject | None:
        request_id = submit.request_id
        too_old = client_refusal(submit.protocol)
        if too_old is not None:
            return Reject(request_id, RejectReason.INVALID, too_old)
        if self.draining:
            return Reject(request_id, RejectReason.SHUTTING_DOWN, "the daemon is draining")
        if request_id in self._requests:
            return Reject(request_id, RejectReason.DUPLICATE, "this request id is already in flight")
        if len(self._requests) >= self.config.max_in_flight:
            return Reject(request_id, RejectReason.OVERLOADED, "the daemon's in-flight limit is reached",
                          retry_after_s=self.config.retry_after_s, retryable=True)
        if self.saturated:
            return Reject(request_id, RejectReason.OVERLOADED,
                          "the daemon is saturated (its event loop busy at least max_loop_busy of the "
                          "time): requests would wait in its sockets", retry_after_s=self.config.retry_after_s,
                          retryable=True)
        if not len(self.registry):
            return Reject(request_id, RejectReason.NO_RANKS, "no rank is registered",
                          retry_after_s=self.config.retry_after_s, retryable=True)
        return None

    def _cancel(self, identity: bytes, request_id: str, now: float) -> list[Send]:
        pending = self._requests.get(request_id)
        if pending is None or pending.client != identity:
            self.counters["cancel_unknown"] += 1
            return []
        self.counters["cancelled"] += 1
        return self._close(request_id, Finish(request_id, FinishReason.CANCELLED), abort=True)

    def _drain_rank(self, identity: bytes, rank: str, drain: bool, now: float) -> list[Send]:
        state = self.registry.get(rank)
        if state is None:
            return [ToClient(identity, DrainReply(rank, known=False))]
        self._set_draining(state, drain)
        sends: list[Send] = [ToClient(identity, DrainReply(rank, True, drain, len(state.in_flight)))]
        return sends if drain else sends + self._pump_queue(now)

    def _set_draining(self, state: RankState, drain: bool) -> None:
        if state.draining != drain:
            self.counters["ranks_drained" if drain else "ranks_resumed"] += 1
        state.draining = drain

    # ------------------------------------------------------------------ placement
    def _views(self, now: float) -> tuple[list[RankView], bool]:
        """Views of the fresh ranks, or (no fresh rank) of every reachable one, and which;
        draining ranks are never among them."""
        states = [s for s in self.registry.ranks() if not s.unreachable and not s.draining]
        fresh = [s for s in states if s.fresh(now, self.config.stale_after_s)]
        chosen = fresh or states
        views = []
        for state in chosen:
            report = state.report
            views.append(RankView(
                rank=state.rank, pab_tokens=self.ledger.effective_budget(state.rank),
                running=report.running if report else 0,
                waiting=(report.waiting if report else 0) + self.ledger.outstanding_dispatches(state.rank),
                total_tokens=(report.total_tokens if report else 0) + self.ledger.outstanding_tokens(state.rank),
                in_flight=len(state.in_flight),
                class_budgets=self.ledger.effective_class_budgets(state.rank),
            ))
        return views, bool(fresh)

    def _class_ttfts(self) -> dict[str, float]:
        """Each SLO class's TTFT target as the ranks' last reports state it."""
        ttfts: dict[str, float] = {}
        for state in self.registry.ranks():
            if state.report is not None:
                for name, budget in state.report.class_budgets.items():
                    ttfts.setdefault(name, budget.ttft_s)
        return ttfts

    @staticmethod
    def _routing_class(submit: Submit, class_ttfts: dict[str, float]) -> str | None:
        slo = submit.slo
        if slo is None:
            return None
        ttft_ms = slo.first_token_ms
        return routing_class(class_ttfts, slo.slo_class, None if ttft_ms is None else ttft_ms / 1e3)

    def _queue_ttl(self, submit: Submit, class_ttfts: dict[str, float]) -> float:
        """How long after its arrival a request may wait for a rank's budget: its own TTFT
        target (its SLO's first-token target, else its class's as the ranks report it), at
        most ``queue_ttl_s``, which is also the TTL of a request with neither. Past it, it
        has missed its SLO anyway, and waiting longer only delays the requests behind it."""
        cap = self.config.queue_ttl_s
        slo = submit.slo
        if slo is None:
            return cap
        ttft_ms = slo.first_token_ms
        if ttft_ms is not None:
            return min(cap, ttft_ms / 1e3)
        return min(cap, class_ttfts.get(slo.slo_class, cap)) if slo.slo_class is not None else cap

    def _choose(self, views: list[RankView], pending: Pending, slo_class: str | None) -> str | None:
        prompt = pending.affinity_prompt
        if prompt is None:
            return self.balancer.choose(views, pending.prompt_tokens, slo_class)
        return self.balancer.choose(views, pending.prompt_tokens, slo_class, prompt)

    def _spill(self, views: list[RankView], pending: Pending, slo_class: str | None) -> str | None:
        prompt = pending.affinity_prompt
        if prompt is None:
            return self.balancer.spill(views, pending.prompt_tokens, slo_class)
        return self.balancer.spill(views, pending.prompt_tokens, slo_class, prompt)

    def _place(self, request_id: str, pending: Pending, now: float) -> list[Send]:
        views, fresh = self._views(now)
        views = [v for v in views if v.rank not in pending.tried]
        class_ttfts = self._class_ttfts()
        slo_class = self._routing_class(pending.submit, class_ttfts)
        if fresh:
            rank = self._choose(views, pending, slo_class)
        else:
            rank = least_in_flight(views, self.config.local_inflight_cap)
            if rank is not None:
                self.counters["dispatched_local_accounting"] += 1
        if rank is not None:
            return self._dispatch(request_id, pending, rank)
        if not views:
            reason, detail = RejectReason.NO_RANKS, "no reachable rank that is not draining"
        elif fresh and self.balancer.routes_on_budget:
            of_class = "" if slo_class is None else f" of SLO class {slo_class}"
            uncached = " (less what it holds of the prompt)" if self._routes_on_prompt else ""
            detail = (f"no rank's budget{of_class} covers {pending.prompt_tokens} prompt "
                      f"tokens{uncached}")
            reason = RejectReason.NO_BUDGET
        else:
            reason, detail = RejectReason.OVERLOADED, "every rank is at its in-flight cap"
        if self.config.on_no_budget == "spill" and reason is RejectReason.NO_BUDGET:
            rank = self._spill(views, pending, slo_class)
            if rank is not None:
                self.counters["spilled"] += 1
                return self._dispatch(request_id, pending, rank)
        if self.config.on_no_budget == "queue" and reason is RejectReason.NO_BUDGET:
            ttl = self._queue_ttl(pending.submit, class_ttfts)
            queued_until = pending.received_at + ttl
            if queued_until <= now:
                self._timed_out_at(request_id, pending)
                reason, detail = RejectReason.QUEUE_TIMEOUT, self._expired(ttl)
            elif len(self._queue) < self.config.max_queued:
                pending.queued_until = queued_until
                self._queue.append(request_id)
                self.counters["queued"] += 1
                return []
            else:
                reason, detail = RejectReason.OVERLOADED, "the admission queue is full"
        return self._close(request_id, self._reject(request_id, reason, detail))

    def _timed_out_at(self, request_id: str, pending: Pending) -> None:
        """Count a queue timeout and remember the request's first arrival (at most
        ``max_queued`` of them, the oldest forgotten first)."""
        self.counters["queue_timeouts"] += 1
        self._timed_out[request_id] = pending.received_at
        self._timed_out.move_to_end(request_id)
        while len(self._timed_out) > self.config.max_queued:
            self._timed_out.popitem(last=False)

    @staticmethod
    def _expired(ttl: float) -> str:
        return (f"no rank's budget covered it within its TTFT target ({ttl:g} s), so it would "
                "miss its SLO")

    def _place_elsewhere(self, request_id: str, pending: Pending, error: str, now: float) -> list[Send]:
        """The rank's own admission refused the request before it cost anything: release it
        there and place it on a rank it has not tried, when one with a fresh report is left;
        otherwise answer ``no_budget`` with the rank's reason."""
        views, fresh = self._views(now)
        if not fresh or all(view.rank in pending.tried for view in views):
            return self._close(request_id, self._reject(request_id, RejectReason.NO_BUDGET, error),
                               release=True)
        self.ledger.release(pending.rank, pending.dispatch_seq)
        state = self.registry.get(pending.rank)
        if state is not None and state.epoch == pending.epoch:
            state.in_flight.discard(request_id)
        pending.rank = None
        self.counters["replaced_after_rank_refusal"] += 1
        return self._place(request_id, pending, now)

    def _dispatch(self, request_id: str, pending: Pending, rank: str) -> list[Send]:
        """Send ``pending`` to ``rank``, debiting the prompt less what the balancer believes
        the rank holds of it already (the prefix-tree policies; others: the whole prompt)."""
        state = self.registry.get(rank)
        assert state is not None
        cached = self.balancer.record(rank, pending.affinity_prompt, pending.prompt_tokens)
        if cached:
            self.counters["prompt_tokens_believed_cached"] += cached
        seq = self.ledger.record_dispatch(rank, pending.prompt_tokens - cached)
        pending.rank, pending.epoch, pending.agent, pending.dispatch_seq = rank, state.epoch, state.agent, seq
        pending.queued_until = None
        pending.tried.add(rank)
        self._step.dispatched.add(request_id)
        state.in_flight.add(request_id)
        state.dispatched += 1
        self.counters["dispatched"] += 1
        submit = pending.submit
        dispatch = Dispatch(request_id, rank, state.epoch, seq, submit.prompt, submit.sampling,
                            submit.slo, submit.stream)
        return [ToAgent(state.agent, dispatch),
                ToClient(pending.client, Dispatched(request_id, rank, seq))]

    def _pump_queue(self, now: float) -> list[Send]:
        """Dispatch every queued request a rank's budget now covers, in arrival order, and
        refuse those past their TTL (``queue_timeout``). A request that does not fit does
        not hold back those behind it: a later one whose budget fits a rank goes."""
        if not self._queue:
            return []
        sends: list[Send] = []
        views: list[RankView] | None = None  # rebuilt only after a dispatch changes a budget
        fresh = False
        # the smallest prompt per class no rank took since the views were built: with a
        # policy blind to the prompt's content, no larger one of that class fits either
        declined: dict[str | None, int] = {}
        class_ttfts = self._class_ttfts()
        waiting, self._queue = self._queue, deque()
        for request_id in waiting:
            pending = self._requests.get(request_id)
            if pending is None or pending.rank is not None:
                continue
            self._step.working = request_id
            if pending.queued_until is not None and now > pending.queued_until:
                self._timed_out_at(request_id, pending)
                ttl = pending.queued_until - pending.received_at
                sends += self._close(request_id, self._reject(
                    request_id, RejectReason.QUEUE_TIMEOUT, self._expired(ttl)))
                continue
            if views is None:
                views, fresh = self._views(now)
                declined.clear()
            slo_class = self._routing_class(pending.submit, class_ttfts)
            smallest_declined = declined.get(slo_class)
            rank = None
            if fresh and (smallest_declined is None or pending.prompt_tokens < smallest_declined):
                rank = self._choose(views, pending, slo_class)
                if rank is None and not self._routes_on_prompt:
                    declined[slo_class] = pending.prompt_tokens
            if rank is None:
                self._queue.append(request_id)
            else:
                sends += self._dispatch(request_id, pending, rank)
                views = None
        self._step.working = None
        return sends

    def _reject(self, request_id: str, reason: RejectReason, detail: str, *, output_sent: bool = False) -> Reject:
        self.counters[f"rejected_{reason}"] += 1
        can_retry = retryable(reason) and not output_sent
        retry_after = self.config.retry_after_s if can_retry else None
        return Reject(request_id, reason, detail, retry_after_s=retry_after, retryable=can_retry)

    # ------------------------------------------------------------------ the one exit
    def _close(self, request_id: str, reply: ClientReply | None, *, abort: bool = False,
               release: bool = False) -> list[Send]:
        """End the request once: free its queue or in-flight slot, ``abort`` it at the rank,
        ``release`` its debit (the rank will not serve it), send ``reply`` to the client."""
        pending = self._requests.pop(request_id, None)
        if pending is None:
            return []
        sends: list[Send] = []
        if pending.rank is None:
            if request_id in self._queue:  # not while _pump_queue holds it, nor before it was queued
                self._queue.remove(request_id)
        else:
            if release:
                self.ledger.release(pending.rank, pending.dispatch_seq)
            state = self.registry.get(pending.rank)
            if state is not None and state.epoch == pending.epoch:
                state.in_flight.discard(request_id)
                if abort:
                    sends.append(ToAgent(pending.agent, Abort(pending.rank, pending.epoch, request_id)))
        self.counters["closed"] += 1
        if reply is not None:
            sends.append(ToClient(pending.client, reply))
        self._step.closed += sends
        return sends

    # ------------------------------------------------------------------ internal errors
    def _guarded(self, where: str, identity: bytes, message: object,
                 handle: Callable[..., list[Send]], *args: object) -> list[Send]:
        self._step = _Step()
        try:
            return handle(*args)
        except Exception:
            return self._recover(where, identity, message)

    def _recover(self, where: str, identity: bytes, message: object) -> list[Send]:
        """A bug in the handler of ``message`` (called in its ``except``). The requests it
        had closed keep their answers; those it concerned or left half-done end with
        ``Reject internal``, their debits released; queued ones it had not reached go back
        in the queue."""
        step = self._step
        name = where if message is None else type(message).__name__
        self.counters["internal_errors"] += 1
        self.log.error(f"internal_error:{where}:{name}", "message handling failed", exc_info=True,
                       socket=where, message=name)
        detail = f"the daemon failed handling {name}; see its log"
        sends = list(step.closed)
        answered = {s.message.request_id for s in step.closed if isinstance(s, ToClient)}
        concerned = dict.fromkeys([*self._concerned(identity, message), *step.ending, *step.dispatched])
        if step.working is not None:
            concerned[step.working] = None
        for request_id in self._orphans():
            pending = self._requests[request_id]
            if request_id not in concerned and pending.rank is None and pending.queued_until is not None:
                self._queue.append(request_id)
            else:
                concerned[request_id] = None
        for request_id in concerned:
            pending = self._requests.get(request_id)
            if pending is None:
                continue
            self.counters["internal_error_requests"] += 1
            reject = self._reject(request_id, RejectReason.INTERNAL, detail, output_sent=pending.output_sent)
            sends += self._close(request_id, reject, release=True,
                                 abort=pending.rank is not None and request_id not in step.dispatched)
            answered.add(request_id)
        if isinstance(message, Submit) and message.request_id not in answered:
            sends.append(ToClient(identity, self._reject(message.request_id, RejectReason.INTERNAL, detail)))
        return sends

    def _concerned(self, identity: bytes, message: object) -> list[str]:
        """The requests ``message`` was about, found without the handler that failed."""
        match message:
            case Submit(request_id=request_id):
                pending = self._requests.get(request_id)
                return [request_id] if pending is not None and pending.submit is message else []
            case Cancel(request_id=request_id):
                pending = self._requests.get(request_id)
                return [request_id] if pending is not None and pending.client == identity else []
            case Output() | Done():
                pending = self._requests.get(message.request_id)
                state = self.registry.get(message.rank)
                ours = (pending is not None and state is not None and state.agent == identity
                        and state.epoch == message.epoch == pending.epoch and pending.rank == message.rank
                        and message.dispatch_seq in (0, pending.dispatch_seq))
                return [message.request_id] if ours else []
            case Goodbye(rank=rank, epoch=epoch) | Hello(rank=rank, epoch=epoch):
                # Goodbye ends the rank's requests, a newer epoch's Hello replaces them
                older = isinstance(message, Hello)
                return [request_id for request_id, pending in self._requests.items()
                        if pending.rank == rank and (pending.epoch < epoch if older else
                                                     (pending.epoch, pending.agent) == (epoch, identity))]
            case ToClient(message=reply):
                request_id = getattr(reply, "request_id", None)
                pending = self._requests.get(request_id) if request_id is not None else None
                return [request_id] if pending is not None and pending.client == identity else []
            case ToAgent(message=Dispatch(request_id=request_id, dispatch_seq=seq)):
                pending = self._requests.get(request_id)
                return [request_id] if pending is not None and pending.dispatch_seq == seq else []
        return []

    def _orphans(self) -> list[str]:
        """Requests that neither the queue nor their rank's in-flight set holds: nothing
        would ever end them (a handler failed half-way)."""
        queued = set(self._queue)
        orphans = []
        for request_id, pending in self._requests.items():
            if pending.rank is None:
                if request_id not in queued:
                    orphans.append(request_id)
                continue
            state = self.registry.get(pending.rank)
            if state is None or state.epoch != pending.epoch or request_id not in state.in_flight:
                orphans.append(request_id)
        return orphans

    def check_integrity(self) -> None:
        """Raise RuntimeError unless every request is queued once or in flight on its rank's
        current epoch, and the ranks' in-flight sets hold nothing else."""
        orphans = self._orphans()
        on_ranks = sum(len(state.in_flight) for state in self.registry.ranks())
        if orphans or on_ranks != self.in_flight or len(set(self._queue)) != len(self._queue):
            raise RuntimeError(f"core integrity: {len(orphans)} orphaned requests {orphans[:5]}, "
                               f"{on_ranks} in flight on ranks vs {self.in_flight} dispatched, "
                               f"{len(self._queue)} queue slots for {len(set(self._queue))} requests")

    # ------------------------------------------------------------------ agents
    def on_agent(self, identity: bytes, message: AgentMessage, now: float) -> list[Send]:
        """One message from an agent; each item of a :class:`RankOutputs` as if it came
        alone (a bug handling one item ends only the requests that item concerns)."""
        if isinstance(message, RankOutputs):
            self.registry.seen(identity, now)
            sends: list[Send] = []
            owned: tuple[str, int] | None = None  # a (rank, epoch) this agent was found to own
            for item in message.items:
                if type(item) is Output:
                    try:
                        pending = self._requests.get(item.request_id)
                        if (pending is not None and pending.submit.stream and pending.rank == item.rank
                                and pending.epoch == item.epoch
                                and item.dispatch_seq in (0, pending.dispatch_seq)):
                            served_by = (item.rank, item.epoch)
                            if served_by == owned or self.registry.owns(identity, *served_by):
                                owned = served_by
                                sends.append(self._chunk(pending, item))
                                continue
                    except Exception:  # the general path below meets the bug again and recovers
                        owned = None
                sends += self._guarded("agent", identity, item, self._agent_message, identity, item, now)
                owned = None  # judged again after anything the general path did
            return sends
        return self._guarded("agent", identity, message, self._agent_message, identity, message, now)

    def _agent_message(self, identity: bytes, message: AgentMessage, now: float) -> list[Send]:
        match message:
            case Hello():
                return self._hello(identity, message, now)
            case Heartbeat(agent=agent):
                if agent.encode() != identity:
                    self.counters["identity_mismatch"] += 1
                    return []
                if not self.registry.knows_agent(identity):
                    return [ToAgent(identity, Fenced("", 0, UNKNOWN_AGENT))]
                self.registry.seen(identity, now)
                return []
            case Goodbye(rank=rank, epoch=epoch):
                if not self.registry.owns(identity, rank, epoch):
                    return self._fence(identity, rank, epoch)
                self.registry.seen(identity, now)
                self.counters["ranks_left"] += 1
                return self._depart(self.registry.leave(rank), f"rank {rank} left")
            case Draining(rank=rank, epoch=epoch):
                if not self.registry.owns(identity, rank, epoch):
                    return self._fence(identity, rank, epoch)
                self.registry.seen(identity, now)
                self._set_draining(self.registry.get(rank), True)
                return []
            case Output() | Done():
                return self._rank_output(identity, message, now)
        return []

    def _hello(self, identity: bytes, hello: Hello, now: float) -> list[Send]:
        if hello.agent.encode() != identity:
            self.counters["identity_mismatch"] += 1
            return []
        refusal = protocol_refusal(hello.protocol)
        if refusal is not None:
            self.counters["protocol_refused"] += 1
            self.log.warning("protocol_refused", "a rank agent's Hello was refused", agent=hello.agent,
                             rank=hello.rank, detail=refusal)
            return [ToAgent(identity, Fenced(hello.rank, hello.epoch, refusal))]
        outcome, departure = self.registry.hello(identity, hello.rank, hello.epoch, now)
        if outcome is HelloOutcome.FENCED:
            self.counters["fenced_messages"] += 1
            held = self.registry.get(hello.rank)
            return [ToAgent(identity, Fenced(hello.rank, hello.epoch,
                                             f"epoch {hello.epoch} is older than the rank's epoch {held.epoch}"))]
        self.counters[f"ranks_{outcome.value}"] += 1
        sends: list[Send] = []
        if departure is not None:
            self.ledger.reset(hello.rank)
            sends += self._depart(departure, f"rank {hello.rank} restarted (epoch {hello.epoch})", reset=False)
        if outcome is HelloOutcome.JOINED:
            self.ledger.reset(hello.rank)
        sends.append(ToAgent(identity, Welcome(hello.rank, hello.epoch, self.daemon_id,
                                               self.config.report_address,
                                               self.config.heartbeat_interval_s)))
        return sends + self._pump_queue(now)

    def _fence(self, identity: bytes, rank: str, epoch: int) -> list[Send]:
        self.counters["fenced_messages"] += 1
        held = self.registry.get(rank)
        detail = UNKNOWN_RANK if held is None else f"rank {rank} is in epoch {held.epoch}"
        return [ToAgent(identity, Fenced(rank, epoch, detail))]

    def _rank_output(self, identity: bytes, message: Output | Done, now: float) -> list[Send]:
        if not self.registry.owns(identity, message.rank, message.epoch):
            return self._fence(identity, message.rank, message.epoch)
        self.registry.seen(identity, now)
        request_id = message.request_id
        pending = self._requests.get(request_id)
        if (pending is None or pending.rank != message.rank or pending.epoch != message.epoch
                or message.dispatch_seq not in (0, pending.dispatch_seq)):
            self.counters["late_messages"] += 1
            return []
        if isinstance(message, Output):
            if pending.submit.stream:
                return [self._chunk(pending, message)]
            pending.text.append(message.text)
            pending.token_ids.extend(message.token_ids)
            return []
        if message.invalid:  # it never reached the scheduler: release its debit
            return self._close(request_id, self._reject(request_id, RejectReason.INVALID, message.error),
                               release=True)
        if message.no_budget:
            return self._place_elsewhere(request_id, pending, message.error, now)
        self.counters[f"finished_{message.reason}"] += 1
        text = "" if pending.submit.stream else "".join(pending.text) + message.text
        token_ids = [] if pending.submit.stream else pending.token_ids + message.token_ids
        finish = Finish(request_id, message.reason, message.prompt_tokens, message.completion_tokens,
                        message.ttft_s, message.latency_s, text, token_ids, message.error)
        return self._close(request_id, finish)

    @staticmethod
    def _chunk(pending: Pending, output: Output) -> ToClient:
        pending.output_sent = True
        return ToClient(pending.client, Chunk(output.request_id, output.token_ids, output.text,
                                              output.completion_tokens))

    def _depart(self, departure: Departure | None, why: str, *, reset: bool = True) -> list[Send]:
        if departure is None:
            return []
        if reset:
            self.ledger.reset(departure.rank)
        affinity = getattr(self.balancer, "affinity", None)  # a prefix-tree policy's tree
        if affinity is not None:
            affinity.forget(departure.rank)  # gone, or back with an empty cache
        sends: list[Send] = []
        for request_id in sorted(departure.in_flight):
            pending = self._requests.get(request_id)
            if pending is None or pending.epoch != departure.epoch:
                continue
            self.counters["rank_lost_requests"] += 1
            sends += self._close(request_id, self._reject(request_id, RejectReason.RANK_LOST, why,
                                                          output_sent=pending.output_sent))
        return sends

    # ------------------------------------------------------------------ reports
    def on_report(self, report: Report, now: float) -> list[Send]:
        return self._guarded("report", b"", report, self._report, report, now)

    def _report(self, report: Report, now: float) -> list[Send]:
        outcome, gaps = self.registry.report(report, now)
        self.counters[f"reports_{outcome.value}"] += 1
        if gaps:
            self.counters["report_seq_gaps"] += gaps
        if outcome is not ReportOutcome.APPLIED:
            return []
        class_budgets = {name: budget.tokens for name, budget in report.class_budgets.items()}
        self.ledger.apply_report(report.rank, report.pab_tokens, report.echoed_dispatch_seq, class_budgets)
        return self._pump_queue(now)

    # ------------------------------------------------------------------ time and failures
    def on_tick(self, now: float, *, agents_read_until: float | None = None) -> list[Send]:
        """Deadlines, queue TTLs and silent agents. ``agents_read_until``: the last time the
        daemon had read everything the agents sent (None: now). An agent is lost once it has
        said nothing for ``lost_after_s`` before that time, so a daemon that fell behind never
        takes the heartbeats it has not read yet for silence."""
        return self._guarded("tick", b"", None, self._tick, now, agents_read_until)

    def _tick(self, now: float, agents_read_until: float | None = None) -> list[Send]:
        sends: list[Send] = []
        read_until = now if agents_read_until is None else min(now, agents_read_until)
        if read_until < now:
            self.counters["lost_check_behind"] += 1
        for departure in self.registry.lost_agents(read_until, self.config.lost_after_s):
            self.counters["ranks_lost"] += 1
            sends += self._depart(departure, f"rank {departure.rank} stopped responding")
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline_at, request_id = heapq.heappop(self._deadlines)
            pending = self._requests.get(request_id)
            if pending is None or pending.deadline_at != deadline_at:
                continue
            self._step.working = request_id
            self.counters["deadline_expired"] += 1
            sends += self._close(request_id, self._reject(request_id, RejectReason.DEADLINE,
                                                          "the request's deadline passed"), abort=True)
        self._step.working = None
        return sends + self._pump_queue(now)

    def on_send_failed(self, send: Send, now: float) -> list[Send]:
        """A send could not be delivered (peer gone or its queue full)."""
        return self._guarded("send_failed", send.identity, send, self._send_failed, send, now)

    def _send_failed(self, send: Send, now: float) -> list[Send]:
        self.counters["send_failures"] += 1
        message = send.message
        if isinstance(send, ToClient):
            request_id = getattr(message, "request_id", None)
            if request_id is None or request_id not in self._requests:
                return []
            self.counters["client_gone"] += 1
            return self._close(request_id, None, abort=True)
        self.registry.mark_unreachable(send.identity)
        if not isinstance(message, Dispatch):
            return []
        pending = self._requests.get(message.request_id)
        if pending is None or pending.dispatch_seq != message.dispatch_seq or pending.rank != message.rank:
            return []
        self.counters["dispatch_undelivered"] += 1
        self.ledger.release(message.rank, message.dispatch_seq)
        state = self.registry.get(message.rank)
        if state is not None:
            state.in_flight.discard(message.request_id)
        pending.rank, pending.epoch, pending.agent, pending.dispatch_seq = None, 0, b"", 0
        return self._place(message.request_id, pending, now)

    # ------------------------------------------------------------------ drain
    def begin_drain(self) -> list[Send]:
        return self._guarded("drain", b"", None, self._begin_drain)

    def _begin_drain(self) -> list[Send]:
        self.draining = True
        self._step.ending += self._queue
        sends: list[Send] = []
        for request_id in list(self._queue):
            sends += self._close(request_id, self._reject(request_id, RejectReason.SHUTTING_DOWN,
                                                          "the daemon is draining"))
        return sends

    def abort_all(self, detail: str) -> list[Send]:
        return self._guarded("abort_all", b"", None, self._abort_all, detail)

    def _abort_all(self, detail: str) -> list[Send]:
        self._step.ending += self._requests
        sends: list[Send] = []
        for request_id, pending in list(self._requests.items()):
            sends += self._close(request_id, self._reject(request_id, RejectReason.SHUTTING_DOWN, detail,
                                                          output_sent=pending.output_sent), abort=True)
        return sends
