"""FairBatching's budgets for the routers people already run: each rank's Prefill Admission
Budget and predicted TTFT per SLO class, as Prometheus gauges on SGLang's ``/metrics``
(``docs/metrics.md`` documents names, labels, units, staleness and router recipes).

Only with ``--enable-metrics`` (SGLang's multiprocess registry: the scheduler's gauges are
served by the HTTP process), and only in the scheduler process that SGLang itself logs
metrics from (pipeline, attention-TP and attention-CP rank 0: one per DP rank). Without
``--enable-metrics`` nothing is registered and nothing is computed.

The values are refreshed after a step or an idle pass at most every
:data:`PUBLISH_INTERVAL_S`; between refreshes a step pays one clock read and a compare.
A refresh computes from the views and clock of the last decision (or idle pass):

- ``budget``: prompt tokens a request of the class arriving now may bring and still get
  its first token within the class's TTFT without making an admitted request miss its own.
  The number the rank publishes to the 429 gate, the DP ``pab`` method and the control
  plane when one of them is on (``FairBatchingState.class_budgets``); otherwise the
  same computation (the policy's admission rule, ``edf`` unless set), then without the
  KV term, which only runs when something consumes budgets at every decision. May be
  negative: the queue already holds more than the class's TTFT can absorb.
- ``predicted TTFT``: the EDF forecast's time for a one-token prompt of the class arriving
  now: the prefill work the queue serves before it (every in-time prefill with an earlier
  or equal deadline), drained at the forecast's prefill rate from the decision on, plus
  one token at that rate. For a prompt of ``P`` tokens add ``P / prefill_rate``. Capped
  at :data:`MAX_PREDICTED_TTFT_S` (no prefill rate left: decodes take every step).
- ``prefill rate``: the forecast's prompt tokens per second left for prefill after every
  request's decodes at its TPOT (``sglang_ext.policy.admission.prefill_rate``).
"""

from __future__ import annotations

import logging
import math
import time
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sglang_ext.adapter.scheduler.state import whole_budget_tokens
from sglang_ext.policy.admission import AdmissionRule, QueueForecast, forecast
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.view import RequestState

logger = logging.getLogger("sglang_ext.fairbatching")

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
ROUTER_METRICS_ATTR = "fairbatching_router_metrics"
#: Refresh period of the gauges, seconds (a router's scrape sees values at most this much
#: older than the last step or idle pass, plus its own scrape interval).
PUBLISH_INTERVAL_S = 0.1
#: The predicted TTFT when no prefill rate is left.
MAX_PREDICTED_TTFT_S = 3600.0
#: The labels telling ranks apart, as SGLang's own ``sglang:*`` scheduler gauges name them
#: (``dp_rank`` is 0 on a server without data parallelism, where SGLang omits it).
RANK_LABELS = ("model_name", "dp_rank", "tp_rank", "pp_rank")
#: :class:`HandledErrors` site: a refresh that failed.
PUBLISH_FAILED_SITE = "router_metrics.publish"


@dataclass(frozen=True, slots=True)
class RouterSignals:
    """What one rank tells routers, per SLO class."""

    budget_tokens: dict[str, int]
    predicted_ttft_s: dict[str, float]
    prefill_rate_tokens_per_s: float


def router_signals(
    policy: Any, views: Sequence[RequestState], decided_at: float, now: float,
    classes: Mapping[str, Slo], published_budgets: Mapping[str, int] | None = None,
) -> RouterSignals:
    """The signals at ``now`` (same clock as ``decided_at``) from the ``views`` of the
    decision made at ``decided_at`` by ``policy`` (a ``BatchPolicy``). ``published_budgets``:
    the budgets the rank already publishes, taken as they are (module docstring)."""
    admission = policy.admission
    queue = forecast(
        views, decided_at, policy.step_model.coefficients, policy.context.global_slo.tpot_s,
        admission.headroom, policy.kv_outlook, admission.length_weight,
    )
    if published_budgets:
        budgets = dict(published_budgets)
    elif admission.rule is AdmissionRule.EDF:
        budgets = {name: whole_budget_tokens(queue.budget(slo.ttft_s)) for name, slo in classes.items()}
    else:
        budgets = {name: whole_budget_tokens(tokens)
                   for name, tokens in policy.class_budgets(views, decided_at, classes).items()}
    ttfts = {name: predicted_ttft_s(queue, slo.ttft_s, now) for name, slo in classes.items()}
    return RouterSignals(budgets, ttfts, queue.rate)


def predicted_ttft_s(queue: QueueForecast, ttft_s: float, now: float) -> float:
    """A one-token prompt with TTFT target ``ttft_s`` arriving at ``now``: served after the
    in-time prefills due no later than it, at the forecast's rate from ``queue.now``."""
    if queue.rate <= 0:
        return MAX_PREDICTED_TTFT_S
    index = bisect_right(queue.deadlines, queue.now + ttft_s)
    work_ahead = queue.work_through[index - 1] if index else 0.0
    drained_at = queue.now + work_ahead / queue.rate
    return min(MAX_PREDICTED_TTFT_S, max(0.0, drained_at - now) + 1.0 / queue.rate)


