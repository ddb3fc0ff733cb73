"""Kairos (seed ``kairos.txt``) and its DistServe-like baseline, for the disaggregated mode.

Each policy is one registered name whose instances run on either side of a
prefill/decode split (``sglang_ext.sim.disagg``): a prefill rank's instance only ever
sees requests with prompt tokens pending, a decode rank's only decoding requests, and
``form_batch`` schedules whichever it is given. ``disaggregated = True`` routes every
run of these names to the disaggregated engine. ``NAME@C`` sets the prefill chunk size
``C`` (default SGLang's ``chunked_prefill_size``: 8192 on 60-160 GB GPUs, 4096 below).

- ``kairos-fcfs`` (DistServe as the seed runs it): prefill ranks fill ``C`` tokens a step
  in arrival order, the last request chunked; decode ranks run every admitted decode
  each step (continuous batching).
- ``kairos``: Algorithms 1-2 on prefill ranks (:func:`urgency_chunks`), Algorithm 3 on
  decode ranks (:func:`slack_guided_batch`) over a lookup table built offline from the
  GPU model's noise-free step times (:class:`DecodeStepTable`), as the paper profiles it.
- ``kairos-online`` (our extension, not the paper's offline table): ``kairos`` whose
  table is corrected after every decode step by the historical mean of measured /
  tabled step time in the cell the step falls in (:class:`OnlineDecodeStepTable`;
  Algorithm 3 line 24).

Readings of what the seed leaves open:
- Algorithm 1 ``input_len``: urgency is normalised by the whole prompt (as ``fb-kairos``),
  chunks are filled from the tokens still pending (Algorithm 2's
  ``remaining_prefill_tokens``). Lines 17-18 (``C <- c_used`` after a partial chunk) end
  the selection: the step is ``C`` tokens in urgency order, only the last one partial.
- The prefill throughput ``mu`` (Algorithm 2) starts at the initial step model's
  per-token cost and follows the measured prefill steps by an EWMA (factor 0.1, as
  ``fb-kairos``) of computed tokens / step time.
- Algorithm 3 ``n_gen``: decode tokens generated so far, so ``n_gen + 1`` is the index
  ``j`` of the next token and its slack is ``t_first + j * TPOT - now - LUT[1, seq_len]``
  (Equation 2 with ``T_prefill_finish`` = the first token's time): exactly the max-TPOT
  deadline the metrics score. ``seq_len`` is the tokens in the request's KV (context).
- Line 12 ``LUT[|B u {r}|, r.seq_len]``: the batch's step at its size with every member
  at the longest member's length (``r``: the list is sorted ascending), matching line
  24's ``max seq_len``. The table interpolates bilinearly between its grid points and
  clamps at the grid's edges.
- Line 13's scan continues past a rejected request (as printed); an empty selection
  decodes every request (lines 19-21).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from sglang_ext.policy.policies import POLICIES, PolicyContext
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.policy.variants import KairosPrefillRate, kairos_order
from sglang_ext.policy.view import RequestState
from sglang_ext.sim.competitors.baselines import fifo_prefills
from sglang_ext.sim.decode_step_table import DecodeStepTable
from sglang_ext.sim.disagg_policy import Chunks, DisaggregatedPolicy


def fill_chunks(ordered: Sequence[RequestState], chunk_tokens: int) -> Chunks:
    """``chunk_tokens`` of pending prompt in the given order, only the last request partial
    (Algorithm 1 lines 12-20)."""
    chunks: list[tuple[Hashable, int]] = []
    fifo_prefills(ordered, chunk_tokens, chunks)
    return tuple(chunks)


def urgency_chunks(
    prefills: Sequence[RequestState], now: float, tokens_per_s: float, chunk_tokens: int
) -> Chunks:
    """Algorithms 1-2: FCFS finish-time prediction at ``tokens_per_s``, urgency
    ``(ttft - (finish - arrival)) / ttft / prompt``, descending, then ``chunk_tokens``."""
    ordered = kairos_order([(0.0, r) for r in prefills], now, tokens_per_s)
    return fill_chunks([request for _, request in ordered], chunk_tokens)


@dataclass(eq=False)
class OnlineDecodeStepTable:
    """Our extension: an offline table times, per grid cell, the mean of measured /
    tabled step time over the steps observed in that cell (1 before any)."""

    offline: DecodeStepTable
    _ratio_sum: dict[tuple[int, int], float] = field(default_factory=dict)
    _count: dict[tuple[int, int], int] = field(default_factory=dict)

    def lookup(self, batch: int, seq_len: int) -> float:
        cell = self.offline.cell(batch, seq_len)
        count = self._count.get(cell, 0)
        ratio = self._ratio_sum[cell] / count if count else 1.0
        return self.offline.lookup(batch, seq_len) * ratio

    def update(self, batch: int, max_seq_len: int, measured_s: float) -> None:
        """Algorithm 3 line 24: one measured step of ``batch`` decodes, longest ``max_seq_len``."""
        cell = self.offline.cell(batch, max_seq_len)
        ratio = measured_s / self.offline.lookup(batch, max_seq_len)
        self._ratio_sum[cell] = self._ratio_sum.get(cell, 0.0) + ratio
        self._count[cell] = self._count.get(cell, 0) + 1


def slack_guided_batch(
    decodes: Sequence[RequestState], now: float, lookup: Callable[[int, int], float]
) -> tuple[Hashable, ...]:
    """Algorithm 3 lines 3-21: ids of the decodes to run this step, shortest first."""
    slack_min = min(
        r.slo.tpot_s * r.next_output_index - (now - r.first_token_time) - lookup(1, r.context)
        for r in decodes
    )
    batch: list[Hashable] = []
    current_s = 0.0
    for request in sorted(decodes, key=lambda r: r.context):
        step_s = lookup(len(batch) + 1, request.context)
        faster = not batch or (len(batch) + 1) / step_s > len(batch) / current_s
        if step_s <= slack_min and faster:
            batch.append(request.req_id)
            current_s = step_s
    return tuple(batch) if batch else tuple(r.req_id for r in decodes)


@POLICIES.register("kairos-fcfs")
class KairosFcfs(DisaggregatedPolicy):
    """DistServe as Kairos's evaluation runs it: FCFS chunked prefill, every decode each step."""

    name = "kairos-fcfs"

    def prefill_batch(self, prefills, now):
        return fill_chunks(sorted(prefills, key=lambda r: r.arrival_seq), self.chunk_tokens)

    def decode_batch(self, decodes, now):
        return tuple(r.req_id for r in decodes)


