"""Per-scheduler FairBatching state: the policy, parked decodes, PAB, step timing, GC.

One instance lives on each SGLang ``Scheduler`` as ``scheduler.fairbatching``; the hook
functions in :mod:`sglang_ext.adapter.scheduler.hooks` drive it.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from controlplane.protocol import budget_tokens
from controlplane.ratelimited_log import RateLimitedLog
from sglang_ext.adapter.extension_config import ExtensionConfig
from sglang_ext.adapter.scheduler.device_clock import DeviceClock
from sglang_ext.adapter.scheduler.request_store import table_min_requests
from sglang_ext.adapter.scheduler.requests import RequestRecords
from sglang_ext.adapter.scheduler.step_trace import StepTrace, TracedDecision
from sglang_ext.policy.admission import AdmissionMode, AdmissionRule, AdmissionSettings
from sglang_ext.policy.batch_former import unserviceable_slo_reason
from sglang_ext.policy.gc import should_collect
from sglang_ext.policy.pab import prefill_admission_budget
from sglang_ext.policy.startup_calibration import Calibration, CalibrationFit
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.policy.view import BatchDecision, RequestState

if TYPE_CHECKING:
    from sglang_ext.adapter.scheduler.prefill_plan import PrefillPlan

logger = logging.getLogger("sglang_ext.fairbatching")

LAUNCH_ATTR = "_fairbatching_launch"
#: A handled error's site is logged the first time, then at most once per this many
#: seconds with the number left out since (every occurrence is counted).
ERROR_LOG_INTERVAL_S = 60.0
#: a step over its budget is the model's miss only when it also took this much longer than predicted
OVERRUN_TOLERANCE = 0.1


class HandledErrors:
    """Errors a scheduler hook handled instead of letting them stop the scheduler.

    Nothing is dropped silently: every occurrence is counted by site (``counts``, the
    state's ``snapshot()["errors"]`` and, with ``--enable-metrics``,
    ``fairbatching:handled_errors_total{site}``) and logged at WARNING, the first time
    at once and then at most once per ``interval_s`` per site with ``suppressed=N``
    (:class:`controlplane.ratelimited_log.RateLimitedLog`)."""

    def __init__(self, interval_s: float = ERROR_LOG_INTERVAL_S,
                 on_error: Callable[[str], None] | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.counts: Counter[str] = Counter()
        self.on_error = on_error  # FairBatchingMetrics.observe_error, with --enable-metrics
        self._log = RateLimitedLog(logger, interval_s, clock=clock)

    def record(self, site: str, message: str, *, exc_info: bool = True, **fields: object) -> None:
        """Count one occurrence at ``site`` and log it (rate-limited); call it from the
        ``except`` block handling it (``exc_info`` then carries the traceback)."""
        self.counts[site] += 1
        if self.on_error is not None:
            self.on_error(site)
        self._log.warning(site, f"FairBatching: {message}", site=site, total=self.counts[site],
                          exc_info=exc_info, **fields)


@dataclass(frozen=True, slots=True)
class StepLaunch:
    launched_at: float
    features: StepShape
    predicted_s: float
    time_budget_s: float | None = None
    traced: TracedDecision | None = None  # with [trace] step_log: the decision behind it


@dataclass(frozen=True, slots=True)
class GcPause:
    at: float
    pause_s: float
    collected: int
    reason: str  # "idle" or "slack"


@dataclass
class Counters:
    steps: int = 0
    decisions: int = 0
    deferred_decodes: int = 0  # decode slots skipped (summed over steps)
    steps_with_deferral: int = 0
    planned_prefill_tokens: int = 0
    fallbacks: int = 0  # plans SGLang could not realise (memory); everything decoded
    overruns: int = 0  # steps over their time budget and over their prediction (the model's miss)
    budget_below_floor: int = 0  # steps planned over their budget from the start (predicted > budget)
    late_prefills: int = 0  # requests past their TTFT deadline without a first token (once each)
    deferred_expired: int = 0  # admission mode defer: ended after max_defer_s without a token
    decodes_sat_out: int = 0  # chosen decodes SGLang did not mix into a prefill step
    forced_decode_steps: int = 0  # prefill plans dropped so that those decodes run
    refused_never_fit: int = 0  # queued requests ended: an empty KV pool cannot hold them
    refused_unserviceable: int = 0  # requests ended: their SLO is below the calibrated device's floor


class FairBatchingState:
    def __init__(self, config: ExtensionConfig, metrics: Any = None,
                 trace: StepTrace | None = None) -> None:
        self.config = config
        self.metrics = metrics  # FairBatchingMetrics, or None without --enable-metrics
        self.trace = trace  # the step log ([trace] step_log), or None
        self._last_publish = 0.0
        self._published_counts: tuple[int, ...] = ()
        self.policy = config.build_policy()
        self.admission: AdmissionSettings = self.policy.admission
        self.records = RequestRecords(config.catalog)
        self.parked: Any = None  # ScheduleBatch of deferred decodes, or None
        self.sat_out = False  # chosen decodes sat out the last prefill step: decode next
        self.calibration: Calibration | None = None  # the start-up calibration, while it runs
        self.calibrated: CalibrationFit | None = None  # what it fitted
        # the PAB's inputs at the last decision (views, clock, step model), computed from
        # them when first read (pab_tokens)
        self._budget_inputs: tuple[Sequence[RequestState], float, Any] | None = None
        self._pab_tokens: int | None = 0
        # Per SLO class, prompt tokens a new request may bring (published in the load
        # snapshot for the HTTP process's admission gate and the DP pab method, and in
        # control-plane reports); computed under mode reject, or when one of those
        # routes on them (they set publishes_budgets), else empty.
        self.class_budgets: dict[str, int] = {}
        self.admission_echo: dict[str, int] = {}  # the admissions class_budgets count
        self.publishes_budgets = self.admission.mode is AdmissionMode.REJECT
        self.last_decision: BatchDecision | None = None
        # decisions of at least this many requests read them as a RequestTable collected
        # by the view loops (request_store), smaller ones as the list of views; None:
        # always the list (the same decisions, bit for bit; adapter_cost times both)
        self.table_min_requests: int | None = table_min_requests()
        # the prefill plan SGLang's get_new_batch_prefill is realising, set only while it
        # runs; read by the adder-class and waiting-queue ordering hooks
        self.active_plan: PrefillPlan | None = None
        # rids the policy ended (defer), aborted at the scheduler's next request poll;
        # at most one entry per live request (each is ended once)
        self.pending_aborts: list[Any] = []
        # (rid, why) of queued requests KV memory can never hold, or whose SLO the
        # calibrated device cannot serve: left out of decisions, ended the same way
        self.pending_refusals: dict[Any, str] = {}
        self.counters = Counters()
        self.errors = HandledErrors(on_error=metrics.observe_error if metrics is not None else None)
        self.gc_pauses: deque[GcPause] = deque(maxlen=256)
        self.decision_s: deque[float] = deque(maxlen=4096)  # adapter + policy time per decision
        self.learning_s: deque[float] = deque(maxlen=4096)  # the step model's learning per step
        self._last_gc: float | None = None
        self.device = DeviceClock()
        self._last_log = time.perf_counter()

    def launched(self, launched_at: float, predicted_s: float) -> None:
        """A step went to the device: it starts when the device is free (overlap loop)."""
        self.device.launched(launched_at, predicted_s)

    @property
    def device_free_at(self) -> float:
        """Predicted end of the steps launched so far."""
        return self.device.free_at

    def decision_time(self, now: float) -> float:
        """When a step formed now will start: under SGLang's overlap loop the next batch is
        formed while the previous one still runs, so its tokens come after that one ends."""
        return max(now, self.device.free_at)

    @property
    def highest_dispatch_seq(self) -> int:
        return self.records.highest_dispatch_seq

    def controlplane_echo(self, slot: int) -> int:
        """The highest dispatch seq of control-plane daemon ``slot`` this rank has seen."""
        return self.records.controlplane_echo.get(slot, 0)

    @property
    def parked_reqs(self) -> list[Any]:
        return [] if self.parked is None else list(self.parked.reqs)

    @property
    def forecasts_kv(self) -> bool:
        """Whether decisions need the rank's KV outlook: the ``edf`` forecast runs (to
        publish budgets, or to mark hopeless prefills under ``defer``)."""
        return self.admission.rule is AdmissionRule.EDF and (
            self.publishes_budgets or self.admission.mode is not AdmissionMode.OFF)

    def decide(self, views: Sequence[RequestState], now: float) -> BatchDecision:
        """The policy's decision over ``views`` at ``now``, and the rank's budgets at it
        (:meth:`update_budgets`); a rank that publishes its budgets takes both from one
        forecast (``BatchPolicy.form_batch_with_budgets``)."""
        if not self.publishes_budgets:
            self.update_budgets(views, now)
            return self.policy.form_batch(views, now)
        decision, budgets = self.policy.form_batch_with_budgets(
            views, now, self.config.catalog.classes)
        self.update_budgets(views, now, budgets)
        return decision

    def update_budgets(self, views: Sequence[RequestState], now: float,
                   budgets: Mapping[str, float] | None = None) -> None:
        """The rank's budgets at this decision (``budgets``: the class budgets, when the
        caller has them). The PAB is computed when first read (a metrics publish, a load
        snapshot, a control-plane report; a single rank without metrics never reads it),
        from what it would have been computed from now: these views (refreshed in place
        only by the next decision, which calls this again before anything reads it), this
        clock and this step model (a new object after every observed step)."""
        self._budget_inputs = (views, now, self.policy.step_model.coefficients)
        self._pab_tokens = None
        if self.publishes_budgets:
            if budgets is None:
                budgets = self.policy.class_budgets(views, now, self.config.catalog.classes)
            self.class_budgets = {name: whole_budget_tokens(b) for name, b in budgets.items()}
            self.admission_echo = dict(self.records.admission_echo)

    @property
    def decision_inputs(self) -> tuple[Sequence[RequestState], float] | None:
        """The views and clock of the last decision (or idle pass), as :meth:`update_budgets`
        received them; None before the first."""
        inputs = self._budget_inputs
        return None if inputs is None else (inputs[0], inputs[1])

    @property
    def pab_tokens(self) -> int:
        """The Prefill Admission Budget at the last decision, whole tokens (0 before any)."""
        if self._pab_tokens is None:
            views, now, coefficients = self._budget_inputs
            # BatchPolicy.prefill_admission_budget, with the step model of that decision
            budget = prefill_admission_budget(views, now, coefficients, self.policy.context.global_slo)
            self._pab_tokens = int(budget) if math.isfinite(budget) else 0
        return self._pab_tokens

    @pab_tokens.setter
    def pab_tokens(self, tokens: int) -> None:
        self._budget_inputs, self._pab_tokens = None, tokens

    def observe_prefills(self, prefills: Sequence[Any], now: float, abort_ids: Sequence[Any]) -> None:
        """Count the waiting ``prefills`` (live views) that passed their TTFT deadline
        without a first token, each once, and queue the requests the policy ended
        (``BatchDecision.abort_ids``, admission mode defer) for :meth:`take_aborts`."""
        late = 0
        for view in prefills:
            if not view.late and view.next_output_index == 0 and now > view.arrival + view.slo.ttft_s:
                view.late = True
                late += 1
        self.counters.late_prefills += late
        if not abort_ids:
            return
        ended = set(abort_ids)
        for view in prefills:
            if view.req_id in ended and not view.expired:
                view.expired = True
                self.counters.deferred_expired += 1
                self.pending_aborts.append(view.req_id)

    def take_aborts(self) -> list[Any]:
        aborts, self.pending_aborts = self.pending_aborts, []
        return aborts

    def take_refusals(self) -> dict[Any, str]:
        refusals, self.pending_refusals = self.pending_refusals, {}
        return refusals

    def observe_completion(self, launch: StepLaunch, done_at: float) -> float | None:
        """A step's result reached the host at ``done_at``: it ran from its launch, or from
        the previous step's completion when the device was still busy with that. Returns
        that measured time (None: nothing to learn from)."""
        measured = done_at - self.device.completed(done_at)
        features = launch.features
        if measured <= 0 or features.new_tokens <= 0:
            return None
        self.counters.steps += 1
        budget = launch.time_budget_s
        if budget is not None and launch.predicted_s > budget:
            self.counters.budget_below_floor += 1
        elif (budget is not None and measured > budget
              and measured > (1.0 + OVERRUN_TOLERANCE) * launch.predicted_s):
            self.counters.overruns += 1
            logger.debug("FairBatching step overran its budget and its prediction: %.1f ms > %.1f ms "
                         "(predicted %.1f ms, %d new tokens, %d context)", measured * 1e3,
                         budget * 1e3, launch.predicted_s * 1e3, features.new_tokens,
                         features.total_context)
        speed = self.policy.speed_factor
        learning = time.perf_counter()
        self.policy.observe_step(features, measured)
        self.learning_s.append(time.perf_counter() - learning)
        if self.policy.speed_factor != speed:
            logger.info("FairBatching: this device runs steps %.2fx as long as the step model "
                        "predicts (median of its first steps); learning again from the model "
                        "scaled by that", self.policy.speed_factor)
        if self.calibration is not None:
            self.calibration.record(features, measured)
        self.maybe_log(done_at)
        self.maybe_publish(done_at)
        return measured

    def finish_calibration(self) -> CalibrationFit | None:
        """Fit the step model to the calibration's steps and adopt it (logged); None, with
        the file's model kept, when the steps cannot be fitted. From then on a request
        whose SLO the fitted model cannot serve is refused on first sight."""
        calibration, self.calibration = self.calibration, None
        if calibration is None:
            return None
        ready_at = time.perf_counter()
        current = self.policy.initial_step_model
        try:
            fit = calibration.fit(current.form, current)
        except ValueError as exc:
            self.records.ready(ready_at)
            logger.warning("FairBatching start-up calibration kept the step-model file (%s): %s",
                           self.config.source, exc)
            return None
        self.policy.adopt_initial_model(fit.model.model, fit.model.linear)
        self.records.ready(ready_at, self._refuse_if_unserviceable)
        self.calibrated = fit
        logger.info("FairBatching start-up calibration %s", fit.summary())
        for name, slo in self.config.catalog.classes.items():
            reason = unserviceable_slo_reason(slo, fit.model.model)
            if reason is not None:
                logger.error("FairBatching: SLO class %r cannot be served on this device: %s. Its "
                             "requests are refused with a 400; raise its tpot_ms", name, reason)
        return fit

    def _refuse_if_unserviceable(self, rid: Any, slo: Any) -> None:
        reason = self.policy.refusal(slo)
        if reason is not None:
            self.counters.refused_unserviceable += 1
            self.pending_refusals[rid] = (
                f"unserviceable SLO on this device (calibrated at start-up): {reason}")

    def maybe_publish(self, now: float, force: bool = False) -> None:
        """Metrics at most every 0.5 s of steps, and (``force``, when the rank goes idle)
        once more if the counters moved since, so what the last steps counted is not left
        unpublished."""
        if self.metrics is None:
            return
        due = now - self._last_publish >= 0.5
        if not (due or force):
            return
        counts = tuple(vars(self.counters).values())
        if due or counts != self._published_counts:
            self._last_publish = now
            self._published_counts = counts
            self.metrics.publish(self)

    def maybe_collect_garbage(self, views: Sequence[RequestState], now: float, reason: str) -> float:
        """Collect if the policy core says so; returns the pause in seconds (0.0: none)."""
        if not self.config.gc_enabled:
            return 0.0
        if not self.gc_pauses and views:
            return 0.0  # the first collection's pause is unknown: take it only when idle
        gc_config = self.config.gc
        if self.gc_pauses:
            # A collection must fit inside every decode's slack, with room to spare.
            needed = 2.0 * self.gc_pauses[-1].pause_s
            if needed > gc_config.min_decode_slack_s:
                gc_config = dataclasses.replace(gc_config, min_decode_slack_s=needed)
        if not should_collect(gc_config, views, now, self._last_gc):
            return 0.0
        started = time.perf_counter()
        collected = gc.collect()
        ended = time.perf_counter()
        self._last_gc = ended
        pause = GcPause(started, ended - started, collected, reason)
        self.gc_pauses.append(pause)
        if self.metrics is not None:
            self.metrics.observe_gc_pause(pause.pause_s)
        logger.info(
            "FairBatching gc: collected %d objects in %.1f ms (%s)",
            collected, pause.pause_s * 1e3, reason,
        )
        return pause.pause_s

    def maybe_log(self, now: float) -> None:
        if now - self._last_log < self.config.log_interval_s:
            return
        self._last_log = now
        coefficients = self.policy.step_model.coefficients
        error = self.policy.step_model.error
        counters = self.counters
        logger.info(
            "FairBatching step model (%s): a=%.3f ms b=%.3f us/token%s; "
            "error mean=%.1f%% p95=%.1f%% median by kind %s over %d steps; PAB=%d tokens; "
            "deferred %d decode slots in %d of %d decisions; fallbacks=%d; budget overruns=%d; "
            "budget below the floor=%d; late prefills=%d; ended after max_defer_s=%d; "
            "decision time p50/p99 %s us",
            coefficients.form, coefficients.a_s * 1e3, coefficients.b_s_per_token * 1e6,
            f" knee={coefficients.knee_tokens:.0f}" if hasattr(coefficients, "knee_tokens") else "",
            error.mean_abs_relative * 100, error.p95_abs_relative * 100,
            " ".join(f"{kind}={median * 100:.1f}%" for kind, _, median in error.by_kind) or "-",
            counters.steps, self.pab_tokens, counters.deferred_decodes, counters.steps_with_deferral,
            counters.decisions, counters.fallbacks, counters.overruns, counters.budget_below_floor,
            counters.late_prefills,
            counters.deferred_expired, "/".join(str(v) for v in _percentiles_us(self.decision_s).values()),
        )

    def snapshot(self) -> dict[str, Any]:
        """What ``/fairbatching`` style introspection and tests read."""
        coefficients = self.policy.step_model.coefficients
        error = self.policy.step_model.error
        return {
            "policy": self.config.policy,
            "pab_tokens": self.pab_tokens,
            "admission": self.admission.label,
            "class_budgets": dict(self.class_budgets),
            "highest_dispatch_seq": self.highest_dispatch_seq,
            "parked": len(self.parked_reqs),
            "step_model": {
                "form": coefficients.form,
                **coefficients.fields(),
                "mean_abs_relative_error": error.mean_abs_relative,
                "p95_abs_relative_error": error.p95_abs_relative,
                "median_abs_relative_error": error.median_abs_relative,
                "median_abs_relative_error_by_kind": {kind: median for kind, _, median in error.by_kind},
            },
            "calibration": None if self.calibrated is None else {
                "steps": self.calibrated.steps, "seconds": self.calibrated.seconds,
                "fitted_median_abs_error": self.calibrated.fitted_error,
                "file_median_abs_error": self.calibrated.file_error,
            },
            "counters": vars(self.counters).copy(),
            "errors": dict(self.errors.counts),
            "gc_pauses_ms": [round(p.pause_s * 1e3, 3) for p in self.gc_pauses],
            "decision_us": _percentiles_us(self.decision_s),
            "learning_us": _percentiles_us(self.learning_s),
        }


def whole_budget_tokens(budget: float) -> int:
    """A budget as whole tokens: clamped as a report carries it (the PAB rule may say
    inf), then floored."""
    return math.floor(budget_tokens(budget))


def _percentiles_us(samples: deque[float]) -> dict[str, int]:
    if not samples:
        return {}
    ordered = sorted(samples)
    pick = lambda q: int(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6)  # noqa: E731
    return {"p50": pick(0.50), "p99": pick(0.99)}
