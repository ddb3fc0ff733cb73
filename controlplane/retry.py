"""The client's resubmission schedule, shared by the SDK and the cluster simulator's
model of it."""

from __future__ import annotations

DEFAULT_MAX_RETRIES = 3
DEFAULT_RETRY_BACKOFF_S = 0.05


def retry_delay(attempt: int, retry_after_s: float | None, backoff_s: float, jitter: float) -> float:
    """How long the client waits before resubmitting after its ``attempt``-th (from 1) was
    refused: the daemon's ``retry_after_s``, or the exponential backoff if longer, stretched
    by up to a quarter (``jitter`` in [0, 1))."""
    return max(retry_after_s or 0.0, backoff_s * 2 ** (attempt - 1)) * (1.0 + 0.25 * jitter)
