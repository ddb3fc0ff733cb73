"""The client's resubmission schedule."""

from __future__ import annotations

import pytest

from controlplane.retry import retry_delay


def test_the_daemons_retry_after_wins_until_the_backoff_outgrows_it() -> None:
    assert [retry_delay(attempt, 0.25, 0.05, 0.0) for attempt in (1, 2, 3, 4)] == \
        [0.25, 0.25, 0.25, 0.4]
    assert retry_delay(1, None, 0.05, 0.0) == 0.05


def test_jitter_stretches_the_wait_by_at_most_a_quarter() -> None:
    assert retry_delay(1, 0.25, 0.05, 0.999) == pytest.approx(0.25 * 1.24975)
    assert retry_delay(2, None, 0.05, 0.5) == pytest.approx(0.1 * 1.125)
