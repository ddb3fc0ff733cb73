"""Deprecated alias, kept for one release: ``python -m sglang_ext.replay`` runs
``python -m benchmarks.server.trace_replay`` (the trace replay client) with the same
arguments.

The replay client is a benchmark tool and lives in the checkout's ``benchmarks`` package,
which the wheel does not ship: this alias works only from a checkout (run in its root).
Anywhere else it prints a one-line error naming the new command and exits 2.
"""

from __future__ import annotations

import importlib.util
import runpy
import sys

TARGET = "benchmarks.server.trace_replay"


def main() -> int:
    try:
        found = importlib.util.find_spec(TARGET) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        print(f"error: python -m sglang_ext.replay is now `python -m {TARGET}`, run from the "
              "repository's root (the benchmarks package is not installed)", file=sys.stderr)
        return 2
    sys.argv[0] = TARGET
    runpy.run_module(TARGET, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
