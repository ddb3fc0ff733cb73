"""Proactive garbage-collection trigger (FairBatching §4)."""

from __future__ import annotations

import math

import pytest

from policy_helpers import NOW, request
from sglang_ext.policy.gc import GcConfig, should_collect

CONFIG = GcConfig(min_decode_slack_s=0.5, min_interval_s=30.0)
CALM = [request("d1", 0.8), request("d2", 0.5 + 1e-6), request("d3", 2.0)]


def test_defaults() -> None:
    assert GcConfig() == GcConfig(0.5, 30.0)


def test_collects_when_all_conditions_hold() -> None:
    assert should_collect(CONFIG, CALM, NOW, last_collect_s=NOW - 30.0)
    assert should_collect(CONFIG, CALM, NOW, last_collect_s=None)  # never collected


def test_idle_rank_collects() -> None:
    assert should_collect(CONFIG, [], NOW, last_collect_s=None)
    assert should_collect(CONFIG, [], NOW, last_collect_s=NOW - 31)


def test_queued_prefill_blocks() -> None:
    # the prefill itself has ample slack; its presence alone blocks
    blocked = CALM + [request("p", 0.9, prefill=1)]
    assert not should_collect(CONFIG, blocked, NOW, last_collect_s=None)


def test_partly_done_prefill_blocks() -> None:
    blocked = CALM + [request("p", 0.9, prefill=10, context=5000, next_output_index=0)]
    assert not should_collect(CONFIG, blocked, NOW, last_collect_s=None)


def test_one_tight_decode_blocks() -> None:
    tight = CALM + [request("tight", 0.5 - 1e-6)]
    assert not should_collect(CONFIG, tight, NOW, last_collect_s=None)
    assert not should_collect(CONFIG, CALM + [request("late", -1.0)], NOW, last_collect_s=None)


def test_recent_collection_blocks() -> None:
    assert not should_collect(CONFIG, CALM, NOW, last_collect_s=NOW - 29.9)
    assert not should_collect(CONFIG, [], NOW, last_collect_s=NOW)


def test_each_condition_alone_blocks() -> None:
    assert should_collect(CONFIG, CALM, NOW, NOW - 60.0)  # the baseline collects
    assert not should_collect(CONFIG, CALM + [request("p", 5.0, prefill=3)], NOW, NOW - 60.0)
    assert not should_collect(CONFIG, CALM + [request("t", 0.1)], NOW, NOW - 60.0)
    assert not should_collect(CONFIG, CALM, NOW, NOW - 1.0)


def test_zero_thresholds() -> None:
    eager = GcConfig(min_decode_slack_s=0.0, min_interval_s=0.0)
    assert should_collect(eager, [request("d", 0.0 + 1e-9)], NOW, last_collect_s=NOW)
    assert not should_collect(eager, [request("d", -1e-3)], NOW, last_collect_s=NOW)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"min_decode_slack_s": -0.1}, "min_decode_slack_s"),
        ({"min_decode_slack_s": math.nan}, "min_decode_slack_s"),
        ({"min_decode_slack_s": math.inf}, "min_decode_slack_s"),
        ({"min_interval_s": -1.0}, "min_interval_s"),
        ({"min_interval_s": math.nan}, "min_interval_s"),
        ({"min_interval_s": math.inf}, "min_interval_s"),
    ],
)
def test_config_validation(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        GcConfig(**kwargs)
