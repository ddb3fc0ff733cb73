"""Benchmark: wall time of one ``form_batch`` call per registered policy.

What: for every registered batch policy (and the shipped config's policy with its
admission mode, e.g. ``fb-smooth+defer``, whose forecast runs at every decision), the
time ``policy.form_batch(requests, now)`` takes at 64, 256 and 1024 running decodes
plus 64 waiting prefills (p50 / p99 in microseconds, ``time.perf_counter_ns`` around
each call, the garbage collector enabled with its default thresholds). The goal: p99 <= 100 us at 256 + 64 (SGLang's
own per-step batch formation costs ~1-3 ms on this kind of CPU).

How the states are built:

* ``synthetic N+64`` (the main table, one state per size, shared by all policies):
  frozen ``RequestView`` objects with realistic distributions. (prompt, output)
  pairs are drawn from the bundled Azure conversation sample; a decode's next output
  index j is uniform in 1..min(500, output), its context is prompt + j - 1, its slack
  (``arrival + ttft + tpot * j - now``) is uniform in -20 ms .. +3 s (capped so the
  request arrived at least 50 ms + 10 ms per emitted token ago), ``first_token_time``
  lies between arrival + 50 ms and the latest time consistent with j tokens; a waiting
  prefill has waited 0 .. 2.02 s (TTFT slack +2 s .. -20 ms), the oldest one is half
  prefilled (a chunked prefill in flight). All requests use the default SLO class of
  ``configs/slo.toml``. Synthetic, because the simulator never holds these states on
  the bundled H100 profile: fb keeps the waiting queue near empty until the rank is
  saturated (so "64 running + 64 waiting" does not occur), and saturation caps running
  decodes near 300 (prefill compute and the ~407k-token KV pool; 1024 trace-length
  requests would need ~1.3M tokens of KV).
* ``sim 256+64`` (a cross-check column): a snapshot of a real simulation -- the
  ``fb`` policy on the full Azure trace's request lengths with Poisson arrivals at
  20 req/s (H100 profile), taken at the first step with 256..269 running decodes and
  >= 64 waiting prefills, trimmed to 256 decodes (seeded random subset) and the 64
  oldest waiting prefills, copied into ``RequestView`` objects.

Before timing, each policy observes the 200 steps that precede that snapshot in the
same simulation (``observe_step`` with the measured new tokens, context, step time
and prefill tokens), so its online step model is learned, ``fb-margin`` has a margin
and ``fb-kairos`` a prefill-throughput estimate. Budgeted policies run at a 1024-token
budget (``fb-fb@1024``, ``sarathi@1024``). Per state: ``gc.collect()``, 200 warm-up
calls of every policy, then ``--calls`` timed calls of each, in rounds of ``--block``
calls per policy (shuffled order per round, one untimed call opening each block), so
the machine's noise hits every policy alike; a fixed pure-Python loop is timed in the
same rounds to show that noise. The whole pass is repeated ``--repeats`` times and each
cell reports the run whose p99 is the median (all runs are kept in the JSON). Extra
rows: ``fb`` after ``gc.freeze()`` (as SGLang does after warm-up) and with gc disabled,
a split of ``fb`` at 256+64 into its triage and pack phases plus a cProfile of it, and
``fb`` on the simulator state with ``now`` a numpy.float64 (the simulator's clock).

Knee against linear: every FairBatching-family policy whose step model is the knee form
(all but ``fb``, ``fb-pab`` and ``fb-tb``, which keep the paper's linear model) is timed a
second time as ``LABEL [linear]``, the same policy started from the profile's linear fit
and trained on the same 200 steps, in the same interleaved rounds. Their p50 ratio is the
median of paired block ratios (each block's median over its twin's block of the same
round), their p99 ratio that of all runs' samples pooled; the table checks the
limits (p50 at most +5 %, p99 at most +10 % against the linear model).

Tables: every FairBatching-family policy is timed a third time as ``LABEL [table]``, the
same policy object given each state as a ``RequestTable`` (its columns built once, as the
SGLang adapter collects them in its per-step view loops) instead of a list; the decisions
are checked equal before timing, and the page gives table / list per state as paired
ratios.

Run pinned to one core, e.g.::

    source scripts/_env.sh
    # writes docs/bench/decision_time.{md,json}:
    taskset -c 1 python -m benchmarks.sim.decision_time
    # a quick look:
    taskset -c 1 python -m benchmarks.sim.decision_time --calls 500 --repeats 1 --no-write
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np

import sglang_ext.sim.runner  # noqa: F401  registers every policy (variants, baselines)
from benchmarks.support.machine import cpu_times, cpu_usage, machine_info, machine_line
from benchmarks.support.outputs import write_outputs
from benchmarks.support.paths import DOCS_BENCH, REPO, SHARED_AZURE_TRACE
from sglang_ext.adapter.extension_config import ExtensionConfig
from sglang_ext.policy import compiled
from sglang_ext.policy.admission import AdmissionMode
from sglang_ext.policy.batch_former import form_batch, pack, triage
from sglang_ext.policy.policies import POLICIES, BatchPolicy
from sglang_ext.policy.request_table import RequestTable
from sglang_ext.policy.slo import Slo, SloCatalog
from sglang_ext.policy.view import RequestView
from sglang_ext.sim.engine import SimEngine, StepRecord
from sglang_ext.sim.profile import bundled_profile_path, load_profile
from sglang_ext.sim.runner import Scenario, build_policy, parse_policy
from sglang_ext.sim.workloads import Workload, bundled_sample, load_workload

PROFILE = "llama3.1-8b-h100"
SIZES = (64, 256, 1024)
WAITING = 64
GOAL_SIZE = 256
GOAL_P99_US = 100.0
BUDGETED = 1024  # token budget of fb-fb / sarathi
WARMUP_CALLS = 200
STEP_MODEL_STEPS = 200
SNAPSHOT_RATE = 20.0  # req/s, Poisson
SIM_NOW = 1000.0  # the clock of the synthetic states
SHIPPED_CONFIG = REPO / "configs" / "fairbatching.toml"


LINEAR_TWIN = " [linear]"  # label suffix: the same policy on the linear step model
FORM_LIMITS = {"p50": 1.05, "p99": 1.10}  # the limits against the linear model
#: label suffix: the same policy deciding over the state as a RequestTable (its columns
#: built once, as an engine that keeps them does), not as a list of requests
TABLE_TWIN = " [table]"
#: label suffix of a table twin timed on the pure-Python reference (compiled.FUNCTIONS off)
PURE_TWIN = " [pure Python]"


# ------------------------------------------------------------------ machine
REFERENCE = "reference loop"  # a fixed pure-Python loop timed alongside: the machine's own jitter
REFERENCE_ITERATIONS = 2000


def reference_work() -> int:
    total = 0
    for i in range(REFERENCE_ITERATIONS):
        total += i
    return total


# ------------------------------------------------------------------ states
def synthetic_state(
    n_decodes: int, n_waiting: int, lengths: Sequence[tuple[int, int]], slo: Slo, seed: int
) -> list[RequestView]:
    """See the module docstring; requests are returned in arrival order, as an engine keeps them."""
    rng = random.Random(seed)
    now = SIM_NOW
    rows: list[dict] = []
    for _ in range(n_decodes):
        prompt, output = rng.choice(lengths)
        j = rng.randint(1, max(1, min(500, output)))
        min_age = 0.05 + 0.01 * j  # first token after >= 50 ms, then >= 10 ms per token
        high = min(3.0, slo.ttft_s + slo.tpot_s * j - min_age)
        slack = rng.uniform(-0.02, max(-0.02, high))
        arrival = now + slack - slo.ttft_s - slo.tpot_s * j
        latest_first = now - 0.01 * (j - 1)
        first = rng.uniform(min(arrival + 0.05, latest_first), latest_first)
        rows.append(dict(arrival=arrival, next_output_index=j, pending_prefill=0,
                         context=prompt + j - 1, prompt_tokens=prompt, first_token_time=first))
    waits = sorted((rng.uniform(0.0, slo.ttft_s + 0.02) for _ in range(n_waiting)), reverse=True)
    for index, waited in enumerate(waits):
        prompt, _ = rng.choice(lengths)
        # the oldest: a chunked prefill in flight
        done = prompt // 2 if index == 0 and prompt > 1 else 0
        rows.append(dict(arrival=now - waited, next_output_index=0, pending_prefill=prompt - done,
                         context=done, prompt_tokens=prompt, first_token_time=None))
    rows.sort(key=lambda row: row["arrival"])
    return [RequestView(req_id=seq, slo=slo, arrival_seq=seq, **row)
            for seq, row in enumerate(rows)]


def _view(request) -> RequestView:
    # Times as Python floats: after its first simulated stall the simulator's clock is a
    # numpy.float64 (RooflineGpu adds a numpy draw), which makes every slack computation
    # several times slower than with the float an SGLang adapter passes (time.monotonic()).
    first = request.first_token_time
    return RequestView(
        req_id=request.req_id, arrival=float(request.arrival), slo=request.slo,
        next_output_index=request.next_output_index, pending_prefill=request.pending_prefill,
        context=request.context, prompt_tokens=request.prompt_tokens,
        arrival_seq=request.arrival_seq, first_token_time=None if first is None else float(first),
    )


def simulated_snapshot(
    workload: Workload, scenario: Scenario, n_decodes: int, n_waiting: int, seed: int
) -> tuple[list[RequestView], float, list[StepRecord], dict]:
    """Run fb on Poisson arrivals at SNAPSHOT_RATE until the rank holds n_decodes..+5%
    running decodes and >= n_waiting waiting prefills; return that state (trimmed to
    exactly n_decodes + n_waiting), its clock, the steps before it, and a description."""
    timed = workload.with_arrivals("poisson", SNAPSHOT_RATE, seed)
    engine = SimEngine(scenario.profile, build_policy(scenario, parse_policy("fb")),
                       seed=seed, record_steps=True)
    slo = scenario.catalog.default
    limit = n_decodes + max(1, n_decodes // 20)
    for index, request in enumerate(timed.requests):
        while engine.now < request.arrival_s and engine.has_work:
            engine.step()
            active = engine.active_requests
            decodes = [r for r in active if r.pending_prefill == 0]
            waiting = [r for r in active if r.pending_prefill > 0]
            if n_decodes <= len(decodes) <= limit and len(waiting) >= n_waiting:
                rng = random.Random(seed)
                kept = set(id(r) for r in rng.sample(decodes, n_decodes))
                kept |= set(id(r) for r in sorted(waiting, key=lambda r: r.arrival_seq)[:n_waiting])
                state = [_view(r) for r in active if id(r) in kept]
                about = {
                    "policy": "fb", "arrivals": f"poisson {SNAPSHOT_RATE:g} req/s, seed {seed}",
                    "lengths": workload.source, "sim_time_s": engine.now, "steps": engine.steps,
                    "decodes_before_trim": len(decodes), "waiting_before_trim": len(waiting),
                    "kv_used_tokens": engine.kv_used, "kv_capacity_tokens": engine.kv_capacity,
                }
                clock = type(engine.now)
                about["sim_clock_type"] = f"{clock.__module__}.{clock.__name__}"
                return state, float(engine.now), engine.step_log[-STEP_MODEL_STEPS:], about
        engine.submit(index, request.arrival_s, request.prompt_tokens, request.output_tokens, slo)
    raise SystemExit(
        f"no state with {n_decodes} decodes and {n_waiting} waiting in {workload.source}")


def describe_state(state: Sequence[RequestView], now: float) -> dict:
    decodes = [r for r in state if r.pending_prefill == 0]
    waiting = [r for r in state if r.pending_prefill > 0]

    def span(values: list[float], digits: int = 3) -> list[float]:
        if not values:
            return []
        return [round(float(v), digits) for v in np.percentile(values, [0, 50, 100])]

    def slack(r: RequestView) -> float:
        return r.arrival + r.slo.ttft_s + r.slo.tpot_s * r.next_output_index - now

    return {
        "decodes": len(decodes), "waiting": len(waiting),
        "decode_slack_s_min_med_max": span([slack(r) for r in decodes]),
        "waiting_slack_s_min_med_max": span([slack(r) for r in waiting]),
        "decode_context_min_med_max": span([r.context for r in decodes], 0),
        "decode_index_min_med_max": span([r.next_output_index for r in decodes], 0),
        "waiting_pending_min_med_max": span([r.pending_prefill for r in waiting], 0),
    }


# ------------------------------------------------------------------ timing
def policy_names() -> list[str]:
    """Every registered policy, and the shipped config's policy with its admission mode
    when that is not ``off`` (``fb-smooth+defer``: the forecast runs at every decision)."""
    names = [f"{name}@{BUDGETED}" if POLICIES.get(name).takes_token_budget else name
             for name in POLICIES.names()]
    shipped = ExtensionConfig.load(SHIPPED_CONFIG)
    if shipped.admission.mode is not AdmissionMode.OFF:
        names.append(f"{shipped.policy}+{shipped.admission.label}")
    return names


def trained_policy(scenario: Scenario, label: str, steps: Sequence[StepRecord]) -> BatchPolicy:
    policy = build_policy(scenario, parse_policy(label))
    for step in steps:
        # float(): as an SGLang adapter timing steps with perf_counter passes (see the notes)
        policy.observe_step(step.shape, float(step.duration_s))
    return policy


def linear_twins(scenario: Scenario, policies: dict[str, BatchPolicy],
                 steps: Sequence[StepRecord]) -> dict[str, BatchPolicy]:
    """``LABEL [linear]`` for every FairBatching-family policy whose step model is not the
    linear one: the same policy started from the profile's linear fit, trained on the same
    steps. The baselines own a step model too (a rank's PAB is read whatever the policy),
    but never consult it to form a batch, so they get no twin."""
    linear = replace(scenario, step_form="linear")
    return {f"{label}{LINEAR_TWIN}": trained_policy(linear, label, steps)
            for label, policy in policies.items()
            if policy.takes_admission and policy.step_model.coefficients.form != "linear"}


def paired_samples(timed: dict[str, np.ndarray], block: int,
                   pairs: dict[str, dict[str, dict[str, list]]], state: str,
                   suffix: str = LINEAR_TWIN) -> None:
    """Adds one interleaved run of ``state`` to ``pairs``: per policy with a twin (label +
    ``suffix``), the ratio of each block's median to its twin's block of the same round
    (the two ran seconds apart, so a slow stretch of the machine cancels out), and both
    policies' samples for a pooled p99."""
    for label, samples in timed.items():
        twin = timed.get(f"{label}{suffix}")
        if twin is None:
            continue
        cell = pairs.setdefault(label, {}).setdefault(
            state, {"block_ratios": [], "samples": [], "twin_samples": []})
        for offset in range(0, samples.size, block):
            cell["block_ratios"].append(float(np.median(samples[offset:offset + block])
                                              / np.median(twin[offset:offset + block])))
        cell["samples"].append(samples)
        cell["twin_samples"].append(twin)


def tables_first(timed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``timed`` with each table twin's samples under its policy's label and the list's
    under the twin's, so that :func:`paired_samples` pairs table over list."""
    swapped = {}
    for label, samples in timed.items():
        if label.endswith(TABLE_TWIN):
            base = label[:-len(TABLE_TWIN)]
            swapped[base], swapped[label] = samples, timed[base]
    return swapped


def form_comparison(pairs: dict[str, dict[str, dict[str, list]]],
                    limits: dict[str, float] = FORM_LIMITS) -> dict[str, dict[str, dict]]:
    """Per policy with a twin and per state: the p50 ratio as the median of the paired
    block ratios over every run, the p99 ratio from all runs' samples pooled (policy over
    twin), and whether both are within ``limits``."""
    compared = {}
    for label, row in pairs.items():
        compared[label] = {}
        for state, cell in row.items():
            p50 = float(np.median(cell["block_ratios"]))
            p99 = float(np.percentile(np.concatenate(cell["samples"]), 99)
                        / np.percentile(np.concatenate(cell["twin_samples"]), 99))
            compared[label][state] = {
                "p50_ratio": p50, "p99_ratio": p99, "blocks": len(cell["block_ratios"]),
                "within_limits": p50 <= limits["p50"] and p99 <= limits["p99"],
            }
    return compared


def time_calls(call: Callable[[], object], calls: int, *, freeze: bool = False) -> np.ndarray:
    """``calls`` timed calls in one go (used for the phase split); microseconds."""
    clock = time.perf_counter_ns
    samples = [0] * calls
    gc.collect()
    for _ in range(WARMUP_CALLS):
        call()
    if freeze:
        gc.collect()
        gc.freeze()
    try:
        for i in range(calls):
            start = clock()
            call()
            samples[i] = clock() - start
    finally:
        if freeze:
            gc.unfreeze()
    return np.asarray(samples, dtype=float) / 1e3


def time_interleaved(
    calls: dict[str, Callable[[], object]], total: int, block: int,
    before_block: dict[str, Callable[[], None]] | None = None,
    after_block: dict[str, Callable[[], None]] | None = None,
) -> dict[str, np.ndarray]:
    """Time every callable ``total`` times, in rounds of one block of ``block`` calls each
    (in a shuffled order per round), so a noisy stretch of wall time (the other core, the
    hypervisor) hits all of them alike. Each block starts with one untimed call: the first
    call after switching from other code pays instruction/data cache misses (~3x for fb),
    an artifact of the interleaving, not of the policy. Returns microseconds per call."""
    clock = time.perf_counter_ns
    samples = {key: [0] * total for key in calls}
    before_block, after_block = before_block or {}, after_block or {}
    gc.collect()
    for call in calls.values():
        for _ in range(WARMUP_CALLS):
            call()
    order = list(calls)
    shuffler = random.Random(len(order) * 7919 + total)
    for offset in range(0, total, block):
        shuffler.shuffle(order)
        for key in order:
            call = calls[key]
            if key in before_block:
                before_block[key]()
            out = samples[key]
            try:
                call()  # untimed: the first call after switching code pays cache misses
                for i in range(offset, min(total, offset + block)):
                    start = clock()
                    call()
                    out[i] = clock() - start
            finally:
                if key in after_block:
                    after_block[key]()
    return {key: np.asarray(values, dtype=float) / 1e3 for key, values in samples.items()}


_COMPILED = {name: getattr(compiled, name) for name in compiled.FUNCTIONS}


def switch_to_pure_python() -> None:
    for name in compiled.FUNCTIONS:
        setattr(compiled, name, None)


def switch_to_compiled() -> None:
    for name, function in _COMPILED.items():
        setattr(compiled, name, function)


@contextmanager
def pure_python() -> Iterator[None]:
    switch_to_pure_python()
    try:
        yield
    finally:
        switch_to_compiled()


def stats(samples_us: np.ndarray) -> dict:
    p50, p99 = np.percentile(samples_us, [50, 99])
    return {"p50_us": round(float(p50), 2), "p99_us": round(float(p99), 2),
            "mean_us": round(float(samples_us.mean()), 2),
            "max_us": round(float(samples_us.max()), 2),
            "calls": int(samples_us.size)}


def median_run(runs: list[dict]) -> dict:
    ordered = sorted(runs, key=lambda r: r["p99_us"])
    return dict(ordered[len(ordered) // 2], runs_p99_us=[r["p99_us"] for r in runs],
                runs_p50_us=[r["p50_us"] for r in runs])


def profile_fb(state: Sequence[RequestView], now: float, policy: BatchPolicy, calls: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        policy.form_batch(state, now)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(12)
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    return "\n".join(line.replace(str(REPO) + "/", "") for line in lines[start:] if line.strip())


# ------------------------------------------------------------------ report
def form_table(doc: dict) -> list[str]:
    compared = doc.get("form_comparison")
    if not compared:
        return []
    states = list(next(iter(compared.values())))
    limits = doc["form_limits"]
    lines = [
        "", "## Knee step model against the linear one", "",
        "Every FairBatching-family policy whose step model is the knee form (`fb`, `fb-pab` "
        "and `fb-tb` keep the linear model; the baselines never consult theirs) was also "
        f"timed as `LABEL{LINEAR_TWIN}`: the same policy started from the profile's linear "
        "fit and trained on the same steps, in the same interleaved rounds. Cells: knee / "
        "linear - 1 at p50, the median over every block of its paired ratio (a block's "
        "median over its twin's block of the same round: both ran within seconds, so a slow "
        "stretch of this VM cancels out; the main table's cells, taken from one run each, do "
        "not pair and swing by +-10% between runs), and at p99, of every run's samples "
        "pooled. Limits: "
        f"p50 at most {limits['p50'] - 1:+.0%}, p99 at most {limits['p99'] - 1:+.0%}.", "",
        "| policy | " + " | ".join(f"{state} p50 / p99" for state in states)
        + " | within limits |",
        "|" + "---|" * (len(states) + 2),
    ]
    for label, row in compared.items():
        cells = [f"{row[s]['p50_ratio'] - 1:+.1%} / {row[s]['p99_ratio'] - 1:+.1%}" for s in states]
        misses = [s for s in states if not row[s]["within_limits"]]
        verdict = "yes" if not misses else "**no**: " + ", ".join(misses)
        lines.append(f"| `{label}` | " + " | ".join(cells) + f" | {verdict} |")
    return lines


def table_section(doc: dict) -> list[str]:
    compared = doc.get("table_comparison")
    if not compared:
        return []
    lines = [
        "", "## The decision over a table", "",
        f"Every FairBatching-family policy was also timed as `LABEL{TABLE_TWIN}`: the same "
        "policy object given the state as a `RequestTable` (the requests with their fields "
        "as columns, built once, as the SGLang adapter's view loops collect them each step) "
        "instead of a list; the decisions are the same, bit for bit (checked on every state "
        "before timing). Cells: table / list - 1 at p50 (median of paired block ratios) and "
        "p99 (all runs pooled); negative is faster.",
    ]
    return lines + ratio_rows(compared)


def ratio_rows(compared: dict[str, dict[str, dict]]) -> list[str]:
    """A markdown table of ``form_comparison``'s ratios, one row per policy, as changes."""
    states = list(next(iter(compared.values())))
    lines = ["", "| policy | " + " | ".join(f"{state} p50 / p99" for state in states) + " |",
             "|" + "---|" * (len(states) + 1)]
    for label, row in compared.items():
        cells = [f"{row[s]['p50_ratio'] - 1:+.0%} / {row[s]['p99_ratio'] - 1:+.0%}" for s in states]
        lines.append(f"| `{label}` | " + " | ".join(cells) + " |")
    return lines


def compiled_section(doc: dict) -> list[str]:
    compared = doc.get("compiled_comparison")
    if not compared:
        return ["", f"Decision path: {doc.get('decision_path', 'not recorded')}; no compiled "
                "twin was timed."]
    lines = [
        "", "## Compiled against the pure-Python reference", "",
        f"Decision path: {doc['decision_path']}. Every table twin was also timed as "
        f"`LABEL{PURE_TWIN}`: the same policy on the same table with the compiled functions "
        "switched off for its blocks (the fallback a machine without a C compiler runs); the "
        "decisions are the same, bit for bit (checked on every state before timing). Cells: "
        "compiled / pure Python - 1 at p50 (median of paired block ratios) and p99 (all runs "
        "pooled); negative is faster.",
    ]
    return lines + ratio_rows(compared)


def markdown(doc: dict) -> str:
    sizes = doc["sizes"]
    goal_col = f"{GOAL_SIZE}+{WAITING}"
    head = ["policy"] + [f"{n}+{WAITING} p50 / p99" for n in sizes] + [
        f"sim {goal_col} p50 / p99", f"p99 <= {GOAL_P99_US:g} us at {goal_col} (synthetic / sim)"]
    lines = [
        "# Decision time per step (`form_batch`)",
        "",
        f"Machine: {doc['machine_line']}.",
        "",
        f"Microseconds per `policy.form_batch(requests, now)` call, N running decodes + {WAITING} "
        f"waiting prefills; gc **enabled** (default thresholds); {doc['calls']} timed calls "
        "per cell "
        f"after {WARMUP_CALLS} warm-up calls, the policies of one state timed in interleaved "
        f"rounds of {doc['block']}-call blocks, shuffled order per round, one untimed call "
        "opening each block (so noise hits all alike and no policy pays for the switch); "
        f"{doc['repeats']} runs of the whole table, each cell shows the run with the median p99 "
        "(all runs in `decision_time.json`). Goal: "
        f"p99 <= {GOAL_P99_US:g} us at {goal_col}. Budgeted policies at a 1024-token budget. "
        f"CPU use while timing ({doc['timing_wall_s']:.0f} s): "
        + ", ".join(f"{cpu} busy {u['busy_pct']:.0f}% (steal {u['steal_pct']:.0f}%)"
                    for cpu, u in doc["cpu_usage_during_timing"].items()) + ".",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for label, row in doc["results"].items():
        if label == REFERENCE:
            continue
        cells = [f"`{label}`"]
        for n in sizes:
            cell = row[f"synthetic {n}+{WAITING}"]
            cells.append(f"{cell['p50_us']:.1f} / {cell['p99_us']:.1f}")
        sim = row[f"sim {goal_col}"]
        cells.append(f"{sim['p50_us']:.1f} / {sim['p99_us']:.1f}")
        flags = []
        for state in (f"synthetic {goal_col}", f"sim {goal_col}"):
            p99 = row[state]["p99_us"]
            flags.append(f"yes ({p99:.0f})" if p99 <= GOAL_P99_US else f"**no** ({p99:.0f})")
        cells.append(" / ".join(flags))
        lines.append("| " + " | ".join(cells) + " |")
    lines += form_table(doc)
    lines += table_section(doc)
    lines += compiled_section(doc)
    ref = doc["results"][REFERENCE]
    lines += ["", f"Machine jitter: a fixed {REFERENCE_ITERATIONS}-iteration pure-Python loop "
              "timed in "
              "the same interleaved rounds took p50 / p99 " + ", ".join(
                  f"{ref[name]['p50_us']:.1f} / {ref[name]['p99_us']:.1f} us" for name in ref)
              + f" (rounds of the {', '.join(ref)} states): its p99 / p50 ratio is what this "
              "machine adds to any call of that length, whatever the policy."]
    lines += ["", "`fb` with `gc.freeze()` after warm-up (as SGLang's scheduler does), and with gc "
              "disabled for reference, measured as its own interleaved triple (`gc.collect()` "
              "before every block of each, then `gc.freeze()` / `gc.disable()` for the variant's "
              "blocks, undone after them), median-p99 run of the repeats:", "",
              "| state | p50 / p99, gc enabled | p50 / p99, after gc.freeze() "
              "| p50 / p99, gc disabled |",
              "|---|---|---|---|"]
    for state, trio in doc["fb_gc_freeze"].items():
        lines.append(f"| {state} | " + " | ".join(
            f"{trio[key]['p50_us']:.1f} / {trio[key]['p99_us']:.1f}"
            for key in ("gc enabled", "gc.freeze()", "gc disabled")) + " |")
    split = doc["fb_phase_split"]
    lines += [
        "", f"Where `fb`'s time goes at {goal_col} (synthetic state): `triage` (slack of every "
        f"request, grouping, two sorts) p50 {split['triage']['p50_us']:.1f} us, `pack` "
        "(filling the "
        f"step) p50 {split['pack']['p50_us']:.1f} us, of `form_batch` p50 "
        f"{split['form_batch']['p50_us']:.1f} us (one interleaved run). cProfile "
        f"({doc['cprofile_calls']} calls, "
        "sorted by own time; profiling inflates the absolute times):",
        "", "```", doc["fb_cprofile"], "```", "",
        "## States", "",
        "Synthetic states (all policies, main columns): " + doc["method"]["synthetic"], "",
        "Simulator snapshot (`sim` column): " + doc["method"]["sim"], "",
        "Learned step model: " + doc["method"]["step_model"], "",
        "| state | decodes | waiting | decode slack s (min/med/max) | waiting slack s | "
        "decode context (min/med/max) | decode j | waiting pending tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, d in doc["states"].items():
        lines.append(
            f"| {name} | {d['decodes']} | {d['waiting']} | {d['decode_slack_s_min_med_max']} | "
            f"{d['waiting_slack_s_min_med_max']} | {d['decode_context_min_med_max']} | "
            f"{d['decode_index_min_med_max']} | {d['waiting_pending_min_med_max']} |"
        )
    clock = doc.get("fb_sim_state_clock_type")
    if clock:
        lines += ["", "## Notes", "",
                  f"- What a numpy clock costs (the simulated GPU once leaked `numpy.float64` "
                  f"step times into the simulator's clock; fixed, but an adapter must pass "
                  f"plain floats such as `time.monotonic()`). `fb` on the sim {goal_col} "
                  "state with "
                  f"`now` a float: p50 {clock['float']['p50_us']:.1f} / p99 "
                  f"{clock['float']['p99_us']:.1f} us; with `now` a numpy.float64: p50 "
                  f"{clock['numpy.float64']['p50_us']:.1f} / p99 "
                  f"{clock['numpy.float64']['p99_us']:.1f} us (one interleaved run). The table "
                  "uses "
                  "floats, as an SGLang adapter passing `time.monotonic()` would."]
    lines += [
        "- What the variants add to `fb` (read from the code): `fb-margin` / "
        "`fb-anchor-margin` refresh their margin in `observe_step`, after the step (sorting "
        "the error window of up to 256 entries for its p95), so a decision only reads it; "
        "their knee step model costs a little more per prediction than `fb`'s linear one; "
        "`fb-smooth` first tries a step of one TPOT with every decode (one more pass over the "
        "decodes and the prefills' costs); "
        "`fb-kairos` sorts the prefill group twice more and scores each prefill; `fb-anchor` "
        "only changes the slack formula. The baselines do no per-request slack arithmetic: "
        "`sglang-default` and `sarathi` filter and sort the prefills only, `vllm-default` sorts "
        "every request by arrival.",
        "- p99 on this machine is mostly the machine's: compare the reference loop's p99 / p50 "
        "ratio with the policies'.",
    ]
    lines += ["", f"Regenerate: `{doc['command']}`", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See the module docstring (top of benchmarks/sim/decision_time.py) for the method.",
    )
    parser.add_argument("--calls", type=int, default=3000,
                        help="timed calls per cell (default 3000)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of the whole table; each cell reports the median-p99 run "
                        "(default 3)")
    parser.add_argument("--policy", action="append", dest="policies",
                        help="policy label, repeatable (default: every registered policy; "
                        f"budgeted ones as NAME@{BUDGETED})")
    parser.add_argument("--block", type=int, default=100,
                        help="calls per policy per round: policies are timed in interleaved blocks "
                        "(default 100)")
    parser.add_argument("--trace", type=Path, default=SHARED_AZURE_TRACE,
                        help="trace whose request lengths feed the simulator snapshot "
                        "(default: ../shared/data/traces/azure_conv_2023.csv; falls back to "
                        "the bundled sample if missing)")
    parser.add_argument("--seed", type=int, default=0, help="states and simulation seed")
    parser.add_argument("--out", type=Path, default=DOCS_BENCH,
                        help="output folder (default docs/bench)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.calls < 100 or args.repeats < 1:
        parser.error("--calls must be >= 100 and --repeats >= 1")

    info = machine_info()
    print(f"machine: {machine_line(info)}", file=sys.stderr)
    if not info["pinned_to_cpus"] or len(info["pinned_to_cpus"]) != 1:
        print("warning: not pinned to one CPU; run under `taskset -c 1`", file=sys.stderr)

    profile = load_profile(bundled_profile_path(PROFILE))
    catalog = SloCatalog.from_toml(REPO / "configs" / "slo.toml")
    sample = bundled_sample()
    lengths = [(r.prompt_tokens, r.output_tokens) for r in sample.requests]
    workload = load_workload(args.trace, "azure") if args.trace.exists() else sample
    scenario = Scenario(workload=workload, profile=profile, catalog=catalog, seed=args.seed)
    slo = catalog.default

    sim_state, sim_now, steps, sim_about = simulated_snapshot(
        workload, scenario, GOAL_SIZE, WAITING, args.seed)
    states: dict[str, tuple[list[RequestView], float]] = {
        f"synthetic {n}+{WAITING}": (
            synthetic_state(n, WAITING, lengths, slo, args.seed + n), SIM_NOW)
        for n in SIZES
    }
    states[f"sim {GOAL_SIZE}+{WAITING}"] = (sim_state, sim_now)
    labels = args.policies or policy_names()
    policies = {label: trained_policy(scenario, label, steps) for label in labels}
    policies.update(linear_twins(scenario, policies, steps))
    policies.update({f"{label}{TABLE_TWIN}": policy for label, policy in list(policies.items())
                     if policy.takes_admission and not label.endswith(LINEAR_TWIN)})
    if compiled.built():
        policies.update({f"{label}{PURE_TWIN}": policy for label, policy in list(policies.items())
                         if label.endswith(TABLE_TWIN)})
    tables = {name: RequestTable.of(state) for name, (state, _) in states.items()}
    for label, policy in policies.items():
        for name, (state, now) in states.items():
            decision = policy.form_batch(state, now)  # sanity: decides something valid
            assert decision.new_tokens >= 0, (label, name)
            assert policy.form_batch(tables[name], now) == decision, (label, name)
            with pure_python():
                assert policy.form_batch(tables[name], now) == decision, (label, name)

    runs: dict[str, dict[str, list[dict]]] = {
        label: {name: [] for name in states} for label in [*policies, REFERENCE]}
    freeze_runs: dict[str, dict[str, list[dict]]] = {
        f"synthetic {n}+{WAITING}": {"gc enabled": [], "gc.freeze()": [], "gc disabled": []}
        for n in SIZES}
    pairs: dict[str, dict[str, dict[str, list]]] = {}
    table_pairs: dict[str, dict[str, dict[str, list]]] = {}
    compiled_pairs: dict[str, dict[str, dict[str, list]]] = {}
    pure_labels = [label for label in policies if label.endswith(PURE_TWIN)]
    pure_on = {label: switch_to_pure_python for label in pure_labels}
    pure_off = {label: switch_to_compiled for label in pure_labels}
    cpu_before, wall_start = cpu_times(), time.monotonic()
    for repeat in range(args.repeats):
        for name, (state, now) in states.items():
            calls = {label: (lambda p=policy, t=now,
                             s=tables[name] if label.endswith((TABLE_TWIN, PURE_TWIN)) else state:
                             p.form_batch(s, t))
                     for label, policy in policies.items()}
            calls[REFERENCE] = reference_work
            timed = time_interleaved(calls, args.calls, args.block, pure_on, pure_off)
            paired_samples(timed, args.block, pairs, name)
            paired_samples(tables_first(timed), args.block, table_pairs, name, TABLE_TWIN)
            paired_samples(timed, args.block, compiled_pairs, name, PURE_TWIN)
            for label, samples in timed.items():
                runs[label][name].append(stats(samples))
                print(f"run {repeat + 1}/{args.repeats} {name:<18} {label:<18} "
                      f"p50 {runs[label][name][-1]['p50_us']:8.1f} us  "
                      f"p99 {runs[label][name][-1]['p99_us']:8.1f} us", file=sys.stderr)
        if "fb" in policies:
            fb = policies["fb"]
            for name, cell in freeze_runs.items():
                state, now = states[name]
                call = lambda s=state, t=now: fb.form_batch(s, t)  # noqa: E731
                timed = time_interleaved(
                    {"gc enabled": call, "gc.freeze()": call, "gc disabled": call},
                    args.calls, args.block,
                    before_block={"gc enabled": gc.collect,
                                  "gc.freeze()": lambda: (gc.collect(), gc.freeze()),
                                  "gc disabled": lambda: (gc.collect(), gc.disable())},
                    after_block={"gc.freeze()": gc.unfreeze, "gc disabled": gc.enable},
                )
                for key, samples in timed.items():
                    cell[key].append(stats(samples))
    wall_s = time.monotonic() - wall_start
    usage = cpu_usage(cpu_before, cpu_times())

    results = {label: {name: median_run(cell) for name, cell in row.items()}
               for label, row in runs.items()}
    doc: dict = {
        "schema": 1,
        "benchmark": "decision_time",
        "machine": info,
        "machine_line": machine_line(info),
        "goal": {"state": f"{GOAL_SIZE}+{WAITING}", "p99_us": GOAL_P99_US},
        "sizes": list(SIZES),
        "waiting": WAITING,
        "calls": args.calls,
        "block": args.block,
        "timing_wall_s": round(wall_s, 1),
        "cpu_usage_during_timing": usage,
        "warmup_calls": WARMUP_CALLS,
        "repeats": args.repeats,
        "gc": f"enabled, default thresholds {gc.get_threshold()}; gc.collect() before each "
              "state's interleaved rounds",
        "timer": "time.perf_counter_ns around each form_batch call",
        "command": " ".join(["taskset -c 1 python -m benchmarks.sim.decision_time",
                            *(sys.argv[1:] if argv is None else argv)]),
        "method": {
            "synthetic": (
                "frozen RequestView objects; (prompt, output) from the bundled Azure sample; "
                "decode j "
                "uniform 1..min(500, output), context = prompt + j - 1, slack uniform -20 ms..+3 s "
                "(capped by the request's age), first_token_time set; waiting prefills waited "
                "0..2.02 s, the oldest half prefilled; default SLO class (TTFT 2 s, TPOT 50 ms); "
                "requests in arrival order. Synthetic because the simulator does not reach these "
                "states on the H100 profile (see the script's docstring)."
            ),
            "sim": (
                f"fb on {sim_about['lengths']} lengths, {sim_about['arrivals']}, H100 profile; "
                "first "
                f"step with {GOAL_SIZE}..{GOAL_SIZE + GOAL_SIZE // 20} decodes and >= {WAITING} "
                f"waiting (t = {sim_about['sim_time_s']:.1f} s, step {sim_about['steps']}, "
                f"{sim_about['decodes_before_trim']} decodes / {sim_about['waiting_before_trim']} "
                f"waiting, KV {sim_about['kv_used_tokens']}/{sim_about['kv_capacity_tokens']} "
                f"tokens), trimmed to {GOAL_SIZE} decodes (random) + the {WAITING} oldest waiting; "
                "the rank is saturated there, so every decode is past or near its deadline. Times "
                "converted to Python floats (the simulator's clock there is a "
                f"{sim_about['sim_clock_type']}; see Notes)."
            ),
            "step_model": (
                f"each policy first observes the {len(steps)} simulated steps preceding that "
                "snapshot (observe_step with each step's shape and measured time)."
            ),
        },
        "sim_snapshot": sim_about,
        "states": {name: describe_state(state, now) for name, (state, now) in states.items()},
        "results": results,
        "form_comparison": form_comparison(pairs),
        "form_limits": FORM_LIMITS,
        "table_comparison": form_comparison(table_pairs),
        "decision_path": compiled.decision_path(),
        "compiled_comparison": form_comparison(compiled_pairs),
        "runs": runs,
    }
    if "fb" in policies:
        doc["fb_gc_freeze"] = {name: {key: median_run(runs_) for key, runs_ in cell.items()}
                               for name, cell in freeze_runs.items()}
        state, now = states[f"synthetic {GOAL_SIZE}+{WAITING}"]
        fb = policies["fb"]
        coefficients = fb.step_model.coefficients
        groups = triage(state, now)
        phases = time_interleaved({
            "triage": lambda: triage(state, now),
            "pack": lambda: pack(groups, coefficients, token_budget=fb.context.max_token_budget,
                                 time_budget_s=groups.init_time_budget_s),
            "form_batch": lambda: form_batch(state, now, coefficients),
        }, args.calls, args.block)
        doc["fb_phase_split"] = {key: stats(samples) for key, samples in phases.items()}
        sim_state, sim_now = states[f"sim {GOAL_SIZE}+{WAITING}"]
        numpy_now = np.float64(sim_now)
        clock_pair = time_interleaved(
            {"float": lambda: fb.form_batch(sim_state, sim_now),
             "numpy.float64": lambda: fb.form_batch(sim_state, numpy_now)},
            args.calls, args.block)
        doc["fb_sim_state_clock_type"] = {key: stats(v) for key, v in clock_pair.items()}
        doc["cprofile_calls"] = args.calls
        doc["fb_cprofile"] = profile_fb(state, now, fb, args.calls)

    text = markdown(doc) if "fb" in policies else json.dumps(results, indent=1)
    print(text)
    if not args.no_write:
        write_outputs(args.out, "decision_time", text, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
