"""What else ran on the machine during a real-server run: CPU use and other SGLang
servers (a shared machine's noise, recorded with each point)."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from benchmarks.support.machine import cpu_times, cpu_usage


def foreign_sglang(own_pgid: int | None) -> list[str]:
    """SGLang server processes on this machine that are not in our server's process group."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            pgid = os.getpgid(int(proc.name))
        except (OSError, ProcessLookupError):
            continue
        if "sglang.launch_server" in cmdline and pgid != own_pgid:
            found.append(f"{proc.name}: {cmdline[:120].strip()}")
    return found


def wait_quiet(own_pgid: int | None, limit_s: float) -> float:
    """Wait (at most ``limit_s``) until no foreign SGLang server runs; return the wait."""
    start = time.monotonic()
    announced = False
    while foreign_sglang(own_pgid) and time.monotonic() - start < limit_s:
        if not announced:
            print(f"  waiting up to {limit_s:.0f} s for other SGLang servers to stop: "
                  f"{foreign_sglang(own_pgid)}", file=sys.stderr)
            announced = True
        time.sleep(5)
    return time.monotonic() - start


class Watch:
    """CPU use (/proc/stat) and foreign SGLang servers over one run."""

    def __init__(self, own_pgid: int | None) -> None:
        self.own_pgid = own_pgid
        self.foreign: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> Watch:
        self._cpu0 = cpu_times()
        self._load0 = os.getloadavg()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.cpu = cpu_usage(self._cpu0, cpu_times())
        self.load = os.getloadavg()

    def _sample(self) -> None:
        while not self._stop.wait(2.0):
            self.foreign.update(foreign_sglang(self.own_pgid))

    def record(self) -> dict:
        return {"cpu": self.cpu, "load_average_before": self._load0, "load_average_after": self.load,
                "foreign_sglang_servers": sorted(self.foreign)}
