"""A property campaign against the adapter's memory contract: seeded random scenarios
driven through a real SGLang ``Scheduler`` (emulated GPU, CPU), the contract checked
after every step.

The contract (docs/sglang.md, *Memory contract*), one check each:

- ``oom``: nothing is allocated past free + evictable KV (SGLang raises when it would be);
- ``remainder_unreserved``: a cut prompt's remainder still fits in free + evictable KV
  after the step (asserted where every request ignores EOS, so every reservation is
  exact; elsewhere SGLang's own retraction covers decodes that outgrow their estimate);
- ``chunk_dropped``: a prefill step either continues the chunked request or admits no
  other prompt, and no chunk is counted in flight twice;
- ``decode_sat_out``: a decode left out of a mixed step is one the policy parked, or one
  the adapter reported sitting out (and it runs in the next step);
- ``rows_exceeded``: running, parked and admitted requests together fit the request pool
  and ``max_running_requests``;
- ``leak`` / ``not_idle``: after the drain every KV slot is free or evictable, nothing is
  parked, queued or running;
- ``lost_answer`` / ``duplicate_answer``: every request gets exactly one final answer.

Each worker process runs many scenarios, a fresh ``Scheduler`` each (the plugin's hooks
patch SGLang process-wide, so a worker is FairBatching only). From the repository root::

    python -m benchmarks.server.kv_campaign --scenarios 400 --seed 0 --out docs/bench/kv_campaign.json

The scenario generator is :func:`random_scenario` (pure, seeded); ``--replay SEED``
runs one scenario and prints its steps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.server.emulated import PROFILE
from benchmarks.support.paths import pythonpath_with_checkout

REPO = Path(__file__).resolve().parents[2]
RESULT_PREFIX = "KV-CAMPAIGN "
POLICIES = ("fb", "fb-smooth")
ADMISSION = (("off", None), ("reject", None), ("defer", "longest"), ("defer", "fair"),
             ("defer", "latest"))
SLOS = ({"class": "interactive"}, {"class": "standard"}, {"class": "relaxed"},
        {"ttft_ms": 100, "tpot_ms": 15}, {"ttft_ms": 1, "tpot_ms": 1})
ABORT_TARGETS = ("waiting", "chunked", "parked", "decoding")


@dataclass(frozen=True)
class Scenario:
    seed: int
    pool_tokens: int
    chunked_prefill_size: int
    overlap: bool
    radix_cache: bool
    priority: bool
    policy: str
    admission_mode: str
    give_up: str | None
    prefill_piece_tokens: int | None
    requests: tuple[Mapping[str, Any], ...]
    aborts: tuple[tuple[int, str], ...]  # (step, which kind of request to abort then)
    max_running_requests: int | None = None

    def server_flags(self) -> dict[str, Any]:
        return {"max_total_tokens": self.pool_tokens, "chunked_prefill_size": self.chunked_prefill_size,
                "overlap": self.overlap, "disable_radix_cache": not self.radix_cache,
                "enable_priority_scheduling": self.priority,
                "max_running_requests": self.max_running_requests}

    def config_text(self) -> str:
        admission = f'[admission]\nmode = "{self.admission_mode}"\n'
        if self.give_up is not None:
            admission += f'give_up = "{self.give_up}"\n'
        return (f'policy = "{self.policy}"\nslo_file = "{REPO / "configs" / "slo.toml"}"\n'
                f'step_model = "{REPO / "configs" / "step_models" / "llama3.1-8b-h100.toml"}"\n'
                + admission)


def random_scenario(seed: int) -> Scenario:
    """A scenario drawn from ``seed``: pools from just above one prompt to large, prompt
    and output lengths from tiny to the pool's size, arrivals per step, shared prefixes,
    aborts in every state, priorities, every admission mode and ``give_up``, partial
    prefill plans on and off, both loops."""
    rng = random.Random(seed)
    pool = rng.choice((600, 1200, 2000, 3300, 5000, 12000))
    chunk = rng.choice((128, 256, 512, 2048, 8192))
    mode, give_up = rng.choice(ADMISSION)
    requests = []
    step = 0
    shapes = ("tiny", "short", "long", "pool", "beyond")
    weights = (3, 6, 3, 1, 0.3)
    for i in range(rng.randint(4, 24)):
        step += rng.choice((0, 0, 1, 1, 2, 5))
        shape = rng.choices(shapes, weights)[0]
        prompt = {"tiny": rng.randint(1, 8), "short": rng.randint(16, 200),
                  "long": rng.randint(300, max(301, pool // 2)),
                  "pool": rng.randint(max(1, pool // 2), pool - 40),
                  "beyond": rng.randint(pool, pool * 2)}[shape]
        max_new = rng.choice((1, 2, 8, 40, rng.randint(1, max(1, pool // 4))))
        spec: dict[str, Any] = {"rid": f"r{i}", "prompt_tokens": max(1, prompt), "max_new_tokens": max_new,
                                "at_step": step, "slo": rng.choice(SLOS),
                                "ignore_eos": rng.random() < 0.8}
        if rng.random() < 0.4:
            spec["prefix_group"] = f"g{rng.randint(0, 2)}"
        if rng.random() < 0.5:
            spec["priority"] = rng.randint(-5, 5)
        requests.append(spec)
    aborts = tuple(sorted((rng.randint(0, step + 40), rng.choice(ABORT_TARGETS))
                          for _ in range(rng.choice((0, 0, 1, 2, 4)))))
    return Scenario(
        seed=seed, pool_tokens=pool, chunked_prefill_size=chunk, overlap=rng.random() < 0.5,
        radix_cache=rng.random() < 0.6, priority=rng.random() < 0.3,
        policy=rng.choice(POLICIES), admission_mode=mode, give_up=give_up,
        prefill_piece_tokens=rng.choice((None, None, 64, 256)), requests=tuple(requests), aborts=aborts,
        max_running_requests=rng.choice((None, None, 4, 16)),
    )


@dataclass
class Outcome:
    seed: int
    steps: int = 0
    violations: Counter[str] = field(default_factory=Counter)
    first_violation: str | None = None
    retracted: int = 0
    aborted: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0

    def violate(self, kind: str, detail: str) -> None:
        self.violations[kind] += 1
        if self.first_violation is None:
            self.first_violation = f"{kind}: {detail}"


def run_scenario(scenario: Scenario, max_steps: int = 30_000, trace: list | None = None) -> Outcome:
    """Drive ``scenario`` through a fresh ``Scheduler`` in this process (the plugin
    loaded), checking the contract after every step; the process's parallel groups are
    torn down after it, so the next scenario can build its own."""
    try:
        return _run_scenario(scenario, max_steps, trace)
    finally:
        from sglang.srt.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        destroy_model_parallel()
        destroy_distributed_environment()


def _run_scenario(scenario: Scenario, max_steps: int, trace: list | None) -> Outcome:
    from sglang.srt.managers.io_struct import AbortReq

    from benchmarks.server.scheduler_harness import (
        _cap_planned_prefills,
        _capture_outputs,
        build_scheduler,
        run_step,
        submit,
    )
    from sglang_ext.adapter.extension_config import ExtensionConfig
    from sglang_ext.adapter.scheduler.hooks import attach

    outcome = Outcome(scenario.seed)
    started = time.perf_counter()
    scheduler = build_scheduler(scenario.server_flags())
    with tempfile.TemporaryDirectory(prefix="fb-campaign-") as tmp:
        config_path = Path(tmp) / "fb.toml"
        config_path.write_text(scenario.config_text())
        state = attach(scheduler, ExtensionConfig.load(config_path))
    if scenario.prefill_piece_tokens:
        _cap_planned_prefills(state, scenario.prefill_piece_tokens)
    outputs = _capture_outputs(scheduler)
    exact = all(spec.get("ignore_eos", True) for spec in scenario.requests)
    pending = list(scenario.requests)
    aborts = list(scenario.aborts)
    rng = random.Random(scenario.seed + 1)
    last_batch = None
    sat_out: set[Any] = set()
    step = 0
    try:
        while step < max_steps:
            while pending and pending[0]["at_step"] <= step:
                submit(scheduler, pending.pop(0))
            while aborts and aborts[0][0] <= step:
                _, target = aborts.pop(0)
                rid = _pick(scheduler, state, target, rng)
                if rid is not None:
                    scheduler.abort_request(AbortReq(rid=rid))
                    outcome.aborted[rid] = target
            scheduler.process_input_requests(scheduler._poll_timeout_aborts())
            told = getattr(state.counters, "decodes_sat_out", 0)
            plan = scheduler.get_next_batch_to_run(scheduler.running_batch, last_batch)
            reporter = scheduler.metrics_reporter
            outcome.retracted += getattr(reporter, "num_retracted_reqs", 0) or 0
            reporter.num_retracted_reqs = 0
            scheduler.running_batch = plan.running_batch
            batch = plan.batch_to_run
            sat_out = _check_formed(scheduler, state, batch, sat_out, told, outcome, step)
            if trace is not None:
                trace.append(_describe(scheduler, state, batch, step))
            run_step(scheduler, batch, last_batch)
            _check_after(scheduler, exact, outcome, step)
            last_batch = batch
            step += 1
            if (not pending and not aborts and batch is None and scheduler.is_fully_idle()
                    and not scheduler.waiting_queue):
                break
    except Exception as exc:  # noqa: BLE001 - a crash is the finding, not the campaign's end
        kind = "oom" if "Out of memory" in str(exc) else "crash"
        outcome.violate(kind, f"step {step}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        outcome.steps = step
        outcome.wall_s = time.perf_counter() - started
        return outcome
    outcome.steps = step
    _check_drained(scheduler, state, scenario, outputs, outcome, scheduler.model_config.context_len)
    outcome.wall_s = time.perf_counter() - started
    return outcome


def _pick(scheduler: Any, state: Any, target: str, rng: random.Random) -> Any:
    if target == "waiting":
        reqs = list(scheduler.waiting_queue)
    elif target == "chunked":
        reqs = [scheduler.chunked_req] if scheduler.chunked_req is not None else []
    elif target == "parked":
        reqs = list(state.parked.reqs) if state.parked is not None else []
    else:
        reqs = list(scheduler.running_batch.reqs)
    reqs = [r for r in reqs if not r.finished()]
    return rng.choice(reqs).rid if reqs else None


def _check_formed(scheduler: Any, state: Any, batch: Any, sat_out_before: set[Any], told: int,
                  outcome: Outcome, step: int) -> set[Any]:
    parked = {r.rid for r in state.parked.reqs} if state.parked is not None else set()
    running = [r for r in scheduler.running_batch.reqs if not r.finished()]
    in_batch = {r.rid for r in batch.reqs} if batch is not None else set()
    sat_out: set[Any] = set()
    if batch is not None and batch.forward_mode.is_extend():
        sat_out = {r.rid for r in running} - in_batch - parked
        if sat_out and getattr(state.counters, "decodes_sat_out", 0) == told:
            outcome.violate("decode_sat_out", f"step {step}: {sorted(sat_out)} left out of a mixed step untold")
        again = sat_out & sat_out_before
        if again:
            outcome.violate("decode_sat_out", f"step {step}: {sorted(again)} left out of two steps in a row")
        prefill_reqs = [r for r in batch.reqs if r not in (batch.decoding_reqs or [])]
        chunked = scheduler.chunked_req
        if chunked is not None and prefill_reqs and chunked not in prefill_reqs:
            outcome.violate("chunk_dropped", f"step {step}: prompts admitted beside an uncontinued chunk")
        limit = 2 if scheduler.enable_overlap else 1
        if chunked is not None and chunked.inflight_middle_chunks > limit:
            outcome.violate("chunk_dropped", f"step {step}: inflight_middle_chunks={chunked.inflight_middle_chunks}")
    live = len(running) + len(parked) + (len(in_batch) if batch is not None and batch.forward_mode.is_extend() else 0)
    cap = scheduler.max_running_requests
    if cap is not None and live - len(set(r.rid for r in running) & in_batch) > cap + 1:
        outcome.violate("rows_exceeded", f"step {step}: {live} requests hold rows, max_running_requests={cap}")
    if scheduler.req_to_token_pool.available_size() < 0:
        outcome.violate("rows_exceeded", f"step {step}: request pool over-allocated")
    return sat_out


def _check_after(scheduler: Any, exact: bool, outcome: Outcome, step: int) -> None:
    chunked = scheduler.chunked_req
    if not exact or chunked is None or chunked.finished():
        return
    remainder = len(chunked.origin_input_ids) + len(chunked.output_ids) - chunked.extend_end
    free = scheduler.token_to_kv_pool_allocator.available_size() + scheduler.tree_cache.evictable_size()
    if remainder > free:
        outcome.violate("remainder_unreserved",
                        f"step {step}: the cut prompt's remaining {remainder} tokens exceed free+evictable {free}")


def _check_drained(scheduler: Any, state: Any, scenario: Scenario, outputs: Mapping[str, Any],
                   outcome: Outcome, context_len: int) -> None:
    free = scheduler.token_to_kv_pool_allocator.available_size() + scheduler.tree_cache.evictable_size()
    if free != scheduler.max_total_num_tokens:
        outcome.violate("leak", f"{scheduler.max_total_num_tokens - free} KV tokens not returned")
    if not scheduler.is_fully_idle() or scheduler.waiting_queue or state.parked is not None:
        outcome.violate("not_idle", "the scheduler did not drain")
    for spec in scenario.requests:
        record = outputs.get(spec["rid"])
        finals = 0 if record is None else record["finals"]
        reports = 0 if record is None else record["abort_reports"]
        if finals == 0 and reports == 0:
            outcome.violate("lost_answer", f"{spec['rid']} got no final answer")
        elif finals > 1:
            outcome.violate("duplicate_answer", f"{spec['rid']} got {finals} final answers")
        elif finals == 1 and record["finished"] == "length" and record["tokens"] != spec["max_new_tokens"] \
                and spec.get("ignore_eos", True) and spec["prompt_tokens"] + spec["max_new_tokens"] < context_len:
            outcome.violate("lost_answer", f"{spec['rid']}: {record['tokens']} of {spec['max_new_tokens']} tokens")


def _describe(scheduler: Any, state: Any, batch: Any, step: int) -> dict[str, Any]:
    free = scheduler.token_to_kv_pool_allocator.available_size() + scheduler.tree_cache.evictable_size()
    return {"step": step, "mode": batch.forward_mode.name if batch is not None else None,
            "reqs": {r.rid: r.extend_len for r in batch.reqs} if batch is not None else {},
            "parked": sorted(r.rid for r in state.parked.reqs) if state.parked is not None else [],
            "waiting": [r.rid for r in scheduler.waiting_queue], "free_plus_evictable": free,
            "planned": dict(state.last_decision.prefill_chunks) if state.last_decision is not None else None,
            "chunked": scheduler.chunked_req.rid if scheduler.chunked_req is not None else None}


def worker(seeds: Sequence[int]) -> None:
    """Run ``seeds`` in this process and print one JSON line per outcome."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    for seed in seeds:
        outcome = run_scenario(random_scenario(seed))
        record = asdict(outcome)
        record["violations"] = dict(outcome.violations)
        print(RESULT_PREFIX + json.dumps(record), flush=True)