class RouterMetrics:
    """One rank's router gauges (``scheduler.<ROUTER_METRICS_ATTR>``).

    Per rank (``RANK_LABELS``): ``fairbatching:prefill_admission_budget_tokens{slo_class}``,
    ``fairbatching:predicted_ttft_seconds{slo_class}``,
    ``fairbatching:prefill_rate_tokens_per_second`` and
    ``fairbatching:budget_updated_timestamp_seconds`` (Unix time of the refresh). Per
    server (``model_name``, ``slo_class``; merged over the DP ranks by prometheus_client's
    multiprocess modes ``max`` and ``min``): ``fairbatching:server_prefill_admission_budget_tokens``
    (the best rank's budget) and ``fairbatching:server_predicted_ttft_seconds`` (the best
    rank's TTFT), for a router that sees a DP server as one endpoint."""

    def __init__(self, rank_labels: Mapping[str, str], registry: Any = None,
                 interval_s: float = PUBLISH_INTERVAL_S,
                 clock: Callable[[], float] = time.perf_counter,
                 wall_clock: Callable[[], float] = time.time) -> None:
        from prometheus_client import REGISTRY, Gauge

        self.labels = {name: str(rank_labels[name]) for name in RANK_LABELS}
        self.interval_s = interval_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._last_publish = -math.inf
        registry = REGISTRY if registry is None else registry

        def gauge(name: str, doc: str, labelnames: Sequence[str], mode: str = "mostrecent") -> Any:
            return Gauge(f"fairbatching:{name}", doc, labelnames=list(labelnames),
                         multiprocess_mode=mode, registry=registry)

        per_class = (*RANK_LABELS, "slo_class")
        server = ("model_name", "slo_class")
        self.budget = gauge("prefill_admission_budget_tokens",
                            "Prompt tokens a request of the class arriving now may bring and "
                            "meet its TTFT (FairBatching's Prefill Admission Budget)", per_class)
        self.ttft = gauge("predicted_ttft_seconds",
                          "Predicted TTFT of a one-token prompt of the class arriving now; add "
                          "prompt tokens / prefill_rate_tokens_per_second", per_class)
        self.rate = gauge("prefill_rate_tokens_per_second",
                          "Prompt tokens per second the forecast leaves for prefill", RANK_LABELS)
        self.updated = gauge("budget_updated_timestamp_seconds",
                             "Unix time the rank last refreshed its budget gauges", RANK_LABELS)
        self.server_budget = gauge("server_prefill_admission_budget_tokens",
                                   "The largest prefill admission budget over the server's ranks",
                                   server, "max")
        self.server_ttft = gauge("server_predicted_ttft_seconds",
                                 "The smallest predicted TTFT over the server's ranks", server, "min")

    def due(self, now: float) -> bool:
        return now - self._last_publish >= self.interval_s

    def maybe_publish(self, state: Any) -> None:
        """Refresh from ``state`` (a ``FairBatchingState``) if the interval has passed."""
        now = self._clock()
        if not self.due(now):
            return
        inputs = state.decision_inputs
        if inputs is None:
            return
        self._last_publish = now
        views, decided_at = inputs
        published = state.class_budgets if state.publishes_budgets else None
        signals = router_signals(state.policy, views, decided_at, now,
                                 state.config.catalog.classes, published)
        self.publish(signals)

    def publish(self, signals: RouterSignals) -> None:
        labels = self.labels
        model = labels["model_name"]
        for slo_class, tokens in signals.budget_tokens.items():
            self.budget.labels(**labels, slo_class=slo_class).set(tokens)
            self.server_budget.labels(model_name=model, slo_class=slo_class).set(tokens)
        for slo_class, seconds in signals.predicted_ttft_s.items():
            self.ttft.labels(**labels, slo_class=slo_class).set(seconds)
            self.server_ttft.labels(model_name=model, slo_class=slo_class).set(seconds)
        self.rate.labels(**labels).set(signals.prefill_rate_tokens_per_s)
        self.updated.labels(**labels).set(self._wall_clock())


def rank_labels_of(scheduler: Any) -> dict[str, str] | None:
    """This scheduler's ``RANK_LABELS`` if it is the one SGLang logs metrics from with
    ``--enable-metrics``, else None."""
    reporter = getattr(scheduler, "metrics_reporter", None)
    if not (getattr(reporter, "enable_metrics", False)
            and getattr(reporter, "is_stats_logging_rank", False)):
        return None
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    sglang_labels = getattr(getattr(scheduler, "metrics_collector", None), "labels", None) or {}
    model_name = sglang_labels.get("model_name") or scheduler.server_args.served_model_name
    return {
        "model_name": str(model_name),
        "dp_rank": str(parallel.dp_rank if parallel.dp_rank is not None else 0),
        "tp_rank": str(parallel.tp_rank),
        "pp_rank": str(parallel.pp_rank),
    }


def attach_router_metrics(scheduler: Any) -> RouterMetrics | None:
    if getattr(scheduler, "fairbatching", None) is None:
        return None
    labels = rank_labels_of(scheduler)
    if labels is None:
        return None
    metrics = RouterMetrics(labels)
    setattr(scheduler, ROUTER_METRICS_ATTR, metrics)
    return metrics


def install_router_metrics() -> None:
    """Register the scheduler hooks; call after ``install_scheduler_hooks`` so they run
    after FairBatching's own (``scheduler.fairbatching`` exists, the decision is made)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{SCHEDULER}.__init__", _after_init, HookType.AFTER)
    HookRegistry.register(f"{SCHEDULER}.process_batch_result", _refresh, HookType.AFTER)
    HookRegistry.register(f"{SCHEDULER}.on_idle", _refresh, HookType.AFTER)


def _after_init(_result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    attach_router_metrics(scheduler)


def _refresh(_result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    metrics: RouterMetrics | None = getattr(scheduler, ROUTER_METRICS_ATTR, None)
    if metrics is None:
        return
    state = scheduler.fairbatching
    try:
        metrics.maybe_publish(state)
    except Exception:  # a gauge is never worth a scheduler; counted and logged
        state.errors.record(PUBLISH_FAILED_SITE, "router metrics: refresh failed")
