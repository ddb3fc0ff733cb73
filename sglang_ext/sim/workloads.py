"""Request workloads for the simulator: trace loaders and arrival-process shaping.

Supported trace formats (``FORMATS``):

* ``azure``    -- Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).
* ``burstgpt`` -- BurstGPT CSV (``Timestamp``, ``Request tokens``, ``Response tokens``, ...).
* ``mooncake`` -- Mooncake JSONL (``timestamp`` in ms, ``input_length``, ``output_length``).
* ``jsonl``    -- plain JSONL (``arrival_s``, ``prompt_tokens``, ``output_tokens``,
  optional ``slo_class``).

Loaded workloads are sorted by arrival (stable) and shifted so the first request
arrives at 0.0 s. Rows with zero prompt or output tokens (failed requests in the
public traces) are dropped and counted in ``Workload.dropped``.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from importlib import resources
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "FORMATS",
    "TraceRequest",
    "Workload",
    "WorkloadError",
    "bundled_sample",
    "gamma_arrivals",
    "load_workload",
    "parse_arrivals",
    "poisson_arrivals",
]

FORMATS = ("azure", "burstgpt", "mooncake", "jsonl")
ARRIVAL_FORMS = "'trace', 'poisson' or 'gamma:CV' with CV > 0 (e.g. 'gamma:2.0')"

_EPOCH = datetime(1970, 1, 1)
_SAMPLE_FILE = "data/azure_conv_sample.csv"


class WorkloadError(ValueError):
    """Invalid workload input; the message names the file and line where applicable."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    slo_class: str | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0.0):
            raise WorkloadError(f"arrival_s must be finite and >= 0, got {self.arrival_s!r}")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise WorkloadError(
                f"token counts must be >= 1, got prompt={self.prompt_tokens} "
                f"output={self.output_tokens}"
            )