def _worker_env(config: Path) -> dict[str, str]:
    env = {**os.environ, "FAIRBATCHING_EMULATED_GPU": PROFILE, "FAIRBATCHING_CONFIG": str(config),
           "SGLANG_LOG_LEVEL": "error"}
    env["PYTHONPATH"] = pythonpath_with_checkout(env)
    return env


def campaign(seeds: Sequence[int], jobs: int, timeout_s: float) -> list[dict[str, Any]]:
    """Run ``seeds`` over ``jobs`` worker processes; a worker that dies (a crash this
    process cannot catch) reports the seed it was on as a crash."""
    with tempfile.TemporaryDirectory(prefix="fb-campaign-") as tmp:
        config = Path(tmp) / "fb.toml"
        config.write_text(random_scenario(0).config_text())
        shares = [list(seeds[i::jobs]) for i in range(jobs)]
        procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.server.kv_campaign", "--worker",
                                   ",".join(map(str, share))], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=_worker_env(config), cwd=REPO)
                 for share in shares if share]
        results: list[dict[str, Any]] = []
        for proc, share in zip(procs, [s for s in shares if s]):
            try:
                out, err = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            done = [json.loads(line.removeprefix(RESULT_PREFIX)) for line in out.splitlines()
                    if line.startswith(RESULT_PREFIX)]
            results += done
            seen = {r["seed"] for r in done}
            for seed in share:
                if seed not in seen:
                    results.append({"seed": seed, "steps": 0, "violations": {"crash": 1},
                                    "first_violation": f"crash: worker exit {proc.returncode}: {err[-300:]}",
                                    "retracted": 0, "aborted": {}, "wall_s": 0.0})
                    break
        return sorted(results, key=lambda r: r["seed"])


