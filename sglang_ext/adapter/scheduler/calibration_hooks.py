"""The start-up calibration inside SGLang's scheduler
(:mod:`sglang_ext.policy.startup_calibration`): the plan is queued when the scheduler
is built, its requests' outputs never reach the detokenizer, and the fit runs when the
last one ends."""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable, Iterable
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_ext.policy.startup_calibration import (
    Calibration,
    calibration_plan,
    calibration_slo,
    is_calibration_rid,
)
from sglang_ext.adapter.scheduler.state import FairBatchingState

logger = logging.getLogger("sglang_ext.fairbatching")

STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"


def install_calibration_hooks() -> None:
    HookRegistry.register(f"{STREAMER}.stream_output", _without_calibration, HookType.AROUND)


def start_calibration(scheduler: Any, state: FairBatchingState) -> None:
    """Queue the calibration plan on ``scheduler`` (a colocated one: a disaggregated
    prefill or decode rank keeps its file)."""
    mode = getattr(getattr(scheduler, "disaggregation_mode", None), "value", "null")
    if mode != "null":
        logger.info("FairBatching start-up calibration skipped: disaggregation mode %s", mode)
        return
    model_config = scheduler.model_config
    plan = calibration_plan(int(scheduler.max_total_num_tokens), int(model_config.context_len),
                            int(model_config.vocab_size))
    if not plan:
        logger.warning("FairBatching start-up calibration skipped: the KV pool (%d tokens) holds "
                       "none of its requests", scheduler.max_total_num_tokens)
        return
    state.calibration = Calibration({request.rid for request in plan})
    state.records.hold_arrivals()
    slo = calibration_slo(state.config.catalog.default).as_spec()
    for request in plan:
        _submit(scheduler, request.rid, request.input_ids, request.max_new_tokens, slo)
    logger.info("FairBatching start-up calibration: %d synthetic requests (%d prompt tokens) queued "
                "before traffic", len(plan), sum(len(r.input_ids) for r in plan))


def note_finished(state: FairBatchingState, reqs: Iterable[Any]) -> None:
    """After a step's results: the calibration's requests that ended; the fit after the last."""
    note_ended(state, [req.rid for req in reqs if req.finished()])


def note_ended(state: FairBatchingState, rids: Iterable[Any]) -> None:
    """Requests that ended, finished or aborted; the fit after the calibration's last."""
    calibration = state.calibration
    if calibration is None:
        return
    for rid in rids:
        if is_calibration_rid(rid) and calibration.finished(rid):
            state.finish_calibration()
            return


def held_back(state: FairBatchingState, waiting_queue: list[Any]) -> list[Any]:
    """The waiting requests the policy may plan while the calibration runs: its own. The
    others (SGLang's readiness warm-up, a client that came early) wait for its end, so
    the server reports ready only after it; a calibration past its timeout ends here
    with the steps it has."""
    calibration = state.calibration
    if calibration is not None and calibration.overdue(time.perf_counter()):
        logger.warning("FairBatching start-up calibration timed out with %d requests left",
                       len(calibration.pending))
        state.finish_calibration()
    if state.calibration is None:
        return waiting_queue
    return [req for req in waiting_queue if is_calibration_rid(req.rid)]


def _submit(scheduler: Any, rid: str, input_ids: tuple[int, ...], max_new_tokens: int,
            slo: dict[str, float]) -> None:
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True,
                            custom_params={"slo": slo})
    params.normalize(None)
    scheduler.handle_generate_request(TokenizedGenerateReqInput(
        rid=rid, input_text=None, input_ids=array("q", input_ids), input_embeds=None,
        mm_inputs=None, token_type_ids=None, sampling_params=params, return_logprob=False,
        logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False,
    ))


def _without_calibration(orig: Callable[..., Any], self: Any, reqs: list[Any], *args: Any,
                         **kwargs: Any) -> Any:
    """No client waits for a calibration request: its outputs are not streamed."""
    kept = [req for req in reqs if not is_calibration_rid(req.rid)]
    if len(kept) == len(reqs):
        return orig(self, reqs, *args, **kwargs)
    if not kept:
        return None
    return orig(self, kept, *args, **kwargs)
