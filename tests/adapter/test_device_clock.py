"""The adapter's model of when the device is free under SGLang's overlap loop (pure)."""

from __future__ import annotations

import pytest

from sglang_ext.adapter.scheduler.device_clock import DeviceClock


def overlap_loop(durations: list[float], predicted: list[float], host_s: float = 0.001):
    """Replays the overlap loop's order (decide k+1, launch k+1, wait for and process k)
    on a device that runs ``durations``; yields (decision time, clock's start, true start)."""
    clock = DeviceClock()
    now = 0.0
    device_end = 0.0
    ends: list[float] = []
    for k, (duration, guess) in enumerate(zip(durations, predicted)):
        yield now, max(now, clock.free_at), max(now, device_end)
        start = max(now, device_end)
        device_end = start + duration
        ends.append(device_end)
        clock.launched(now, guess)
        if k > 0:
            now = max(now, ends[k - 1])  # the host waits for step k-1's result
            clock.completed(now)
        now += host_s


def test_a_chain_of_short_predictions_does_not_fall_a_step_behind():
    durations = [0.014] * 50 + [0.030] + [0.014] * 50
    predicted = [0.014] * 50 + [0.010] + [0.014] * 50  # one step ran 20 ms longer than predicted
    errors = [true - planned for _, planned, true in overlap_loop(durations, predicted)]
    assert max(abs(e) for e in errors[60:]) < 0.002, "re-anchored on every result"


def test_measured_start_is_the_launch_or_the_previous_result():
    clock = DeviceClock()
    clock.launched(1.0, 0.010)
    clock.launched(1.002, 0.010)
    assert clock.free_at == pytest.approx(1.020)
    assert clock.completed(1.011) == 1.0
    assert clock.free_at == pytest.approx(1.021), "the step in flight starts when its predecessor ended"
    assert clock.completed(1.022) == pytest.approx(1.011)
    assert clock.in_flight == 0 and clock.free_at == pytest.approx(1.022)


def test_a_result_without_a_launch_leaves_the_clock_at_that_result():
    clock = DeviceClock()
    assert clock.completed(2.0) == 2.0
    assert clock.free_at == 2.0
