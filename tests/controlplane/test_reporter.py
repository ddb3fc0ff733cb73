"""ReportPublisher: numbered reports on a PUSH socket that never blocks; ReportThrottle."""

from __future__ import annotations

import time

import pytest
import zmq

from controlplane import protocol as p
from controlplane.reporter import ReportPublisher, ReportThrottle

REPORTS = p.report_channel()


@pytest.fixture
def pull():
    socket = zmq.Context.instance().socket(zmq.PULL)
    socket.setsockopt(zmq.LINGER, 0)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    yield socket, f"tcp://127.0.0.1:{port}"
    socket.close()


def publish(publisher: ReportPublisher, echoed: int = 0) -> bool:
    return publisher.publish(1234.5, 2, 1, 900, 5000, echoed, 0.012)


def wait_connected(publisher: ReportPublisher, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not publish(publisher):
        assert time.monotonic() < deadline, "never connected"
        time.sleep(0.01)


def test_reports_are_numbered_from_one_and_decode(pull):
    socket, address = pull
    with ReportPublisher(address, "r0", 42) as publisher:
        wait_connected(publisher)
        first_sent = publisher.seq
        for echoed in (1, 2, 3):
            assert publish(publisher, echoed)
        reports = [REPORTS.decode(socket.recv()) for _ in range(4)]
    assert [r.seq for r in reports] == list(range(first_sent, first_sent + 4))
    assert reports[0].seq >= 1
    last = reports[-1]
    assert (last.rank, last.epoch, last.pab_tokens, last.running, last.waiting) == ("r0", 42, 1234.5, 2, 1)
    assert (last.total_tokens, last.free_kv_tokens, last.echoed_dispatch_seq, last.step_time_s) == (900, 5000, 3, 0.012)
    assert last.sent_at <= time.monotonic()


def test_without_a_daemon_reports_are_dropped_at_once_and_still_numbered():
    with ReportPublisher("tcp://127.0.0.1:1", "r0", 1) as publisher:
        started = time.monotonic()
        results = [publish(publisher) for _ in range(100)]
        assert time.monotonic() - started < 1.0
    assert not any(results)
    assert (publisher.seq, publisher.sent, publisher.dropped) == (100, 0, 100)


def test_a_daemon_that_does_not_read_never_blocks_the_publisher(pull):
    socket, address = pull
    socket.setsockopt(zmq.RCVHWM, 1)
    with ReportPublisher(address, "r0", 1, hwm=1) as publisher:
        wait_connected(publisher)
        started = time.monotonic()
        results = [publish(publisher) for _ in range(20_000)]
        assert time.monotonic() - started < 5.0
    assert not all(results) and publisher.dropped > 0
    assert publisher.sent + publisher.dropped == publisher.seq


def test_negative_load_values_are_clamped_to_what_the_wire_allows(pull):
    socket, address = pull
    with ReportPublisher(address, "r0", 1) as publisher:
        wait_connected(publisher)
        assert publisher.publish(-50.0, 0, 0, 0, -3, 0, -0.1)
        reports = [REPORTS.decode(socket.recv()) for _ in range(2)]
    assert (reports[-1].pab_tokens, reports[-1].free_kv_tokens, reports[-1].step_time_s) == (-50.0, 0, 0.0)


def test_invalid_hwm_is_refused():
    with pytest.raises(ValueError):
        ReportPublisher("tcp://127.0.0.1:1", "r0", 1, hwm=0)


def test_throttle_publishes_every_interval_and_sooner_on_a_change():
    throttle = ReportThrottle(interval_s=0.010, min_gap_s=0.002)
    assert throttle.due(0.0, (1, 0))
    throttle.published(0.0, (1, 0))
    assert not throttle.due(0.005, (1, 0))  # nothing changed, interval not over
    assert not throttle.due(0.001, (2, 0))  # changed, but within the minimum gap
    assert throttle.due(0.003, (2, 0))  # changed
    assert throttle.due(0.010, (1, 0))  # interval over
    assert throttle.next_due_s() == pytest.approx(0.010)


def test_the_default_throttle_is_a_slow_heartbeat_plus_changes():
    from controlplane.reporter import HEARTBEAT_S, MIN_GAP_S

    throttle = ReportThrottle()
    assert (throttle.interval_s, throttle.min_gap_s) == (HEARTBEAT_S, MIN_GAP_S) == (0.25, 0.001)
    throttle.published(10.0, ("idle",))
    assert not throttle.due(10.2, ("idle",)) and throttle.due(10.25, ("idle",))
    assert throttle.next_due_s(("idle",)) == 10.25
    assert throttle.due(10.002, ("busy",)) and throttle.next_due_s(("busy",)) == 10.0 + MIN_GAP_S


def test_budget_buckets_ignore_drift_and_see_moves():
    from controlplane.reporter import budget_bucket

    assert budget_bucket(10_000) == budget_bucket(10_040)  # a few tokens of drift
    assert budget_bucket(10_000) != budget_bucket(11_000)  # 10%
    assert budget_bucket(-10_000) == -budget_bucket(10_000) != 0
    assert budget_bucket(5) == budget_bucket(-5) == budget_bucket(float("nan")) == 0
