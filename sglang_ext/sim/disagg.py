"""Prefill/decode disaggregation in virtual time: P prefill ranks, D decode ranks.

Each rank is one GPU of the profile (``make_gpu``), seeded ``seed + i`` for prefill rank
``i`` and ``seed + P + j`` for decode rank ``j``, with its own KV pool and its own
instance of the policy (a :class:`~sglang_ext.sim.disagg_policy.DisaggregatedPolicy`).

- **Prefill.** An arrival goes to the prefill rank with the fewest prompt tokens still
  pending (lowest index on ties). Each prefill rank is a :class:`SimEngine` that serves
  the request as a one-token request: its first token is emitted when its prefill ends,
  and the engine's memory rules (a prompt starts when it fits, retraction) apply as in a
  colocated run.
- **Transfer.** When its prefill ends a request with more tokens to emit joins one FIFO
  queue for decode memory (the head blocks those behind it). It is admitted by the
  decode rank with the least KV reserved once that rank has room for all the KV it will
  hold there (prompt + output - 1 tokens; the engine knows output lengths as SGLang knows
  ``max_new_tokens``, the policy never does). Its prompt KV then crosses the prefill
  rank's link, one transfer at a time per link: ``prompt tokens x KV bytes per token x 8
  / link Gb/s`` (:func:`kv_transfer_s`; KV bytes per token from the profile's model).
- **Decode.** A decode rank steps whenever it holds requests: the policy picks the
  decodes, each emits its next token at the step's end. A request the decode side can
  never hold (prompt + output - 1 over a decode rank's capacity) is rejected on arrival.
- **Output lengths** are learnt per task as a colocated engine learns them (the
  request's SLO class, else its SLO; ``sglang_ext.policy.output_length``), from the
  requests finished by then in virtual time. An end-to-end SLO's envelope is paced for
  the estimate when the request's prefill ends (its first token's deadline does not
  depend on it); the record keeps that envelope, the decode policy sees it.

NOTE: the prefill rank frees a request's KV when its prefill ends (the transfer reads a
staged copy), so a full decode side never blocks prefills; requests wait in the transfer
queue instead, their TPOT clock already running from the first token.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from sglang_ext.policy.output_length import OutputLengthModel
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.sim.decode_step_table import DecodeStepTable
from sglang_ext.sim.disagg_policy import DisaggregatedPolicy
from sglang_ext.sim.engine import SimEngine, TokenEvent
from sglang_ext.sim.metrics import RequestRecord
from sglang_ext.sim.profile import HardwareProfile
from sglang_ext.sim.service_curve import make_gpu

DEFAULT_LINK_GBPS = 400.0  # a 400 Gb/s-class NIC per GPU (InfiniBand NDR, 400GbE)
DEFAULT_SPLIT = (1, 1)

# tie order at equal times: freed memory first, finished output lengths before arrivals
_STEP_END, _FINISHED, _READY, _ARRIVE = 0, 1, 2, 3


class DisaggConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    prefill_ranks: int = DEFAULT_SPLIT[0]
    decode_ranks: int = DEFAULT_SPLIT[1]
    link_gbps: float = DEFAULT_LINK_GBPS  # each prefill rank's outbound link, Gb/s

    def __post_init__(self) -> None:
        for name in ("prefill_ranks", "decode_ranks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DisaggConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not (math.isfinite(self.link_gbps) and self.link_gbps > 0):
            raise DisaggConfigError(f"link bandwidth must be a finite number > 0 Gb/s, "
                                    f"got {self.link_gbps!r}")

    @property
    def gpus(self) -> int:
        return self.prefill_ranks + self.decode_ranks

    @property
    def split(self) -> str:
        return f"{self.prefill_ranks}:{self.decode_ranks}"

    @classmethod
    def parse_split(cls, text: str) -> tuple[int, int]:
        """``P:D`` (``1:1``, ``2:3``): prefill and decode ranks, each an integer >= 1."""
        parts = text.split(":")
        try:
            prefill, decode = (int(part) for part in parts)
        except ValueError:
            raise DisaggConfigError(
                f"split must be P:D with integer prefill and decode ranks, e.g. 1:1, got {text!r}"
            ) from None
        if prefill < 1 or decode < 1:
            raise DisaggConfigError(f"split {text!r}: prefill and decode ranks must be >= 1")
        return prefill, decode


def kv_transfer_s(prompt_tokens: int, kv_bytes_per_token: float, link_gbps: float) -> float:
    """Seconds to move ``prompt_tokens`` of KV over a ``link_gbps`` Gb/s link."""
    return prompt_tokens * kv_bytes_per_token * 8.0 / (link_gbps * 1e9)


class DecodeRequest:
    """A request on a decode rank (implements ``RequestState``): its prompt is in KV."""

    __slots__ = (
        "req_id", "arrival", "slo", "prompt_tokens", "arrival_seq", "next_output_index",
        "pending_prefill", "context", "first_token_time", "output_tokens",
    )

    def __init__(self, record: RequestRecord, seq: int) -> None:
        self.req_id = record.req_id
        self.arrival = record.arrival
        self.slo = record.slo
        self.prompt_tokens = record.prompt_tokens
        self.output_tokens = record.output_tokens
        self.arrival_seq = seq
        self.next_output_index = 1
        self.pending_prefill = 0
        self.context = record.prompt_tokens
        self.first_token_time = record.first_token_s

    @property
    def kv_needed(self) -> int:
        """The KV this request holds on its decode rank at its last token."""
        return self.prompt_tokens + self.output_tokens - 1


class DecodeRank:
    """One decode GPU: requests admitted by reservation, a step of the policy's decodes."""

    def __init__(self, index: int, profile: HardwareProfile, policy: DisaggregatedPolicy,
                 seed: int) -> None:
        self.index = index
        self.policy = policy
        self.gpu = make_gpu(profile, seed)
        self.capacity = profile.kv_capacity_tokens
        self.reserved = 0
        self.active: list[DecodeRequest] = []
        self.running: list[DecodeRequest] = []  # the step in flight
        self.steps = 0
        self.partial_steps = 0  # steps that left an admitted request out
        self.busy_s = 0.0

    def fits(self, request: DecodeRequest) -> bool:
        return request.kv_needed <= self.capacity - self.reserved

    def reserve(self, request: DecodeRequest) -> None:
        if not self.fits(request):
            raise RuntimeError(f"decode rank {self.index}: {request.req_id!r} does not fit")
        self.reserved += request.kv_needed

    def start_step(self, now: float) -> float:
        """Run the policy's batch from ``now``; returns when the step ends."""
        decision = self.policy.form_batch(self.active, now)
        by_id = {r.req_id: r for r in self.active}
        batch = [by_id.get(req_id) for req_id in decision.decode_ids]
        if (decision.prefill_chunks or not batch or None in batch
                or len(set(decision.decode_ids)) != len(batch)):
            raise RuntimeError(f"{self.policy.name}: invalid decode batch {decision!r}")
        shape = StepShape(0, 0.0, 0, len(batch), sum(r.context for r in batch))
        duration = self.gpu.measure_step_s(shape)
        self.policy.observe_step(shape, duration)
        self.running = batch
        self.steps += 1
        self.partial_steps += len(batch) < len(self.active)
        self.busy_s += duration
        return now + duration

    def finish_step(self) -> list[DecodeRequest]:
        """The step in flight ends: each decode's KV grows by one token; returns its requests."""
        batch, self.running = self.running, []
        for request in batch:
            request.context += 1
        return batch

    def release(self, request: DecodeRequest) -> None:
        self.active.remove(request)
        self.reserved -= request.kv_needed

    def check_integrity(self) -> None:
        held = sum(r.context for r in self.active)
        need = sum(r.kv_needed for r in self.active)
        if held > need or need > self.reserved or self.reserved > self.capacity:
            raise RuntimeError(f"decode rank {self.index}: KV held {held}, needed {need}, "
                               f"reserved {self.reserved}, capacity {self.capacity}")


