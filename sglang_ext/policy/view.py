"""What a batch policy sees of a request, and what it decides for one step.

Policies read requests through the :class:`RequestState` protocol so an engine can
hand over its own objects without copying (the simulator does); adapters that have no
such object build a frozen :class:`RequestView`. A policy never sees output lengths.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

from sglang_ext.policy.slo import Slo


class RequestState(Protocol):
    @property
    def req_id(self) -> Hashable: ...
    @property
    def arrival(self) -> float: ...  # seconds, the engine's clock
    @property
    def slo(self) -> Slo: ...
    @property
    def next_output_index(self) -> int: ...  # j of the next token to emit (0 = first token)
    @property
    def pending_prefill(self) -> int: ...  # prompt (or recompute) tokens not yet in KV; 0 = decoding
    @property
    def context(self) -> int: ...  # tokens of this request already in the KV cache
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def arrival_seq(self) -> int: ...  # arrival order, for FIFO baselines
    @property
    def first_token_time(self) -> float | None: ...  # when token 0 was emitted; None before


@dataclass(frozen=True, slots=True)
class RequestView:
    req_id: Hashable
    arrival: float
    slo: Slo
    next_output_index: int
    pending_prefill: int
    context: int
    prompt_tokens: int
    arrival_seq: int = 0
    first_token_time: float | None = None


@dataclass(frozen=True, slots=True)
class BatchDecision:
    """One step's batch. Mutates nothing; the engine realises it."""

    # requests that decode one token this step, in priority order
    decode_ids: tuple[Hashable, ...]
    # (req_id, prompt tokens to compute this step) in admission order; only the last may be partial
    prefill_chunks: tuple[tuple[Hashable, int], ...]
    # the policy's predicted step time in seconds (0.0 when it has no step model)
    predicted_step_s: float = 0.0
    # the time budget the step was formed under, seconds; None for token-budget policies
    time_budget_s: float | None = None
    # requests the policy ends before the step (a queue timeout); engines abort them
    abort_ids: tuple[Hashable, ...] = ()
    # > 0: the GPU idles on purpose this many seconds (a batch still forming), unless a
    # request arrives first; an engine runs nothing instead of its fallback for an empty batch
    hold_s: float = 0.0

    @classmethod
    def make_empty(cls) -> BatchDecision:
        return cls((), ())

    @property
    def is_empty(self) -> bool:
        return not self.decode_ids and not self.prefill_chunks and not self.abort_ids

    @property
    def new_tokens(self) -> int:
        return len(self.decode_ids) + sum(n for _, n in self.prefill_chunks)
