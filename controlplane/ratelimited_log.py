"""Logging for errors that are handled, counted and must not flood the log.

An error that repeats (a peer sending bad frames, a full queue, a bug hit by every
message) is logged the first time and then at most once per ``interval_s`` for each
``key``; that next line carries ``suppressed=N``, the occurrences left out since the
previous one. Counting every occurrence is the caller's job (its counters), so the rate
limit loses no information, only lines.

Dependency-free: it takes a stdlib :class:`logging.Logger` (fields are rendered as
``key=value`` after the message) or anything with structlog's ``logger.warning(event,
**fields)`` methods. ``exc_info=True`` is passed through to either. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


@dataclass(slots=True)
class _Window:
    logged_at: float
    suppressed: int = 0


class RateLimitedLog:
    """``log.warning(key, event, **fields)``: at most one line per ``key`` per ``interval_s``.

    Keys name a kind of error (``"frame_dropped:client:invalid"``), not a peer or a
    request; past ``max_keys`` the oldest key is forgotten (its next occurrence logs)."""

    def __init__(self, logger: object, interval_s: float = 60.0, *, max_keys: int = 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0 or max_keys < 1:
            raise ValueError("interval_s must be >= 0 and max_keys >= 1")
        self.logger = logger
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()

    def debug(self, key: str, event: str, /, **fields: object) -> bool:
        return self.log("debug", key, event, **fields)

    def info(self, key: str, event: str, /, **fields: object) -> bool:
        return self.log("info", key, event, **fields)

    def warning(self, key: str, event: str, /, **fields: object) -> bool:
        return self.log("warning", key, event, **fields)

    def error(self, key: str, event: str, /, **fields: object) -> bool:
        return self.log("error", key, event, **fields)

    def log(self, level: str, key: str, event: str, /, **fields: object) -> bool:
        """Log unless ``key`` was logged less than ``interval_s`` ago; whether it logged."""
        now = self._clock()
        with self._lock:
            window = self._windows.get(key)
            if window is not None and now - window.logged_at < self.interval_s:
                window.suppressed += 1
                return False
            suppressed = window.suppressed if window is not None else 0
            self._windows.pop(key, None)
            if len(self._windows) >= self.max_keys:
                del self._windows[next(iter(self._windows))]
            self._windows[key] = _Window(now)
        if suppressed:
            fields["suppressed"] = suppressed
        self._emit(level, event, fields)
        return True

    def suppressed(self) -> dict[str, int]:
        """Occurrences not logged yet, by key (those with any)."""
        with self._lock:
            return {key: w.suppressed for key, w in self._windows.items() if w.suppressed}

    def _emit(self, level: str, event: str, fields: dict[str, object]) -> None:
        logger = self.logger
        if isinstance(logger, (logging.Logger, logging.LoggerAdapter)):
            exc_info = fields.pop("exc_info", False)
            rendered = " ".join(f"{name}={value!r}" if isinstance(value, str) else f"{name}={value}"
                                for name, value in fields.items())
            logger.log(_LEVELS[level], "%s", f"{event} {rendered}" if rendered else event,
                       exc_info=exc_info)
        else:
            getattr(logger, level)(event, **fields)
