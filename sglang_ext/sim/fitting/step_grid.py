"""Measured step-time grids: the CSV format of ``../shared/data/gpu/`` (one forward step per
row, written by ``benchmarks/gpu/step_profiler.py``), read strictly.

Columns (any order; extra columns are ignored): ``kind`` (decode / prefill / mixed /
random), ``n_prefill`` (prefill chunks), ``prefill_tokens`` (their new tokens),
``prefill_prefix`` (their cached prefix), ``prefill_pairs`` (causal query-key pairs,
``sum n * (prefix + (n + 1) / 2)``), ``n_decode``, ``decode_ctx`` (the decodes' KV
length), ``new_tokens`` (``prefill_tokens + n_decode``), then times in milliseconds:
``graph_ms`` (device time, median of CUDA-graph replays), ``graph_p10``, ``graph_p90``,
``eager_ms``, ``eager_p90``.

A malformed file raises :class:`GridError` naming the file, the line and the column.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from sglang_ext.policy.step_shape import StepShape

__all__ = ["GRID_COLUMNS", "GRID_KINDS", "GridError", "GridRow", "read_grid"]

GRID_KINDS = ("decode", "prefill", "mixed", "random")
_INT_COLUMNS = ("n_prefill", "prefill_tokens", "prefill_prefix", "n_decode", "decode_ctx",
                "new_tokens")
_TIME_COLUMNS = ("graph_ms", "graph_p10", "graph_p90", "eager_ms", "eager_p90")
GRID_COLUMNS = ("kind", *_INT_COLUMNS[:3], "prefill_pairs", *_INT_COLUMNS[3:], *_TIME_COLUMNS)


class GridError(ValueError):
    """A malformed grid: the message names the file and the line."""


@dataclass(frozen=True, slots=True)
class GridRow:
    kind: str
    n_prefill: int
    prefill_tokens: int
    prefill_prefix: int
    prefill_pairs: float
    n_decode: int
    decode_ctx: int
    new_tokens: int
    graph_ms: float
    graph_p10: float
    graph_p90: float
    eager_ms: float
    eager_p90: float
    line: int = 0  # where it was read from (1 = the header)

    @property
    def shape(self) -> StepShape:
        return StepShape(self.prefill_tokens, self.prefill_pairs, self.prefill_prefix,
                         self.n_decode, self.decode_ctx, self.n_prefill)

    @property
    def seconds(self) -> float:
        """The step's device time (``graph_ms``) in seconds."""
        return self.graph_ms / 1e3


def read_grid(path: str | Path, *, min_rows: int = 1) -> list[GridRow]:
    """All rows of a grid CSV; :class:`GridError` when it is malformed or has fewer than
    ``min_rows`` rows."""
    path = Path(path)
    try:
        with path.open(newline="") as handle:
            reader = csv.reader(handle)
            header = next(reader, None)
            if header is None:
                raise GridError(f"{path}: empty file, expected a header with {', '.join(GRID_COLUMNS)}")
            index = _column_index(path, [name.strip() for name in header])
            rows = [_parse_row(path, reader.line_num, index, record) for record in reader
                    if any(cell.strip() for cell in record)]
    except OSError as exc:
        raise GridError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise GridError(f"{path}: not a CSV text file: {exc}") from None
    if len(rows) < min_rows:
        raise GridError(f"{path}: {len(rows)} row(s), need at least {min_rows}")
    return rows


def _column_index(path: Path, header: list[str]) -> dict[str, int]:
    missing = [name for name in GRID_COLUMNS if name not in header]
    if missing:
        raise GridError(f"{path}: line 1: missing column(s) {', '.join(missing)}")
    return {name: header.index(name) for name in GRID_COLUMNS}


def _parse_row(path: Path, line: int, index: dict[str, int], record: list[str]) -> GridRow:
    def cell(name: str) -> str:
        position = index[name]
        if position >= len(record):
            raise GridError(f"{path}: line {line}: no value for column {name}")
        return record[position].strip()

    def fail(name: str, why: str) -> GridError:
        return GridError(f"{path}: line {line}: column {name}: {why}")

    kind = cell("kind")
    if kind not in GRID_KINDS:
        raise fail("kind", f"{kind!r} is not one of {', '.join(GRID_KINDS)}")
    values: dict[str, float] = {}
    for name in _INT_COLUMNS:
        text = cell(name)
        try:
            values[name] = int(text)
        except ValueError:
            raise fail(name, f"{text!r} is not an integer") from None
        if values[name] < 0:
            raise fail(name, f"{text} is negative")
    for name in ("prefill_pairs", *_TIME_COLUMNS):
        text = cell(name)
        try:
            values[name] = float(text)
        except ValueError:
            raise fail(name, f"{text!r} is not a number") from None
        if not math.isfinite(values[name]) or values[name] < 0:
            raise fail(name, f"{text} is not a finite number >= 0")
    for name in _TIME_COLUMNS:
        if values[name] <= 0:
            raise fail(name, "a step time must be > 0")
    if values["new_tokens"] != values["prefill_tokens"] + values["n_decode"]:
        raise fail("new_tokens", "must equal prefill_tokens + n_decode")
    if values["new_tokens"] == 0:
        raise fail("new_tokens", "an empty step (no new tokens)")
    if (values["n_prefill"] == 0) != (values["prefill_tokens"] == 0):
        raise fail("n_prefill", "prefill chunks and prefill tokens must be both zero or both > 0")
    if values["prefill_tokens"] and values["prefill_pairs"] < values["prefill_tokens"]:
        raise fail("prefill_pairs", "fewer causal pairs than prefill tokens")
    return GridRow(kind=kind, line=line, **values)  # type: ignore[arg-type]
