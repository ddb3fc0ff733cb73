"""A data-parallel cluster in virtual time: N simulated ranks behind one dispatcher.

The dispatcher routes exactly as the control-plane daemon does (``docs/controlplane.md``):
a :mod:`controlplane.balancer` policy chooses among :class:`RankView` values built from
each rank's last report plus the :mod:`controlplane.ledger`'s debits since, every
dispatch is debited and numbered per rank, and a report's echo of the highest dispatch
sequence it accounts for reconciles the debits.

- **Ranks.** One :class:`SimEngine` per rank, each with its own policy instance built
  as a single-rank run builds it, seeded ``seed + rank index`` (rank 0 is the
  single-rank run's engine). A dispatched request reaches its rank at once.
- **Reports.** After each of its steps (and when it ingests a request it does not keep
  busy, e.g. one its own admission refused) a rank reports its PAB, under the ``pab``
  balancers each SLO class's budget too (the policy's ``class_budgets``), running
  and waiting counts, tokens held, requests over so far and the highest dispatch
  sequence it has ingested; the dispatcher gets the report ``report_delay_s`` later.
  Every rank reports once at time 0, before traffic, as ranks register before a daemon
  takes requests.
- **Classes.** The ``pab`` balancers judge a request by the budget of its SLO class
  (a trace's own or ``--class-mix``); a request without a class by the default class's
  PAB, as the daemon does.
- **No covering budget** (the ``pab`` balancers: the balancer returns None): the
  daemon's ``on_no_budget`` (``ClusterConfig.on_no_budget``). ``"reject"``: the request
  is rejected (``no_budget``). ``"spill"``: it goes to the balancer's ``spill`` choice
  (its own order, budgets ignored) and the rank's own admission decides. ``"queue"``
  (the default), as the daemon's ``DispatcherCore`` queues: the request
  waits in an admission queue retried in arrival order on every report, where one that
  does not fit does not hold back a later one that does; past its own TTFT target from
  its arrival (at most ``queue_ttl_s``) it is rejected (``queue_timeout``): it has missed
  its SLO anyway. A request that finds ``max_queued`` requests waiting is rejected
  (``overloaded``). A rejected request counts as an SLO violation; TTFT counts from the
  original arrival, so time spent queued is part of it. (Every simulated request has an
  SLO, its class's or the default class's; the daemon holds a request that names none
  for ``queue_ttl_s``.)
- **Client retries** (``client_retries``, default 0: each request is submitted once): a
  request refused ``no_budget``, ``overloaded`` or ``queue_timeout`` is resubmitted, as the
  SDK inside the gateway resubmits it (:func:`controlplane.retry.retry_delay`: the daemon's
  ``retry_after_s`` or the SDK's backoff, with jitter drawn from the run's seed), at most
  ``client_retries`` times; only its last refusal counts. A resubmission is never queued
  past its TTFT target from its first arrival (the daemon keeps the first arrival of a
  request it timed out).
- **Shared prefixes** (``prefixes``: one :class:`SharedPrefix` or None per request of
  the workload): each rank gets a :class:`RankPrefixCache` (its assumptions are that
  module's) and a request is prefilled only past its longest prefix cached on its rank;
  its record keeps its whole prompt length. The balancer gets each request's prompt
  (:func:`prompt_units`, one unit a block of its prefix tree) and, after the dispatch,
  ``record`` s it; the ledger debits the prompt less what the balancer believed the rank
  held. Without ``prefixes`` no prompt is passed and nothing is cached (every prompt is
  its own).
- Events at the same virtual time run reports first, then arrivals, then steps (a
  single-rank run also submits an arrival before a step that starts at the same time).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from controlplane.balancer import (
    BALANCERS,
    PREFIX_TREE_POLICIES,
    CacheAwareSettings,
    RankView,
    make_balancer,
)
from controlplane.config import ON_NO_BUDGET, DaemonConfig
from controlplane.ledger import DispatchLedger
from controlplane.retry import DEFAULT_RETRY_BACKOFF_S, retry_delay
from sglang_ext.policy.slo import Slo
from sglang_ext.sim.engine import SimEngine
from sglang_ext.sim.metrics import LatencySamples, RequestRecord, latency_samples, summarize
from sglang_ext.sim.prefix_cache import RankPrefixCache, SharedPrefix, prompt_units
from sglang_ext.sim.runner import PolicySpec, Scenario, build_policy, request_slo
from sglang_ext.sim.workloads import TraceRequest

_DAEMON_DEFAULTS = DaemonConfig()
DEFAULT_REPORT_DELAY_S = 0.005
DEFAULT_QUEUE_TTL_S = _DAEMON_DEFAULTS.queue_ttl_s
DEFAULT_MAX_QUEUED = _DAEMON_DEFAULTS.max_queued

_REPORT, _ARRIVAL, _STEP = 0, 1, 2  # tie order at equal times


class ClusterConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    ranks: int
    balancer: str
    report_delay_s: float = DEFAULT_REPORT_DELAY_S
    queue_ttl_s: float = DEFAULT_QUEUE_TTL_S
    max_queued: int = DEFAULT_MAX_QUEUED
    rank_cache_tokens: int | None = None  # a rank's prefix cache bound (None: its free KV)
    on_no_budget: str = "queue"  # the daemon's: reject, queue or spill
    client_retries: int = 0  # resubmissions of a refused request (the SDK's max_retries)
    retry_after_s: float = _DAEMON_DEFAULTS.retry_after_s
    retry_backoff_s: float = DEFAULT_RETRY_BACKOFF_S

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ClusterConfigError(f"ranks must be >= 1, got {self.ranks}")
        if self.balancer not in BALANCERS:
            raise ClusterConfigError(
                f"unknown balancer {self.balancer!r}; expected one of {', '.join(BALANCERS)}"
            )
        if not (math.isfinite(self.report_delay_s) and self.report_delay_s >= 0):
            raise ClusterConfigError(f"report delay must be >= 0 s, got {self.report_delay_s}")
        if not (math.isfinite(self.queue_ttl_s) and self.queue_ttl_s > 0):
            raise ClusterConfigError(f"queue TTL must be > 0 s, got {self.queue_ttl_s}")
        if self.max_queued < 1:
            raise ClusterConfigError(f"max queued must be >= 1, got {self.max_queued}")
        if self.on_no_budget not in ON_NO_BUDGET:
            raise ClusterConfigError(f"unknown on_no_budget {self.on_no_budget!r}; expected one "
                                     f"of {', '.join(ON_NO_BUDGET)}")
        if self.client_retries < 0:
            raise ClusterConfigError(f"client retries must be >= 0, got {self.client_retries}")
        if not all(math.isfinite(v) and v >= 0 for v in (self.retry_after_s, self.retry_backoff_s)):
            raise ClusterConfigError(
                f"retry_after_s and retry_backoff_s must be >= 0 s, got {self.retry_after_s} "
                f"and {self.retry_backoff_s}")


@dataclass(frozen=True, slots=True)
class RankReport:
    rank: int
    taken_at: float
    pab_tokens: float
    running: int
    waiting: int
    total_tokens: int
    finished: int  # requests over at the rank (finished, refused or aborted) so far
    echoed_dispatch_seq: int
    class_budgets: dict[str, float] = field(default_factory=dict)  # SLO class -> tokens


@dataclass(frozen=True)
class ClusterResult:
    label: str  # "<policy> + <balancer>"
    load: dict  # summarize()'s load point plus the cluster's own counters
    samples: LatencySamples | None


@dataclass(slots=True)
class _Queued:
    index: int
    request: TraceRequest
    slo: Slo
    slo_class: str  # the request's class, else the catalog's default class
    prompt: tuple[int, ...] | None = None  # its units, with shared prefixes only
    attempts: int = 1  # submissions so far, the first included


class _Rank:
    __slots__ = ("cache", "classes", "dispatched", "engine", "index", "ingested_seq",
                 "last_report", "name", "prefilling", "step_scheduled")

    def __init__(self, index: int, engine: SimEngine, classes: Mapping[str, Slo],
                 cache: RankPrefixCache | None = None) -> None:
        self.index = index
        self.cache = cache
        self.prefilling: list[tuple[int, tuple[int, ...]]] = []  # dispatched, not yet cached
        self.name = str(index)
        self.engine = engine
        self.classes = classes  # whose budgets it reports (empty: none)
        self.last_report: RankReport | None = None
        self.dispatched = 0
        self.ingested_seq = 0
        self.step_scheduled = False

    @property
    def free_kv_tokens(self) -> int:
        return self.engine.kv_capacity - self.engine.kv_used

    def cache_prefilled(self) -> None:
        """Insert the prompts whose prefill completed into the cache (drop refused ones)."""
        records = self.engine.records
        still = []
        for index, units in self.prefilling:
            record = records[index]
            if record.first_token_s is not None:
                self.cache.insert(units, self.free_kv_tokens)
            elif not (record.rejected or record.aborted):
                still.append((index, units))
        self.prefilling = still

    def report(self) -> RankReport:
        engine = self.engine
        running = waiting = total_tokens = 0
        active = engine.active_requests
        for request in active:
            if request.context:
                running += 1
            else:
                waiting += 1
            total_tokens += request.context + request.pending_prefill
        return RankReport(
            rank=self.index,
            taken_at=engine.now,
            pab_tokens=engine.prefill_admission_budget(),
            running=running,
            waiting=waiting,
            total_tokens=total_tokens,
            finished=len(engine.records) - len(active),
            echoed_dispatch_seq=self.ingested_seq,
            class_budgets=engine.policy.class_budgets(active, engine.now, self.classes)
            if self.classes else {},
        )


class ClusterSimulation:
    """One run: :meth:`run` once, then read :attr:`records`, :attr:`placement` and
    :meth:`load`."""

    def __init__(self, scenario: Scenario, spec: PolicySpec, cluster: ClusterConfig,
                 prefixes: Sequence[SharedPrefix | None] | None = None) -> None:
        self.scenario = scenario
        self.spec = spec
        self.cluster = cluster
        if prefixes is not None and len(prefixes) != len(scenario.workload.requests):
            raise ClusterConfigError(
                f"{len(prefixes)} prefixes for {len(scenario.workload.requests)} requests")
        self.prefixes = prefixes
        self.balancer = make_balancer(cluster.balancer, scenario.seed,
                                      CacheAwareSettings(block_size=1))
        # a balancer that routes on budget judges a request by its SLO class's budget
        classes = scenario.catalog.classes if self.balancer.routes_on_budget else {}
        cache_bound = scenario.profile.kv_capacity_tokens if cluster.rank_cache_tokens is None \
            else cluster.rank_cache_tokens
        self.ranks = [
            _Rank(i, SimEngine(
                scenario.profile, build_policy(scenario, spec), seed=scenario.seed + i
            ), classes, None if prefixes is None else RankPrefixCache(cache_bound))
            for i in range(cluster.ranks)
        ]
        self.ledger = DispatchLedger()
        self.full_prompt_tokens: dict[int, int] = {}  # requests prefilled past a cached prefix
        self.queue: deque[_Queued] = deque()
        self.placement: dict[int, int] = {}
        self.rejected_by_dispatcher: dict[int, RequestRecord] = {}
        self.counters = {
            "queued": 0, "queue_timeout": 0, "overloaded": 0, "dispatched_from_queue": 0,
            "no_budget": 0, "spilled": 0, "retries": 0,
            "max_queue_depth": 0, "reports": 0, "prompt_tokens_dispatched": 0,
            "prompt_tokens_cached": 0,
        }
        self.queue_waits_s: list[float] = []
        self._events: list[tuple[float, int, int, object]] = []
        self._event_count = 0
        self._deadline = math.inf
        self.last_arrival_s = 0.0
        self._retry_jitter = random.Random(scenario.seed)

    # ---------------------------------------------------------------- events
    def _push(self, time_s: float, kind: int, payload: object) -> None:
        self._event_count += 1
        heapq.heappush(self._events, (time_s, kind, self._event_count, payload))

    def _schedule_step(self, rank: _Rank) -> None:
        engine = rank.engine
        if not rank.step_scheduled and engine.has_work and engine.now < self._deadline:
            rank.step_scheduled = True
            self._push(engine.now, _STEP, rank)

    def _send_report(self, rank: _Rank) -> None:
        report = rank.report()
        self._push(report.taken_at + self.cluster.report_delay_s, _REPORT, report)

    def run(self, rate: float) -> None:
        scenario = self.scenario
        workload = scenario.workload.with_arrivals(scenario.arrivals, rate, scenario.seed)
        requests = workload.requests
        self.last_arrival_s = requests[-1].arrival_s
        self._deadline = self.last_arrival_s + scenario.drain_s
        for rank in self.ranks:
            self._apply_report(rank.report())
        next_arrival = 0
        self._push(requests[0].arrival_s, _ARRIVAL, None)
        while self._events:
            time_s, kind, _, payload = heapq.heappop(self._events)
            if kind == _STEP:
                rank = payload
                rank.step_scheduled = False
                rank.engine.step()
                if rank.prefilling:
                    rank.cache_prefilled()
                self._send_report(rank)
                self._schedule_step(rank)
            elif kind == _REPORT:
                self._apply_report(payload)
                self._drain_queue(time_s)
            elif payload is not None:  # a client's resubmission
                self._arrive(time_s, payload)
            else:
                request = requests[next_arrival]
                slo, slo_class = request_slo(scenario.catalog, request.slo_class)
                prompt = None if self.prefixes is None else prompt_units(
                    next_arrival, request.prompt_tokens, self.prefixes[next_arrival])
                self._arrive(time_s, _Queued(next_arrival, request, slo, slo_class, prompt))
                next_arrival += 1
                if next_arrival < len(requests):
                    self._push(requests[next_arrival].arrival_s, _ARRIVAL, None)
        for queued in self.queue:
            self._reject(queued, "queue_timeout", None)
        self.queue.clear()
        for rank in self.ranks:
            for index, record in rank.engine.records.items():
                if index in self.full_prompt_tokens:
                    record.prompt_tokens = self.full_prompt_tokens[index]

    # ---------------------------------------------------------------- dispatcher
    def _apply_report(self, report: RankReport) -> None:
        rank = self.ranks[report.rank]
        self.ledger.apply_report(rank.name, report.pab_tokens, report.echoed_dispatch_seq,
                                 report.class_budgets)
        rank.last_report = report
        self.counters["reports"] += 1

    def _views(self) -> list[RankView]:
        ledger = self.ledger
        views = []
        for rank in self.ranks:
            report = rank.last_report
            views.append(RankView(
                rank=rank.name,
                pab_tokens=ledger.effective_budget(rank.name),
                running=report.running,
                waiting=report.waiting + ledger.outstanding_dispatches(rank.name),
                total_tokens=report.total_tokens + ledger.outstanding_tokens(rank.name),
                in_flight=rank.dispatched - report.finished,
                class_budgets=ledger.effective_class_budgets(rank.name),
            ))
        return views

    def _arrive(self, now: float, queued: _Queued) -> None:
        views = self._views()
        chosen = self._choose(views, queued)
        if chosen is None:
            on_no_budget = self.cluster.on_no_budget
            if on_no_budget == "queue":
                self._enqueue(now, queued)
                return
            if on_no_budget == "reject":
                self._reject(queued, "no_budget", now)
                return
            chosen = self._spill(views, queued)
            self.counters["spilled"] += 1
        self._dispatch(now, queued, self.ranks[int(chosen)])

    def _choose(self, views: list[RankView], queued: _Queued) -> str | None:
        request = queued.request
        if queued.prompt is None:  # no prompt: the call every balancer takes
            return self.balancer.choose(views, request.prompt_tokens, request.slo_class or None)
        return self.balancer.choose(views, request.prompt_tokens, request.slo_class or None,
                                    queued.prompt)

    def _spill(self, views: list[RankView], queued: _Queued) -> str:
        request = queued.request
        if queued.prompt is None:
            return self.balancer.spill(views, request.prompt_tokens, request.slo_class or None)
        return self.balancer.spill(views, request.prompt_tokens, request.slo_class or None,
                                   queued.prompt)

    def _queue_ttl(self, queued: _Queued) -> float:
        """How long after its arrival a request may wait: its TTFT target, at most
        ``queue_ttl_s`` (the daemon's ``DispatcherCore._queue_ttl``)."""
        return min(self.cluster.queue_ttl_s, queued.slo.ttft_s)

    def _enqueue(self, now: float, queued: _Queued) -> None:
        if now - queued.request.arrival_s > self._queue_ttl(queued):  # a late resubmission
            self._reject(queued, "queue_timeout", now)
            return
        if len(self.queue) >= self.cluster.max_queued:
            self._reject(queued, "overloaded", now)
            return
        self.queue.append(queued)
        self.counters["queued"] += 1
        self.counters["max_queue_depth"] = max(self.counters["max_queue_depth"], len(self.queue))

    def _drain_queue(self, now: float) -> None:
        """The daemon's ``DispatcherCore._pump_queue``: in arrival order, refuse those past
        their TTL, dispatch those a rank's budget covers, keep the rest in order."""
        if not self.queue:
            return
        waiting, self.queue = self.queue, deque()
        views: list[RankView] | None = None
        declined: dict[str, int] = {}  # per class, the smallest prompt no rank took
        blind = self.cluster.balancer not in PREFIX_TREE_POLICIES  # the prompt cannot change a choice
        for queued in waiting:
            request = queued.request
            if now - request.arrival_s > self._queue_ttl(queued):
                self._reject(queued, "queue_timeout", now)
                continue
            if views is None:
                views = self._views()
                declined.clear()
            smallest_declined = declined.get(request.slo_class)
            chosen = None
            if smallest_declined is None or request.prompt_tokens < smallest_declined:
                chosen = self._choose(views, queued)
                if chosen is None and blind:
                    declined[request.slo_class] = request.prompt_tokens
            if chosen is None:
                self.queue.append(queued)
                continue
            self.counters["dispatched_from_queue"] += 1
            self.queue_waits_s.append(now - request.arrival_s)
            self._dispatch(now, queued, self.ranks[int(chosen)])
            views = None

    def _dispatch(self, now: float, queued: _Queued, rank: _Rank) -> None:
        request = queued.request
        believed = self.balancer.record(rank.name, queued.prompt, request.prompt_tokens)
        seq = self.ledger.record_dispatch(rank.name, request.prompt_tokens - believed)
        rank.dispatched += 1
        self.placement[queued.index] = rank.index
        engine = rank.engine
        if not engine.has_work and engine.now < now:
            engine.advance_to(now)
        prefill = request.prompt_tokens
        if rank.cache is not None and queued.prompt is not None:
            cached = rank.cache.cached_tokens(queued.prompt, prefill, rank.free_kv_tokens)
            if cached:
                self.full_prompt_tokens[queued.index] = prefill
                prefill -= cached
            rank.prefilling.append((queued.index, queued.prompt))
        self.counters["prompt_tokens_dispatched"] += request.prompt_tokens
        self.counters["prompt_tokens_cached"] += request.prompt_tokens - prefill
        engine.submit(
            queued.index, request.arrival_s, prefill, request.output_tokens,
            queued.slo, queued.slo_class,
        )
        rank.ingested_seq = seq
        if engine.has_work:
            self._schedule_step(rank)
        else:
            self._send_report(rank)

    def _reject(self, queued: _Queued, reason: str, now: float | None) -> None:
        """Refuse ``queued``: the client resubmits it while it has retries left and the
        run has not ended (``now`` None), else it is over, refused for ``reason``."""
        cluster = self.cluster
        if now is not None and queued.attempts <= cluster.client_retries:
            delay = retry_delay(queued.attempts, cluster.retry_after_s, cluster.retry_backoff_s,
                                self._retry_jitter.random())
            queued.attempts += 1
            self.counters["retries"] += 1
            self._push(now + delay, _ARRIVAL, queued)
            return
        request = queued.request
        record = RequestRecord(
            queued.index, request.arrival_s, queued.slo, request.prompt_tokens,
            request.output_tokens, queued.slo_class, rejected=True,
        )
        self.rejected_by_dispatcher[queued.index] = record
        self.counters[reason] += 1

    # ---------------------------------------------------------------- results
    @property
    def records(self) -> dict[int, RequestRecord]:
        """Every request by its index in the workload: the ranks' records and the
        dispatcher's rejections."""
        merged: dict[int, RequestRecord] = dict(self.rejected_by_dispatcher)
        for rank in self.ranks:
            merged.update(rank.engine.records)
        return merged

    def load(self, rate: float) -> dict:
        """``summarize()``'s load point for the whole cluster plus its own counters."""
        engines = [rank.engine for rank in self.ranks]
        duration = max(self.last_arrival_s, *(engine.now for engine in engines))
        load = summarize(self.records.values(), rate, duration)
        dispatched = [rank.dispatched for rank in self.ranks]
        mean_dispatched = sum(dispatched) / len(dispatched)
        waits = sorted(self.queue_waits_s)
        busy = sum(engine.busy_s for engine in engines)
        load |= {
            "ranks": self.cluster.ranks,
            "balancer": self.cluster.balancer,
            "report_delay_s": self.cluster.report_delay_s,
            "queue_ttl_s": self.cluster.queue_ttl_s,
            "on_no_budget": self.cluster.on_no_budget,
            "steps": sum(engine.steps for engine in engines),
            "gpu_busy_fraction": busy / (duration * len(engines)) if duration > 0 else 0.0,
            "dispatched_per_rank": dispatched,
            "dispatch_imbalance": max(dispatched) / mean_dispatched if mean_dispatched else 0.0,
            "rejected_by_ranks": sum(
                record.rejected for engine in engines for record in engine.records.values()
            ),
            "rejected_by_dispatcher": len(self.rejected_by_dispatcher),
            "queue_wait_ms_p50": waits[len(waits) // 2] * 1e3 if waits else None,
            "queue_wait_ms_max": waits[-1] * 1e3 if waits else None,
        } | self.counters
        return load


def simulate_cluster(
    scenario: Scenario, spec: PolicySpec, rate: float, cluster: ClusterConfig,
    *, keep_samples: bool = False, prefixes: Sequence[SharedPrefix | None] | None = None,
) -> ClusterResult:
    """Replay the scenario's workload at ``rate`` req/s (the whole cluster's offered load)."""
    simulation = ClusterSimulation(scenario, spec, cluster, prefixes)
    simulation.run(rate)
    samples = latency_samples(simulation.records.values()) if keep_samples else None
    return ClusterResult(f"{spec.label} + {cluster.balancer}", simulation.load(rate), samples)