@dataclass(frozen=True, slots=True)
class Arrival:
    req_id: Hashable
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    slo: Slo
    slo_class: str | None = None  # the request's class: per-class metrics, its task

    @property
    def task(self) -> Hashable:
        """What its output length is learnt per (as ``SimEngine.submit`` keys it)."""
        return self.slo if self.slo_class is None else self.slo_class


@dataclass(frozen=True)
class DisaggRun:
    records: dict[Hashable, RequestRecord]
    prefill_engines: tuple[SimEngine, ...]
    decode_ranks: tuple[DecodeRank, ...]
    transfer_s: tuple[float, ...]  # each transfer's time on its link
    decode_wait_s: tuple[float, ...]  # prefill end to decode admission, per admitted request
    tokens: tuple[TokenEvent, ...]  # every token, in emission order (``record_tokens``)
    duration_s: float

    @property
    def steps(self) -> int:
        return sum(e.steps for e in self.prefill_engines) + sum(r.steps for r in self.decode_ranks)


def run_disaggregated(
    arrivals: Sequence[Arrival], profile: HardwareProfile,
    make_policy: Callable[[], DisaggregatedPolicy], config: DisaggConfig, *,
    seed: int = 0, drain_s: float = 120.0, record_tokens: bool = False,
    check_invariants: bool = False,
) -> DisaggRun:
    """Serve ``arrivals`` (sorted by time) until ``drain_s`` after the last."""
    table = DecodeStepTable.offline(make_gpu(profile, seed).ideal_step_s,
                                    profile.kv_capacity_tokens)
    engines = []
    for i in range(config.prefill_ranks):
        policy = make_policy()
        policy.use_decode_table(table)
        engines.append(SimEngine(profile, policy, seed=seed + i, record_tokens=True,
                                 check_invariants=check_invariants))
    ranks = []
    for j in range(config.decode_ranks):
        policy = make_policy()
        policy.use_decode_table(table)
        ranks.append(DecodeRank(j, profile, policy, seed + config.prefill_ranks + j))
    records: dict[Hashable, RequestRecord] = {}
    tasks: dict[Hashable, Hashable] = {}
    source: dict[Hashable, int] = {}
    for arrival in arrivals:
        for engine in engines:
            engine.advance_to(arrival.arrival_s)
        record = RequestRecord(arrival.req_id, arrival.arrival_s, arrival.slo,
                               arrival.prompt_tokens, arrival.output_tokens, arrival.slo_class)
        records[arrival.req_id] = record
        tasks[arrival.req_id] = arrival.task
        if arrival.prompt_tokens + arrival.output_tokens - 1 > ranks[0].capacity:
            record.rejected = True
            continue
        index = min(range(len(engines)), key=lambda i: (_pending(engines[i]), i))
        source[arrival.req_id] = index
        if not engines[index].submit(arrival.req_id, arrival.arrival_s, arrival.prompt_tokens,
                                     1, arrival.slo, arrival.slo_class):
            record.rejected = True
    last = arrivals[-1].arrival_s if arrivals else 0.0
    deadline = last + drain_s
    tokens: list[TokenEvent] = []
    ready: list[tuple[float, Hashable]] = []
    finished_at_prefill: list[tuple[float, Hashable]] = []
    for engine in engines:
        engine.run_until_idle(deadline)
        for event in engine.drain_tokens():
            record = records[event.req_id]
            _copy_prefill(engine.records[event.req_id], record)
            record.on_token(0, event.time_s)
            if record_tokens:
                tokens.append(TokenEvent(event.req_id, 0, event.time_s, record.finished))
            pending = finished_at_prefill if record.finished else ready
            pending.append((event.time_s, event.req_id))
        for req_id, prefill_record in engine.records.items():
            if prefill_record.aborted:
                records[req_id].aborted = True
    decode = _DecodeSide(records, tasks, ranks, source, profile.model.kv_bytes_per_token, config,
                         tokens if record_tokens else None, check_invariants)
    end = decode.run(sorted(ready, key=lambda pair: pair[0]), finished_at_prefill, deadline)
    tokens.sort(key=lambda event: event.time_s)
    duration = max(last, end, *(engine.now for engine in engines))
    return DisaggRun(records, tuple(engines), tuple(ranks), tuple(decode.transfers),
                     tuple(decode.waits), tuple(tokens), duration)