@dataclass(frozen=True, slots=True)
class Workload:
    """A non-empty sequence of requests, kept sorted by arrival time (stable).

    ``dropped`` counts source rows skipped at load time for having zero tokens.
    """

    requests: tuple[TraceRequest, ...]
    source: str
    dropped: int = 0

    def __post_init__(self) -> None:
        if not self.requests:
            raise WorkloadError(f"{self.source}: workload has no requests")
        ordered = tuple(sorted(self.requests, key=attrgetter("arrival_s")))
        object.__setattr__(self, "requests", ordered)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def mean_rate(self) -> float:
        """Requests per second, ``(n - 1) / duration_s``; needs two distinct arrival times."""
        n, duration = len(self.requests), self.duration_s
        if n < 2 or duration <= 0.0:
            raise WorkloadError(
                f"{self.source}: mean rate undefined for {n} request(s) over {duration:g} s"
            )
        return (n - 1) / duration

    def head(self, seconds: float) -> Workload:
        """Requests arriving less than ``seconds`` after the first one."""
        if not seconds > 0.0:
            raise WorkloadError(f"head: seconds must be > 0, got {seconds!r}")
        start = self.requests[0].arrival_s
        kept = tuple(r for r in self.requests if r.arrival_s - start < seconds)
        return replace(self, requests=kept, source=f"{self.source}[:{seconds:g}s]")

    def skip(self, seconds: float) -> Workload:
        """Requests arriving at least ``seconds`` after the first one: a later window of a
        trace, with :meth:`head` for its length."""
        if not seconds >= 0.0:
            raise WorkloadError(f"skip: seconds must be >= 0, got {seconds!r}")
        start = self.requests[0].arrival_s
        kept = tuple(r for r in self.requests if r.arrival_s - start >= seconds)
        if not kept:
            span = self.requests[-1].arrival_s - start
            raise WorkloadError(
                f"{self.source}: no request arrives {seconds:g} s or later after the first "
                f"(the trace spans {span:g} s)"
            )
        return replace(self, requests=kept, source=f"{self.source}[{seconds:g}s:]")

    def scaled_to_rate(self, rate: float) -> Workload:
        """Stretch or compress arrival times (from 0.0) so that ``mean_rate == rate``."""
        _check_rate(rate)
        factor = self.mean_rate / rate
        start = self.requests[0].arrival_s
        arrivals = [(r.arrival_s - start) * factor for r in self.requests]
        return self._retimed(arrivals, f"trace(rate={rate:g})")

    def with_arrivals(self, arrivals: str, rate: float, seed: int) -> Workload:
        """Re-time the workload by an arrival spec (see ``parse_arrivals``) at ``rate`` req/s.

        ``trace`` rescales the recorded arrivals; ``poisson`` and ``gamma:CV`` keep the
        request lengths in order and draw fresh arrival times from ``seed``.
        """
        kind, cv = parse_arrivals(arrivals)
        if kind == "trace":
            return self.scaled_to_rate(rate)
        n = len(self.requests)
        if kind == "poisson":
            times = poisson_arrivals(rate, n, seed)
            label = f"poisson(rate={rate:g}, seed={seed})"
        else:
            assert cv is not None
            times = gamma_arrivals(rate, cv, n, seed)
            label = f"gamma(rate={rate:g}, cv={cv:g}, seed={seed})"
        return self._retimed(times.tolist(), label)

    def with_class_mix(self, mix: ClassMix, seed: int) -> Workload:
        """Each request gets an SLO class drawn from ``mix`` (seeded, independent of the
        arrival draw); refused for a trace that names its own classes."""
        named = sum(1 for r in self.requests if r.slo_class)
        if named:
            raise WorkloadError(
                f"{self.source}: {named} request(s) already name an SLO class; a class mix "
                "would replace them"
            )
        names = [name for name, _ in mix.fractions]
        weights = np.array([fraction for _, fraction in mix.fractions])
        draws = np.random.default_rng([seed, CLASS_MIX_STREAM]).choice(
            len(names), size=len(self.requests), p=weights / weights.sum()
        )
        requests = tuple(
            replace(r, slo_class=names[i]) for r, i in zip(self.requests, draws, strict=True)
        )
        return replace(self, requests=requests, source=f"{self.source} with classes {mix.label}")

    def _retimed(self, arrivals: list[float], label: str) -> Workload:
        requests = tuple(
            replace(r, arrival_s=float(t)) for r, t in zip(self.requests, arrivals, strict=True)
        )
        return replace(self, requests=requests, source=f"{self.source} @ {label}")


CLASS_MIX_STREAM = 0x5C1A55  # separates the class draw from the arrival draw of one seed


@dataclass(frozen=True, slots=True)
class ClassMix:
    """``NAME:FRACTION,...``: the share of requests in each SLO class (fractions sum to 1)."""

    fractions: tuple[tuple[str, float], ...]

    @classmethod
    def parse(cls, text: str) -> ClassMix:
        fractions: dict[str, float] = {}
        for part in text.split(","):
            name, sep, value = part.strip().partition(":")
            try:
                fraction = float(value) if sep else math.nan
            except ValueError:
                fraction = math.nan
            if not name or not (math.isfinite(fraction) and 0.0 < fraction <= 1.0):
                raise WorkloadError(
                    f"invalid class mix entry {part.strip()!r} in {text!r}; expected "
                    "NAME:FRACTION with 0 < FRACTION <= 1, e.g. interactive:0.3,standard:0.7"
                )
            if name in fractions:
                raise WorkloadError(f"class {name!r} appears twice in the class mix {text!r}")
            fractions[name] = fraction
        total = sum(fractions.values())
        if abs(total - 1.0) > 1e-6:
            raise WorkloadError(f"class mix fractions must sum to 1, got {total:g} in {text!r}")
        return cls(tuple(fractions.items()))

    @property
    def label(self) -> str:
        return ",".join(f"{name}:{fraction:g}" for name, fraction in self.fractions)


