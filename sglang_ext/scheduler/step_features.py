"""The step model's features of an SGLang batch, as the simulator defines them:
new tokens, the prompt part of them, and the KV tokens already present (context)."""

from __future__ import annotations

from typing import Any, NamedTuple


class StepFeatures(NamedTuple):
    new_tokens: int
    prefill_tokens: int
    context: int
    decode_requests: int


def step_features(batch: Any) -> StepFeatures:
    mode = batch.forward_mode
    if mode is not None and mode.is_extend():
        decoding = len(batch.decoding_reqs or ())
        new_tokens = int(sum(batch.extend_lens))
        return StepFeatures(new_tokens, new_tokens - decoding, int(sum(batch.prefix_lens)), decoding)
    if mode is not None and mode.is_decode():
        requests = len(batch.reqs)
        seq_lens = batch.seq_lens_cpu
        total = int(seq_lens.sum()) if seq_lens is not None else sum(r.seqlen for r in batch.reqs)
        return StepFeatures(requests, 0, max(0, total - requests), requests)
    return StepFeatures(0, 0, 0, 0)
