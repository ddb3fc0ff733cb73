"""Each scheduler's load reports to the control-plane daemon (``docs/controlplane.md``).

One :class:`controlplane.reporter.ReportPublisher` per DP rank and daemon (the scheduler
process with pipeline, attention-TP and attention-CP rank 0 -- the one SGLang gives an
idle sleeper), for rank ``<prefix>/<dp_rank>`` and the server's epoch
(:mod:`sglang_ext.adapter.controlplane_agent`). With several daemons each gets the same
load, each with the echo of its own dispatch numbering. A report goes out

- after each step (``Scheduler.process_batch_result``) and on each idle pass
  (``Scheduler.on_idle``), at most every ``MIN_GAP_S`` when the load changed (running or
  waiting requests, the echoed dispatch, a budget by about 6%:
  :func:`controlplane.reporter.budget_bucket`) and every ``INTERVAL_S`` (the report
  heartbeat, 0.25 s) when it did not;
- while the scheduler sleeps on idle (``--sleep-on-idle`` blocks up to 1 s in a
  ``zmq.Poller``): its idle sleeper's poller is wrapped so that the wait is cut into
  ``IDLE_INTERVAL_S`` slices with a report between them, and it still wakes at once
  for a request. A scheduler stuck in a step sends nothing, so report age stays the
  daemon's liveness signal for the scheduler itself.

What a report says: the PAB FairBatching computed for the latest decision, and each SLO
class's budget from the same state (``FairBatchingState.class_budgets``, which a
scheduler that reports computes whatever its admission mode); the highest
dispatch sequence of that daemon the scheduler has ingested
(``FairBatchingState.controlplane_echo``: it moves when the policy first sees a request,
in the pass that computes that PAB, so a report never echoes a dispatch its PAB does not
account for); running requests (the running batch, parked
decodes, the batch being launched and the chunked request), waiting requests, SGLang's
``total_tokens`` load (KV tokens held plus tokens of waiting prompts), free KV tokens and
the last step's measured time.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from controlplane.protocol import pack_class_budgets
from sglang_ext.adapter.scheduler.state import LAUNCH_ATTR, HandledErrors

logger = logging.getLogger("sglang_ext.fairbatching")

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
REPORTER_ATTR = "fairbatching_controlplane_reports"
INTERVAL_S = 0.25  # a report at least this often (controlplane.reporter.HEARTBEAT_S)
MIN_GAP_S = 0.002  # and sooner when the load changed, but not more often than this
IDLE_INTERVAL_S = 0.1  # while it sleeps on idle
#: :class:`HandledErrors` site: a load report that could not be built or sent.
REPORT_FAILED_SITE = "controlplane.load_report"


@dataclass(frozen=True, slots=True)
class RankLoad:
    pab_tokens: int
    running: int
    waiting: int
    total_tokens: int
    free_kv_tokens: int
    echoed_dispatch_seqs: tuple[int, ...]  # per daemon slot
    class_budgets: tuple[tuple[str, int], ...] = ()  # (SLO class, tokens)

    @property
    def key(self) -> tuple[object, ...]:
        """What counts as a change worth an early report."""
        from controlplane.reporter import budget_bucket

        return (budget_bucket(self.pab_tokens), self.running, self.waiting, self.echoed_dispatch_seqs,
                tuple((name, budget_bucket(tokens)) for name, tokens in self.class_budgets))


def load_of(scheduler: Any, daemons: int = 1) -> RankLoad:
    state = scheduler.fairbatching
    seen: set[int] = set()
    running = 0
    batches = [scheduler.running_batch, state.parked, getattr(scheduler, "cur_batch_for_debug", None)]
    for batch in batches:
        for req in getattr(batch, "reqs", None) or ():
            if id(req) not in seen:
                seen.add(id(req))
                running += 1
    chunked = getattr(scheduler, "chunked_req", None)
    if chunked is not None and id(chunked) not in seen:
        running += 1
    waiting_queue = scheduler.waiting_queue
    used, _ = scheduler.pool_stats_observer.get_pool_stats().get_kv_token_stats()
    used = int(used)
    return RankLoad(
        pab_tokens=int(state.pab_tokens),
        running=running,
        waiting=len(waiting_queue),
        total_tokens=used + sum(req.seqlen for req in waiting_queue),
        free_kv_tokens=max(0, int(scheduler.max_total_num_tokens) - used),
        echoed_dispatch_seqs=tuple(int(state.controlplane_echo(slot)) for slot in range(daemons)),
        class_budgets=tuple(state.class_budgets.items()),
    )


class SchedulerReports:
    """A scheduler's publishers (one per daemon, in slot order), throttle and step clock
    (``scheduler.<REPORTER_ATTR>``)."""

    def __init__(self, publishers: Any, throttle: Any, errors: HandledErrors | None = None) -> None:
        self.publishers = list(publishers) if isinstance(publishers, (list, tuple)) else [publishers]
        self.throttle = throttle
        self.step_time_s = 0.0
        self._last_done = 0.0
        # The scheduler's FairBatchingState.errors: failures are counted with its other
        # handled errors (snapshot, fairbatching:handled_errors_total) and rate-limit logged.
        self.errors = errors if errors is not None else HandledErrors()

    @property
    def failures(self) -> int:
        return self.errors.counts[REPORT_FAILED_SITE]

    def observe_step(self, launch: Any, done_at: float) -> None:
        """A step's result reached the host: it ran from its launch or from the previous
        step's end, whichever is later (the overlap loop launches ahead)."""
        start = max(launch.launched_at, self._last_done)
        self._last_done = done_at
        if done_at > start:
            self.step_time_s = done_at - start

    @property
    def publisher(self) -> Any:
        """The first daemon's publisher."""
        return self.publishers[0]

    def maybe_publish(self, scheduler: Any) -> None:
        try:
            load = load_of(scheduler, len(self.publishers))
            now = time.monotonic()
            if not self.throttle.due(now, load.key):
                return
            classes = scheduler.fairbatching.config.catalog.classes
            ttfts = {name: slo.ttft_s for name, slo in classes.items()}
            budgets = pack_class_budgets(dict(load.class_budgets), ttfts)
            for publisher, echo in zip(self.publishers, load.echoed_dispatch_seqs):
                publisher.publish(load.pab_tokens, load.running, load.waiting, load.total_tokens,
                                  load.free_kv_tokens, echo, self.step_time_s, budgets)
            self.throttle.published(now, load.key)
        except Exception:  # a report is never worth a scheduler; counted and logged
            self.errors.record(REPORT_FAILED_SITE, "control plane: load report failed")

    def close(self) -> None:
        for publisher in self.publishers:
            publisher.close()


