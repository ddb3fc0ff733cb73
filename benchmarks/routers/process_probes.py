"""Reading the stack's processes from outside: their CPU time (``/proc``), a dead server's
last error, and the prefill tokens the emulated GPU logged."""

from __future__ import annotations

import json
import os
from pathlib import Path


def proc_cpu_s(pid: int) -> float:
    """utime + stime of one process (all its threads), seconds; 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """utime + stime of every live process in the process group ``pgid``."""
    total = 0.0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def crash_summary(log_path: Path, lines: int = 3) -> str:
    """The last lines of a dead server's log that name an error (for the saved point)."""
    try:
        text = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return "log unreadable"
    starts = [i for i, line in enumerate(text) if "Traceback (most recent call last)" in line]
    if starts:  # the last traceback's last lines: where it failed and the exception
        block = []
        for line in text[starts[-1] + 1:]:
            if line.startswith("[") and block:
                break
            if line.strip() and not set(line.strip()) <= set("^~ "):
                block.append(line.strip())
        return f"{log_path.name}: " + " | ".join(block[-lines:])
    errors = [line.strip() for line in text if "Error" in line and "Ignore import error" not in line]
    return f"{log_path.name}: " + (" | ".join(errors[-lines:]) or "no error line in the log")


class StepLogTail:
    """Prefill tokens the emulated GPU computed, read from its step log since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def skip(self) -> None:
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def prefill_tokens(self) -> int:
        if not self.path.exists():
            return 0
        total = 0
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            if b'"prefill_tokens"' in line:
                total += json.loads(line).get("prefill_tokens", 0)
        return total
