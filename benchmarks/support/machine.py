"""What a benchmark records about the machine and the code it ran on: the CPU, CPU use
from ``/proc/stat``, the git commit of this checkout."""

from __future__ import annotations

import os
import platform
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.support.paths import REPO
from sglang_ext.provenance import git_state


def cpu_model() -> str | None:
    """The CPU's model name from ``/proc/cpuinfo`` (None where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info() -> dict:
    """The CPU, the CPUs this process may run on, Python, the load and the commit, now."""
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    git = git_state(REPO)
    return {
        "cpu_model": cpu_model() or platform.processor() or "unknown",
        "logical_cpus": os.cpu_count(),
        "pinned_to_cpus": affinity,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "load_average_at_start": list(os.getloadavg()),
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "git_commit": git["commit"] + (" (+ uncommitted changes)" if git["dirty"] else ""),
    }


def machine_line(info: dict) -> str:
    """:func:`machine_info` in one line, saying whether the run was pinned to one CPU."""
    pinned = info["pinned_to_cpus"]
    pin = (f"pinned to CPU {pinned[0]}" if pinned and len(pinned) == 1
           else f"NOT pinned (may run on CPUs {pinned})")
    return (
        f"{info['cpu_model']} ({info['logical_cpus']} logical CPUs, {pin}), {info['python']}, "
        f"{info['platform']}; load average at start {info['load_average_at_start'][0]:.2f}; "
        f"{info['date_utc']} UTC; commit {info['git_commit']}"
    )


def cpu_times() -> dict[str, list[int]]:
    """Per-CPU jiffies from /proc/stat:
    [busy (user+nice+system+irq+softirq), idle+iowait, steal]."""
    times = {}
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("cpu") and line[3:4].isdigit():
                name, *values = line.split()
                v = [int(x) for x in values] + [0] * 8
                times[name] = [v[0] + v[1] + v[2] + v[5] + v[6], v[3] + v[4], v[7]]
    except OSError:
        pass
    return times


def cpu_usage(before: dict[str, list[int]], after: dict[str, list[int]]) -> dict[str, dict]:
    """Per CPU, the busy and steal shares (percent) between two :func:`cpu_times`."""
    usage = {}
    for name in after:
        if name not in before:
            continue
        busy, idle, steal = (a - b for a, b in zip(after[name], before[name]))
        total = busy + idle + steal
        if total > 0:
            usage[name] = {"busy_pct": round(100 * busy / total, 1),
                           "steal_pct": round(100 * steal / total, 1)}
    return usage
