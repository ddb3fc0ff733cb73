"""Parking decodes: requests FairBatching defers this step leave the running batch with
their KV (and their request-pool row) kept, and rejoin it at the start of the next step.

A parked request's next input token stays valid: decode inputs are gathered from
SGLang's pool-indexed ``FutureMap`` relay, which only that request's row writes.
"""

from __future__ import annotations

import copy
from array import array
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.managers.schedule_batch import CaptureHiddenMode, ScheduleBatch
from sglang.srt.sampling.penaltylib import BatchedPenalizerOrchestrator
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.utils.common import is_pin_memory_available


def split_batch(scheduler: Any, batch: ScheduleBatch, park: Sequence[int]) -> ScheduleBatch:
    """Remove rows ``park`` from ``batch`` (in place) and return them as a new batch."""
    parked_rows = sorted(park)
    parked_set = set(parked_rows)
    keep = [i for i in range(len(batch.reqs)) if i not in parked_set]
    parked = _sub_batch(scheduler, batch, parked_rows)
    keep_rows(batch, keep)
    if not keep:
        batch.reqs = []
    return parked


def merge_into(running: ScheduleBatch, parked: ScheduleBatch, *,
               none_finished: bool = False) -> ScheduleBatch:
    """Put parked requests back; returns the batch to use as the running batch. Requests
    that finished (aborted) while parked are dropped by SGLang's filter, which is a no-op
    when the caller has just read that ``none_finished`` (and no beam tail is left to strip)."""
    if not none_finished or parked.beam_tail is not None:
        parked.filter_batch()
    if parked.is_empty():
        return running
    if running.is_empty():
        parked.batch_is_full = running.batch_is_full
        return parked
    if running.multimodal_inputs is not None and parked.multimodal_inputs is None:
        parked.multimodal_inputs = [None] * len(parked.reqs)
    running.merge_batch(parked)
    return running


#: what SGLang's ``filter_batch`` unsets on every filter, for its forward pass to rebuild
_UNSET_ON_FILTER = (
    "out_cache_loc", "seq_lens_sum", "mamba_track_indices", "mamba_track_buffer_indices",
    "mamba_track_mask", "mamba_track_seqlens", "mamba_track_seqlens_cpu",
    "mamba_prefill_track_mask_cpu", "mamba_track_mask_cpu", "mamba_track_mask_next_cpu",
    "mamba_decode_batch_idx_cpu", "mamba_lazy_spec_track_positions_cpu", "mamba_cow_src_indices",
    "mamba_cow_dst_indices", "mamba_clear_indices",
)


def _asks_nothing_per_request(batch: ScheduleBatch) -> bool:
    """No request of ``batch`` asks for log-probabilities, a grammar or hidden states, so
    no subset of them does: the batch's flags say so exactly (SGLang sets them from every
    request on each filter and ORs them on each merge)."""
    return not (batch.return_logprob or batch.has_grammar
                or batch.return_hidden_states_mode != CaptureHiddenMode.NULL)


def keep_rows(batch: ScheduleBatch, keep: list[int]) -> None:
    """``batch.filter_batch(keep_indices=keep)``, without its passes over the kept requests
    where they cannot change anything: when no request of the batch asks for
    log-probabilities, a grammar or hidden states, none of those it keeps does, so the flags
    SGLang recomputes from every kept request stay as they are and only the rows are sliced.
    Otherwise (and for encoder-decoder models, speculative decoding or a beam tail) SGLang's
    own filter runs."""
    if (not _asks_nothing_per_request(batch)
            or batch.model_config.is_encoder_decoder or batch.spec_info is not None
            or batch.beam_tail is not None or not keep or len(keep) == len(batch.reqs)):
        batch.filter_batch(keep_indices=keep)
        return
    on_host, index = _row_index(keep, batch.device)
    batch.reqs = [batch.reqs[i] for i in keep]
    if batch.multimodal_inputs is not None:
        batch.multimodal_inputs = [batch.multimodal_inputs[i] for i in keep]
    batch.req_pool_indices = batch.req_pool_indices[index]
    batch.req_pool_indices_cpu = batch.req_pool_indices_cpu[on_host]
    batch.seq_lens = batch.seq_lens[index]
    batch.orig_seq_lens = batch.orig_seq_lens[index]
    if batch.input_ids is not None:
        batch.input_ids = batch.input_ids[index]
    if batch.seq_lens_cpu is not None:
        batch.seq_lens_cpu = batch.seq_lens_cpu[on_host]
    for name in _UNSET_ON_FILTER:
        setattr(batch, name, None)
    batch.top_logprobs_nums = None
    batch.token_ids_logprobs = None
    batch.return_hidden_states = False
    batch.sampling_info.filter_batch(keep, index)


def _row_index(rows: list[int], device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` as an index tensor on the host and on ``device`` (one tensor where they
    are the same): a host tensor indexes the host copies without converting the list
    again for each, as indexing with the list itself would. Made from the list's machine
    integers (``array``), a third of ``torch.tensor``'s time, which reads each as an object."""
    on_host = torch.frombuffer(array("q", rows), dtype=torch.int64) if rows else torch.empty(0, dtype=torch.int64)
    if is_pin_memory_available(device):
        on_host = on_host.pin_memory()
    return on_host, on_host.to(device, non_blocking=True)


def _sub_batch(scheduler: Any, batch: ScheduleBatch, rows: list[int]) -> ScheduleBatch:
    reqs = [batch.reqs[i] for i in rows]
    plain = _asks_nothing_per_request(batch)
    sub = ScheduleBatch.init_new(
        reqs=[] if plain else reqs,  # plain: the flags SGLang would read from them are unset
        req_to_token_pool=scheduler.req_to_token_pool,
        token_to_kv_pool_allocator=scheduler.token_to_kv_pool_allocator,
        tree_cache=scheduler.tree_cache,
        model_config=scheduler.model_config,
        enable_overlap=scheduler.enable_overlap,
        spec_algorithm=scheduler.spec_algorithm,
    )
    if plain:
        sub.reqs = reqs
        sub.is_prefill_only = all(req.is_prefill_only for req in reqs)
    on_host, index = _row_index(rows, batch.device)
    sub.req_pool_indices = batch.req_pool_indices[index]
    sub.req_pool_indices_cpu = batch.req_pool_indices_cpu[on_host]
    sub.seq_lens = batch.seq_lens[index]
    sub.orig_seq_lens = batch.orig_seq_lens[index]
    sub.seq_lens_cpu = batch.seq_lens_cpu[on_host] if batch.seq_lens_cpu is not None else None
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