def summarise(results: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    results = list(results)
    violations: Counter[str] = Counter()
    failing = []
    for result in results:
        violations.update(result["violations"])
        if result["violations"]:
            failing.append({"seed": result["seed"], "first": result["first_violation"]})
    return {"scenarios": len(results), "steps": sum(r["steps"] for r in results),
            "retracted": sum(r["retracted"] for r in results),
            "aborts": sum(len(r["aborted"]) for r in results),
            "violations": dict(violations), "failing": failing}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.server.kv_campaign", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", type=int, default=200, help="how many scenarios (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="the first scenario's seed (default 0)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--timeout-s", type=float, default=7200.0, help="per worker (default 7200)")
    parser.add_argument("--out", type=Path, help="write the summary and every outcome here (JSON)")
    parser.add_argument("--replay", type=int, help="run one seed in this process and print its steps")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker([int(s) for s in args.worker.split(",") if s])
        return 0
    if args.scenarios < 1 or args.jobs < 1:
        parser.error("--scenarios and --jobs must be at least 1")
    if args.replay is not None:
        return _replay(args.replay)
    started = time.perf_counter()
    results = campaign(range(args.seed, args.seed + args.scenarios), args.jobs, args.timeout_s)
    summary = summarise(results)
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        from sglang_ext.provenance import git_state

        provenance = {**git_state(REPO), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      "command": " ".join(["python -m benchmarks.server.kv_campaign", *(argv or sys.argv[1:])])}
        args.out.write_text(json.dumps({"provenance": provenance, "summary": summary,
                                        "outcomes": results}, indent=1) + "\n")
    return 1 if summary["violations"] else 0


def _replay(seed: int) -> int:
    with tempfile.TemporaryDirectory(prefix="fb-campaign-") as tmp:
        config = Path(tmp) / "fb.toml"
        config.write_text(random_scenario(seed).config_text())
        os.environ.update(_worker_env(config))
        from sglang.srt.plugins import load_plugins

        load_plugins()
        trace: list[dict[str, Any]] = []
        scenario = random_scenario(seed)
        print(json.dumps(asdict(scenario), default=str))
        outcome = run_scenario(scenario, trace=trace)
    for line in trace:
        print(json.dumps(line))
    print(json.dumps({**asdict(outcome), "violations": dict(outcome.violations)}))
    return 1 if outcome.violations else 0


if __name__ == "__main__":
    sys.exit(main())
