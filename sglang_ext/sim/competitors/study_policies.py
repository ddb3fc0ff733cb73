"""The discrete-event batching study's policies (``shared/seeds/des_batching_study.txt``).

The study's scheduler sees *jobs*; here a request has exactly one job ready at a time: its
prefill (its pending prompt tokens) until the first token, then one decode token, the next
ready when the previous is emitted (the study's "each decode token completion triggers the
next token"). A job *waits* from when it became ready: a prefill from its arrival, a decode
from the end of the step that emitted the previous token, which is when the engine next asks
for a batch (:class:`JobClock` records it; requests carry no last-token time). A step is one
of the study's batches; its *token load* is prefill tokens plus one per decode, the ``b`` of
the study's ``S(b)`` (``sglang_ext.sim.service_curve``). A batch still forming holds the GPU
idle (``BatchDecision.hold_s``: until it would go, or the next arrival). Memory stays the
engine's.

Readings of what the seed leaves open (each tested in ``tests/sim/test_study_policies.py``):

* **fixed-batch** dispatches when the queued token work is ``>= b`` or the oldest job has
  waited ``timeout``, as printed. Unsaid: what the batch holds. We take the oldest jobs
  (by ready time, then arrival) while their tokens fit ``b``, stopping at the first that does
  not (a FCFS queue), the oldest always, even past ``b``: a prefill is one job, never cut (the
  batching experiment has no chunking; "conservation of queued token work").
* **dynamic-batch**: "adjusts its target batch size with queue depth" through "queue-depth
  thresholds", and "dispatches early when the oldest job approaches its waiting-time
  threshold". We read two thresholds ``low`` < ``high`` on the queue depth (jobs queued, one
  per active request) picking the target among a quarter, half and all of the batch size;
  "approaches" as: the oldest job's wait plus the batch's predicted time (the policy's online
  step model) reaches the latency target, so that job finishes by it. The batch is formed as
  fixed-batch's.
* **fcfs-complete** (process-to-completion, decode-prioritised): the oldest request alone,
  its whole prompt in one step ("prefill processes the entire prompt as a single batchable
  unit"), then one decode per step until it finishes; then the next.
* **prefill-first** (chunked prefill under prefill-prioritised batching): "decode work is
  available but delayed by ongoing prefill iterations" while a "prefill backlog" persists,
  so the priority is strict: any pending prefill makes a prefill-only step (the study's
  iterations are prefill or decode, never mixed), chunks FCFS by arrival, each at most
  ``chunk`` tokens, the step at most ``K`` (the last chunk cut to what is left); else a
  decode step of the oldest ``K`` decodes ("the total token load of the batch is capped by a
  global token budget K", decodes included). Several chunks of one step may be partial:
  ``BatchDecision``'s "only the last may be partial" is SGLang's limit, not this engine's.

The study's warm-up discard is the caller's (``benchmarks/sim/batching_study.py``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from operator import attrgetter

from sglang_ext.policy.policies import POLICIES, BatchPolicy, PolicyContext
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.policy.view import BatchDecision, RequestState

STUDY_TOKEN_BUDGET = 128  # the study's K
DEFAULT_DEPTHS = {"low": 4.0, "high": 16.0}  # dynamic-batch's queue-depth thresholds, jobs
_FCFS = attrgetter("ready_s", "arrival_seq")  # oldest ready first, then arrival
CLOCK_SLACK_S = 1e-9  # a wait this close to its limit has reached it (float sums)


@dataclass(frozen=True, slots=True)
class Job:
    """A request's one ready job."""

    req_id: Hashable
    tokens: int  # pending prompt tokens of a prefill; 1 for a decode
    ready_s: float  # when it became ready (engine clock)
    arrival_seq: int
    context: int  # the request's tokens already in KV
    is_prefill: bool


