"""When the device will be free, for a scheduler that launches steps ahead of their
results (SGLang's overlap loop launches step k+1 while step k still runs).

Each launched step starts when the one before it ends, or at its own launch if the
device was idle; results come back in launch order. The clock re-anchors on every
result: the steps still in flight are laid out again from the moment the last one came
back, so a prediction that ran short is not carried into every later decision (a chain
of predictions alone falls behind by whole steps and never catches up: the launch of
k+1, right after k-1's result, then looks like an idle device).
"""

from __future__ import annotations

from collections import deque


class DeviceClock:
    def __init__(self) -> None:
        self._in_flight: deque[tuple[float, float]] = deque()  # (launched_at, predicted_s)
        self._last_done = 0.0
        self.free_at = 0.0  # predicted end of every step launched so far

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def launched(self, launched_at: float, predicted_s: float) -> None:
        self._in_flight.append((launched_at, predicted_s))
        self.free_at = max(launched_at, self.free_at) + predicted_s

    def completed(self, done_at: float) -> float:
        """The oldest step in flight came back at ``done_at``; returns when it started
        (its launch, or the previous result when the device was busy with that)."""
        launched_at = self._in_flight.popleft()[0] if self._in_flight else done_at
        started = max(launched_at, self._last_done)
        self._last_done = done_at
        free = done_at
        for launch, predicted in self._in_flight:
            free = max(free, launch) + predicted
        self.free_at = free
        return started
