"""A rank's load reports: a synchronous PUSH socket that never blocks its caller.

When to report (:class:`ReportThrottle`): as soon as the load changed (at most every
``min_gap_s``), and otherwise every ``HEARTBEAT_S`` (0.25 s) so that an idle rank stays
fresh: the daemon's ``stale_after_s`` (1 s by default) must exceed that, and a rank that
skips about four heartbeats in a row is stale. A rank states what counts as a change in
its throttle key; budgets enter it through :func:`budget_bucket`, so the drift of a
budget by a few tokens between steps is no change, and a move of about 6% is one.

It lives in the process that knows the load (an SGLang scheduler, a simulated rank),
which may have no event loop. A report that cannot be queued at once (no daemon
connected, or ``hwm`` reports already waiting) is dropped: only the latest load
matters, and the next report replaces it. Drops are counted (``dropped``) and logged at
most once a minute.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Hashable, Mapping

import zmq

from controlplane.curve import CurvePeer
from controlplane.protocol import ClassBudget, Report, encode
from controlplane.ratelimited_log import RateLimitedLog

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.25  # a report at least this often when nothing changed
MIN_GAP_S = 0.001  # and when something did, at most this often
BUDGET_BUCKETS_PER_DOUBLING = 12  # budget_bucket's resolution: about 6% of the budget


class ReportPublisher:
    """Numbers every report it builds per (rank, epoch) from 1, sent or dropped, so the
    daemon's ``seq_gaps`` counts the reports lost anywhere between here and there."""

    def __init__(
        self,
        address: str,
        rank: str,
        epoch: int,
        *,
        hwm: int = 16,
        context: zmq.Context | None = None,
        curve: CurvePeer | None = None,
    ) -> None:
        if hwm < 1:
            raise ValueError(f"hwm must be >= 1, got {hwm}")
        self.address = address
        self.rank = rank
        self.epoch = epoch
        self.seq = 0
        self.sent = 0
        self.dropped = 0
        self._rare_log = RateLimitedLog(logger, 60.0)
        self._socket = (context or zmq.Context.instance()).socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        # NOTE: queue only to a connected daemon; reports queued while none is would
        # all arrive stale the moment it starts.
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        if curve is not None:
            curve.apply(self._socket)
        self._socket.connect(address)

    def publish(
        self,
        pab_tokens: float,
        running: int,
        waiting: int,
        total_tokens: int,
        free_kv_tokens: int,
        echoed_dispatch_seq: int,
        step_time_s: float,
        class_budgets: Mapping[str, ClassBudget] | None = None,
    ) -> bool:
        """Queue one report without blocking; False when it was dropped.
        ``class_budgets``: see :func:`controlplane.protocol.pack_class_budgets`."""
        self.seq += 1
        report = Report(
            rank=self.rank,
            epoch=self.epoch,
            seq=self.seq,
            pab_tokens=float(pab_tokens),
            running=running,
            waiting=waiting,
            total_tokens=total_tokens,
            free_kv_tokens=max(0, free_kv_tokens),
            echoed_dispatch_seq=echoed_dispatch_seq,
            step_time_s=max(0.0, step_time_s),
            sent_at=time.monotonic(),
            class_budgets=dict(class_budgets or {}),
        )
        try:
            self._socket.send(encode(report), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            self._rare_log.warning("report_dropped", "load report dropped (no daemon connected, or "
                                   "the send queue is full)", address=self.address, rank=self.rank,
                                   dropped_total=self.dropped)
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        self._socket.close(linger=0)

    def __enter__(self) -> ReportPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def budget_bucket(tokens: float) -> int:
    """A budget as a throttle key sees it: equal for budgets within about 6% of each other
    (and for any two within 16 tokens of zero), signed."""
    magnitude = abs(tokens)
    if not magnitude >= 16:  # also NaN
        return 0
    bucket = 1 + int(math.log2(magnitude / 16) * BUDGET_BUCKETS_PER_DOUBLING)
    return bucket if tokens > 0 else -bucket


class ReportThrottle:
    """When to publish: every ``interval_s`` (the heartbeat, so an idle rank stays fresh),
    and sooner, but at most every ``min_gap_s``, when the material state (``key``) changed."""

    def __init__(self, interval_s: float = HEARTBEAT_S, min_gap_s: float = MIN_GAP_S) -> None:
        if interval_s <= 0 or min_gap_s < 0:
            raise ValueError("interval_s must be > 0 and min_gap_s >= 0")
        self.interval_s = interval_s
        self.min_gap_s = min(min_gap_s, interval_s)
        self._last_s = -float("inf")
        self._last_key: Hashable = object()

    def due(self, now_s: float, key: Hashable) -> bool:
        elapsed = now_s - self._last_s
        return elapsed >= self.interval_s or (key != self._last_key and elapsed >= self.min_gap_s)

    def published(self, now_s: float, key: Hashable) -> None:
        self._last_s = now_s
        self._last_key = key

    def next_due_s(self, key: Hashable = None) -> float:
        """When a report falls due: the heartbeat if nothing changes, or (``key``, the
        state now, differs from the last one published) once the minimum gap is over."""
        if key is not None and key != self._last_key:
            return self._last_s + self.min_gap_s
        return self._last_s + self.interval_s
