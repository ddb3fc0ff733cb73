"""Parking decodes: requests FairBatching defers this step leave the running batch with
their KV (and their request-pool row) kept, and rejoin it at the start of the next step.

A parked request's next input token stays valid: decode inputs are gathered from
SGLang's pool-indexed ``FutureMap`` relay, which only that request's row writes.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.sampling.penaltylib import BatchedPenalizerOrchestrator
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo


def split_batch(scheduler: Any, batch: ScheduleBatch, park: Sequence[int]) -> ScheduleBatch:
    """Remove rows ``park`` from ``batch`` (in place) and return them as a new batch."""
    parked_rows = sorted(park)
    parked_set = set(parked_rows)
    keep = [i for i in range(len(batch.reqs)) if i not in parked_set]
    parked = _sub_batch(scheduler, batch, parked_rows)
    batch.filter_batch(keep_indices=keep)
    if not keep:
        batch.reqs = []
    return parked


def merge_into(running: ScheduleBatch, parked: ScheduleBatch) -> ScheduleBatch:
    """Put parked requests back; returns the batch to use as the running batch."""
    parked.filter_batch()  # drop requests that finished (aborted) while parked
    if parked.is_empty():
        return running
    if running.is_empty():
        parked.batch_is_full = running.batch_is_full
        return parked
    if running.multimodal_inputs is not None and parked.multimodal_inputs is None:
        parked.multimodal_inputs = [None] * len(parked.reqs)
    running.merge_batch(parked)
    return running


def _sub_batch(scheduler: Any, batch: ScheduleBatch, rows: list[int]) -> ScheduleBatch:
    reqs = [batch.reqs[i] for i in rows]
    sub = ScheduleBatch.init_new(
        reqs=reqs,
        req_to_token_pool=scheduler.req_to_token_pool,
        token_to_kv_pool_allocator=scheduler.token_to_kv_pool_allocator,
        tree_cache=scheduler.tree_cache,
        model_config=scheduler.model_config,
        enable_overlap=scheduler.enable_overlap,
        spec_algorithm=scheduler.spec_algorithm,
    )
    index = batch.req_pool_indices.new_tensor(rows)
    sub.req_pool_indices = batch.req_pool_indices[index]
    sub.req_pool_indices_cpu = batch.req_pool_indices_cpu[rows]
    sub.seq_lens = batch.seq_lens[index]
    sub.orig_seq_lens = batch.orig_seq_lens[index]
    sub.seq_lens_cpu = batch.seq_lens_cpu[rows] if batch.seq_lens_cpu is not None else None
    sub.seq_lens_sum = None
    sub.input_ids = None
    sub.forward_mode = batch.forward_mode
    if batch.multimodal_inputs is not None:
        sub.multimodal_inputs = [batch.multimodal_inputs[i] for i in rows]
    sub.sampling_info = _sub_sampling_info(batch.sampling_info, sub, rows, index)
    return sub


#: what SGLang's ``from_schedule_batch`` leaves unset and each step sets (grammar masks,
#: request ids, penalties accumulated under overlap): a sub-batch starts without them too
_PER_STEP_SAMPLING = ("grammars", "rids_int", "bootstrap_room_ids_int", "grammar_mask",
                      "acc_additive_penalties", "acc_scaling_penalties")


def _sub_sampling_info(info: SamplingBatchInfo, sub: ScheduleBatch, rows: list[int],
                       index: Any) -> SamplingBatchInfo:
    """The sampling state of ``rows`` of a batch, for ``sub``: SGLang's own
    ``filter_batch`` on a copy of the batch's, so its tensors are sliced rather than
    rebuilt from every request's parameters (its flags stay the whole batch's, as after
    SGLang's own filtering). The copy gets penalizers of its own over ``sub``: the batch's
    track the batch's rows (and parked requests never have penalties)."""
    sliced = copy.copy(info)
    for name in _PER_STEP_SAMPLING:
        setattr(sliced, name, None)
    sliced.penalizer_orchestrator = _unrequired_penalizers(info, sub)
    sliced.filter_batch(rows, index)
    return sliced


class _NoRequests:
    """An empty batch to build penalizers against (they check its requests)."""

    reqs: tuple[Any, ...] = ()

    def __init__(self, device: Any) -> None:
        self.device = device


def _unrequired_penalizers(info: SamplingBatchInfo, sub: ScheduleBatch) -> BatchedPenalizerOrchestrator:
    """Penalizers for ``sub``, none of them required (no parked request has penalties),
    without checking each request as SGLang's constructor does: built against an empty
    batch, then pointed at ``sub``, whose requests they read if a merge needs them."""
    orchestrator = BatchedPenalizerOrchestrator(
        vocab_size=info.vocab_size, batch=_NoRequests(sub.device),
        penalizers=set(info.penalizer_orchestrator.penalizers))
    orchestrator.batch = sub
    return orchestrator
