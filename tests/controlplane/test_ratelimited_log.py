"""The rate-limited log: first occurrence at once, then one line per key per interval."""

from __future__ import annotations

import logging

import pytest

from controlplane.ratelimited_log import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StructlogLike:
    """What structlog's bound loggers look like to the helper: ``warning(event, **fields)``."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):
        return lambda event, **fields: self.lines.append((level, event, fields))


def test_first_occurrence_logs_then_one_line_per_interval_with_the_count_left_out():
    clock, logger = Clock(), StructlogLike()
    log = RateLimitedLog(logger, 10.0, clock=clock)
    assert log.warning("drop:bad_magic", "frame dropped", peer="a")
    for _ in range(4):
        clock.now += 1.0
        assert not log.warning("drop:bad_magic", "frame dropped", peer="b")
    assert log.warning("drop:invalid", "frame dropped", peer="c")  # another key: its own window
    assert log.suppressed() == {"drop:bad_magic": 4}
    clock.now = 10.0
    assert log.warning("drop:bad_magic", "frame dropped", peer="d")
    assert not log.warning("drop:bad_magic", "frame dropped", peer="e")
    assert logger.lines == [
        ("warning", "frame dropped", {"peer": "a"}),
        ("warning", "frame dropped", {"peer": "c"}),
        ("warning", "frame dropped", {"peer": "d", "suppressed": 4}),
    ]
    assert log.suppressed() == {"drop:bad_magic": 1}


def test_stdlib_loggers_get_the_fields_rendered_and_the_traceback(caplog):
    log = RateLimitedLog(logging.getLogger("test.ratelimited"), 60.0)
    with caplog.at_level(logging.INFO, logger="test.ratelimited"):
        try:
            raise ValueError("broken")
        except ValueError:
            assert log.error("bug", "handler failed", exc_info=True, socket="client", count=3)
        assert log.info("plain", "nothing else")
        assert not log.error("bug", "handler failed")
    first, second = caplog.records
    assert first.levelno == logging.ERROR and first.getMessage() == "handler failed socket='client' count=3"
    assert first.exc_info[0] is ValueError
    assert second.getMessage() == "nothing else" and second.levelno == logging.INFO


def test_keys_are_bounded():
    clock, logger = Clock(), StructlogLike()
    log = RateLimitedLog(logger, 10.0, max_keys=2, clock=clock)
    for key in ("a", "b", "c", "a"):  # "a" was forgotten to make room for "c": it logs again
        assert log.info(key, key)
    assert [event for _, event, _ in logger.lines] == ["a", "b", "c", "a"]
    with pytest.raises(ValueError):
        RateLimitedLog(logger, -1.0)