class ReportingPoller:
    """Stands in for an idle sleeper's ``zmq.Poller``: the same wait, cut into slices
    with a report between them; returns as soon as a socket is readable."""

    def __init__(self, poller: Any, tick: Any, slice_s: float = IDLE_INTERVAL_S) -> None:
        self._poller = poller
        self._tick = tick
        self._slice_s = slice_s

    def poll(self, timeout: float | None = None) -> list[Any]:
        if timeout is None or timeout < 0:
            timeout_s = float("inf")
        else:
            timeout_s = timeout / 1000.0
        deadline = time.monotonic() + timeout_s
        while True:
            self._tick()
            remaining = deadline - time.monotonic()
            wait_ms = math.ceil(min(remaining, self._slice_s) * 1000) if remaining > 0 else 0
            events = self._poller.poll(wait_ms)
            if events or time.monotonic() >= deadline:
                return events

    def __getattr__(self, name: str) -> Any:
        return getattr(self._poller, name)


def attach_reports(scheduler: Any, settings: Any) -> SchedulerReports | None:
    """Start this scheduler's reports if it is the one that speaks for its DP rank."""
    from sglang.srt.runtime_context import get_parallel

    from controlplane.reporter import ReportPublisher, ReportThrottle
    from sglang_ext.adapter.controlplane_agent import rank_prefix_of

    if getattr(scheduler, "fairbatching", None) is None:
        return None
    scheduler.fairbatching.publishes_budgets = True  # the daemon routes on each class's budget
    parallel = get_parallel()
    if parallel.pp_rank != 0 or parallel.attn_tp_rank != 0 or parallel.attn_cp_rank != 0:
        return None
    dp_rank = parallel.dp_rank if parallel.dp_rank is not None else 0
    rank = f"{rank_prefix_of(settings, scheduler.server_args)}/{dp_rank}"
    curve = settings.curve_peer()
    publishers = [ReportPublisher(address, rank, settings.epoch, curve=curve)
                  for address in settings.report_addresses]
    reports = SchedulerReports(publishers, ReportThrottle(INTERVAL_S, MIN_GAP_S),
                               errors=scheduler.fairbatching.errors)
    setattr(scheduler, REPORTER_ATTR, reports)
    sleeper = getattr(scheduler, "idle_sleeper", None)
    poller = getattr(sleeper, "poller", None)
    if poller is not None and not isinstance(poller, ReportingPoller):
        sleeper.poller = ReportingPoller(poller, lambda: reports.maybe_publish(scheduler))
    logger.info("control plane: scheduler reports as %s (epoch %d) to %s", rank, settings.epoch,
                ", ".join(settings.report_addresses))
    return reports


def install_controlplane_reports(settings: Any) -> None:
    """Register the scheduler hooks; call after ``install_scheduler_hooks`` so they run
    after FairBatching's own (``scheduler.fairbatching`` exists, the PAB is updated)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after_init(_result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
        attach_reports(scheduler, settings)

    HookRegistry.register(f"{SCHEDULER}.__init__", after_init, HookType.AFTER)
    HookRegistry.register(f"{SCHEDULER}.process_batch_result", _after_step, HookType.AFTER)
    HookRegistry.register(f"{SCHEDULER}.on_idle", _after_idle, HookType.AFTER)


def _after_step(_result: Any, scheduler: Any, batch: Any = None, result: Any = None,
                *args: Any, **kwargs: Any) -> None:
    reports: SchedulerReports | None = getattr(scheduler, REPORTER_ATTR, None)
    if reports is None:
        return
    launch = getattr(result, LAUNCH_ATTR, None)
    if launch is not None:
        reports.observe_step(launch, time.perf_counter())
    reports.maybe_publish(scheduler)


def _after_idle(_result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    reports: SchedulerReports | None = getattr(scheduler, REPORTER_ATTR, None)
    if reports is not None:
        reports.maybe_publish(scheduler)
