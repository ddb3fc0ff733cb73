"""What the step log (``[trace] step_log``) costs the scheduler per step, off and on.

Off, the hooks test ``state.trace is None`` three times a step (the decision, the launch,
the result); on, they build the decision's deadlines, keep it with the launch and write
one JSON line per step. Both are timed here on the hooks' own code with a rank's worth
of requests (256 decoding, 64 queued; SGLang-like ``Req`` stand-ins: the log reads only
``rid`` and ``output_ids``), against the adapter's whole decision time measured on a real
SGLang scheduler (``docs/bench/adapter.json``). Writes ``docs/bench/step_trace.json``::

    python -m benchmarks.server.step_trace_cost
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
import timeit
from pathlib import Path
from types import SimpleNamespace

from benchmarks.support.paths import DOCS_BENCH
from sglang_ext.adapter.scheduler.step_trace import StepTrace
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.view import BatchDecision, RequestView
from sglang_ext.sim.gpu import StepShape

RUNNING = 256
WAITING = 64
REPEATS = 7


def off_path_ns() -> float:
    """The three ``is None`` tests a step makes with the log off, in nanoseconds."""
    state = SimpleNamespace(trace=None)

    def step() -> None:
        if state.trace is not None:
            raise AssertionError
        _ = state.trace.take_decision() if state.trace is not None else None
        if state.trace is not None:
            raise AssertionError

    runs = [timeit.timeit(step, number=200_000) / 200_000 for _ in range(REPEATS)]
    return min(runs) * 1e9


def on_path_us(directory: Path) -> dict[str, float]:
    slo = Slo(ttft_s=2.0, tpot_s=0.05)
    views = [RequestView(f"req-{i}", 100.0, slo, 20 + i % 50, 0, 1_000 + i, 900, i, 100.5)
             for i in range(RUNNING)]
    views += [RequestView(f"wait-{i}", 101.0, slo, 0, 2_048, 0, 2_048, RUNNING + i)
              for i in range(WAITING)]
    decision = BatchDecision(tuple(f"req-{i}" for i in range(RUNNING - 32)), (("wait-0", 512),))
    reqs = [SimpleNamespace(rid=f"req-{i}", output_ids=[0] * (20 + i % 50)) for i in range(RUNNING)]
    parked = reqs[RUNNING - 32:]
    features = StepShape(512, 512 * 256.5, 0, RUNNING - 32, 240_000, 1)
    trace = StepTrace(directory / "steps.jsonl")
    samples = []
    for _ in range(2_000):
        started = time.perf_counter()
        trace.decided(started, 1e-4, started, views, decision, True, WAITING, parked)
        traced = trace.take_decision()
        trace.step_done(traced, features, started, 0.02, 0.05, started + 0.02, 0.02, reqs[: RUNNING - 32])
        samples.append(time.perf_counter() - started)
    trace.close()
    ordered = sorted(samples)
    return {"p50": round(ordered[len(ordered) // 2] * 1e6, 1),
            "p99": round(ordered[int(0.99 * len(ordered))] * 1e6, 1),
            "mean": round(statistics.fmean(samples) * 1e6, 1),
            "bytes_per_step": round((directory / "steps.jsonl").stat().st_size / len(samples))}


def main() -> None:
    adapter = json.loads((DOCS_BENCH / "adapter.json").read_text())
    decision_us = adapter["loads"][str(RUNNING)]["fairbatching"]["decision_us"]
    with tempfile.TemporaryDirectory() as directory:
        on = on_path_us(Path(directory))
    off = off_path_ns()
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load": f"{RUNNING} decoding requests ({RUNNING - 32} in the step, 32 parked), {WAITING} queued",
        "off_ns_per_step": round(off, 1),
        "on_us_per_step": on,
        "adapter_decision_us_for_scale": decision_us,
    }
    out = DOCS_BENCH / "step_trace.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"step log off: {off:.0f} ns per step; on: p50 {on['p50']} us, p99 {on['p99']} us per step, "
          f"{on['bytes_per_step']} bytes per step; the adapter's decision p50/p99 {decision_us} us")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
