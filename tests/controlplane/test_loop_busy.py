"""The daemon's measure of its own saturation: its event loop's busy share."""

from __future__ import annotations

import time

import pytest
import zmq
from live import thread_daemon

from controlplane import daemon as daemon_module
from controlplane import protocol as p
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


def test_a_saturated_daemon_answers_new_submits_overloaded_until_its_loop_has_room(monkeypatch):
    share = {"now": 1.0}
    monkeypatch.setattr(daemon_module.LoopBusy, "sample", lambda self, wall_s, cpu_s: share["now"])
    replies = p.client_reply_channel()
    with thread_daemon() as running:
        client = zmq.Context.instance().socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(running.config.client_address)
        try:
            def answer(request_id: str):
                client.send(p.encode(p.Submit(request_id, p.Prompt(text="hi"), protocol=p.PROTOCOL_VERSION)))
                assert client.poll(5000), "no answer"
                return replies.decode(client.recv())

            deadline = time.monotonic() + 30
            while not running.daemon.core.saturated:
                assert time.monotonic() < deadline, "never saturated"
                time.sleep(0.01)
            refused = answer("during")
            assert (refused.reason, refused.retryable) == (p.RejectReason.OVERLOADED, True)
            assert refused.retry_after_s == running.config.retry_after_s and "saturated" in refused.detail
            share["now"] = 0.1
            while running.daemon.core.saturated:
                assert time.monotonic() < deadline, "never recovered"
                time.sleep(0.01)
            assert answer("after").reason is p.RejectReason.NO_RANKS  # admitted: no rank to take it
            assert running.counters()["saturated_on"] == running.counters()["saturated_off"] == 1
        finally:
            client.close()
