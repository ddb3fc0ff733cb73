"""When to run a full garbage collection (FairBatching §4).

Python's stop-the-world GC can pause a step for hundreds of milliseconds; collecting
proactively while nothing is urgent keeps those pauses out of request bursts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sglang_ext.policy.view import RequestState


@dataclass(frozen=True, slots=True)
class GcConfig:
    min_decode_slack_s: float = 0.5  # every decode must be at least this far ahead of its deadline
    min_interval_s: float = 30.0  # seconds since the previous collection

    def __post_init__(self) -> None:
        if not (math.isfinite(self.min_decode_slack_s) and self.min_decode_slack_s >= 0):
            raise ValueError(f"min_decode_slack_s must be >= 0, got {self.min_decode_slack_s}")
        if not (math.isfinite(self.min_interval_s) and self.min_interval_s >= 0):
            raise ValueError(f"min_interval_s must be >= 0, got {self.min_interval_s}")


def should_collect(
    config: GcConfig, requests: Sequence[RequestState], now: float, last_collect_s: float | None
) -> bool:
    """Collect when no prefill is queued, every decode has ample slack, and the last
    collection is at least ``min_interval_s`` old (``None``: never collected)."""
    if last_collect_s is not None and now - last_collect_s < config.min_interval_s:
        return False
    for request in requests:
        if request.pending_prefill > 0:
            return False
        slo = request.slo
        slack = request.arrival + slo.ttft_s + slo.tpot_s * request.next_output_index - now
        if slack < config.min_decode_slack_s:
            return False
    return True
