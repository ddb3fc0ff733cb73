"""What FairBatching adds to SGLang's per-step scheduling time, on a real Scheduler.

Drives one SGLang 0.5.23 ``Scheduler`` (emulated GPU, CPU) step by step through
:mod:`benchmarks.server.scheduler_harness` with and without FairBatching, and reports
``get_next_batch_to_run`` wall time per step (p50/p99) at loads of N running requests
(``--running``, default 64, 256 and 1024, arriving :data:`ARRIVALS_PER_STEP` per step so
that the shipped admission takes them in rather than ending them at once) and a queue of
64 long prompts, plus the adapter's own decision time per step (views of every request,
the KV outlook, the policy's ``form_batch``, parking the deferred decodes: what
FairBatching adds before SGLang's own prefill admission) and, beside it, the step model's
learning after each step. ``stock`` is SGLang's default (prefill-first, chunk
8192); ``stock-mixed`` adds ``--enable-mixed-chunk`` with a 512-token chunk, which builds
mixed batches as FairBatching does. FairBatching runs the shipped config's policy and
admission (``configs/fairbatching.toml``) unless ``--policy`` names another (then
admission off): ``fairbatching`` as shipped (deciding on the table its view loops
collect, ``sglang_ext.adapter.scheduler.request_store``, from ``table_min_requests()``
requests, on the list of views below), ``fairbatching-tables`` and ``fairbatching-lists``
always on one or the other (the same decisions), and ``fairbatching-publishing`` as
shipped, publishing its class budgets at every decision (behind the control plane, or
with DP's pab method). Only busy steps count (at least half the
running requests decoding or parked). The runs of one size go in ``--rounds``
interleaved rounds (each in a fresh interpreter) and the samples of all rounds are
pooled, so a slow stretch of a shared machine hits all alike. The check, per size:
FairBatching's adapter plus policy no slower than stock's own ``get_next_batch_to_run``
at the same load. Writes ``docs/bench/adapter.json``. Run pinned to one core with the
test environment's Python (``FB_EXTRAS=dev,sglang source scripts/_env.sh``)::

    taskset -c 1 python -m benchmarks.server.adapter_cost
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import tomllib
from pathlib import Path

from benchmarks.server.scheduler_harness import HarnessFailed, run_scenario
from benchmarks.support.machine import cpu_times, cpu_usage, machine_info, machine_line
from benchmarks.support.paths import DOCS_BENCH, REPO

RUNNING = (64, 256, 1024)
WAITING = 64
#: the running requests arrive this many per step: as many at once as a rank admits in
#: time, so FairBatching's admission (``defer``) serves them all at every load
ARRIVALS_PER_STEP = 4
SHIPPED_CONFIG = REPO / "configs" / "fairbatching.toml"
#: name: (FairBatching, --enable-mixed-chunk, publishing budgets, the decision's input)
RUNS = {
    "stock": (False, False, False, None),
    "stock-mixed": (False, True, False, None),
    "fairbatching": (True, False, False, "auto"),
    "fairbatching-tables": (True, False, False, "tables"),
    "fairbatching-lists": (True, False, False, "lists"),
    "fairbatching-publishing": (True, False, True, "auto"),
}


def busy_steps(running: int) -> int:
    """A step counts when at least this many requests decode or are parked."""
    return running // 2


def scenario(config: Path | None, mixed: bool = False, publish: bool = False,
             running: int = 256, decision_path: str = "auto") -> dict:
    requests = [{"rid": f"run-{i}", "prompt_tokens": 128 + (i % 7) * 16, "max_new_tokens": 400,
                 "at_step": i // ARRIVALS_PER_STEP,
                 "slo": {"class": ("interactive", "standard", "relaxed")[i % 3]}} for i in range(running)]
    queue_at = max(40, running // ARRIVALS_PER_STEP + 8)
    requests += [{"rid": f"wait-{i}", "prompt_tokens": 2048, "max_new_tokens": 8, "at_step": queue_at,
                  "slo": {"class": "standard"}} for i in range(WAITING)]
    result = {"requests": requests, "overlap": False,
              "max_total_tokens": max(400_000, running * 700 + WAITING * 2_100),
              "timeout_s": 900, "max_steps": 400, "enable_mixed_chunk": mixed,
              "chunked_prefill_size": 512 if mixed else 8192, "record_triage": False, "check_rows": False,
              "publish_budgets": publish, "decision_path": decision_path}
    if config is not None:
        result["config"] = str(config)
    return result


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of ``values``; nan when there are none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> dict:
    if not values:
        return {"steps": 0}
    return {"p50": percentile(values, 0.5), "p90": percentile(values, 0.9),
            "p99": percentile(values, 0.99), "mean": round(statistics.fmean(values), 1),
            "steps": len(values)}


def run(name: str, config: Path | None, workdir: Path, mixed: bool = False,
        publish: bool = False, running: int = 256,
        decision_path: str = "auto") -> dict[str, list[float]]:
    """One run; the busy steps' ``get_next_batch_to_run`` times and, with FairBatching,
    the adapter's decision times of the same steps (microseconds)."""
    try:
        report = run_scenario(scenario(config, mixed, publish, running, decision_path), workdir,
                              f"{name}-{running}", timeout_s=1800)
    except HarnessFailed as error:
        raise SystemExit(f"{name} at {running} running failed: {error}") from None
    busy = [s for s in report["steps"]
            if s.get("decodes") and len(s["decodes"]) + len(s.get("parked", [])) >= busy_steps(running)]
    return {"get_next_batch_us": [s["get_next_batch_us"] for s in busy],
            "decision_us": [s["decision_us"] for s in busy if "decision_us" in s],
            "learning_us": [s["learning_us"] for s in busy if "learning_us" in s]}


