"""FairBatching's Prometheus metrics, served by SGLang's ``/metrics`` when the server
runs with ``--enable-metrics`` (SGLang's multiprocess registry; one series per DP rank).

``fairbatching:step_model_coefficient{term=<field>}`` coefficients, ``fairbatching:step_model_error``
(mean and p95 relative error), ``fairbatching:pab_tokens``, ``fairbatching:parked_requests``,
``fairbatching:deferred_decodes_total``, ``fairbatching:decisions_total``,
``fairbatching:fallbacks_total``, ``fairbatching:gc_pause_seconds`` and
``fairbatching:handled_errors_total{site}`` (errors a hook caught instead of raising;
see :class:`sglang_ext.adapter.scheduler.state.HandledErrors`); with admission control,
``fairbatching:late_prefills_total`` (mode defer: prefills the forecast called hopeless,
summed over decisions) and ``fairbatching:deferred_expired_total`` (mode defer: requests
ended after ``max_defer_s`` without a first token).

**Deprecated:** ``fairbatching:admission_budget_tokens{slo_class}`` (only while the rank
publishes budgets: the budget per SLO class it publishes) duplicates the router gauge
``fairbatching:prefill_admission_budget_tokens``
(:mod:`sglang_ext.adapter.scheduler.router_metrics`: the same number whenever the rank
publishes budgets, always exported, with SGLang's rank labels). It is still emitted so that
existing dashboards keep working, and will be removed in a later release.
"""

from __future__ import annotations

from typing import Any

#: The deprecated duplicate of ``fairbatching:prefill_admission_budget_tokens``: still
#: emitted so that existing dashboards keep working; to be removed in a later release.
DEPRECATED_ADMISSION_BUDGET = "admission_budget_tokens"
ADMISSION_BUDGET_REPLACEMENT = "fairbatching:prefill_admission_budget_tokens"
DEPRECATED_ADMISSION_BUDGET_HELP = (
    f"DEPRECATED, use {ADMISSION_BUDGET_REPLACEMENT} (same budget, SGLang's rank labels, "
    "always exported); removed in a later release. Admission budget per SLO class, prompt "
    "tokens (only while the rank publishes budgets)")


class FairBatchingMetrics:
    def __init__(self, dp_rank: int | None) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self._labels = {"dp_rank": str(dp_rank if dp_rank is not None else 0)}
        names = list(self._labels)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Gauge(f"fairbatching:{name}", doc, labelnames=[*names, *extra],
                         multiprocess_mode="mostrecent")

        self.coefficient = gauge("step_model_coefficient",
                                 "Step model coefficients by field name (a_s, b_s_per_token, ...)", ("term",))
        self.error = gauge("step_model_error", "Step model relative error", ("stat",))
        self.pab = gauge("pab_tokens", "Prefill Admission Budget at the default SLO class, tokens")
        self.parked = gauge("parked_requests", "Decodes parked (deferred with KV kept) now")
        self.deferred = Counter("fairbatching:deferred_decodes", "Decode slots deferred", names)
        self.decisions = Counter("fairbatching:decisions", "Batch decisions made", names)
        self.fallbacks = Counter("fairbatching:fallbacks", "Plans SGLang could not realise", names)
        self.gc_pause = Histogram("fairbatching:gc_pause_seconds", "Proactive gc.collect() pauses",
                                  names, buckets=(0.001, 0.005, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0))
        self.handled_errors = Counter("fairbatching:handled_errors",
                                      "Errors FairBatching's scheduler hooks caught instead of raising",
                                      [*names, "site"])
        self.admission_budget = gauge(DEPRECATED_ADMISSION_BUDGET, DEPRECATED_ADMISSION_BUDGET_HELP,
                                      ("slo_class",))
        self.late_prefills = Counter("fairbatching:late_prefills",
                                     "Prefills the admission forecast called hopeless, per decision",
                                     names)
        self.deferred_expired = Counter("fairbatching:deferred_expired",
                                        "Requests ended after max_defer_s without a first token",
                                        names)
        self.overruns = Counter("fairbatching:budget_overruns",
                                "Steps over their time budget and over their prediction", names)
        self.below_floor = Counter("fairbatching:budget_below_floor",
                                   "Steps planned over their time budget (predicted above it)", names)
        self.sat_out = Counter("fairbatching:decodes_sat_out",
                               "Chosen decodes SGLang left out of a prefill step", names)
        self.refused_never_fit = Counter("fairbatching:refused_never_fit",
                                         "Requests refused: an empty KV pool cannot hold them", names)
        self.refused_unserviceable = Counter(
            "fairbatching:refused_unserviceable",
            "Requests refused: their SLO is below the calibrated device's serviceable TPOT", names)
        self._counted = ("deferred_decodes", "decisions", "fallbacks", "late_prefills",
                         "deferred_expired", "overruns", "budget_below_floor", "decodes_sat_out",
                         "refused_never_fit", "refused_unserviceable")
        self._last_counts = (0,) * len(self._counted)

    def publish(self, state: Any) -> None:
        labels = self._labels
        coefficients = state.policy.step_model.coefficients
        for term, value in coefficients.fields().items():
            self.coefficient.labels(**labels, term=term).set(value)
        error = state.policy.step_model.error
        self.error.labels(**labels, stat="mean").set(error.mean_abs_relative)
        self.error.labels(**labels, stat="p95").set(error.p95_abs_relative)
        self.error.labels(**labels, stat="median").set(error.median_abs_relative)
        for kind, _, median in error.by_kind:
            self.error.labels(**labels, stat=f"median_{kind}").set(median)
        self.pab.labels(**labels).set(state.pab_tokens)
        self.parked.labels(**labels).set(len(state.parked_reqs))
        for slo_class, tokens in state.class_budgets.items():
            self.admission_budget.labels(**labels, slo_class=slo_class).set(tokens)
        counters = state.counters
        counts = tuple(getattr(counters, name) for name in self._counted)
        counter_metrics = (self.deferred, self.decisions, self.fallbacks, self.late_prefills,
                           self.deferred_expired, self.overruns, self.below_floor, self.sat_out,
                           self.refused_never_fit, self.refused_unserviceable)
        for counter, now, before in zip(counter_metrics, counts, self._last_counts, strict=True):
            if now > before:
                counter.labels(**labels).inc(now - before)
        self._last_counts = counts

    def observe_error(self, site: str) -> None:
        """At once, not at the next ``publish``: the error may be what stops publishing."""
        self.handled_errors.labels(**self._labels, site=site).inc()

    def observe_gc_pause(self, pause_s: float) -> None:
        self.gc_pause.labels(**self._labels).observe(pause_s)