class JobClock:
    """When each request's current job became ready, as a policy called before every step
    sees it: a first prefill at its arrival, any other job when first seen in its state
    (output index, prefill or decode). Forgets requests no longer passed in."""

    __slots__ = ("_since",)

    def __init__(self) -> None:
        self._since: dict[Hashable, tuple[int, bool, float]] = {}

    def jobs(self, requests: Sequence[RequestState], now: float) -> list[Job]:
        """Every request's job, in FCFS order."""
        since: dict[Hashable, tuple[int, bool, float]] = {}
        jobs = []
        for request in requests:
            prefill = request.pending_prefill > 0
            known = self._since.get(request.req_id)
            if known is not None and known[:2] == (request.next_output_index, prefill):
                ready = known[2]
            elif prefill and request.next_output_index == 0:
                ready = request.arrival
            else:
                ready = now
            since[request.req_id] = (request.next_output_index, prefill, ready)
            tokens = request.pending_prefill if prefill else 1
            jobs.append(Job(request.req_id, tokens, ready, request.arrival_seq,
                            request.context, prefill))
        self._since = since
        jobs.sort(key=_FCFS)
        return jobs


def fcfs_batch(jobs: Sequence[Job], token_budget: float) -> list[Job]:
    """The oldest jobs while their tokens fit ``token_budget``; the first always."""
    batch: list[Job] = []
    load = 0
    for job in jobs:
        if batch and load + job.tokens > token_budget:
            break
        batch.append(job)
        load += job.tokens
    return batch


def decision_of(batch: Sequence[Job]) -> BatchDecision:
    return BatchDecision(
        tuple(job.req_id for job in batch if not job.is_prefill),
        tuple((job.req_id, job.tokens) for job in batch if job.is_prefill),
    )


def shape_of(batch: Sequence[Job]) -> StepShape:
    return StepShape.from_requests(
        [(job.tokens, job.context) for job in batch if job.is_prefill],
        [job.context for job in batch if not job.is_prefill],
    )


@POLICIES.register("fixed-batch")
class FixedBatch(BatchPolicy):
    """Fixed-b dispatch with a timeout: a batch goes when the queued token work reaches
    ``b`` or the oldest job has waited ``timeout_ms``; it holds the oldest jobs while they
    fit ``b`` (module docstring). Otherwise the GPU idles (``hold_s``) until the timeout
    fires or a request arrives.

    Tunables: ``b``, the token budget (``fixed-batch@B``, default 128, the middle of the
    study's 32-256 sweep); ``timeout_ms`` (default half the default SLO class's TPOT target,
    so a decode that waited it whole still has half its TPOT for the step).
    """

    name = "fixed-batch"
    takes_token_budget = True
    setting_names = ("timeout_ms",)

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self.token_budget = context.token_budget or STUDY_TOKEN_BUDGET
        self.timeout_s = self.setting_value("timeout_ms", self.token_budget) / 1e3
        self.clock = JobClock()

    @classmethod
    def default_setting(cls, name: str, context: PolicyContext, token_budget: int) -> float:
        if name != "timeout_ms":
            return super().default_setting(name, context, token_budget)
        return context.global_slo.tpot_s * 1e3 / 2

    def form_batch(self, requests: Sequence[RequestState], now: float) -> BatchDecision:
        jobs = self.clock.jobs(requests, now)
        if not jobs:
            return BatchDecision.make_empty()
        queued = sum(job.tokens for job in jobs)
        left_s = self.timeout_s - (now - jobs[0].ready_s)
        if queued < self.token_budget and left_s > CLOCK_SLACK_S:
            return BatchDecision((), (), hold_s=left_s)
        return decision_of(fcfs_batch(jobs, self.token_budget))


