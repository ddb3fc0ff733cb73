"""The daemon's measure of its own saturation: its event loop's busy share."""

from __future__ import annotations

import pytest

from controlplane.config import ConfigError, DaemonConfig
from controlplane.daemon import LoopBusy


def test_the_busy_share_follows_cpu_over_wall_time_smoothed_over_the_window():
    busy = LoopBusy(window_s=1.0)
    assert busy.sample(0.0, 0.0) == 0.0  # a first sample has nothing to compare with
    wall = cpu = 0.0
    for _ in range(60):  # 3 s fully busy, in 50 ms ticks
        wall, cpu = wall + 0.05, cpu + 0.05
        share = busy.sample(wall, cpu)
    assert share > 0.95
    for _ in range(60):  # 3 s idle
        wall += 0.05
        share = busy.sample(wall, cpu)
    assert share < 0.05
    for _ in range(4):  # a 200 ms burst is not saturation
        wall, cpu = wall + 0.05, cpu + 0.05
        share = busy.sample(wall, cpu)
    assert share < 0.5


def test_a_clock_that_does_not_advance_changes_nothing():
    busy = LoopBusy(window_s=1.0)
    busy.sample(1.0, 1.0)
    assert busy.sample(1.0, 2.0) == 0.0


def test_max_loop_busy_is_a_share():
    assert DaemonConfig().max_loop_busy == 0.95
    for bad in (0.0, 1.5):
        with pytest.raises(ConfigError, match="max_loop_busy"):
            DaemonConfig.from_mapping({"max_loop_busy": bad})
