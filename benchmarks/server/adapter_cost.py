"""What FairBatching adds to SGLang's per-step scheduling time, on a real Scheduler.

Drives one SGLang 0.5.23 ``Scheduler`` (emulated GPU, CPU) step by step through
:mod:`benchmarks.server.scheduler_harness` with and without FairBatching, and reports
``get_next_batch_to_run`` wall time per step (p50/p99) at a load of about 256 running
requests and a queue of long prompts, plus the adapter's own decision time. ``stock``
is SGLang's default (prefill-first, chunk 8192); ``stock-mixed`` adds
``--enable-mixed-chunk`` with a 512-token chunk, which builds mixed batches as
FairBatching does. Writes
``docs/bench/adapter.json``. Run with the test environment's Python
(``FB_EXTRAS=dev,sglang source scripts/_env.sh``)::

    python -m benchmarks.server.adapter_cost
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

from benchmarks.server.scheduler_harness import HarnessFailed, run_scenario
from benchmarks.support.paths import DOCS_BENCH, REPO

RUNNING = 256
WAITING = 64


def scenario(config: Path | None, mixed: bool = False) -> dict:
    requests = [{"rid": f"run-{i}", "prompt_tokens": 128 + (i % 7) * 16, "max_new_tokens": 400,
                 "slo": {"class": ("interactive", "standard", "relaxed")[i % 3]}} for i in range(RUNNING)]
    requests += [{"rid": f"wait-{i}", "prompt_tokens": 2048, "max_new_tokens": 8, "at_step": 40,
                  "slo": {"class": "standard"}} for i in range(WAITING)]
    result = {"requests": requests, "overlap": False, "max_total_tokens": 400_000,
              "timeout_s": 900, "max_steps": 400, "enable_mixed_chunk": mixed,
              "record_triage": False,
              "chunked_prefill_size": 512 if mixed else 8192}
    if config is not None:
        result["config"] = str(config)
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(name: str, config: Path | None, workdir: Path, mixed: bool = False) -> dict:
    try:
        report = run_scenario(scenario(config, mixed), workdir, name, timeout_s=1800)
    except HarnessFailed as error:
        raise SystemExit(f"{name} failed: {error}") from None
    busy = [s["get_next_batch_us"] for s in report["steps"]
            if s.get("decodes") and len(s["decodes"]) + len(s.get("parked", [])) >= RUNNING // 2]
    return {
        "steps_measured": len(busy),
        "get_next_batch_us": {"p50": percentile(busy, 0.5), "p99": percentile(busy, 0.99),
                              "mean": round(statistics.fmean(busy), 1)},
        "fairbatching_decision_us": (report["fairbatching"] or {}).get("decision_us"),
    }


def main() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="bench-adapter-"))
    config = workdir / "fb.toml"
    config.write_text(f'policy = "fb-anchor-margin"\nslo_file = "{REPO}/configs/slo.toml"\n'
                      f'step_model = "{REPO}/configs/step_models/llama3.1-8b-h100.toml"\n')
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
               "load": f"{RUNNING} decoding requests, {WAITING} queued 2048-token prompts",
               "stock": run("stock", None, workdir),
               "stock-mixed": run("stock-mixed", None, workdir, mixed=True),
               "fairbatching": run("fairbatching", config, workdir)}
    out = DOCS_BENCH / "adapter.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    for name in ("stock", "stock-mixed", "fairbatching"):
        r = results[name]
        print(f"{name:13s} get_next_batch_to_run p50 {r['get_next_batch_us']['p50']:8.0f} us  "
              f"p99 {r['get_next_batch_us']['p99']:8.0f} us  ({r['steps_measured']} busy steps)"
              + (f"; adapter+policy p50/p99 {r['fairbatching_decision_us']}" if r["fairbatching_decision_us"] else ""))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