@POLICIES.register("dynamic-batch")
class DynamicBatch(BatchPolicy):
    """Dynamic batching: the target batch size follows the queue depth (jobs queued) through
    two thresholds, a quarter of the batch size up to ``low`` jobs, half up to ``high``, all
    of it from ``high`` on; a batch goes when the queued token work reaches the target, or
    early when the oldest job's wait plus the batch's predicted step time reaches
    ``latency_ms`` (the latency guard). The batch is the oldest jobs while they fit the batch
    size (module docstring). Otherwise the GPU idles (``hold_s``) until the guard fires or a
    request arrives.

    Tunables: the batch size in tokens (``dynamic-batch@B``, default 256, the top of the
    study's fixed sweep); ``low`` (default 4 jobs) and ``high`` (default 16 jobs): a depth
    ``<= low`` targets B/4, ``< high`` B/2 (no middle tier when ``low >= high``);
    ``latency_ms`` (default the default class's TPOT target).
    """

    name = "dynamic-batch"
    takes_token_budget = True
    setting_names = ("low", "high", "latency_ms")

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self.token_budget = context.token_budget or 2 * STUDY_TOKEN_BUDGET
        value = {
            name: self.setting_value(name, self.token_budget)
            for name in self.setting_names
        }
        self.low, self.high = value["low"], value["high"]
        self.latency_s = value["latency_ms"] / 1e3
        self.clock = JobClock()

    @classmethod
    def default_setting(cls, name: str, context: PolicyContext, token_budget: int) -> float:
        if name == "latency_ms":
            return context.global_slo.tpot_s * 1e3
        if name in DEFAULT_DEPTHS:
            return DEFAULT_DEPTHS[name]
        return super().default_setting(name, context, token_budget)

    def target_tokens(self, depth: int) -> float:
        """The queued token work that dispatches a batch at queue depth ``depth``."""
        if depth >= self.high:
            return self.token_budget
        if depth > self.low:
            return self.token_budget / 2
        return self.token_budget / 4

    def form_batch(self, requests: Sequence[RequestState], now: float) -> BatchDecision:
        jobs = self.clock.jobs(requests, now)
        if not jobs:
            return BatchDecision.make_empty()
        batch = fcfs_batch(jobs, self.token_budget)
        queued = sum(job.tokens for job in jobs)
        if queued >= self.target_tokens(len(jobs)):
            return decision_of(batch)
        finish = now - jobs[0].ready_s + self.step_model.predict(shape_of(batch))
        left_s = self.latency_s - finish
        if left_s > CLOCK_SLACK_S:
            return BatchDecision((), (), hold_s=left_s)
        return decision_of(batch)


@POLICIES.register("fcfs-complete")
class FcfsToCompletion(BatchPolicy):
    """FCFS process-to-completion: the oldest request alone, its whole pending prompt in one
    step, then one decode per step until it finishes. No tunables."""

    name = "fcfs-complete"

    def form_batch(self, requests: Sequence[RequestState], now: float) -> BatchDecision:
        if not requests:
            return BatchDecision.make_empty()
        head = min(requests, key=lambda request: request.arrival_seq)
        if head.pending_prefill:
            return BatchDecision((), ((head.req_id, head.pending_prefill),))
        return BatchDecision((head.req_id,), ())


@POLICIES.register("prefill-first")
class PrefillFirst(BatchPolicy):
    """Prefill-prioritised batching with chunked prefill under a token budget ``K``: while
    any prefill is pending, a prefill-only step of chunks FCFS by arrival, each at most
    ``chunk`` tokens, the step at most ``K``; otherwise a decode step of the oldest ``K``
    decodes.

    Tunables: ``K`` (``prefill-first@K``, default 128, the study's); ``chunk`` (tokens, default
    ``K``: no cap below the budget; rounded down, at least 1).
    """

    name = "prefill-first"
    takes_token_budget = True
    setting_names = ("chunk",)

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self.token_budget = context.token_budget or STUDY_TOKEN_BUDGET
        chunk = self.setting_value("chunk", self.token_budget)
        self.chunk = max(1, math.floor(chunk))

    @classmethod
    def default_setting(cls, name: str, context: PolicyContext, token_budget: int) -> float:
        if name != "chunk":
            return super().default_setting(name, context, token_budget)
        return float(token_budget)

    def form_batch(self, requests: Sequence[RequestState], now: float) -> BatchDecision:
        prefills = sorted((r for r in requests if r.pending_prefill),
                          key=lambda request: request.arrival_seq)
        if prefills:
            chunks: list[tuple[Hashable, int]] = []
            left = self.token_budget
            for request in prefills:
                if left <= 0:
                    break
                take = min(request.pending_prefill, self.chunk, left)
                chunks.append((request.req_id, take))
                left -= take
            return BatchDecision((), tuple(chunks))
        decodes = sorted(requests, key=lambda request: request.arrival_seq)[:self.token_budget]
        return BatchDecision(tuple(request.req_id for request in decodes), ())
