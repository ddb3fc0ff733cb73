"""A single simulated rank in virtual time: one scheduler, one GPU model, one KV pool.

The GPU is the profile's (``sglang_ext.sim.service_curve.make_gpu``): the roofline, or the
batching study's service curve for a profile with a ``[service]`` table.

Steppable: ``submit`` a request when it arrives, ``advance_to(t)`` runs every step
that starts before ``t`` (a step in flight at ``t`` finishes first, as on a GPU),
``drain_tokens`` returns emitted tokens, ``prefill_admission_budget`` the rank's
current PAB, ``abort`` drops a request. The policy sees requests through
:class:`SimRequest`, which carries no output length; it learns step times only from
the noisy measured steps.

Output lengths are learnt as a scheduler could: per task (the request's SLO class, or
its SLO when it names none) a Gaussian fitted online to the finished requests
(``sglang_ext.policy.output_length``). Each request carries its task and the estimate
at its arrival; an end-to-end SLO's token envelope is paced for the estimate's mean
(``Slo.with_expected_output``), and the record keeps that envelope.

Memory follows SGLang: KV is allocated as tokens are computed; a new prefill starts
only when its whole prompt and all its outputs fit beside the unfinished prefills and
what the decoding requests reserve for their remaining outputs
(``sglang_ext.sim.output_reserve``; a step whose prefills are all blocked this way runs
every decode instead, or with none, continues the started prefills); when decodes cannot
grow, requests are retracted (fewest outputs first, then longest prompt) and later
recomputed from prompt + emitted tokens, counted as ``recomputed_tokens``.
A held decision (``BatchDecision.hold_s``: a batch still forming) idles instead: until the
hold ends or the caller's horizon (``advance_to``'s target, ``run_until_idle``'s deadline),
whichever is first; one tick when ``step`` is called without a horizon.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable
from dataclasses import dataclass

from sglang_ext.policy.admission import (
    AdmissionMode,
    AdmissionRule,
    KvOutlook,
    last_token_due,
    release_time,
)
from sglang_ext.policy.output_length import OutputEstimate, OutputLengthModel
from sglang_ext.policy.policies import BatchPolicy
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.policy.view import BatchDecision
from sglang_ext.sim.metrics import RequestRecord
from sglang_ext.sim.output_reserve import NewTokenRatio, reserved_outputs
from sglang_ext.sim.profile import HardwareProfile
from sglang_ext.sim.service_curve import make_gpu

IDLE_TICK_S = 1e-3
MIN_HOLD_S = 1e-6  # a held idle period is at least this long (the clock always moves)


class SimRequest:
    """The scheduler-visible state of one request (implements ``RequestState``)."""

    __slots__ = (
        "req_id", "arrival", "slo", "prompt_tokens", "arrival_seq",
        "next_output_index", "pending_prefill", "context", "first_token_time",
        "task", "output_estimate",
    )

    def __init__(self, req_id: Hashable, arrival: float, slo: Slo, prompt_tokens: int, seq: int,
                 task: Hashable = None, output_estimate: OutputEstimate | None = None):
        self.req_id = req_id
        self.task = slo if task is None else task  # what output lengths are learnt per
        self.output_estimate = output_estimate  # the task's output length at arrival
        self.arrival = arrival
        self.slo = slo
        self.prompt_tokens = prompt_tokens
        self.arrival_seq = seq
        self.next_output_index = 0
        self.pending_prefill = prompt_tokens
        self.context = 0
        self.first_token_time: float | None = None

    def __repr__(self) -> str:
        return (
            f"SimRequest({self.req_id!r}, next={self.next_output_index}, "
            f"pending={self.pending_prefill}, context={self.context})"
        )


@dataclass(frozen=True, slots=True)
class TokenEvent:
    req_id: Hashable
    index: int  # 0 = first output token
    time_s: float
    finished: bool


@dataclass(frozen=True, slots=True)
class StepRecord:
    start_s: float
    duration_s: float
    predicted_s: float
    new_tokens: int
    context: int
    decodes: int
    prefill_tokens: int
    shape: StepShape | None = None  # what the step computed, as the step model reads it


class SimEngine:
    def __init__(
        self,
        profile: HardwareProfile,
        policy: BatchPolicy,
        *,
        seed: int = 0,
        record_tokens: bool = False,
        record_steps: bool = False,
        check_invariants: bool = False,
    ) -> None:
        self.profile = profile
        self.policy = policy
        self.gpu = make_gpu(profile, seed)
        self.kv_capacity = profile.kv_capacity_tokens
        self.now = 0.0
        self.records: dict[Hashable, RequestRecord] = {}
        self.steps = 0
        self.busy_s = 0.0
        self.idle_ticks = 0
        self.step_log: list[StepRecord] = []
        self._active: list[SimRequest] = []
        self._by_id: dict[Hashable, SimRequest] = {}
        self._output_target: dict[Hashable, int] = {}
        self.output_lengths = OutputLengthModel()
        self._kv_used = 0
        self.new_token_ratio = NewTokenRatio()
        self.retractions = 0
        self._seq = 0
        self._events: list[TokenEvent] = []
        self._record_tokens = record_tokens
        self._record_steps = record_steps
        self._check = check_invariants
        # the KV outlook is built where the policy reads it, as the scheduler builds it
        # under the edf rule: at arrivals under reject (the forecast), and every step under
        # reject or defer (defer's hopeless prefills; fb-smooth's fallback)
        admission = policy.admission
        self._admission_mode = admission.mode if admission.rule is AdmissionRule.EDF else None

    # ---------------------------------------------------------------- interface
    @property
    def has_work(self) -> bool:
        return bool(self._active)

    @property
    def kv_used(self) -> int:
        return self._kv_used

    @property
    def active_requests(self) -> tuple[SimRequest, ...]:
        return tuple(self._active)

    def submit(
        self, req_id: Hashable, arrival: float, prompt_tokens: int, output_tokens: int, slo: Slo,
        slo_class: str | None = None,
    ) -> bool:
        """A request arrives; returns whether it was admitted (rejections are recorded).

        An arrival later than the engine's clock first advances the clock to it, so a
        request is never scheduled before it exists. ``slo_class`` names the request's
        class (its task) for per-class metrics and output-length learning."""
        if req_id in self.records:
            raise ValueError(f"request id {req_id!r} was already submitted")
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError(f"request {req_id!r}: prompt and output must be >= 1 token")
        if arrival > self.now:
            self.advance_to(arrival)
        task = slo if slo_class is None else slo_class
        estimate = self.output_lengths.estimate(task)
        slo = slo.with_expected_output(estimate.expected_tokens)
        record = RequestRecord(req_id, arrival, slo, prompt_tokens, output_tokens, slo_class)
        self.records[req_id] = record
        too_long = prompt_tokens + output_tokens > self.kv_capacity
        if not too_long and self._admission_mode is AdmissionMode.REJECT:
            self._share_kv_outlook()
        if (
            too_long
            or self.policy.refusal(slo) is not None
            or not self.policy.admit(self._active, self.now, prompt_tokens, slo, arrival)
        ):
            record.rejected = True
            return False
        request = SimRequest(req_id, arrival, slo, prompt_tokens, self._seq, task, estimate)
        self._seq += 1
        self._active.append(request)
        self._by_id[req_id] = request
        self._output_target[req_id] = output_tokens
        return True

    def advance_to(self, time_s: float) -> None:
        """Run every step that starts before ``time_s``; idle time jumps to it."""
        while self.now < time_s:
            if not self._active:
                self.now = time_s
                self.new_token_ratio.reset()
                return
            self.step(time_s)

    def run_until_idle(self, deadline_s: float) -> None:
        while self._active and self.now < deadline_s:
            self.step(deadline_s)

    def drain_tokens(self) -> list[TokenEvent]:
        events, self._events = self._events, []
        return events

    def kv_outlook(self) -> KvOutlook:
        """The pool as the admission forecast sees it, by this engine's own rule: a prefill
        starts when its prompt and all its outputs fit beside what the active requests
        hold and what the decoding ones reserve for their remaining outputs (SGLang's
        reservation, ``sglang_ext.sim.output_reserve``), and a decoding request gives both
        back when its last token is due, or sooner at the step cadence
        (``release_time``). The engine knows output lengths as SGLang knows
        ``max_new_tokens``; the policy gets sums, never a request's length: a queued
        prompt is expected to reserve the median of what the active ones reserved at
        their arrival."""
        cadence = min((request.slo.tpot_s for request in self._active), default=0.0)
        ratio = self.new_token_ratio.current
        free = float(self.kv_capacity - self._kv_used)
        releases = []
        initial = []
        for request in self._active:
            target = self._output_target[request.req_id]
            initial.append(reserved_outputs(target))
            if request.pending_prefill:
                continue
            left = target - request.next_output_index
            reserve = reserved_outputs(left, ratio)
            free -= reserve
            due = last_token_due(request, target)
            releases.append((release_time(due, self.now, left, cadence), request.context + reserve))
        new_reserve = statistics.median(initial) if initial else 0.0
        return KvOutlook.of(free, releases, new_reserve=new_reserve)

    def _share_kv_outlook(self) -> None:
        self.policy.observe_kv(self.kv_outlook())

    def prefill_admission_budget(self) -> float:
        return self.policy.prefill_admission_budget(self._active, self.now)

    def abort(self, req_id: Hashable) -> bool:
        """Drop an active request and release its KV (``records[req_id].aborted``);
        False when it is not active (unknown, rejected, finished or already aborted)."""
        request = self._by_id.get(req_id)
        if request is None:
            return False
        self._abort(request)
        return True

    # ---------------------------------------------------------------- one step
    def step(self, horizon_s: float | None = None) -> None:
        """Run one step of the policy's batch (or idle); ``horizon_s``: when the caller next
        needs the engine (an arrival), which ends a held idle period."""
        if self._admission_mode in (AdmissionMode.DEFER, AdmissionMode.REJECT):
            self._share_kv_outlook()  # every decision, as the scheduler does (forecasts_kv)
        decision = self.policy.form_batch(self._active, self.now)
        for req_id in decision.abort_ids:
            request = self._by_id.get(req_id)
            if request is None:
                raise RuntimeError(f"{self.policy.name}: invalid abort of {req_id!r}")
            self._abort(request)
        retractions = self.retractions
        decodes, chunks = self._validated(decision)
        decodes = self._reserve_decode_memory(decodes)
        chunks = self._fit_prefills(chunks, len(decodes))
        if not decodes and not chunks and not decision.hold_s:
            # NOTE: as in SGLang, a prefill that memory blocks yields the step to decodes.
            decodes = self._reserve_decode_memory(
                [r for r in self._active if r.pending_prefill == 0]
            )
            if not decodes:
                # Nothing decodes either: continue the started prefills (as SGLang always
                # continues its chunked request). They hold the KV the blocked prompt waits
                # for, so a policy that keeps choosing the blocked prompt would otherwise
                # idle forever.
                chunks = self._continue_started_prefills(
                    sum(tokens for _, tokens in decision.prefill_chunks)
                )
        if not decodes and not chunks:
            if decision.abort_ids:
                return
            self._idle(decision.hold_s, horizon_s)
            return
        if not chunks and self.retractions == retractions:
            self.new_token_ratio.decay_step()  # as SGLang: a decode-only step, none retracted
        shape, context = self._shape(decodes, chunks)
        duration = self.gpu.measure_step_s(shape)
        start = self.now
        self.now = start + duration
        self.steps += 1
        self.busy_s += duration
        if self._record_steps:
            self.step_log.append(
                StepRecord(start, duration, decision.predicted_step_s, shape.new_tokens, context,
                           shape.decode_requests, shape.prefill_tokens, shape)
            )
        self.policy.observe_step(shape, duration)
        self._apply(decodes, chunks)
        if self._check:
            self.check_integrity()

    def _idle(self, hold_s: float, horizon_s: float | None) -> None:
        self.idle_ticks += 1
        self.new_token_ratio.reset()
        if hold_s > 0 and horizon_s is not None:
            wake = min(self.now + max(hold_s, MIN_HOLD_S), horizon_s)
            if wake > self.now:
                self.now = wake
                return
        self.now += IDLE_TICK_S

    def _validated(
        self, decision: BatchDecision
    ) -> tuple[list[SimRequest], list[tuple[SimRequest, int]]]:
        seen: set[Hashable] = set()
        decodes = []
        for req_id in decision.decode_ids:
            request = self._by_id.get(req_id)
            if request is None or request.pending_prefill or req_id in seen:
                raise RuntimeError(f"{self.policy.name}: invalid decode of {request or req_id!r}")
            seen.add(req_id)
            decodes.append(request)
        chunks = []
        for req_id, tokens in decision.prefill_chunks:
            request = self._by_id.get(req_id)
            if request is None or req_id in seen or not 1 <= tokens <= request.pending_prefill:
                raise RuntimeError(
                    f"{self.policy.name}: invalid prefill chunk of {tokens} for {request or req_id!r}"
                )
            seen.add(req_id)
            chunks.append((request, tokens))
        return decodes, chunks

    def _reserve_decode_memory(self, decodes: list[SimRequest]) -> list[SimRequest]:
        retracted = False
        while len(decodes) > self.kv_capacity - self._kv_used:
            victim = self._retraction_victim()
            if victim is None:
                break
            self._retract(victim)
            retracted = True
            if victim in decodes:
                decodes.remove(victim)
        if retracted:
            self.new_token_ratio.after_retraction(
                (r.next_output_index, self._output_target[r.req_id])
                for r in self._active if r.pending_prefill == 0
            )
        return decodes

    def _retraction_victim(self) -> SimRequest | None:
        decoding = [r for r in self._active if r.pending_prefill == 0]
        if len(decoding) > 1:
            return min(decoding, key=lambda r: (r.next_output_index, -r.prompt_tokens))
        started = [r for r in self._active if r.pending_prefill and r.context]
        if started:
            return max(started, key=lambda r: r.arrival_seq)
        return decoding[0] if decoding else None

    def _retract(self, request: SimRequest) -> None:
        record = self.records[request.req_id]
        new_pending = request.prompt_tokens + request.next_output_index
        record.recomputed_tokens += new_pending - request.pending_prefill
        record.preemptions += 1
        self.retractions += 1
        self._kv_used -= request.context
        request.context = 0
        request.pending_prefill = new_pending
        if new_pending + self._output_target[request.req_id] - request.next_output_index > self.kv_capacity:
            self._abort(request)

    def _continue_started_prefills(self, tokens: int) -> list[tuple[SimRequest, int]]:
        """Chunks of the started prefills, oldest first, up to ``tokens`` in all."""
        started = sorted(
            (r for r in self._active if r.context and r.pending_prefill),
            key=lambda r: r.arrival_seq,
        )
        chunks = []
        for request in started:
            if tokens < 1:
                break
            take = min(request.pending_prefill, tokens)
            chunks.append((request, take))
            tokens -= take
        return self._fit_prefills(chunks, 0)

    def _fit_prefills(
        self, chunks: list[tuple[SimRequest, int]], decode_tokens: int
    ) -> list[tuple[SimRequest, int]]:
        if not chunks:
            return chunks
        free = self.kv_capacity - self._kv_used - decode_tokens
        unfinished = sum(r.pending_prefill for r in self._active if r.context and r.pending_prefill)
        ratio = self.new_token_ratio.current
        outputs_reserved = sum(
            reserved_outputs(self._remaining_outputs(r), ratio)
            for r in self._active if r.pending_prefill == 0
        )
        fitted = []
        for request, tokens in chunks:
            if request.context == 0:
                reserve = reserved_outputs(self._remaining_outputs(request))
                if request.pending_prefill + reserve > free - unfinished - outputs_reserved:
                    continue
                unfinished += request.pending_prefill
                outputs_reserved += reserve
            tokens = min(tokens, free)
            if tokens < 1:
                break
            fitted.append((request, tokens))
            free -= tokens
            unfinished -= tokens  # now allocated: no longer owed to the unfinished prefills
        return fitted

    def _remaining_outputs(self, request: SimRequest) -> int:
        return self._output_target[request.req_id] - request.next_output_index

    @staticmethod
    def _shape(
        decodes: list[SimRequest], chunks: list[tuple[SimRequest, int]]
    ) -> tuple[StepShape, int]:
        prefill_tokens = 0
        pairs = 0.0
        prefill_context = 0
        for request, tokens in chunks:
            prefill_tokens += tokens
            prefill_context += request.context
            pairs += tokens * (request.context + (tokens + 1) / 2)
        decode_context = sum(r.context for r in decodes)
        shape = StepShape(
            prefill_tokens=prefill_tokens,
            prefill_attention_pairs=pairs,
            prefill_context=prefill_context,
            decode_requests=len(decodes),
            decode_context=decode_context,
            prefill_requests=len(chunks),
        )
        return shape, prefill_context + decode_context

    def _apply(self, decodes: list[SimRequest], chunks: list[tuple[SimRequest, int]]) -> None:
        finished = False
        for request, tokens in chunks:
            request.context += tokens
            request.pending_prefill -= tokens
            self._kv_used += tokens
            record = self.records[request.req_id]
            record.prefill_tokens_computed += tokens
            if request.pending_prefill == 0:
                record.prefill_completions += 1
                finished |= self._emit(request, record)
        for request in decodes:
            request.context += 1
            self._kv_used += 1
            record = self.records[request.req_id]
            record.decode_steps += 1
            finished |= self._emit(request, record)
        if finished:
            self._active = [r for r in self._active if r.req_id in self._by_id]

    def _emit(self, request: SimRequest, record: RequestRecord) -> bool:
        index = request.next_output_index
        record.on_token(index, self.now)
        if index == 0:
            request.first_token_time = self.now
        request.next_output_index = index + 1
        done = request.next_output_index == self._output_target[request.req_id]
        if self._record_tokens:
            self._events.append(TokenEvent(request.req_id, index, self.now, done))
        if done:
            self.output_lengths.observe(request.task, request.next_output_index)
            self._release(request)
        return done

    def _abort(self, request: SimRequest) -> None:
        self.records[request.req_id].aborted = True
        self._release(request)
        self._active = [r for r in self._active if r.req_id in self._by_id]

    def _release(self, request: SimRequest) -> None:
        self._kv_used -= request.context
        request.context = 0
        del self._by_id[request.req_id]
        del self._output_target[request.req_id]

    # ---------------------------------------------------------------- checks
    def check_integrity(self) -> None:
        """Raise RuntimeError if the KV accounting or request state is inconsistent."""
        in_kv = sum(r.context for r in self._active)
        if in_kv != self._kv_used or self._kv_used > self.kv_capacity or self._kv_used < 0:
            raise RuntimeError(
                f"KV accounting: used={self._kv_used} sum(context)={in_kv} "
                f"capacity={self.kv_capacity}"
            )
        if len(self._active) != len(self._by_id):
            raise RuntimeError(f"{len(self._active)} active but {len(self._by_id)} indexed")
        for request in self._active:
            if request.pending_prefill < 0 or request.context < 0:
                raise RuntimeError(f"negative state: {request!r}")
