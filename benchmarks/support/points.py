"""Saved benchmark points: one JSON object per line, appended as soon as a point finishes,
so a benchmark can run in parts and resume (:mod:`benchmarks.server.stock_vs_fairbatching`,
:mod:`benchmarks.server.admission`, :mod:`benchmarks.routers`).

A point's *resume key* is the tuple of some of its fields (dicts and lists compared by
their canonical JSON); a point holding an ``"error"`` does not count as done, so a resumed
run runs it again. Also: a mean-and-spread summary over seeds. No third-party imports
(the tests import this without SGLang).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path


def append_point(path: Path, point: dict) -> None:
    """Append ``point`` as one line of ``path`` (created with its folder), flushed at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as sink:
        sink.write(json.dumps(point) + "\n")
        sink.flush()


def load_points(path: Path) -> list[dict]:
    """Every point saved in ``path``, in the order saved (none if the file is missing)."""
    if not path.exists():
        return []
    points = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                points.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON point ({error})") from None
    return points


def move_aside(path: Path) -> Path | None:
    """Rename an existing ``path`` to ``<stem>-<UTC timestamp><suffix>`` next to it (a new
    run starts a fresh file; the old points are kept); return the new name, or None."""
    if not path.exists():
        return None
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.stem}-{stamp}{path.suffix}")
    index = 1
    while target.exists():
        target = path.with_name(f"{path.stem}-{stamp}-{index}{path.suffix}")
        index += 1
    path.rename(target)
    return target


def canonical(value: object) -> object:
    """A value comparable across saved points (containers as sorted-key JSON)."""
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True)
    return value


def point_key(point: dict, fields: Sequence[str]) -> tuple:
    """The values of ``fields`` in ``point`` (None where missing), hashable."""
    return tuple(canonical(point.get(name)) for name in fields)


def done_keys(points: Iterable[dict], fields: Sequence[str]) -> set[tuple]:
    """Resume keys of the points that finished without an error."""
    return {point_key(p, fields) for p in points if "error" not in p}


def latest_by_key(points: Iterable[dict], fields: Sequence[str]) -> list[dict]:
    """One point per key: the last good one saved, else the last failed one (input order)."""
    chosen: dict[tuple, dict] = {}
    for point in points:
        key = point_key(point, fields)
        if "error" not in point or key not in chosen or "error" in chosen[key]:
            chosen[key] = point
    return list(chosen.values())


def spread(values: Iterable[float | None]) -> dict | None:
    """Mean, min, max and count of the values that are numbers (None and NaN skipped);
    None when there are none."""
    numbers = [float(v) for v in values
               if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)]
    if not numbers:
        return None
    return {"mean": sum(numbers) / len(numbers), "min": min(numbers), "max": max(numbers),
            "n": len(numbers)}