def poisson_arrivals(rate: float, n: int, seed: int) -> np.ndarray:
    """``n`` cumulative arrival times of a Poisson process at ``rate``, the first at 0.0."""
    _check_rate(rate)
    _check_count(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def gamma_arrivals(rate: float, cv: float, n: int, seed: int) -> np.ndarray:
    """``n`` cumulative arrival times with gamma gaps of mean ``1/rate`` and CV ``cv``."""
    _check_rate(rate)
    _check_count(n)
    if not (math.isfinite(cv) and cv > 0.0):
        raise WorkloadError(f"gamma CV must be finite and > 0, got {cv!r}")
    shape = 1.0 / cv**2
    gaps = np.random.default_rng(seed).gamma(shape, 1.0 / (rate * shape), size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def parse_arrivals(spec: str) -> tuple[str, float | None]:
    """Parse an arrival spec: ``trace``, ``poisson`` or ``gamma:CV`` (CV > 0)."""
    text = spec.strip().lower()
    if text in ("trace", "poisson"):
        return text, None
    kind, sep, arg = text.partition(":")
    if kind == "gamma" and sep:
        try:
            cv = float(arg)
        except ValueError:
            cv = math.nan
        if math.isfinite(cv) and cv > 0.0:
            return "gamma", cv
    raise WorkloadError(f"invalid arrival spec {spec!r}; expected {ARRIVAL_FORMS}")


def load_workload(path: str | Path, fmt: str) -> Workload:
    """Load a trace file in one of ``FORMATS``; see the module docstring."""
    if fmt not in FORMATS:
        expected = ", ".join(FORMATS)
        raise WorkloadError(f"unknown workload format {fmt!r}; expected one of {expected}")
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise WorkloadError(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not text.strip():
        raise WorkloadError(f"{path}: empty file")

    rows: list[_Row] = []
    dropped = 0
    try:
        parser = _parse_csv if fmt in ("azure", "burstgpt") else _parse_json
        for row in parser(path, text, fmt):
            if row[1] == 0 or row[2] == 0:
                dropped += 1
            else:
                rows.append(row)
    except csv.Error as exc:
        raise WorkloadError(f"{path}: malformed CSV ({exc})") from None
    if not rows:
        raise WorkloadError(f"{path}: no usable rows ({dropped} dropped with zero tokens)")
    rows.sort(key=lambda row: row[0])
    start = rows[0][0]
    requests = tuple(TraceRequest(t - start, p, o, slo) for t, p, o, slo in rows)
    return Workload(requests, str(path), dropped)


def bundled_sample() -> Workload:
    """The packaged Azure conversation sample (first 600 s of the 2023 trace)."""
    with resources.as_file(resources.files("sglang_ext").joinpath(_SAMPLE_FILE)) as path:
        return load_workload(path, "azure")


_Row = tuple[float, int, int, str | None]


def _check_rate(rate: float) -> None:
    if not (math.isfinite(rate) and rate > 0.0):
        raise WorkloadError(f"rate must be finite and > 0, got {rate!r}")


def _check_count(n: int) -> None:
    if n < 1:
        raise WorkloadError(f"need at least one arrival, got n={n}")


def _csv_rows(path: Path, text: str, columns: tuple[str, ...]) -> Iterator[tuple[int, list[str]]]:
    """Yield ``(line, values of columns)`` per non-blank data row, columns found by header."""
    reader = csv.reader(io.StringIO(text, newline=""))
    header = [name.strip() for name in next(reader)]
    index = {name: i for i, name in reversed(list(enumerate(header)))}
    for name in columns:
        if name not in index:
            raise WorkloadError(
                f"{path}:{reader.line_num}: missing column {name!r} (header: {', '.join(header)})"
            )
    for fields in reader:
        if not any(field.strip() for field in fields):
            continue
        if len(fields) != len(header):
            raise WorkloadError(
                f"{path}:{reader.line_num}: expected {len(header)} fields, got {len(fields)}"
            )
        yield reader.line_num, [fields[index[name]].strip() for name in columns]


def _json_objects(path: Path, text: str) -> Iterator[tuple[int, dict[str, Any]]]:
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path}:{line}: invalid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise WorkloadError(f"{path}:{line}: expected a JSON object, got {type(obj).__name__}")
        yield line, obj


def _json_value(path: Path, line: int, obj: dict[str, Any], key: str) -> float:
    if key not in obj:
        raise WorkloadError(f"{path}:{line}: missing key {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WorkloadError(f"{path}:{line}: {key!r} must be a number, got {value!r}")
    return value


def _number(path: Path, line: int, key: str, raw: str | float) -> float:
    try:
        value = float(raw)
    except (ValueError, OverflowError):
        raise WorkloadError(f"{path}:{line}: {key!r} is not a number: {raw!r}") from None
    if not math.isfinite(value) or value < 0:
        raise WorkloadError(f"{path}:{line}: {key!r} must be finite and >= 0, got {raw!r}")
    return value


def _count(path: Path, line: int, key: str, raw: str | float) -> int:
    value = _number(path, line, key, raw)
    if not value.is_integer():
        raise WorkloadError(f"{path}:{line}: {key!r} must be an integer, got {raw!r}")
    return int(value)


def _wallclock(path: Path, line: int, text: str) -> tuple[int, float]:
    """Split ``YYYY-MM-DD HH:MM:SS[.fffffff]`` into whole epoch seconds and a fraction."""
    base, dot, digits = text.partition(".")
    try:
        if dot and not (digits.isascii() and digits.isdigit()):
            raise ValueError
        stamp = datetime.fromisoformat(base)
    except ValueError:
        raise WorkloadError(f"{path}:{line}: 'TIMESTAMP': bad timestamp {text!r}") from None
    if stamp.tzinfo is not None:
        stamp = stamp.astimezone(UTC).replace(tzinfo=None)
    whole = (stamp - _EPOCH) // timedelta(seconds=1)
    return whole, int(digits) / 10 ** len(digits) if digits else 0.0


def _parse_csv(path: Path, text: str, fmt: str) -> Iterator[_Row]:
    time_col, prompt_col, output_col = _FIELDS[fmt]
    first: int | None = None
    for line, (stamp, prompt, output) in _csv_rows(path, text, _FIELDS[fmt]):
        if fmt == "azure":
            whole, fraction = _wallclock(path, line, stamp)
            first = whole if first is None else first
            arrival = float(whole - first) + fraction
        else:
            arrival = _number(path, line, time_col, stamp)
        prompt_tokens = _count(path, line, prompt_col, prompt)
        yield arrival, prompt_tokens, _count(path, line, output_col, output), None


def _parse_json(path: Path, text: str, fmt: str) -> Iterator[_Row]:
    time_key, prompt_key, output_key = _FIELDS[fmt]
    divisor = 1000.0 if fmt == "mooncake" else 1.0
    for line, obj in _json_objects(path, text):
        slo_class = obj.get("slo_class") if fmt == "jsonl" else None
        if slo_class is not None and not isinstance(slo_class, str):
            raise WorkloadError(f"{path}:{line}: 'slo_class' must be a string, got {slo_class!r}")
        arrival = _number(path, line, time_key, _json_value(path, line, obj, time_key)) / divisor
        yield (
            arrival,
            _count(path, line, prompt_key, _json_value(path, line, obj, prompt_key)),
            _count(path, line, output_key, _json_value(path, line, obj, output_key)),
            slo_class,
        )


_FIELDS: dict[str, tuple[str, str, str]] = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
    "mooncake": ("timestamp", "input_length", "output_length"),
    "jsonl": ("arrival_s", "prompt_tokens", "output_tokens"),
}
