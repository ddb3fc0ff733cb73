"""Per-request latency records (streamed, O(1) memory per request) and load summaries.

Definitions (FairBatching §5.1):
- TTFT = first token time - arrival.
- TPOT (the SLO metric) = max over tokens j >= 1 of ``(t_j - t_0) / j``: the worst
  average rate the user saw at any point after the first token.
- mean TPOT = ``(t_last - t_0) / (n - 1)``; TBT = gaps between consecutive tokens.
- e2e latency = last token time - arrival (finished requests).
- SLO met, by the request's SLO kind (``sglang_ext.policy.slo``): TTFT+TPOT, TTFT <=
  target and max TPOT <= target; end-to-end, e2e latency <= target (its TTFT and TPOT
  are those of a derived envelope, not targets, and are not required). A rejected,
  aborted or unfinished request is violated. Envelope met = every token j before
  ``arrival + ttft + tpot * j`` (an e2e request's: its derived envelope's).
- effective RPS = offered RPS x attainment.
- TTFT and TPOT attainment count TTFT+TPOT requests only (an e2e request has no TTFT
  or TPOT target): met / TTFT+TPOT requests, ``None`` when there are none. Attainment
  and envelope attainment count every request. Latency percentiles (TTFT, TPOT, e2e)
  are measurements and include every request that qualifies, whatever its kind.
- ``by_slo_class``: the same per SLO class (``RequestRecord.slo_class``; a record
  without one is grouped under ``UNCLASSED``).
- ``worst_prompt_bucket`` / ``worst_slo_class``: the group (prompt-length bucket, SLO
  class) with the lowest attainment among those with at least ``MIN_GROUP_REQUESTS``
  requests (a smaller group is too noisy to decide it; ties go to the first in bucket
  or name order); ``label`` and ``attainment`` are ``None`` when no group is that large.
  ``sizes`` records every group's request count.
- token goodput = prompt + output tokens of the requests that met their SLO, per second
  of the run's duration (the ``duration_s`` given to ``summarize``, as for
  ``output_tokens_per_s``: the simulator's is from time 0 to the last event or the last
  arrival, whichever is later, the drain included while requests still run).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from sglang_ext.policy.slo import Slo

PERCENTILES = (50, 90, 95, 99)


@dataclass(slots=True)
class RequestRecord:
    req_id: Hashable
    arrival: float
    slo: Slo
    prompt_tokens: int
    output_tokens: int
    slo_class: str | None = None
    rejected: bool = False
    aborted: bool = False
    first_token_s: float | None = None
    last_token_s: float | None = None
    tokens_emitted: int = 0
    max_tpot_s: float = 0.0
    max_tbt_s: float = 0.0
    envelope_met: bool = True
    prefill_tokens_computed: int = 0
    recomputed_tokens: int = 0
    preemptions: int = 0
    prefill_completions: int = 0  # prefills that ended by emitting a token (1 + recomputes)
    decode_steps: int = 0
    finish_s: float | None = None
    _tbt_sum: float = field(default=0.0, repr=False)

    def on_token(self, index: int, time_s: float) -> None:
        if index != self.tokens_emitted:
            raise RuntimeError(
                f"request {self.req_id}: token {index} emitted after {self.tokens_emitted} tokens"
            )
        if time_s > self.arrival + self.slo.ttft_s + self.slo.tpot_s * index:
            self.envelope_met = False
        if index == 0:
            self.first_token_s = time_s
        else:
            tpot = (time_s - self.first_token_s) / index
            if tpot > self.max_tpot_s:
                self.max_tpot_s = tpot
            gap = time_s - self.last_token_s
            self._tbt_sum += gap
            if gap > self.max_tbt_s:
                self.max_tbt_s = gap
        self.last_token_s = time_s
        self.tokens_emitted += 1
        if self.tokens_emitted == self.output_tokens:
            self.finish_s = time_s

    @property
    def finished(self) -> bool:
        return self.finish_s is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival

    @property
    def mean_tpot_s(self) -> float | None:
        if self.tokens_emitted < 2:
            return None
        return (self.last_token_s - self.first_token_s) / (self.tokens_emitted - 1)

    @property
    def mean_tbt_s(self) -> float | None:
        return self.mean_tpot_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival

    @property
    def slo_met(self) -> bool:
        if self.rejected or self.aborted or not self.finished:
            return False
        if self.slo.is_end_to_end:
            return self.e2e_s <= self.slo.e2e_s
        return self.ttft_s <= self.slo.ttft_s and self.max_tpot_s <= self.slo.tpot_s


def percentiles_ms(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    array = np.asarray(values, dtype=float) * 1e3
    summary = {f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}
    summary["mean"] = float(array.mean())
    return summary


@dataclass(frozen=True, slots=True)
class LatencySamples:
    """Per-request values kept for CDF plots (milliseconds)."""

    ttft_ms: tuple[float, ...]
    tpot_ms: tuple[float, ...]
    e2e_ms: tuple[float, ...] = ()


UNCLASSED = "(no class)"  # by_slo_class's group for records without an SLO class
TTFT_TPOT, END_TO_END, MIXED = "ttft+tpot", "e2e", "mixed"  # by_slo_class's kinds


def summarize(records: Iterable[RequestRecord], offered_rate: float, duration_s: float) -> dict:
    """One load point of ``results.json`` (latencies in ms, rates in req/s)."""
    records = list(records)
    total = len(records)
    if total == 0:
        raise ValueError("no requests to summarize")
    served = [r for r in records if not r.rejected and not r.aborted]
    finished = [r for r in served if r.finished]
    met = sum(r.slo_met for r in records)
    envelope = sum(r.envelope_met and r.finished and not r.rejected for r in records)
    mean_tpots = [r.mean_tpot_s for r in finished if r.tokens_emitted >= 2]
    max_tbts = [r.max_tbt_s for r in finished if r.tokens_emitted >= 2]
    attainment = met / total
    output_tokens = sum(r.tokens_emitted for r in records)
    by_prompt = attainment_by_prompt_tokens(records)
    by_class = attainment_by_slo_class(records)
    return {
        "rate": offered_rate,
        "requests": total,
        "attainment": attainment,
        "effective_rps": offered_rate * attainment,
        "envelope_attainment": envelope / total,
        "ttft_attainment": ttft_attainment(records),
        "tpot_attainment": _share(_tpot_met, _ttft_tpot(records)),
        "rejected": sum(r.rejected for r in records),
        "aborted": sum(r.aborted for r in records),
        "unfinished": len(served) - len(finished),
        "preemptions": sum(r.preemptions for r in records),
        "recomputed_tokens": sum(r.recomputed_tokens for r in records),
        "output_tokens_per_s": output_tokens / duration_s if duration_s > 0 else math.nan,
        "ttft_ms": percentiles_ms(_ttfts(served)),
        "tpot_ms": percentiles_ms(_max_tpots(finished)),
        "mean_tpot_ms": percentiles_ms(mean_tpots),
        "max_tbt_ms": percentiles_ms(max_tbts),
        "e2e_ms": percentiles_ms([r.e2e_s for r in finished]),
        "by_prompt_tokens": by_prompt,
        "by_slo_class": by_class,
        "worst_prompt_bucket": worst_group(by_prompt),
        "worst_slo_class": worst_group(by_class),
        "token_goodput": token_goodput(records, duration_s),
    }


#: the fewest requests a prompt-length bucket or SLO class needs to be the worst one
MIN_GROUP_REQUESTS = 20


def worst_group(groups: dict[str, dict], min_requests: int = MIN_GROUP_REQUESTS) -> dict:
    """The lowest-attainment group of ``by_prompt_tokens`` or ``by_slo_class`` among those
    with at least ``min_requests`` requests (ties: the first in ``groups``' order):
    ``{"label", "attainment", "requests", "min_requests", "sizes"}``; ``label`` and
    ``attainment`` (and ``requests``) are ``None`` when no group has that many."""
    eligible = [(name, group) for name, group in groups.items()
                if group["requests"] >= min_requests]
    worst = min(eligible, key=lambda item: item[1]["attainment"], default=None)
    return {
        "label": None if worst is None else worst[0],
        "attainment": None if worst is None else worst[1]["attainment"],
        "requests": None if worst is None else worst[1]["requests"],
        "min_requests": min_requests,
        "sizes": {name: group["requests"] for name, group in groups.items()},
    }


def token_goodput(records: Iterable[RequestRecord], duration_s: float) -> float:
    """Prompt + output tokens per second of the requests that met their SLO."""
    tokens = sum(r.prompt_tokens + r.output_tokens for r in records if r.slo_met)
    return tokens / duration_s if duration_s > 0 else math.nan


def _ttfts(served: Iterable[RequestRecord]) -> list[float]:
    return [r.ttft_s for r in served if r.ttft_s is not None]


def _max_tpots(finished: Iterable[RequestRecord]) -> list[float]:
    return [r.max_tpot_s for r in finished if r.tokens_emitted >= 2]


def _ttft_tpot(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if not r.slo.is_end_to_end]


def _share(predicate: Callable[[RequestRecord], bool],
           records: Sequence[RequestRecord]) -> float | None:
    return sum(map(predicate, records)) / len(records) if records else None


def _ttft_met(record: RequestRecord) -> bool:
    return (not record.rejected and not record.aborted and record.ttft_s is not None
            and record.ttft_s <= record.slo.ttft_s)


def _tpot_met(record: RequestRecord) -> bool:
    return (not record.rejected and not record.aborted and record.finished
            and record.max_tpot_s <= record.slo.tpot_s)


def ttft_attainment(records: Iterable[RequestRecord]) -> float | None:
    """TTFT met over the TTFT+TPOT requests; ``None`` when there are none."""
    return _share(_ttft_met, _ttft_tpot(records))


def attainment_by_slo_class(records: Iterable[RequestRecord]) -> dict[str, dict]:
    """Per SLO class, by name (``UNCLASSED`` for records without one): its kind (``"ttft+tpot"``,
    ``"e2e"``, ``"mixed"`` for an unclassed group of both), requests, attainment and the
    TTFT, TPOT and e2e latency percentiles."""
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        groups.setdefault(record.slo_class or UNCLASSED, []).append(record)
    return {name: _class_summary(groups[name]) for name in sorted(groups)}


def _class_summary(members: list[RequestRecord]) -> dict:
    kinds = {END_TO_END if r.slo.is_end_to_end else TTFT_TPOT for r in members}
    served = [r for r in members if not r.rejected and not r.aborted]
    finished = [r for r in served if r.finished]
    return {
        "kind": kinds.pop() if len(kinds) == 1 else MIXED,
        "requests": len(members),
        "attainment": sum(r.slo_met for r in members) / len(members),
        "ttft_ms": percentiles_ms(_ttfts(served)),
        "tpot_ms": percentiles_ms(_max_tpots(finished)),
        "e2e_ms": percentiles_ms([r.e2e_s for r in finished]),
    }


PROMPT_TOKEN_EDGES = (512, 1024, 2048, 4096)


def prompt_bucket_labels(edges: Sequence[int] = PROMPT_TOKEN_EDGES) -> list[str]:
    """The prompt-length buckets' labels in order: ``"<512"``, ``"512-1023"``, ...,
    ``">=4096"`` (the keys of ``by_prompt_tokens``; tables use them as columns)."""
    labels = [f"<{edges[0]}"] + [f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:])]
    labels.append(f">={edges[-1]}")
    return labels


def attainment_by_prompt_tokens(
    records: Iterable[RequestRecord], edges: Sequence[int] = PROMPT_TOKEN_EDGES
) -> dict[str, dict[str, float]]:
    """SLO and TTFT attainment per prompt-length bucket (``"<512"``, ``"512-1023"``, ...,
    ``">=4096"``; empty buckets left out): who pays for a rule that favours short prompts."""
    labels = prompt_bucket_labels(edges)
    buckets: dict[str, list[RequestRecord]] = {label: [] for label in labels}
    for record in records:
        buckets[labels[bisect_right(edges, record.prompt_tokens)]].append(record)
    return {
        label: {
            "requests": len(members),
            "attainment": sum(r.slo_met for r in members) / len(members),
            "ttft_attainment": ttft_attainment(members),
        }
        for label, members in buckets.items()
        if members
    }


def latency_samples(records: Iterable[RequestRecord]) -> LatencySamples:
    records = [r for r in records if not r.rejected and not r.aborted and r.ttft_s is not None]
    return LatencySamples(
        tuple(r.ttft_s * 1e3 for r in records),
        tuple(r.max_tpot_s * 1e3 for r in records if r.finished and r.tokens_emitted >= 2),
        tuple(r.e2e_s * 1e3 for r in records if r.finished),
    )
