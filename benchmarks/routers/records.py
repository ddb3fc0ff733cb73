"""What the client saw of each request, and a run's goodput, latency percentiles, added
latency, prefill share and CPU cost (pure, but for reading ``configs/slo.toml``'s classes
once at import)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.support.paths import REPO
from sglang_ext.policy.slo import SloCatalog

SLO_FILE = REPO / "configs" / "slo.toml"  # the classes the servers and the daemon resolve


def _targets_ms(catalog: SloCatalog) -> dict[str, dict[str, int]]:
    return {name: {"ttft_ms": round(slo.ttft_s * 1000), "tpot_ms": round(slo.tpot_s * 1000)}
            for name, slo in catalog.classes.items()}


_CATALOG = SloCatalog.from_toml(SLO_FILE)
SLO_CLASSES = _targets_ms(_CATALOG)  # per class, the targets a request of it is judged by
DEFAULT_CLASS = _CATALOG.default_class  # "standard": TTFT 2000 ms, TPOT 50 ms
SLO = SLO_CLASSES[DEFAULT_CLASS]


@dataclass
class Record:
    """What the client saw of one request (times in seconds from the run's start)."""

    index: int
    sent_s: float
    expected_tokens: int
    status: int | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    completion_tokens: int = 0
    events: int = 0
    error: str | None = None
    slo_class: str = DEFAULT_CLASS

    @property
    def ok(self) -> bool:
        return (self.status == 200 and self.error is None and self.first_token_s is not None
                and self.completion_tokens >= self.expected_tokens)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.first_token_s is None or self.last_token_s is None or self.completion_tokens < 2:
            return None
        return (self.last_token_s - self.first_token_s) / (self.completion_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.last_token_s is None else self.last_token_s - self.sent_s

    @property
    def streamed_tokens(self) -> int:
        """Output tokens the router streamed to the client: the usage event's count, else
        one per text chunk seen (a stream cut off before its usage event)."""
        return self.completion_tokens or self.events


def meets_slo(record: Record, slo: dict | None = None) -> bool:
    """Whether ``record`` completed within ``slo``, by default its own class's targets."""
    if slo is None:
        slo = SLO_CLASSES[record.slo_class]
    if not record.ok:
        return False
    ttft, tpot = record.ttft_s, record.tpot_s
    return ttft is not None and ttft * 1000 <= slo["ttft_ms"] and (tpot is None or tpot * 1000 <= slo["tpot_ms"])


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _pcts_ms(values: Sequence[float]) -> dict:
    return {f"p{q}": None if (v := percentile(values, q)) is None else round(v * 1000, 2)
            for q in (50, 90, 99)}


def summarize(records: Sequence[Record], rate: float, slo: dict | None = None) -> dict:
    """Goodput (rate x attainment) and the latency percentiles of one run; each request
    judged by ``slo``, else by its own class (with several classes, attainment per class
    too)."""
    n = len(records)
    good = sum(meets_slo(r, slo) for r in records)
    done = [r for r in records if r.ok]
    statuses: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = str(r.status) if r.error is None else f"{r.status}:{r.error.split(':')[0]}"
            statuses[key] = statuses.get(key, 0) + 1
    attainment = good / n if n else 0.0
    return {
        "requests": n, "completed": len(done), "good": good, "failed": n - len(done),
        "output_tokens": sum(r.streamed_tokens for r in records),
        "failures": statuses, "attainment": round(attainment, 4),
        "goodput": round(rate * attainment, 3),
        "ttft_ms": _pcts_ms([r.ttft_s for r in done]),
        "tpot_ms": _pcts_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "e2e_ms": _pcts_ms([r.e2e_s for r in done]),
        "ttft_attainment": round(sum(_ttft_met(r, slo) for r in done) / n, 4) if n else 0.0,
        **({"by_class": by_class(records)} if slo is None and len({r.slo_class for r in records}) > 1 else {}),
    }


def _ttft_met(record: Record, slo: dict | None) -> bool:
    target = (slo or SLO_CLASSES[record.slo_class])["ttft_ms"]
    return record.ttft_s is not None and record.ttft_s * 1000 <= target


def by_class(records: Sequence[Record]) -> dict:
    """Per SLO class: requests, those on time, attainment, TTFT p99 of those completed."""
    classes: dict[str, list[Record]] = {}
    for record in records:
        classes.setdefault(record.slo_class, []).append(record)
    out = {}
    for name, group in sorted(classes.items()):
        good = sum(meets_slo(r) for r in group)
        p99 = percentile([r.ttft_s for r in group if r.ok], 99)
        out[name] = {"requests": len(group), "good": good, "attainment": round(good / len(group), 4),
                     "ttft_p99_ms": None if p99 is None else round(p99 * 1000, 2)}
    return out


def added_latency(router_ttfts: Sequence[float], direct_ttfts: Sequence[float]) -> dict | None:
    """The router's added TTFT: median through it minus median direct (ms)."""
    if not router_ttfts or not direct_ttfts:
        return None
    via, direct = percentile(router_ttfts, 50), percentile(direct_ttfts, 50)
    return {"router_ms": round(via * 1000, 2), "direct_ms": round(direct * 1000, 2),
            "added_ms": round((via - direct) * 1000, 2), "n": min(len(router_ttfts), len(direct_ttfts))}


def prefill_summary(sent: int, served: int, computed: int) -> dict:
    """Prompt tokens the servers computed over those of the requests they accepted (HTTP
    200: a request a router refused never reached them)."""
    return {"prompt_tokens": sent, "served_prompt_tokens": served, "computed_tokens": computed,
            "computed_fraction": round(computed / served, 4) if served else None}


def cpu_per_1000(cpu_s: float, count: int | None, digits: int = 2) -> float | None:
    """CPU seconds per 1000 of ``count`` (requests, or streamed output tokens); None for
    none (or an unknown count)."""
    return None if not count or count <= 0 else round(cpu_s / count * 1000, digits)
