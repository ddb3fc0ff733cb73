"""The emulated device's clock: when each step runs, and the record of every step.

The device runs one step at a time.  A step launched at ``launch`` starts at
``max(launch, end of the previous step)`` and ends ``duration`` later, so a scheduler that
launches the next step before the current one has finished (SGLang's overlap mode) keeps the
device busy back to back, exactly as on a GPU.  Times are ``time.monotonic()`` seconds, which
on Linux is the system-wide ``CLOCK_MONOTONIC``: comparable across processes on one machine.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

__all__ = ["DeviceDeadline", "DeviceTimeline", "StepLog", "StepRecord"]


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One emulated forward step.

    ``context`` is the KV already cached that the step reads (prefix of each prefill chunk plus
    each decode's length before its new token) -- the simulator's and the step model's
    ``context``; ``seq_lens_sum`` is SGLang's ``sum(seq_lens)``, i.e. ``context + new_tokens``.
    """

    launch: float
    start: float
    end: float
    mode: str
    new_tokens: int
    context: int
    num_reqs: int
    prefill_tokens: int
    prefill_reqs: int
    decode_reqs: int
    seq_lens_sum: int

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def waited(self) -> float:
        """Seconds the step was queued behind the previous one (launch to start)."""
        return self.start - self.launch

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


class DeviceTimeline:
    """A single in-order device: each step starts when it is launched and the device is free."""

    __slots__ = ("busy_until",)

    def __init__(self) -> None:
        self.busy_until = 0.0

    def schedule(self, launch: float, duration: float) -> tuple[float, float]:
        """Place a step of ``duration`` seconds launched at ``launch``; return (start, end)."""
        if duration < 0:
            raise ValueError(f"negative step duration {duration!r}")
        start = max(launch, self.busy_until)
        end = start + duration
        self.busy_until = end
        return start, end


class DeviceDeadline:
    """Stands in for the CUDA event that marks a result's device-to-host copy as done.

    SGLang's result processor calls ``synchronize()`` before it reads a step's tokens; here
    that blocks until the emulated step has ended.  ``query()`` and ``record()`` complete the
    event interface SGLang uses.
    """

    __slots__ = ("deadline",)

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def query(self) -> bool:
        return time.monotonic() >= self.deadline

    def synchronize(self) -> None:
        sleep_until(self.deadline)

    def record(self, stream: object = None) -> None:
        """Nothing to record: the deadline was fixed when the step was launched."""


def sleep_until(deadline: float) -> None:
    """Sleep until ``time.monotonic()`` reaches ``deadline`` (returns at once if it has)."""
    remaining = deadline - time.monotonic()
    while remaining > 0:
        time.sleep(remaining)
        remaining = deadline - time.monotonic()


class StepLog:
    """The last ``capacity`` steps in memory and, optionally, every step as a JSON line.

    The file is opened for appending and flushed after every line, so a reader sees each
    step as soon as it has been launched.
    """

    def __init__(self, capacity: int = 65536, path: Path | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.path = path
        self._ring: deque[StepRecord] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        if path is not None:
            self._file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def append(self, record: StepRecord) -> None:
        with self._lock:
            self._ring.append(record)
            if self._file is not None:
                self._file.write(record.to_json() + "\n")

    def recent(self) -> list[StepRecord]:
        """The steps still held in memory, oldest first."""
        with self._lock:
            return list(self._ring)

    def __len__(self) -> int:
        return len(self._ring)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    @staticmethod
    def per_process_path(path: Path, several_processes: bool) -> Path:
        """``path`` itself, or ``path.<pid>`` when several scheduler processes share it."""
        return path.with_name(f"{path.name}.{os.getpid()}") if several_processes else path

    @staticmethod
    def read(path: str | Path) -> list[StepRecord]:
        """Every step written to a log file, in file order."""
        with open(path, encoding="utf-8") as handle:
            return [StepRecord(**json.loads(line)) for line in handle if line.strip()]
