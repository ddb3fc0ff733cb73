"""The batch formation users run today, as simulator policies.

Each reproduces the *decision rule* of its system; memory admission and preemption
are the engine's (SGLang-style) for every policy alike, and scheduler CPU time is in
the GPU profile's per-step overhead. Simplifications are listed per policy.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from operator import attrgetter

from sglang_ext.policy.policies import POLICIES, BatchPolicy, PolicyContext
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.policy.view import BatchDecision, RequestState

_arrival_order = attrgetter("arrival_seq")


def fifo_prefills(
    prefills: Sequence[RequestState], token_budget: int, chunks: list[tuple[Hashable, int]]
) -> int:
    """Append chunks in the given order until ``token_budget`` is spent; returns what is left."""
    for request in prefills:
        if token_budget <= 0:
            break
        take = min(request.pending_prefill, token_budget)
        chunks.append((request.req_id, take))
        token_budget -= take
    return token_budget


@POLICIES.register("sglang-default")
class SglangDefault(BatchPolicy):
    """SGLang 0.5.23 defaults: prefill-first, mixed chunk off.

    Whenever a prefill is queued, the step is a prefill-only batch: the chunked
    request continues first, then the waiting queue in FCFS order, up to
    ``chunked_prefill_size`` tokens (8192 on 60-160 GB GPUs, 4096 below 60 GB; the
    last request admitted is chunked) and ``max_prefill_tokens`` (16384) in all.
    Otherwise every running request decodes.
    Simplified: no radix-cache prefix reuse (the trace has no prompt text), no
    ``new_token_ratio`` decode-memory reservation, page size 1.
    """

    name = "sglang-default"
    max_prefill_tokens = 16384

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self.chunked_prefill_size = 8192 if context.gpu_memory_gb >= 60 else 4096

    def form_batch(self, requests: Sequence[RequestState], now: float) -> BatchDecision:
        prefills = [r for r in requests if r.pending_prefill > 0]
        if prefills:
            prefills.sort(key=lambda r: (r.context == 0, r.arrival_seq))
            chunks: list[tuple[Hashable, int]] = []
            fifo_prefills(prefills, min(self.chunked_prefill_size, self.max_prefill_tokens), chunks)
            return BatchDecision((), tuple(chunks))
        return BatchDecision(tuple(r.req_id for r in requests), ())


@POLICIES.register("vllm-default")
class VllmDefault(BatchPolicy):
    """vLLM v1 defaults: no phases, running requests first, then waiting, FCFS.

    Each step has ``max_num_batched_tokens`` = 8192: every running request gets its
    next tokens (one for a decode, the rest of its prompt for a partial prefill, cut
    at the budget), in arrival order; then waiting requests are admitted FCFS, the
    last one chunked to the budget left, up to ``max_num_seqs`` (1024 on >= 70 GB
    GPUs, else 256) running requests. Simplified: no prefix caching, preemption by the
    engine's SGLang-style rule rather than vLLM's last-in-first-preempted.
    """

    name = "vllm-default"
    token_budget = 8192

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self.max_num_seqs = 1024 if context.gpu_memory_gb >= 70 else 256

    def form_batch(self, requests: Sequence[RequestState], now: float) -> BatchDecision:
        running = sorted((r for r in requests if r.context > 0), key=_arrival_order)
        waiting = sorted((r for r in requests if r.context == 0), key=_arrival_order)
        budget = self.token_budget
        decodes: list[Hashable] = []
        chunks: list[tuple[Hashable, int]] = []
        for request in running:
            if budget <= 0:
                break
            if request.pending_prefill == 0:
                decodes.append(request.req_id)
                budget -= 1
            else:
                take = min(request.pending_prefill, budget)
                chunks.append((request.req_id, take))
                budget -= take
        room = max(0, self.max_num_seqs - len(running))
        fifo_prefills(waiting[:room], budget, chunks)
        return BatchDecision(tuple(decodes), tuple(chunks))


@POLICIES.register("sarathi")
class Sarathi(BatchPolicy):
    """Sarathi-Serve stall-free batching: decode-first under a token budget.

    Every decode runs every step (stall-free), then partial prefills continue, then
    waiting requests are admitted FCFS, chunked to the tokens the decodes left (that
    order is :meth:`prefill_order`, which ``sarathi-sjf`` and ``sarathi-priority``
    override). The budget is the tuned hyper-parameter: swept as ``sarathi@BUDGET``.

    Decodes run past the budget: with more decodes than budget tokens every decode still
    runs and no prefill does. That is Sarathi-Serve's stall-free rule (a decode is never
    delayed by the budget); vLLM's scheduler instead stops at ``max_num_batched_tokens``
    and leaves the rest of the decodes waiting at tiny budgets. We keep Sarathi's rule:
    it is the better baseline for TPOT, and where the two differ (budget below the decode
    batch) neither admits any prefill, so it cannot flatter FairBatching's ratios.
    """

    name = "sarathi"
    takes_token_budget = True

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self.token_budget = context.token_budget or 512

    @staticmethod
    def prefill_order(request: RequestState) -> tuple:
        """The sort key of the prompts in prefill (the one seam the ordered variants
        override): partly prefilled first, then waiting requests FCFS."""
        return (request.context == 0, request.arrival_seq)

    def form_batch(self, requests: Sequence[RequestState], now: float) -> BatchDecision:
        decodes = tuple(r.req_id for r in requests if r.pending_prefill == 0)
        prefills = sorted((r for r in requests if r.pending_prefill > 0), key=self.prefill_order)
        chunks: list[tuple[Hashable, int]] = []
        fifo_prefills(prefills, self.token_budget - len(decodes), chunks)
        return BatchDecision(decodes, tuple(chunks))


def prefill_tokens_per_s(context: PolicyContext, token_budget: int) -> float:
    """Prefill throughput at a chunk of ``token_budget`` tokens, from the rank's offline
    step-model fit (what a user measures on their GPU before sizing a queue cap)."""
    chunk = StepShape.from_requests([(token_budget, 0)])
    return token_budget / context.initial_step_model.usable().predict_step(chunk)


@POLICIES.register("sarathi-queue-cap")
class SarathiQueueCap(Sarathi):
    """Sarathi plus vLLM's queued-token admission rule (``--max-num-queued-tokens``): an
    arrival is rejected while the prompt tokens of requests still in prefill (a partly
    prefilled prompt counted whole) exceed ``cap``.

    ``cap`` defaults to vLLM's sizing advice, target TTFT x prefill throughput at the
    budget; sweeps tune it (``sarathi-queue-cap@BUDGET,cap=TOKENS``).
    """

    name = "sarathi-queue-cap"
    setting_names = ("cap",)

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self.cap = self.setting_value("cap", self.token_budget)

    @classmethod
    def default_setting(cls, name: str, context: PolicyContext, token_budget: int) -> float:
        if name != "cap":
            return super().default_setting(name, context, token_budget)
        return default_queue_cap(context, token_budget)

    def admit(
        self, requests: Sequence[RequestState], now: float, prompt_tokens: int, slo: Slo,
        arrival: float | None = None,
    ) -> bool:
        queued = sum(r.prompt_tokens for r in requests if r.pending_prefill > 0)
        return queued <= self.cap


def default_queue_cap(context: PolicyContext, token_budget: int) -> float:
    return context.global_slo.ttft_s * prefill_tokens_per_s(context, token_budget)


@POLICIES.register("sarathi-queue-timeout")
class SarathiQueueTimeout(Sarathi):
    """Sarathi plus SGLang's waiting-queue timeout (``SGLANG_REQ_WAITING_TIMEOUT``): a
    request still queued (no prompt token computed yet) ``timeout`` seconds after it
    arrived is aborted. Defaults to the TTFT target; sweeps tune it
    (``sarathi-queue-timeout@BUDGET,timeout=SECONDS``)."""

    name = "sarathi-queue-timeout"
    setting_names = ("timeout",)

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self.timeout_s = self.setting_value("timeout", self.token_budget)

    @classmethod
    def default_setting(cls, name: str, context: PolicyContext, token_budget: int) -> float:
        if name != "timeout":
            return super().default_setting(name, context, token_budget)
        return context.global_slo.ttft_s

    def form_batch(self, requests: Sequence[RequestState], now: float) -> BatchDecision:
        expired = tuple(
            r.req_id for r in requests
            if r.context == 0 and r.next_output_index == 0 and now - r.arrival > self.timeout_s
        )
        if not expired:
            return super().form_batch(requests, now)
        gone = set(expired)
        decision = super().form_batch([r for r in requests if r.req_id not in gone], now)
        return BatchDecision(decision.decode_ids, decision.prefill_chunks, abort_ids=expired)


# ----------------------------------------------------------- ordered waiting queues
# Length- and class-aware admission orders on the same Sarathi batch: each mixin only
# overrides ``Sarathi.prefill_order``; the decodes, the budget, vLLM's queued-token cap
# and SGLang's waiting timeout are those of the FCFS policies above, and so are their
# settings, defaults and tuning axes (``sglang_ext.sim.fitting.tuning``).


class ShortestFirst:
    """Waiting prompts admitted shortest-first: by prompt tokens not yet computed (a
    retracted request's recompute included), ties by arrival; a partly prefilled prompt
    continues first (in arrival order), as SGLang's chunked request does.

    Models a shortest-uncached-prefill-first waiting queue (an ``sjf`` ``--schedule-policy``,
    in SGLang builds that have one; vLLM's ``--scheduling-policy priority`` with each
    request's priority set to its prompt length). Simplified: no prefix cache, so the
    uncached part is the whole prompt; no preemption of running requests for a shorter
    arrival (memory retraction stays the engine's rule); no ageing, so a long prompt can
    wait indefinitely under load.
    """

    @staticmethod
    def prefill_order(request: RequestState) -> tuple:
        waiting = request.context == 0
        return (waiting, request.pending_prefill if waiting else 0, request.arrival_seq)


class TightestClassFirst:
    """Waiting prompts ordered by SLO class, tightest first: the smaller TTFT target, ties
    by the smaller TPOT target (an end-to-end class by its envelope's first-token budget
    and pace), then arrival; a partly prefilled prompt continues first (in arrival order).

    Models SGLang's ``--enable-priority-scheduling`` and vLLM's ``--scheduling-policy
    priority`` with the request's SLO class as its priority. Simplified: the priority is
    derived from the SLO targets, not sent by the client; no preemption: SGLang (above
    ``--priority-scheduling-preemption-threshold``) and vLLM (on a KV shortage, lowest
    priority first) evict running requests of a looser class, ours never does (memory
    retraction stays the engine's rule, whatever the class); no ageing.
    """

    @staticmethod
    def prefill_order(request: RequestState) -> tuple:
        if request.context > 0:
            return (False, 0.0, 0.0, request.arrival_seq)
        return (True, request.slo.ttft_s, request.slo.tpot_s, request.arrival_seq)


@POLICIES.register("sarathi-sjf")
class SarathiSjf(ShortestFirst, Sarathi):
    """Sarathi with a shortest-first waiting queue (:class:`ShortestFirst`: shortest uncached
    prefill first, vLLM's priority scheduling with priority = prompt length).
    Everything else, and the simplifications, as ``sarathi``; swept as
    ``sarathi-sjf@BUDGET``."""

    name = "sarathi-sjf"


@POLICIES.register("sarathi-sjf-queue-cap")
class SarathiSjfQueueCap(ShortestFirst, SarathiQueueCap):
    """``sarathi-sjf`` plus vLLM's queued-token cap (``--max-num-queued-tokens``), exactly
    as ``sarathi-queue-cap``: same rule, default cap and tuning
    (``sarathi-sjf-queue-cap@BUDGET,cap=TOKENS``). The cap counts prompt tokens whatever
    the order, so it refuses the same arrivals; only who is served first differs."""

    name = "sarathi-sjf-queue-cap"


@POLICIES.register("sarathi-sjf-queue-timeout")
class SarathiSjfQueueTimeout(ShortestFirst, SarathiQueueTimeout):
    """``sarathi-sjf`` plus SGLang's waiting-queue timeout (``SGLANG_REQ_WAITING_TIMEOUT``),
    exactly as ``sarathi-queue-timeout``: same rule, default and tuning
    (``sarathi-sjf-queue-timeout@BUDGET,timeout=SECONDS``). Under load the long prompts
    the order leaves behind are the ones that time out."""

    name = "sarathi-sjf-queue-timeout"


@POLICIES.register("sarathi-priority")
class SarathiPriority(TightestClassFirst, Sarathi):
    """Sarathi with waiting prompts ordered by SLO class, tightest first
    (:class:`TightestClassFirst`: SGLang's ``--enable-priority-scheduling``, vLLM's
    priority scheduling, with the class as the priority; no preemption). Everything else,
    and the simplifications, as ``sarathi``; with one SLO class it is ``sarathi``. Swept as
    ``sarathi-priority@BUDGET``."""

    name = "sarathi-priority"


@POLICIES.register("sarathi-priority-queue-cap")
class SarathiPriorityQueueCap(TightestClassFirst, SarathiQueueCap):
    """``sarathi-priority`` plus vLLM's queued-token cap (``--max-num-queued-tokens``),
    exactly as ``sarathi-queue-cap`` (one cap for every class, from the default class's
    TTFT; ``sarathi-priority-queue-cap@BUDGET,cap=TOKENS``)."""

    name = "sarathi-priority-queue-cap"


@POLICIES.register("sarathi-priority-queue-timeout")
class SarathiPriorityQueueTimeout(TightestClassFirst, SarathiQueueTimeout):
    """``sarathi-priority`` plus SGLang's waiting-queue timeout
    (``SGLANG_REQ_WAITING_TIMEOUT``), exactly as ``sarathi-queue-timeout`` (one timeout for
    every class, default the default class's TTFT;
    ``sarathi-priority-queue-timeout@BUDGET,timeout=SECONDS``)."""

    name = "sarathi-priority-queue-timeout"