def shipped_policy() -> str:
    return tomllib.loads(SHIPPED_CONFIG.read_text())["policy"]


def shipped_admission_table() -> str:
    """The shipped config's ``[admission]`` table (TOML), so FairBatching runs as shipped
    (under ``defer`` the queue forecast runs at every decision)."""
    admission = tomllib.loads(SHIPPED_CONFIG.read_text()).get("admission", {})
    lines = ["[admission]"] + [f"{key} = {value!r}" if isinstance(value, str) else f"{key} = {value}"
                               for key, value in admission.items()]
    return "\n".join(lines).replace("'", '"') + "\n"


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated counts, got {text!r}") from None
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError(f"every count must be >= 2, got {text!r}")
    return sizes


def _configs(text: str) -> tuple[str, ...]:
    names = tuple(part for part in text.split(",") if part)
    unknown = sorted(set(names) - set(RUNS))
    if unknown or "stock" not in names:
        raise argparse.ArgumentTypeError(
            f"configs must include 'stock' and name only {', '.join(RUNS)}; got {text!r}")
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default=None,
                        help=f"FairBatching's policy (default: the shipped config's, {shipped_policy()}, "
                        "with its [admission] table)")
    parser.add_argument("--running", type=_sizes, default=RUNNING,
                        help="running requests per load, comma-separated (default 64,256,1024)")
    parser.add_argument("--configs", type=_configs, default=tuple(RUNS),
                        help=f"the runs at each load (default all: {','.join(RUNS)})")
    parser.add_argument("--rounds", type=int, default=2,
                        help="interleaved rounds of a load's runs, samples pooled (default 2)")
    parser.add_argument("--out", type=Path, default=DOCS_BENCH / "adapter.json", help="JSON written")
    args = parser.parse_args(argv)
    policy = args.policy or shipped_policy()
    info = machine_info()
    workdir = Path(tempfile.mkdtemp(prefix="bench-adapter-"))
    config = workdir / "fb.toml"
    config.write_text(f'policy = "{policy}"\nslo_file = "{REPO}/configs/slo.toml"\n'
                      f'step_model = "{REPO}/configs/step_models/llama3.1-8b-h100.toml"\n'
                      + (shipped_admission_table() if args.policy is None else ""))
    before = cpu_times()
    loads = {}
    for running in args.running:
        samples: dict[str, dict[str, list[float]]] = {
            name: {"get_next_batch_us": [], "decision_us": [], "learning_us": []}
            for name in args.configs}
        per_round: dict[str, list[dict]] = {name: [] for name in args.configs}
        for round_ in range(args.rounds):
            for name in args.configs:
                fairbatching, mixed, publish, path = RUNS[name]
                got = run(name, config if fairbatching else None, workdir, mixed, publish,
                          running, path or "auto")
                for key, values in got.items():
                    samples[name][key] += values
                per_round[name].append({key: summary(values) for key, values in got.items() if values})
                print(f"{running} running, round {round_ + 1}/{args.rounds} {name:23s} "
                      f"get_next_batch_to_run p50 {percentile(got['get_next_batch_us'], 0.5):7.0f} us"
                      + (f", adapter+policy p50 {percentile(got['decision_us'], 0.5):6.0f} us"
                         if got["decision_us"] else ""), flush=True)
        results = {name: {key: summary(values) for key, values in cell.items()
                          if values or key == "get_next_batch_us"}
                   for name, cell in samples.items()}
        stock = results["stock"]["get_next_batch_us"]
        checks = {
            name: {q: {"fairbatching_us": cell["decision_us"][q], "stock_us": stock[q],
                       "no_slower": cell["decision_us"][q] <= stock[q]} for q in ("p50", "p99")}
            for name, cell in results.items()
            if cell.get("decision_us", {}).get("steps") and stock.get("steps")
        }
        loads[str(running)] = {
            "load": f"{running} decoding requests (three SLO classes), {WAITING} queued 2048-token "
                    f"prompts from step 40; busy steps only (>= {busy_steps(running)} decoding "
                    "or parked)",
            "adapter_plus_policy_vs_stock_get_next_batch": checks,
            **results,
            "rounds_detail": per_round,
        }
    usage = cpu_usage(before, cpu_times())
    doc = {
        "machine": machine_line(info),
        "machine_info": info,
        "cpu_usage_during_runs": usage,
        "fairbatching_policy": policy,
        "fairbatching_config": config.read_text(),
        "rounds": args.rounds,
        "command": "taskset -c 1 python -m benchmarks.server.adapter_cost"
                   + (" " + " ".join(argv if argv is not None else sys.argv[1:])),
        "note": "get_next_batch_us: SGLang's Scheduler.get_next_batch_to_run per step (with "
                "FairBatching: its hooks included, and SGLang's own prefill admission of the "
                "planned chunks); decision_us: FairBatching's adapter and policy alone (request "
                "views, the KV outlook, form_batch, parking), the 'adapter plus policy' of the "
                "check; learning_us: the step model's learning from the step's measured time, "
                "after the step (in process_batch_result, outside get_next_batch_to_run and "
                "the check), per step; fairbatching: on a table from table_min_requests() requests (the shipped "
                "adapter); fairbatching-tables / -lists: always on a table / on the list of "
                "views, request by request (the same decisions); fairbatching-publishing: the same rank publishing its class budgets "
                "at every decision, as behind the control plane or DP's pab method.",
        "loads": loads,
    }
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"machine: {doc['machine']}; CPU use: " + ", ".join(
        f"{cpu} busy {u['busy_pct']:.0f}%" for cpu, u in usage.items()))
    for running, load in loads.items():
        for name in args.configs:
            cell = load[name]
            if not cell["get_next_batch_us"]["steps"]:
                print(f"{running:>5} {name:23s} no busy step (at least {busy_steps(int(running))} "
                      "requests decoding or parked)")
                continue
            line = (f"{running:>5} {name:23s} get_next_batch_to_run p50/p90/p99 "
                    f"{cell['get_next_batch_us']['p50']:.0f}/{cell['get_next_batch_us']['p90']:.0f}/"
                    f"{cell['get_next_batch_us']['p99']:.0f} us "
                    f"({cell['get_next_batch_us']['steps']} busy steps)")
            if cell.get("decision_us", {}).get("steps"):
                line += (f"; adapter+policy p50/p90/p99 {cell['decision_us']['p50']:.0f}/"
                         f"{cell['decision_us']['p90']:.0f}/{cell['decision_us']['p99']:.0f} us")
            if cell.get("learning_us", {}).get("steps"):
                line += (f"; learning after the step p50/p99 {cell['learning_us']['p50']:.0f}/"
                         f"{cell['learning_us']['p99']:.0f} us")
            print(line)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
