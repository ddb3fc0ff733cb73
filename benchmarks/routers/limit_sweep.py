"""The sweep of smg cache_aware's limits (pure): its grids, the best point, and where to
extend a grid so that the best becomes interior."""

from __future__ import annotations

import math
from collections.abc import Sequence

SWEEP_CONCURRENCY = (16, 32, 64, 128)
SWEEP_QUEUE = (4, 16, 64)
SWEEP_QUEUE_AT = 16  # the queue size while the concurrency limit is swept
QUICK_SWEEP_CONCURRENCY = (16, 64, 256)
QUICK_SWEEP_QUEUE: tuple[int, ...] = ()
MAX_EXTENSIONS = 3  # per swept dimension


def pick_best(points: Sequence[dict], key: str) -> dict:
    """The best of ``points`` (each with ``key`` = the swept value, ``good`` and
    ``ttft_p99``): the most good requests; among ties an interior value first (a flat top
    reaching the grid's inside is not an edge optimum), then the lowest TTFT p99."""
    if not points:
        raise ValueError("no points")
    values = sorted(p[key] for p in points)
    top = max(p["good"] for p in points)
    tied = [p for p in points if p["good"] == top]
    interior = [p for p in tied if values[0] < p[key] < values[-1]]
    pool = interior or tied
    return min(pool, key=lambda p: (math.inf if p.get("ttft_p99") is None else p["ttft_p99"], p[key]))


def edge_extension(grid: Sequence[int], best: int, lower_bound: int = 0) -> int | None:
    """The value to add to ``grid`` so that ``best`` can become interior: twice the highest
    when ``best`` is the highest, half the lowest (not below ``lower_bound``) when it is the
    lowest; None when ``best`` is interior or already at ``lower_bound``."""
    values = sorted(set(grid))
    if best not in values:
        raise ValueError(f"{best} is not in the grid {values}")
    if best == values[-1]:
        return best * 2 if best > 0 else 1
    if best == values[0]:
        if best <= lower_bound:
            return None
        lower = max(lower_bound, best // 2)
        return None if lower in values else lower
    return None


def sweep_verdict(grid: Sequence[int], best: int, lower_bound: int = 0) -> str:
    """``interior``, ``at the lower bound`` (nothing lower exists), or ``edge``."""
    values = sorted(set(grid))
    if values[0] < best < values[-1]:
        return "interior"
    if best == values[0] and best <= lower_bound and best < values[-1]:
        return f"at the lower bound ({lower_bound})"
    return "edge"
