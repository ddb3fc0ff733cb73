"""SGLang 0.5.23's own waiting-queue orders, ``--schedule-policy hrrn`` and
``--schedule-policy shortest-prefill-first``, on the Sarathi batch that models its mixed
chunked prefill (every decode, then prompts under the chunk budget).

Both follow ``sglang/srt/managers/schedule_policy.py``:

- **hrrn** (highest response ratio next, token-based aging). The scheduler counts the
  prompt tokens of every step it launches; a request snapshots the count when it joins
  the waiting queue, and the queue is sorted by ``(count - snapshot) / uncached tokens``,
  highest first, ties by request id (a random order here, as SGLang's ids are random).
  With more than 128 waiting requests SGLang skips the sort (FCFS: the queue keeps its
  last order, new arrivals at its end).
- **shortest-prefill-first**: the queue sorted by uncached prompt tokens, then by when
  each joined it; the continuing chunk is capped so that the shorter waiting prompts
  (each shorter than its remainder) fit in the same step, and no other prompt is cut
  while the chunked one does not finish in this step.

Simplified as the other Sarathi models: no prefix cache (uncached = the whole prompt, a
retracted request's recompute included), page size 1, no in-batch prefix deduplication.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from sglang_ext.policy.policies import POLICIES, PolicyContext
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.policy.view import BatchDecision, RequestState
from sglang_ext.sim.competitors.baselines import (
    Sarathi,
    SarathiQueueTimeout,
    ShortestFirst,
    fifo_prefills,
)

#: above this many waiting requests SGLang's hrrn does not sort (schedule_policy.py)
WAITING_QUEUE_PREFIX_MATCH_MAX = 128
_GOLDEN = 0x9E3779B1


def _random_tie(request: RequestState) -> int:
    """A fixed pseudo-random order of requests, standing in for SGLang's random ids."""
    return (request.arrival_seq * _GOLDEN) & 0xFFFFFFFF


class ResponseRatioFirst:
    """The hrrn order (module docstring); a mixin over :class:`Sarathi`."""

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)  # type: ignore[call-arg]
        self._prefill_tokens_launched = 0
        self._snapshot: dict[Hashable, int] = {}
        self._last_rank: dict[Hashable, int] = {}
        self._sorting = True

    def observe_step(self, shape: StepShape, measured_s: float) -> None:
        super().observe_step(shape, measured_s)  # type: ignore[misc]
        self._prefill_tokens_launched += shape.prefill_tokens

    def form_batch(self, requests: Sequence[RequestState], now: float) -> BatchDecision:
        counter, snapshot = self._prefill_tokens_launched, self._snapshot
        waiting = [r for r in requests if r.context == 0 and r.pending_prefill > 0]
        for request in waiting:
            snapshot.setdefault(request.req_id, counter)
        if len(snapshot) > 4 * max(len(requests), 64):
            live = {r.req_id for r in requests}
            self._snapshot = snapshot = {k: v for k, v in snapshot.items() if k in live}
        self._sorting = len(waiting) <= WAITING_QUEUE_PREFIX_MATCH_MAX
        decision = super().form_batch(requests, now)  # type: ignore[misc]
        if self._sorting:
            order = sorted(waiting, key=self.prefill_order)
            self._last_rank = {r.req_id: i for i, r in enumerate(order)}
        return decision

    def prefill_order(self, request: RequestState) -> tuple:
        if request.context > 0:
            return (False, 0.0, 0, request.arrival_seq)
        if not self._sorting:
            rank = self._last_rank.get(request.req_id)
            return (True, 0.0, rank if rank is not None else len(self._last_rank), request.arrival_seq)
        waited = self._prefill_tokens_launched - self._snapshot.get(request.req_id, 0)
        return (True, -max(0, waited) / max(1, request.pending_prefill), _random_tie(request), 0)


@POLICIES.register("sarathi-hrrn")
class SarathiHrrn(ResponseRatioFirst, Sarathi):
    """Sarathi with SGLang's ``--schedule-policy hrrn`` waiting order (module docstring);
    swept as ``sarathi-hrrn@BUDGET``."""

    name = "sarathi-hrrn"


@POLICIES.register("sarathi-hrrn-queue-timeout")
class SarathiHrrnQueueTimeout(ResponseRatioFirst, SarathiQueueTimeout):
    """``sarathi-hrrn`` plus SGLang's waiting-queue timeout, exactly as
    ``sarathi-queue-timeout`` (``sarathi-hrrn-queue-timeout@BUDGET,timeout=SECONDS``)."""

    name = "sarathi-hrrn-queue-timeout"


class ShortestPrefillFirst(ShortestFirst):
    """SGLang's ``shortest-prefill-first`` batch (module docstring); a mixin over
    :class:`Sarathi` that replaces its prompt packing."""

    def form_batch(self, requests: Sequence[RequestState], now: float) -> BatchDecision:
        decodes = tuple(r.req_id for r in requests if r.pending_prefill == 0)
        prefills = sorted((r for r in requests if r.pending_prefill > 0), key=self.prefill_order)
        continuing = [r for r in prefills if r.context > 0]
        waiting = [r for r in prefills if r.context == 0]
        budget = self.token_budget - len(decodes)  # type: ignore[attr-defined]
        chunks: list[tuple[Hashable, int]] = []
        in_flight = False  # a chunked prompt that does not finish this step
        if continuing and budget > 0:
            chunked = continuing[0]
            limit = budget
            if budget >= 2:
                reserved = 0
                for request in waiting:
                    work = max(1, request.pending_prefill)
                    if work >= chunked.pending_prefill or reserved + work > budget - 1:
                        break
                    reserved += work
                limit = budget - reserved if reserved else budget
            take = min(chunked.pending_prefill, limit)
            chunks.append((chunked.req_id, take))
            budget -= take
            in_flight = take < chunked.pending_prefill
            budget = fifo_prefills(continuing[1:], budget, chunks)
        for request in waiting:
            if budget <= 0:
                break
            if in_flight and request.pending_prefill > budget:
                break  # one chunked request at a time
            take = min(request.pending_prefill, budget)
            chunks.append((request.req_id, take))
            budget -= take
        return BatchDecision(decodes, tuple(chunks))


@POLICIES.register("sarathi-spf")
class SarathiSpf(ShortestPrefillFirst, Sarathi):
    """Sarathi with SGLang's ``--schedule-policy shortest-prefill-first`` (module
    docstring); swept as ``sarathi-spf@BUDGET``."""

    name = "sarathi-spf"


@POLICIES.register("sarathi-spf-queue-timeout")
class SarathiSpfQueueTimeout(SarathiQueueTimeout, SarathiSpf):
    """``sarathi-spf`` plus SGLang's waiting-queue timeout, exactly as
    ``sarathi-queue-timeout`` (``sarathi-spf-queue-timeout@BUDGET,timeout=SECONDS``)."""

    name = "sarathi-spf-queue-timeout"
