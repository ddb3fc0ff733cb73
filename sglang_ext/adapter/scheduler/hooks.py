"""FairBatching's hooks into SGLang 0.5.23's ``Scheduler`` (registered through SGLang's
plugin ``HookRegistry``; nothing of SGLang is edited).

Each step, SGLang's ``get_next_batch_to_run`` merges finished prefills into the running
batch and drops finished requests; then, where it would form a prefill batch, the
policy decides:

- decodes it defers are *parked*: removed from the running batch with their KV kept,
  merged back at the start of the next step;
- its prefill chunks are realised by SGLang's own ``PrefillAdder`` restricted to the
  plan (:mod:`sglang_ext.adapter.scheduler.prefill_plan`), mixed with the chosen decodes in
  one hybrid batch (``ForwardMode.MIXED``);
- with no prefill planned, the chosen decodes run as SGLang's decode batch.

While SGLang's ``get_new_batch_prefill`` runs, the plan is the rank state's
``active_plan`` (:class:`~sglang_ext.adapter.scheduler.state.FairBatchingState`, held on
the scheduler as ``scheduler.fairbatching`` and on its ``SchedulePolicy`` as
``policy.fairbatching``): the adder-class hook and the waiting-queue ordering hook read it
there.

Everything that must see every request of the rank sees parked ones too: the KV
reservation of prefill admission, decode retraction (parked requests rejoin before
SGLang retracts), aborts and pauses (they rejoin first), in-flight collection, the
fully-idle check (and so the idle leak checks) and the load snapshot's running count.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from sglang.srt.managers.scheduler import NextBatchPlan, Scheduler
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_ext.adapter.extension_config import ExtensionConfig
from sglang_ext.adapter.scheduler.calibration_hooks import (
    held_back,
    install_calibration_hooks,
    note_ended,
    note_finished,
    start_calibration,
)
from sglang_ext.adapter.scheduler.kv_outlook import kv_outlook, kv_outlook_of_table
from sglang_ext.adapter.scheduler.parking import merge_into, split_batch
from sglang_ext.adapter.scheduler.prefill_plan import PrefillPlan, adder_factory, plan_from_chunks
from sglang_ext.adapter.scheduler.request_store import DecisionColumns
from sglang_ext.adapter.scheduler.requests import LiveRequestView, must_decode
from sglang_ext.adapter.scheduler.state import LAUNCH_ATTR, FairBatchingState, StepLaunch
from sglang_ext.adapter.scheduler.step_features import step_features
from sglang_ext.adapter.scheduler.step_trace import StepTrace
from sglang_ext.policy import compiled

logger = logging.getLogger("sglang_ext.fairbatching")

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
SCHEDULE_POLICY = "sglang.srt.managers.schedule_policy.SchedulePolicy"

def install_scheduler_hooks(config: ExtensionConfig) -> None:
    hooks: dict[str, tuple[Callable[..., Any], HookType]] = {
        "__init__": (_make_init_hook(config), HookType.AFTER),
        "get_next_batch_to_run": (_get_next_batch_to_run, HookType.AROUND),
        "get_new_batch_prefill": (_get_new_batch_prefill, HookType.AROUND),
        "get_prefill_adder_class": (_get_prefill_adder_class, HookType.AROUND),
        "get_num_allocatable_reqs": (_get_num_allocatable_reqs, HookType.AROUND),
        "update_running_batch": (_update_running_batch, HookType.AROUND),
        "abort_request": (_unpark_before, HookType.BEFORE),
        "pause_generation": (_unpark_before, HookType.BEFORE),
        "is_fully_idle": (_is_fully_idle, HookType.AFTER),
        "_collect_inflight_batches": (_collect_inflight_batches, HookType.AFTER),
        "run_batch": (_run_batch, HookType.AROUND),
        "process_batch_result": (_process_batch_result, HookType.AROUND),
        "on_idle": (_on_idle, HookType.BEFORE),
        "_poll_timeout_aborts": (_poll_timeout_aborts, HookType.AFTER),
        "_add_request_to_queue": (_view_on_arrival, HookType.AFTER),
    }
    for method, (hook, hook_type) in hooks.items():
        HookRegistry.register(f"{SCHEDULER}.{method}", hook, hook_type)
    HookRegistry.register(f"{SCHEDULE_POLICY}.calc_priority", _planned_first, HookType.AFTER)
    if config.calibrate:
        install_calibration_hooks()


def _make_init_hook(config: ExtensionConfig) -> Callable[..., None]:
    def after_init(result: Any, self: Scheduler, *args: Any, **kwargs: Any) -> None:
        attach(self, config)

    return after_init


def attach(scheduler: Scheduler, config: ExtensionConfig) -> FairBatchingState:
    """Turn FairBatching on for one scheduler (the ``__init__`` hook; tests call it directly)."""
    metrics = None
    reporter = getattr(scheduler, "metrics_reporter", None)
    if reporter is not None and getattr(reporter, "enable_metrics", False):
        from sglang.srt.runtime_context import get_parallel

        from sglang_ext.adapter.scheduler.prometheus_metrics import FairBatchingMetrics

        metrics = FairBatchingMetrics(get_parallel().dp_rank)
    trace = None
    if config.step_log is not None:
        from sglang.srt.runtime_context import get_parallel

        dp_size = getattr(getattr(scheduler, "server_args", None), "dp_size", 1) or 1
        trace = StepTrace.for_rank(config.step_log, get_parallel().dp_rank if dp_size > 1 else None)
    state = FairBatchingState(config, metrics, trace)
    if getattr(getattr(scheduler, "server_args", None), "load_balance_method", None) == "pab":
        state.publishes_budgets = True  # the DP controller routes on each class's budget
    scheduler.fairbatching = state
    schedule_policy = getattr(scheduler, "policy", None)
    if schedule_policy is not None:
        # SGLang calls the waiting-queue ordering hook on its SchedulePolicy, which holds
        # no reference to its scheduler: the state rides on it too.
        schedule_policy.fairbatching = state
    # FairBatching's batches are hybrid: chosen decodes ride along with prefill chunks.
    scheduler.is_mixed_chunk = True
    for component in ("load_inquirer", "invariant_checker"):
        owner = getattr(scheduler, component, None)
        if owner is not None and hasattr(owner, "get_running_batch"):
            # Both are dataclasses (the load inquirer a frozen one): rebuild, don't mutate.
            setattr(scheduler, component,
                    dataclasses.replace(owner, get_running_batch=_with_parked(scheduler)))
    logger.info(
        "FairBatching on: policy=%s, default SLO %s, max %d new tokens per step, decisions "
        "over %s, decision path %s (%s)",
        config.policy, config.catalog.default, config.max_token_budget,
        "request lists" if state.table_min_requests is None
        else f"request tables (columns) from {state.table_min_requests} requests",
        compiled.decision_path(), config.source,
    )
    if config.calibrate:
        start_calibration(scheduler, state)
    return state


class _RequestsOf:
    """A read-only stand-in exposing ``reqs`` of the running batch plus parked requests."""

    def __init__(self, reqs: list[Any]) -> None:
        self.reqs = reqs

    def is_empty(self) -> bool:
        return not self.reqs


def _with_parked(scheduler: Scheduler) -> Callable[[], Any]:
    def get_running_batch() -> Any:
        parked = scheduler.fairbatching.parked
        if parked is None or parked.is_empty():
            return scheduler.running_batch
        return _RequestsOf(list(scheduler.running_batch.reqs) + list(parked.reqs))

    return get_running_batch


def unpark(scheduler: Scheduler, running: Any, *, none_finished: bool = False) -> Any:
    """The parked requests back in ``running`` (``parking.merge_into``)."""
    state: FairBatchingState = scheduler.fairbatching
    parked, state.parked = state.parked, None
    if parked is None:
        return running
    return merge_into(running, parked, none_finished=none_finished)


def _view_on_arrival(result: Any, self: Scheduler, req: Any, *args: Any, **kwargs: Any) -> None:
    """A request that joined the waiting queue gets its view as it arrives: the request
    path pays for it once, not the next decision (``RequestRecords.arrived``)."""
    queue = self.waiting_queue
    if queue and queue[-1] is req:
        self.fairbatching.records.arrived(req)


def _get_next_batch_to_run(orig: Callable[..., Any], self: Scheduler, running_batch: Any, last_batch: Any) -> Any:
    """Parked requests stay parked across steps until the policy resumes them; the
    finished-request filtering SGLang does here cannot concern them (they do not run),
    except a parked request whose in-flight token finished it, which resumes and is
    filtered on the next decision."""
    self.fairbatching.last_decision = None
    return orig(self, running_batch, last_batch)


def _in_flight_reqs(scheduler: Scheduler) -> set[Any]:
    """Requests whose previous step is still running (overlap scheduler): their
    ``output_ids`` lag one token behind what will exist when this step runs."""
    queue = getattr(scheduler, "result_queue", None)
    if not scheduler.enable_overlap or not queue:
        return set()
    return {req for batch, _ in queue for req in batch.reqs}


def _get_new_batch_prefill(orig: Callable[..., Any], self: Scheduler, running_batch: Any) -> Any:
    state: FairBatchingState = self.fairbatching
    started = time.perf_counter()
    records = state.records
    if state.calibration is None:
        records.echo_arrivals()  # a decision during the calibration sees only its requests
    in_flight = _in_flight_reqs(self)
    parked_reqs = state.parked_reqs
    chunked = self.chunked_req
    count = len(running_batch.reqs) + len(parked_reqs) + len(self.waiting_queue) + (chunked is not None)
    least = state.table_min_requests
    collected = DecisionColumns() if least is not None and count >= least else None
    views: list[LiveRequestView] = records.decode_views(
        (*running_batch.reqs, *parked_reqs), in_flight, state.device_free_at, collected)
    decoding = len(views)
    chunked_view = None
    if chunked is not None:
        chunked_view = records.prefill_views((chunked,), collected)[0]
        views.append(chunked_view)
    waiting = self.waiting_queue if state.calibration is None else held_back(state, self.waiting_queue)
    queued_views = records.prefill_views(waiting, collected)
    refused = state.pending_refusals
    if refused:  # never planned: ended at the next request poll
        kept = [(req, view) for req, view in zip(waiting, queued_views, strict=True)
                if req.rid not in refused]
        waiting, queued_views = [req for req, _ in kept], [view for _, view in kept]
    views += queued_views
    if collected is None:
        table = views
        records.store.seen()
    else:
        table = collected.table(views, records.store)

    started += state.maybe_collect_garbage(table, time.perf_counter(), "slack")
    now = state.decision_time(time.perf_counter())
    if state.forecasts_kv:
        state.policy.observe_kv(_kv_outlook(self, running_batch, parked_reqs, table, collected))
    decision = state.decide(table, now)
    state.last_decision = decision
    state.observe_prefills(views[len(views) - len(waiting) - (chunked is not None):],
                           now, decision.abort_ids)
    state.counters.decisions += 1
    running_batch = _realise_decodes(self, state, running_batch, decision, views[:decoding])

    decided = time.perf_counter()
    state.decision_s.append(decided - started)
    if state.trace is not None:
        state.trace.decided(started, decided - started, now, views, decision,
                            getattr(state.policy, "anchored", False), len(waiting),
                            state.parked_reqs)
    if not decision.prefill_chunks:
        return NextBatchPlan(batch_to_run=None, running_batch=running_batch)
    sat_out, state.sat_out = state.sat_out, False
    if sat_out and not running_batch.is_empty():
        # Decodes sat out the last prefill step: this one decodes them (and can retract).
        state.counters.forced_decode_steps += 1
        return NextBatchPlan(batch_to_run=None, running_batch=running_batch)

    plan = plan_from_chunks(
        decision.prefill_chunks,
        chunked.rid if chunked is not None else None,
        chunked_view.pending_prefill if chunked_view is not None else 0,
        state.parked_reqs,
    )
    state.counters.planned_prefill_tokens += plan.total_tokens
    state.active_plan = plan
    try:
        result = orig(self, running_batch)
    finally:
        state.active_plan = None
    if result.batch_to_run is None and result.running_batch.is_empty() and state.parked is None \
            and self.chunked_req is None:
        _refuse_what_never_fits(self, state, plan)
    if result.batch_to_run is None and state.parked is not None:
        # SGLang could not admit the planned prefill (KV memory): decode everyone.
        state.counters.fallbacks += 1
        return NextBatchPlan(batch_to_run=None, running_batch=unpark(self, result.running_batch))
    if result.batch_to_run is not None and not result.running_batch.is_empty():
        # SGLang did not mix the chosen decodes into the prefill step (no KV room for
        # their rows, or a batch it cannot mix: logprobs, embeddings, beams). They sit
        # this step out, counted, and the next step decodes them.
        state.counters.decodes_sat_out += len(result.running_batch.reqs)
        state.sat_out = True
    return result


def _refuse_what_never_fits(scheduler: Scheduler, state: FairBatchingState, plan: PrefillPlan) -> None:
    """Nothing runs and nothing was admitted: a planned request that even the whole
    pool cannot hold would stay at the head of the queue for ever, and SGLang's
    admission stops at the first request that does not fit. Such requests are ended
    with a clear error at the next request poll (SGLang caps ``max_new_tokens`` to the
    pool when a request arrives, but its ignore-EOS admission needs a few tokens more)."""
    capacity = scheduler.max_total_num_tokens
    planned = plan.tokens_by_rid
    radix_off = getattr(scheduler.tree_cache, "disable", True)
    for req in scheduler.waiting_queue:
        if req.rid not in planned or req.rid in state.pending_refusals:
            continue
        need = never_fits(req, capacity, scheduler.page_size,
                          ignore_eos_admission=radix_off and req.sampling_params.ignore_eos)
        if need is not None:
            state.pending_refusals[req.rid] = (
                f"FairBatching: this request needs {need} KV tokens (its prompt and "
                f"max_new_tokens), more than this server's KV pool holds ({capacity}); "
                "send a shorter prompt or fewer max_new_tokens")
            state.counters.refused_never_fit += 1


def never_fits(req: Any, capacity: int, page_size: int, *, ignore_eos_admission: bool) -> int | None:
    """The KV tokens SGLang's admission asks of ``req`` (its prompt, a page, its
    outputs; its ignore-EOS admission, taken without the radix cache, one token more)
    when an empty pool of ``capacity`` tokens cannot grant them, else None."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS, IGNORE_EOS_RESERVE_TOKENS

    params = req.sampling_params
    outputs = min(max(params.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
    # not full_untruncated_fill_ids: SGLang fills it only for requests its admission loop reached
    extend = len(req.origin_input_ids) + len(req.output_ids) - req.prefix_len
    need = -(-extend // page_size) * page_size + page_size + outputs
    if ignore_eos_admission:
        need += IGNORE_EOS_RESERVE_TOKENS
    return need if need >= capacity else None


def _kv_outlook(scheduler: Scheduler, running_batch: Any, parked_reqs: Any, views: list[Any],
                collected: DecisionColumns | None) -> Any:
    """The rank's KV outlook: from the decision's table where it was collected whole (the
    waiting queue as it is, none left out), else request by request."""
    decoding_reqs = (*running_batch.reqs, *parked_reqs)
    chunked = scheduler.chunked_req
    split = len(decoding_reqs)
    queued_views = views[split + (chunked is not None):]
    available = (scheduler.token_to_kv_pool_allocator.available_size()
                 + scheduler.tree_cache.evictable_size())
    if (collected is not None and collected.store_rows is not None
            and len(queued_views) == len(scheduler.waiting_queue)):
        return kv_outlook_of_table(
            available, scheduler.new_token_ratio_tracker.current, views,
            scheduler.fairbatching.records.store, collected.store_rows, collected.outputs, split,
            chunked)
    return kv_outlook(
        available,
        scheduler.new_token_ratio_tracker.current,
        tuple(zip(decoding_reqs, views[:split])),
        tuple(zip(scheduler.waiting_queue, queued_views)),
        (chunked, views[split]) if chunked is not None else None,
    )


def _realise_decodes(scheduler: Scheduler, state: FairBatchingState, running: Any, decision: Any,
                     views: list[LiveRequestView]) -> Any:
    """Make the running batch hold exactly the decodes the policy chose (plus those that
    must run), parking the rest. Requests that stay parked stay in place: a parked set
    that only grows costs one split, not a merge and a split every step. ``views``: the
    running requests' views, then the parked ones', as the decision read them."""
    chosen = set(decision.decode_ids)
    parked = state.parked
    reqs = running.reqs
    if parked is not None:
        parked_views = views[len(reqs):]
        if not chosen.isdisjoint([view.req_id for view in parked_views]) or any(
            must_decode(req, view) for req, view in zip(parked.reqs, parked_views, strict=True)
        ):
            # the merged batch is the running requests, then the parked ones that did not
            # finish while parked (SGLang's filter in merge_into drops those)
            unfinished = [view for req, view in zip(parked.reqs, parked_views, strict=True)
                          if not req.finished()]
            views = views[:len(reqs)] + unfinished
            running = unpark(scheduler, running,
                             none_finished=len(unfinished) == len(parked_views))
            parked = None
            reqs = running.reqs
    park = [i for i, view in enumerate(views[:len(reqs)])
            if view.req_id not in chosen and not must_decode(reqs[i], view)]
    if len(park) == len(reqs) and parked is None and not decision.prefill_chunks:
        park = []  # never leave the device idle with decodes waiting
    # from here every parked request was read unfinished: must_decode is false for each
    if park:
        newly_parked = split_batch(scheduler, running, park)
        state.parked = (newly_parked if parked is None
                        else merge_into(parked, newly_parked, none_finished=True))
    if not running.reqs and state.parked is not None and not decision.prefill_chunks:
        running = unpark(scheduler, running, none_finished=True)  # nothing else would run this step
    deferred = len(state.parked_reqs)
    if deferred:
        state.counters.deferred_decodes += deferred
        state.counters.steps_with_deferral += 1
    return running


def _planned_first(result: Any, policy: Any, waiting_queue: list[Any], *args: Any, **kwargs: Any) -> Any:
    """Put the planned requests first (stable), so SGLang's admission loop reaches them
    at once instead of walking, and prefix-matching, the whole queue."""
    state: FairBatchingState | None = getattr(policy, "fairbatching", None)
    plan = state.active_plan if state is not None else None
    if plan is not None:
        planned = plan.tokens_by_rid
        waiting_queue.sort(key=lambda req: req.rid not in planned)
    return result


def _get_prefill_adder_class(orig: Callable[..., Any], self: Scheduler) -> Any:
    base = orig(self)
    plan = self.fairbatching.active_plan
    return base if plan is None else adder_factory(base, plan)


def _get_num_allocatable_reqs(orig: Callable[..., Any], self: Scheduler, running_bs: int, *args: Any,
                              **kwargs: Any) -> Any:
    """Parked requests are running requests: they count against the batch-size limit
    as they hold their request-pool rows."""
    return orig(self, running_bs + len(self.fairbatching.parked_reqs), *args, **kwargs)


def _update_running_batch(orig: Callable[..., Any], self: Scheduler, batch: Any) -> Any:
    state: FairBatchingState = self.fairbatching
    if state.parked is not None and not batch.check_decode_mem():
        # Out of KV for this step's decodes: let SGLang's retraction choose among all
        # decoding requests, parked ones included, and run them all.
        batch = unpark(self, batch)
    return orig(self, batch)


def _unpark_before(self: Scheduler, *args: Any, **kwargs: Any) -> None:
    if self.fairbatching.parked is not None:
        self.running_batch = unpark(self, self.running_batch)


def _is_fully_idle(result: bool, self: Scheduler, *args: Any, **kwargs: Any) -> bool:
    parked = self.fairbatching.parked
    return bool(result) and (parked is None or parked.is_empty())


def _collect_inflight_batches(result: list[Any], self: Scheduler) -> list[Any]:
    parked = self.fairbatching.parked
    return result if parked is None else [*result, parked]


#: :class:`HandledErrors` site: a step that could not be timed.
UNTIMED_STEP_SITE = "run_batch.untimed_step"


def _run_batch(orig: Callable[..., Any], self: Scheduler, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """Time the step: its launch rides on the result (``LAUNCH_ATTR``) to
    ``process_batch_result``, where the measured step feeds the online step model."""
    features = step_features(batch)
    launched_at = time.perf_counter()
    result = orig(self, batch, *args, **kwargs)
    if result is None or features.new_tokens <= 0:
        return result  # an idle batch computes nothing: nothing to time
    state: FairBatchingState = self.fairbatching
    if not _takes_attributes(result):
        state.errors.record(
            UNTIMED_STEP_SITE,
            f"run_batch returned a {type(result).__module__}.{type(result).__qualname__}, which takes "
            "no new attributes: this step is not timed and the step model does not learn from it",
            exc_info=False,
        )
        return result
    decision = state.last_decision
    budget = decision.time_budget_s if decision is not None else None
    predicted = state.policy.step_model.predict(features)
    traced = state.trace.take_decision() if state.trace is not None else None
    setattr(result, LAUNCH_ATTR, StepLaunch(launched_at, features, predicted, budget, traced))
    state.launched(launched_at, predicted)  # only once its completion will be observed
    return result


def _takes_attributes(result: Any) -> bool:
    """Whether the launch can ride on ``result``.

    In SGLang 0.5.23 it always can: ``run_batch`` returns a ``GenerationBatchResult`` in
    every generation mode (normal and overlap loops, pipeline parallel, PD-multiplexed
    split prefill, PD prefill, and PD decode's prebuilt placeholder) and an
    ``EmbeddingBatchResult`` for embedding and reward models, both plain dataclasses
    (no ``__slots__``, not frozen); the emulated GPU's result subclasses the first. The
    case handled here is a future result type with ``__slots__`` or a frozen dataclass.
    It is checked, not caught: a frozen dataclass raises ``FrozenInstanceError``, an
    ``AttributeError``, and swallowing it would silently stop every step-model
    observation and leave the in-flight step count, hence the predicted device-free
    time, never returning to zero; such a step is recorded as a handled error instead."""
    if not hasattr(result, "__dict__"):
        return False
    params = getattr(type(result), "__dataclass_params__", None)
    return not (params is not None and params.frozen)


def _process_batch_result(orig: Callable[..., Any], self: Scheduler, batch: Any, result: Any, *args: Any, **kwargs: Any) -> Any:
    launch = getattr(result, LAUNCH_ATTR, None)
    if launch is None:
        return orig(self, batch, result, *args, **kwargs)
    state: FairBatchingState = self.fairbatching
    copy_done = getattr(result, "copy_done", None)
    if copy_done is not None:
        copy_done.synchronize()
    done_at = time.perf_counter()
    measured = state.observe_completion(launch, done_at)
    processed = orig(self, batch, result, *args, **kwargs)
    if state.calibration is not None:
        note_finished(state, batch.reqs)
    if state.trace is not None:
        state.trace.step_done(launch.traced, launch.features, launch.launched_at, launch.predicted_s,
                              launch.time_budget_s, done_at, measured, batch.reqs)
    return processed


def _poll_timeout_aborts(result: list[Any], self: Scheduler) -> list[Any]:
    """End the requests the policy gave up on (admission mode defer: no first token
    ``max_defer_s`` past the TTFT deadline), and those KV memory can never hold or whose
    SLO the calibrated device cannot serve (a 400),
    the way SGLang ends those past its waiting timeout:
    an ``AbortReq`` joins the requests it polls, so the abort frees their cache state
    and the client gets a final answer with this status."""
    state: FairBatchingState = self.fairbatching
    if not state.pending_aborts and not state.pending_refusals:
        return result
    from http import HTTPStatus

    from sglang.srt.managers.io_struct import AbortReq

    message = (f"FairBatching: no first token within max_defer_s="
               f"{state.admission.max_defer_s:g} s past the TTFT deadline (admission mode defer)")
    reason = {"type": "abort", "status_code": HTTPStatus.SERVICE_UNAVAILABLE, "message": message}
    aborts = [AbortReq(rid=rid, abort_message=message, finished_reason=reason)
              for rid in state.take_aborts()]
    aborts += [AbortReq(rid=rid, abort_message=why,
                        finished_reason={"type": "abort", "status_code": HTTPStatus.BAD_REQUEST,
                                         "message": why})
               for rid, why in state.take_refusals().items()]
    note_ended(state, [abort.rid for abort in aborts])
    return [*result, *aborts]


def _on_idle(self: Scheduler, *args: Any, **kwargs: Any) -> None:
    state: FairBatchingState = self.fairbatching
    if state.parked is not None:
        self.running_batch = unpark(self, self.running_batch)
    now = time.perf_counter()
    state.records.echo_arrivals()
    views = state.records.prefill_views(self.waiting_queue)
    state.update_budgets(views, now)
    if not self.running_batch.reqs and self.chunked_req is None:
        if state.trace is not None:
            state.trace.flush()
        state.maybe_collect_garbage(views, now, "idle")
        state.maybe_publish(now, force=not views)