@POLICIES.register("kairos")
class Kairos(KairosPrefillRate, DisaggregatedPolicy):
    """Urgency-ordered prefill (Algorithms 1-2), slack-guided decode (Algorithm 3) over the
    offline table."""

    name = "kairos"

    def prefill_batch(self, prefills, now):
        return urgency_chunks(prefills, now, self.prefill_tokens_per_s, self.chunk_tokens)

    def decode_batch(self, decodes, now):
        if self.decode_table is None:
            raise RuntimeError(f"{self.name}: decode step before the engine gave a decode table")
        return slack_guided_batch(decodes, now, self._lookup)

    def _lookup(self, batch: int, seq_len: int) -> float:
        return self.decode_table.lookup(batch, seq_len)


@POLICIES.register("kairos-online")
class KairosOnline(Kairos):
    """Our extension of ``kairos``: the decode table corrected online from measured steps
    (:class:`OnlineDecodeStepTable`), Algorithm 3 line 24; the paper's ``kairos`` keeps
    the offline table."""

    name = "kairos-online"

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self.online_table: OnlineDecodeStepTable | None = None
        self._longest = 0  # the longest context in the last decode batch formed

    def use_decode_table(self, table: DecodeStepTable) -> None:
        super().use_decode_table(table)
        self.online_table = OnlineDecodeStepTable(table)

    def observe_step(self, shape: StepShape, measured_s: float) -> None:
        super().observe_step(shape, measured_s)
        if shape.prefill_tokens == 0 and shape.decode_requests and self.online_table is not None:
            self.online_table.update(shape.decode_requests, self._longest, measured_s)

    def decode_batch(self, decodes, now):
        batch = super().decode_batch(decodes, now)
        chosen = set(batch)
        self._longest = max(r.context for r in decodes if r.req_id in chosen)
        return batch

    def _lookup(self, batch: int, seq_len: int) -> float:
        return self.online_table.lookup(batch, seq_len)