def _pending(engine: SimEngine) -> int:
    return sum(r.pending_prefill for r in engine.active_requests)


def _copy_prefill(prefill: RequestRecord, record: RequestRecord) -> None:
    record.prefill_tokens_computed = prefill.prefill_tokens_computed
    record.recomputed_tokens = prefill.recomputed_tokens
    record.preemptions = prefill.preemptions
    record.prefill_completions = prefill.prefill_completions


class _DecodeSide:
    """The transfer queue, the links and the decode ranks, as one event loop."""

    def __init__(self, records: dict[Hashable, RequestRecord], tasks: dict[Hashable, Hashable],
                 ranks: list[DecodeRank], source: dict[Hashable, int],
                 kv_bytes_per_token: float, config: DisaggConfig,
                 tokens: list[TokenEvent] | None, check: bool) -> None:
        self.records = records
        self.tasks = tasks
        self.output_lengths = OutputLengthModel()
        self.ranks = ranks
        self.source = source
        self.kv_bytes_per_token = kv_bytes_per_token
        self.config = config
        self.link_free = [0.0] * config.prefill_ranks
        self.waiting: deque[tuple[float, DecodeRequest]] = deque()
        self.events: list[tuple[float, int, int, object]] = []
        self.order = 0
        self.transfers: list[float] = []
        self.waits: list[float] = []
        self.tokens = tokens
        self.check = check

    def _push(self, time_s: float, kind: int, payload: object) -> None:
        heapq.heappush(self.events, (time_s, kind, self.order, payload))
        self.order += 1

    def run(self, ready: list[tuple[float, Hashable]],
            finished_at_prefill: list[tuple[float, Hashable]], deadline: float) -> float:
        """``ready``: requests whose prefill ended with tokens left to decode;
        ``finished_at_prefill``: one-token requests (their lengths are learnt then).
        Returns the time of the last event handled."""
        for seq, (time_s, req_id) in enumerate(ready):
            self._push(time_s, _READY, (seq, req_id))
        for time_s, req_id in finished_at_prefill:
            self._push(time_s, _FINISHED, req_id)
        now = 0.0
        while self.events:
            time_s, kind, _, payload = heapq.heappop(self.events)
            if kind == _FINISHED:
                self._observe(self.records[payload])
                continue
            if kind != _STEP_END and time_s >= deadline:
                continue
            now = time_s
            if kind == _READY:
                self.waiting.append((now, self._decode_request(*payload)))
            elif kind == _ARRIVE:
                rank, request = payload
                rank.active.append(request)
            else:
                self._finish_step(payload, now)
            self._admit(now)
            if now < deadline:
                for rank in self.ranks:
                    if not rank.running and rank.active:
                        self._push(rank.start_step(now), _STEP_END, rank)
        return now

    def _decode_request(self, seq: int, req_id: Hashable) -> DecodeRequest:
        """The request as its decode rank holds it, its envelope paced for its task's
        output length as learnt by now."""
        record = self.records[req_id]
        estimate = self.output_lengths.estimate(self.tasks[req_id])
        record.slo = record.slo.with_expected_output(estimate.expected_tokens)
        return DecodeRequest(record, seq)

    def _observe(self, record: RequestRecord) -> None:
        self.output_lengths.observe(self.tasks[record.req_id], record.tokens_emitted)

    def _admit(self, now: float) -> None:
        while self.waiting:
            since, request = self.waiting[0]
            rank = min(self.ranks, key=lambda r: (r.reserved, r.index))
            if not rank.fits(request):
                return
            self.waiting.popleft()
            rank.reserve(request)
            link = self.source[request.req_id]
            start = max(now, self.link_free[link])
            transfer = kv_transfer_s(request.prompt_tokens, self.kv_bytes_per_token,
                                     self.config.link_gbps)
            self.link_free[link] = start + transfer
            self.transfers.append(transfer)
            self.waits.append(now - since)
            self._push(start + transfer, _ARRIVE, (rank, request))

    def _finish_step(self, rank: DecodeRank, now: float) -> None:
        for request in rank.finish_step():
            record = self.records[request.req_id]
            record.decode_steps += 1
            record.on_token(request.next_output_index, now)
            request.next_output_index += 1
            if self.tokens is not None:
                self.tokens.append(TokenEvent(request.req_id, request.next_output_index - 1,
                                              now, record.finished))
            if record.finished:
                rank.release(request)
                self._observe(record)
        if self.check:
            rank.check_integrity()
