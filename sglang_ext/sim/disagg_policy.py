"""What a policy of the disaggregated mode (``sglang_ext.sim.disagg``) implements."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from sglang_ext.policy.policies import BatchPolicy, PolicyContext
from sglang_ext.policy.view import BatchDecision, RequestState
from sglang_ext.sim.decode_step_table import DecodeStepTable

Chunks = tuple[tuple[Hashable, int], ...]  # (req_id, prompt tokens) of one prefill step


def default_chunk_tokens(gpu_memory_gb: float) -> int:
    """SGLang's ``chunked_prefill_size`` default: 8192 on 60-160 GB GPUs, 4096 below."""
    return 8192 if gpu_memory_gb >= 60 else 4096


class DisaggregatedPolicy(BatchPolicy):
    """A policy of the disaggregated mode: prefill ranks get :meth:`prefill_batch`, decode
    ranks :meth:`decode_batch`; the engine gives it the decode step table it runs on."""

    disaggregated = True
    takes_token_budget = True  # the prefill chunk size C

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self.chunk_tokens = context.token_budget or default_chunk_tokens(context.gpu_memory_gb)
        self.decode_table: DecodeStepTable | None = None

    def use_decode_table(self, table: DecodeStepTable) -> None:
        """Called by the engine before the first step, with the offline table of its GPU."""
        self.decode_table = table

    def form_batch(self, requests: Sequence[RequestState], now: float) -> BatchDecision:
        prefills = [r for r in requests if r.pending_prefill]
        if prefills:
            return BatchDecision((), self.prefill_batch(prefills, now))
        if not requests:
            return BatchDecision.make_empty()
        return BatchDecision(self.decode_batch(requests, now), ())

    def prefill_batch(self, prefills: Sequence[RequestState], now: float) -> Chunks:
        raise NotImplementedError

    def decode_batch(self, decodes: Sequence[RequestState], now: float) -> tuple[Hashable, ...]:
        raise NotImplementedError
