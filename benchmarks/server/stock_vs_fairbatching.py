"""Benchmark: stock SGLang vs tuned stock vs FairBatching, side by side, on the emulated GPU,
run in parts, resumable, over several seeds (mean and spread per point).

Eight server configurations of the stock ``python -m sglang.launch_server`` (SGLang 0.5.23,
this project's plugin installed), all on the emulated GPU (profile ``llama3.1-8b-h100``,
step times x2 -- ``FAIRBATCHING_EMULATED_GPU_TIME_SCALE=2``) with the same KV size
(``--max-total-tokens``) and the same explicit ``--max-prefill-tokens``:

* ``stock``             -- SGLang's defaults (``FAIRBATCHING_CONFIG`` unset: the plugin is inert);
* ``stock-mixed-256``, ``stock-mixed-512``, ``stock-mixed-1024`` -- tuned stock:
  ``--enable-mixed-chunk --chunked-prefill-size N`` (decodes ride along with small prefill
  chunks, Sarathi-style). Every comparison is against the best of the three *per point*
  (workload and rate; by the mean over seeds of replay attainment / random goodput);
* ``stock-mixed-512-queue-16`` -- the best stock configuration with SGLang's admission
  control: the best chunk size of the replay here (512, at 4 and 7 req/s) with the best
  queue limit of the admission benchmark (``--max-queued-requests 16``,
  ``benchmarks/server/admission.py``: best stock at 16 and 24 req/s);
* ``stock-mixed-512-queue-16-priority`` -- the same with ``--enable-priority-scheduling``,
  the replay client setting each request's ``priority`` from its SLO class (minus its TTFT
  target in ms: interactive before standard; ``--priority class``);
* ``stock-mixed-512-queue-16-sjf`` -- the same with ``--enable-priority-scheduling
  --schedule-low-priority-values-first``, shortest prompt first: **it needs the client to
  set priority = prompt length** (``--priority prompt-length``; SGLang has no
  shortest-first order that combines with priority scheduling). A full queue drops its
  least urgent waiting request for a more urgent arrival. Both priority configurations run
  the replay workload only: (a)'s load generator sends one priority for every request.
  SGLang's semantics, with file and line: ``benchmarks/server/priority.py``;
* ``stock-mixed-512-queue-16-hrrn`` and ``-spf`` -- the same queue with SGLang's own
  orders, ``--schedule-policy hrrn`` (highest response ratio next: shortest first, waiting
  prompts aged by the prefill tokens run since they arrived) and
  ``shortest-prefill-first`` (the continuing chunk capped so shorter prompts fit beside
  it); no client help needed;
* ``fairbatching``      -- ``FAIRBATCHING_CONFIG`` = the shipped ``configs/fairbatching.toml``
  with its initial step model scaled by the time scale (as a deployment starts from
  coefficients fitted on its own GPU) and the SLO classes of ``configs/slo.toml``.

Two workloads at each rate, each with every seed S:

(a) ``python -m sglang.benchmark.serving --backend sglang-oai --dataset-name random``:
    Poisson arrivals; prompts cut from a generated local ShareGPT-format file of random
    words (no hub access; distinct per request, so the radix cache cannot serve prefills);
    one SLO for every request, sent in ``custom_params`` and used for ``--goodput``. Its
    TPOT is per request ``(latency - TTFT) / (output tokens - 1)``, a mean. Its ``--seed``
    is ``100000 * S + k``, k = 1, 2, 3 at the default rates 10, 16, 22 req/s (so seed 0
    repeats the earlier one-seed runs), otherwise k = round(1000 * rate). With
    ``--output-details`` its per-request records also give the simulator's worst prompt
    bucket and token goodput (by its own TTFT and mean-TPOT rule: ``client_runs.serving_records``).
(b) ``python -m benchmarks.server.trace_replay``: the bundled Azure conversation sample at trace
    timestamps (``--arrivals trace``, rescaled to the rate; the head of the trace holding
    about ``--replay-seconds`` of arrivals at that rate), exact prompt/output lengths, SLO
    classes ``interactive:0.5,standard:0.5`` drawn with ``--seed S``. Its TPOT is the
    simulator's: per request the *max* over tokens j of ``(t_j - t_first) / j``, stricter
    than (a)'s mean. Its summary is the simulator's: besides attainment it has attainment per
    prompt-length bucket (<512, 512-1023, 1024-2047, 2048-4095, >=4096 tokens) and per SLO
    class, the worst bucket and the worst class (among groups of at least 20 requests, as
    in the simulator), and token goodput (prompt + output tokens per second of the requests
    that met their SLO), in a second table.

Every finished point (config, workload, rate, seed) is appended at once to
``out/bench_sglang/points.jsonl`` (``--points``) with its command, exit code, wall time,
machine load, result, its server's launch and settings, the commit and whether the tree
was dirty; raw outputs and server logs go to ``out/bench_sglang/<UTC stamp>/``. The tables
(``docs/bench/sglang/table.md`` and ``results.json``, ``--out``) are always rendered from
the saved points. A server is started only for a configuration with points left to run,
and serves all of them (seeds loop inside the configuration); the prefix cache is flushed
before every run::

    scripts/bench_sglang.sh                    # everything: 5 configs x (3 + 3 rates) x 3 seeds
    scripts/bench_sglang.sh --resume           # after an interruption: run only what is missing
    scripts/bench_sglang.sh --resume --configs fairbatching --seeds 0,4 --replay-rates 4
    scripts/bench_sglang.sh --workloads replay --seeds 1     # subsets (a fresh points file)
    scripts/bench_sglang.sh --render-only      # rebuild table.md / results.json from the points
    scripts/bench_sglang.sh --quick --seeds 1  # one rate per workload, 20 s runs: a smoke check
    scripts/bench_sglang.sh --quick --seeds 1 --out /tmp/smoke --points /tmp/smoke/points.jsonl

Without ``--resume`` a run starts a fresh points file (the old one is renamed
``points-<UTC stamp>.jsonl``, never deleted). ``--resume`` skips every saved point with the
same configuration (and launch flags), workload, rate, seed and run-defining parameters
(seconds of arrivals, lengths, SLOs, profile); a point saved with an error runs again.
``--seeds 3`` means seeds 0, 1, 2; ``--seeds 0,4`` (or ``4,``) lists them. The tables show,
per workload, the points run with the parameters of the last point saved for it.

Duration: about 70-90 s per run plus about 30 s per server start, so the full default run
(6 configs x 6 rates + 2 configs x 3 replay rates, x 3 seeds = 126 runs, 8 server starts)
takes about 3-3.5 hours on the 2-vCPU VM; ``--quick`` (20 s runs) with ``--seeds 1`` about
10-14 min for all eight configs. The priority configurations alone::

    scripts/bench_sglang.sh --quick --seeds 1 --workloads replay \
        --configs stock-mixed-512-queue-16,stock-mixed-512-queue-16-priority,stock-mixed-512-queue-16-sjf

The server and the load generator share this machine's CPUs, and so do other people's
processes: each run records the CPU use and any foreign SGLang server seen while it ran
(the script first waits, up to ``--quiet-wait`` s, for such servers to go away).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.server.client_runs import (
    flush_cache,
    replay_command,
    replay_head_seconds,
    run_command,
    serving_records,
    write_random_dataset,
)
from benchmarks.server.emulated import MAX_PROMPT_TOKENS, PROFILE, TIME_SCALE, write_fb_config
from benchmarks.server.machine_watch import Watch, wait_quiet
from benchmarks.server.priority import CLASS, NONE, PROMPT_LENGTH
from benchmarks.server.priority import launch_args as priority_args
from benchmarks.server.stock_server import CPU_ARGS, Server, launch
from benchmarks.support.machine import machine_info
from benchmarks.support.paths import DOCS_BENCH, REPO, relative
from benchmarks.support.points import (
    append_point,
    canonical,
    done_keys,
    latest_by_key,
    load_points,
    move_aside,
    point_key,
    spread,
)
from sglang_ext.policy.slo import Slo
from sglang_ext.provenance import git_state
from sglang_ext.sim.metrics import MIN_GROUP_REQUESTS, prompt_bucket_labels, summarize

KV_TOKENS = 200_000
MAX_PREFILL_TOKENS = 16_384
CHUNKS = (256, 512, 1024)  # the stock-mixed chunk sizes
COMMON_ARGS = ("--max-total-tokens", str(KV_TOKENS), "--max-prefill-tokens", str(MAX_PREFILL_TOKENS))

# (a) the random workload
RANDOM_INPUT_LEN = 1024
RANDOM_OUTPUT_LEN = 128
RANDOM_RANGE_RATIO = 0.5  # lengths uniform in [0.5 L, L]
RANDOM_SLO = {"ttft_ms": 2000, "tpot_ms": 50}  # = the "standard" class of configs/slo.toml
RANDOM_SLO_CLASS = "standard"
# (b) the trace replay
REPLAY_SLO_MIX = "interactive:0.5,standard:0.5"
REPLAY_CLASSES = tuple(part.split(":")[0] for part in REPLAY_SLO_MIX.split(","))
REPLAY_ARRIVALS = "trace"

WORKLOADS = ("random", "replay")
DEFAULT_RANDOM_RATES = (10.0, 16.0, 22.0)
DEFAULT_REPLAY_RATES = (2.0, 4.0, 7.0)
QUICK_RANDOM_RATES = (16.0,)
QUICK_REPLAY_RATES = (4.0,)
DEFAULT_SECONDS = 60.0
QUICK_SECONDS = 20.0
DEFAULT_SEEDS = (0, 1, 2)

DEFAULT_OUT = DOCS_BENCH / "sglang"
RAW_ROOT = REPO / "out" / "bench_sglang"
DEFAULT_POINTS = RAW_ROOT / "points.jsonl"
# A point is done when one with the same values of these fields was saved without an error.
POINT_KEY = ("config", "workload", "rate", "seed", "params", "launch_args")


@dataclass(frozen=True)
class ServerConfig:
    name: str
    args: tuple[str, ...]
    fairbatching: bool
    description: str
    priority: str = NONE  # the replay client's --priority (benchmarks/server/priority.py)
    workloads: tuple[str, ...] = WORKLOADS  # the workloads it runs


MIXED_PREFIX = "stock-mixed-"


def _mixed(chunk: int) -> ServerConfig:
    return ServerConfig(
        f"{MIXED_PREFIX}{chunk}",
        (*COMMON_ARGS, "--enable-mixed-chunk", "--chunked-prefill-size", str(chunk)),
        False,
        f"tuned stock: mixed prefill/decode batches, {chunk}-token prefill chunks",
    )


# The best stock configuration with a queue limit, which the priority configurations extend:
# the replay's best chunk here (512 at 4 and 7 req/s, docs/bench/sglang/table.md) and the
# admission benchmark's best queue limit (16 at 16 and 24 req/s, docs/bench/sglang_admission.md).
QUEUED_CHUNK = 512
QUEUE_LIMIT = 16
QUEUED_NAME = f"{MIXED_PREFIX}{QUEUED_CHUNK}-queue-{QUEUE_LIMIT}"


def _queued(priority: str = NONE) -> ServerConfig:
    """``stock-mixed-512-queue-16``, and with SGLang's priority scheduling: ``-priority`` (the
    SLO class as the priority) or ``-sjf`` (shortest prompt first: the client sets each
    request's priority to its prompt length)."""
    base = (*_mixed(QUEUED_CHUNK).args, "--max-queued-requests", str(QUEUE_LIMIT))
    what = f"stock-mixed-{QUEUED_CHUNK} with SGLang's queue limit {QUEUE_LIMIT}"
    if priority == NONE:
        return ServerConfig(QUEUED_NAME, base, False, what)
    if priority == CLASS:
        return ServerConfig(f"{QUEUED_NAME}-priority", (*base, *priority_args(CLASS)), False,
                            f"{what}, priority scheduling: priority = the SLO class (tightest "
                            "TTFT first; client --priority class)", CLASS, ("replay",))
    return ServerConfig(f"{QUEUED_NAME}-sjf", (*base, *priority_args(PROMPT_LENGTH)), False,
                        f"{what}, priority scheduling, low values first: priority = prompt "
                        "length (shortest first; client --priority prompt-length)",
                        PROMPT_LENGTH, ("replay",))


#: SGLang's own waiting orders (``--schedule-policy``; both need the radix cache, which is on)
SGLANG_ORDERS = {"hrrn": "hrrn", "spf": "shortest-prefill-first"}


def _ordered(suffix: str) -> ServerConfig:
    """``stock-mixed-512-queue-16`` with SGLang's ``--schedule-policy hrrn`` (highest response
    ratio next: shortest first, with waiting prompts aged by the prefill tokens run since
    they arrived) or ``shortest-prefill-first``; neither needs the client's help."""
    policy = SGLANG_ORDERS[suffix]
    base = (*_mixed(QUEUED_CHUNK).args, "--max-queued-requests", str(QUEUE_LIMIT))
    return ServerConfig(f"{QUEUED_NAME}-{suffix}", (*base, "--schedule-policy", policy), False,
                        f"stock-mixed-{QUEUED_CHUNK} with SGLang's queue limit {QUEUE_LIMIT} and "
                        f"--schedule-policy {policy}")


CONFIGS = (
    ServerConfig("stock", COMMON_ARGS, False, "SGLang defaults; plugin installed, FAIRBATCHING_CONFIG unset"),
    *(_mixed(chunk) for chunk in CHUNKS),
    _queued(),
    _queued(CLASS),
    _queued(PROMPT_LENGTH),
    *(_ordered(suffix) for suffix in SGLANG_ORDERS),
    ServerConfig("fairbatching", COMMON_ARGS, True,
                 "FAIRBATCHING_CONFIG = configs/fairbatching.toml (step model x time scale)"),
)
CONFIG_ORDER = {c.name: i for i, c in enumerate(CONFIGS)}
STOCK_NAMES = tuple(c.name for c in CONFIGS if not c.fairbatching)
# the chunk sizes the best stock-mixed is picked from (the queued configurations are not)
MIXED_NAMES = tuple(f"{MIXED_PREFIX}{chunk}" for chunk in CHUNKS)


# ------------------------------------------------------------------ runs
@dataclass
class Plan:
    random_rates: tuple[float, ...]
    replay_rates: tuple[float, ...]
    random_seconds: float
    replay_seconds: float
    configs: tuple[ServerConfig, ...]
    workloads: tuple[str, ...]
    seeds: tuple[int, ...]
    quiet_wait_s: float

    def rates(self, workload: str) -> tuple[float, ...]:
        return self.random_rates if workload == "random" else self.replay_rates


def run_params(plan: Plan, workload: str) -> dict:
    """The parameters that define a point besides its config, rate and seed (part of the
    resume key: a saved point run with other parameters is not reused)."""
    common = {"profile": PROFILE, "time_scale": TIME_SCALE, "kv_tokens": KV_TOKENS,
              "max_prefill_tokens": MAX_PREFILL_TOKENS}
    if workload == "random":
        return {**common, "seconds": plan.random_seconds, "input_len": RANDOM_INPUT_LEN,
                "output_len": RANDOM_OUTPUT_LEN, "range_ratio": RANDOM_RANGE_RATIO, "slo": RANDOM_SLO}
    return {**common, "seconds": plan.replay_seconds, "arrivals": REPLAY_ARRIVALS,
            "slo_mix": REPLAY_SLO_MIX, "max_prompt_tokens": MAX_PROMPT_TOKENS}


def random_seed(seed: int, rate: float) -> int:
    """The random workload's ``--seed`` for seed ``seed`` at ``rate``: 100000 * seed + k with
    k = 1, 2, 3 at the default rates (seed 0 = the seeds of the earlier one-seed runs,
    which used the rate's index + 1) and k = round(1000 * rate) at any other rate."""
    k = DEFAULT_RANDOM_RATES.index(rate) + 1 if rate in DEFAULT_RANDOM_RATES else round(1000 * rate)
    return 100_000 * seed + k


def random_prompts(rate: float, seconds: float) -> int:
    return max(20, round(rate * seconds))


def random_dataset_size(rate: float, seconds: float) -> int:
    """Conversations in the generated dataset: enough for the largest default rate (so the
    prompts a seed draws do not depend on which rates a part of the run selected)."""
    return random_prompts(max(rate, *DEFAULT_RANDOM_RATES), seconds) + 50


def random_command(url: str, model_dir: Path, dataset: Path, rate: float, prompts: int,
                   seed: int, output: Path) -> list[str]:
    slo = RANDOM_SLO
    return [
        sys.executable, "-m", "sglang.benchmark.serving",
        "--backend", "sglang-oai", "--base-url", url,
        "--dataset-name", "random", "--dataset-path", str(dataset),
        "--model", str(model_dir), "--tokenizer", str(model_dir),
        "--random-input-len", str(RANDOM_INPUT_LEN), "--random-output-len", str(RANDOM_OUTPUT_LEN),
        "--random-range-ratio", str(RANDOM_RANGE_RATIO),
        "--num-prompts", str(prompts), "--request-rate", f"{rate:g}", "--seed", str(seed),
        "--goodput", f"ttft:{slo['ttft_ms']}", f"tpot:{slo['tpot_ms']}",
        "--extra-request-body", json.dumps({"custom_params": {"slo": slo}}),
        "--flush-cache", "--disable-tqdm", "--output-details", "--output-file", str(output),
    ]  # fmt: skip


RANDOM_KEYS = (
    "completed", "duration", "request_throughput", "output_throughput", "input_throughput",
    "request_goodput", "slo_attainment", "slo_attainment_by_metric",
    "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_ttft_ms",
    "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms", "mean_tpot_ms",
    "median_itl_ms", "p99_itl_ms", "median_e2e_latency_ms", "p99_e2e_latency_ms",
    "total_input_tokens", "total_output_tokens", "max_concurrent_requests",
)


# What (a) keeps of the simulator's summary of its per-request records.
RANDOM_GROUP_KEYS = ("requests", "attainment", "by_prompt_tokens", "worst_prompt_bucket",
                     "worst_slo_class", "token_goodput")


def parse_random(output: Path) -> dict:
    """The tool's summary (:data:`RANDOM_KEYS`), and under ``"groups"`` the simulator's
    summary of its per-request records (:func:`random_groups`)."""
    lines = [line for line in output.read_text().splitlines() if line.strip()]
    result = json.loads(lines[-1])
    parsed = {key: result.get(key) for key in RANDOM_KEYS}
    groups = random_groups(result)
    if groups is not None:
        parsed["groups"] = groups
    return parsed


def random_groups(result: dict) -> dict | None:
    """Attainment per prompt-length bucket, the worst bucket and class and token goodput of
    a ``sglang.benchmark.serving --output-details`` result (its one SLO, its duration; the
    tool's mean-TPOT rule, :func:`~benchmarks.server.client_runs.serving_records`); None
    without the details."""
    slo = Slo.from_ms(RANDOM_SLO["ttft_ms"], RANDOM_SLO["tpot_ms"])
    records = serving_records(result, slo, RANDOM_SLO_CLASS)
    if not records or not result.get("duration"):
        return None
    summary = summarize(records, result.get("request_rate") or math.nan, result["duration"])
    return {key: summary[key] for key in RANDOM_GROUP_KEYS}


@dataclass
class Inputs:
    """This invocation's run folder and the inputs written into it (paths relative to the
    checkout where possible, so the recorded commands rerun from there)."""

    raw: Path
    model_dir: Path
    fb_config: Path
    datasets: dict[int, Path]

    def dataset(self, conversations: int) -> Path:
        if conversations not in self.datasets:
            path = self.raw / f"random-words-sharegpt-{conversations}.json"
            self.datasets[conversations] = relative(write_random_dataset(path, conversations))
        return self.datasets[conversations]


def run_point(plan: Plan, server: Server, config: ServerConfig, workload: str, rate: float,
              seed: int, inputs: Inputs) -> dict:
    """One run; the point without its server / provenance fields."""
    stem = f"{config.name}-{workload}-r{rate:g}-s{seed}"
    raw = inputs.raw
    waited = wait_quiet(server.process.pid, plan.quiet_wait_s)
    if workload == "random":
        prompts = random_prompts(rate, plan.random_seconds)
        conversations = random_dataset_size(rate, plan.random_seconds)
        output = raw / f"{stem}.jsonl"
        output.unlink(missing_ok=True)
        command = random_command(server.url, inputs.model_dir, inputs.dataset(conversations), rate,
                                 prompts, random_seed(seed, rate), relative(output))
        extra = {"num_prompts": prompts, "workload_seed": random_seed(seed, rate),
                 "dataset_conversations": conversations}
    else:
        flush_cache(server.url)
        head = replay_head_seconds(rate, plan.replay_seconds)
        output = raw / f"{stem}.json"
        output.unlink(missing_ok=True)
        command = replay_command(server.url, rate, head, REPLAY_ARRIVALS, seed, REPLAY_SLO_MIX,
                                 relative(output), priority=config.priority)
        extra = {"head_s": head, "workload_seed": seed}
    print(f"  {stem}: {shlex.join(command[1:])[:160]} ...", file=sys.stderr, flush=True)
    with Watch(server.process.pid) as watch:
        code, wall = run_command(command, raw / f"{stem}.log", timeout_s=900)
    point = {"config": config.name, "workload": workload, "rate": rate, "seed": seed,
             "params": run_params(plan, workload), "launch_args": list(config.args), **extra,
             "command": shlex.join(["python", *command[1:]]), "exit_code": code,
             "wall_s": round(wall, 1), "waited_for_quiet_s": round(waited, 1),
             "machine_during_run": watch.record(), "log": str(relative(raw / f"{stem}.log"))}
    if code != 0 or not output.exists():
        point["error"] = f"exit code {code}; see {relative(raw / (stem + '.log'))}"
        print(f"  {stem}: FAILED ({point['error']})", file=sys.stderr, flush=True)
        return point
    point["result"] = parse_random(output) if workload == "random" else json.loads(output.read_text())
    if not server.alive():
        point["error"] = "server died during the run"
    print(f"  {stem}: done in {wall:.0f} s", file=sys.stderr, flush=True)
    return point


def server_settings(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/server_info", timeout=30) as reply:
        info = json.load(reply)
    keys = ("chunked_prefill_size", "max_prefill_tokens", "max_total_num_tokens",
            "enable_mixed_chunk", "disable_radix_cache", "schedule_policy",
            "disable_overlap_schedule", "max_running_requests", "stream_interval",
            "schedule_conservativeness", "max_queued_requests", "enable_priority_scheduling",
            "schedule_low_priority_values_first", "priority_scheduling_preemption_threshold",
            "version")
    return {key: info.get(key) for key in keys}


def todo_points(plan: Plan, config: ServerConfig, done: set[tuple]) -> list[tuple[str, float, int]]:
    """(workload, rate, seed) of ``config`` not yet saved, seeds outermost (an interrupted run
    leaves whole seeds done)."""
    todo = []
    for seed in plan.seeds:
        for workload in plan.workloads:
            if workload not in config.workloads:
                continue
            for rate in plan.rates(workload):
                probe = {"config": config.name, "workload": workload, "rate": rate, "seed": seed,
                         "params": run_params(plan, workload), "launch_args": list(config.args)}
                if point_key(probe, POINT_KEY) not in done:
                    todo.append((workload, rate, seed))
    return todo


def run_config(plan: Plan, config: ServerConfig, todo: list[tuple[str, float, int]],
               inputs: Inputs, points_path: Path, provenance: dict) -> list[dict]:
    """Start ``config``'s server, run ``todo`` on it, append each point as it finishes."""
    env = {"FAIRBATCHING_EMULATED_GPU": PROFILE, "FAIRBATCHING_EMULATED_GPU_TIME_SCALE": f"{TIME_SCALE:g}"}
    if config.fairbatching:
        env["FAIRBATCHING_CONFIG"] = str(inputs.fb_config)
    log_path = inputs.raw / f"server-{config.name}.log"
    server_record = {
        "name": config.name, "description": config.description,
        "launch": shlex.join(["python", "-m", "sglang.launch_server", "--model-path",
                              str(inputs.model_dir), *CPU_ARGS, *config.args]),
        "env": env, "log": str(relative(log_path)),
    }
    saved = []

    def save(point: dict) -> None:
        point.update(server=server_record, **provenance, **git_state(REPO),
                     date_utc=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"))
        append_point(points_path, point)
        saved.append(point)

    def failed(workload: str, rate: float, seed: int, error: str) -> dict:
        return {"config": config.name, "workload": workload, "rate": rate, "seed": seed,
                "params": run_params(plan, workload), "launch_args": list(config.args), "error": error}

    wait_quiet(None, plan.quiet_wait_s)
    print(f"[{config.name}] starting server for {len(todo)} points", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        server = launch(inputs.model_dir, config.args, env, log_path, python=sys.executable)
    except Exception as error:  # noqa: BLE001 -- record it, go on with the next config
        print(f"[{config.name}] server did not start: {error}", file=sys.stderr, flush=True)
        server_record["start_s"] = round(time.monotonic() - started, 1)
        for item in todo:
            save(failed(*item, f"server did not start: {str(error)[:300]}; see {relative(log_path)}"))
        return saved
    server_record["start_s"] = round(time.monotonic() - started, 1)
    try:
        server_record["server_info"] = server_settings(server.url)
        for workload, rate, seed in todo:
            if not server.alive():
                save(failed(workload, rate, seed, f"server not running; see {relative(log_path)}"))
                continue
            try:
                point = run_point(plan, server, config, workload, rate, seed, inputs)
            except (OSError, RuntimeError) as error:  # /flush_cache failed, ...
                point = failed(workload, rate, seed, f"{type(error).__name__}: {error}")
            point["server_tracebacks_so_far"] = server.log_text().count("Traceback")
            save(point)
    finally:
        server.stop()
    return saved


# ------------------------------------------------------------------ aggregation
@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    get: Callable[[dict], float | None]
    kind: str  # share | rate | latency | count
    digits: int = 0
    higher: bool = True  # for comparisons
    compare: bool = False  # counted in "Where FairBatching loses"


def _dig(*path: str) -> Callable[[dict], float | None]:
    def get(result: dict) -> float | None:
        value = result
        for name in path:
            if not isinstance(value, dict):
                return None
            value = value.get(name)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    return get


PROMPT_BUCKETS = tuple(prompt_bucket_labels())  # <512, 512-1023, ..., >=4096

RANDOM_METRICS = (
    Metric("goodput", "goodput (req/s)", _dig("request_goodput"), "rate", 2, compare=True),
    Metric("attainment", "SLO attainment", _dig("slo_attainment"), "share", compare=True),
    Metric("ttft_attainment", "TTFT attainment", _dig("slo_attainment_by_metric", "ttft"), "share"),
    Metric("tpot_attainment", "TPOT attainment", _dig("slo_attainment_by_metric", "tpot"), "share"),
    Metric("ttft_p50", "TTFT p50 (ms)", _dig("median_ttft_ms"), "latency", 0, False),
    Metric("ttft_p99", "TTFT p99 (ms)", _dig("p99_ttft_ms"), "latency", 0, False, True),
    Metric("tpot_p50", "TPOT p50 (ms)", _dig("median_tpot_ms"), "latency", 1, False),
    Metric("tpot_p99", "TPOT p99 (ms)", _dig("p99_tpot_ms"), "latency", 1, False, True),
    Metric("throughput", "throughput (req/s)", _dig("request_throughput"), "rate", 2),
    Metric("output_tok_s", "output tok/s", _dig("output_throughput"), "rate", 0, compare=True),
    Metric("completed", "completed", _dig("completed"), "count"),
    # from the per-request records (random_groups): one SLO, so its worst class is all
    *(Metric(f"bucket:{label}", f"{label} tokens attainment",
             _dig("groups", "by_prompt_tokens", label, "attainment"), "share") for label in PROMPT_BUCKETS),
    Metric("worst_bucket_attainment", "worst prompt bucket attainment",
           _dig("groups", "worst_prompt_bucket", "attainment"), "share", compare=True),
    Metric("token_goodput", "token goodput (tok/s)", _dig("groups", "token_goodput"), "rate", 0,
           compare=True),
)
REPLAY_METRICS = (
    Metric("attainment", "attainment", _dig("attainment"), "share", compare=True),
    Metric("ttft_attainment", "TTFT attainment", _dig("ttft_attainment"), "share"),
    Metric("tpot_attainment", "max-TPOT attainment", _dig("tpot_attainment"), "share"),
    Metric("effective_rps", "effective RPS", _dig("effective_rps"), "rate", 2),
    Metric("envelope_attainment", "envelope attainment", _dig("envelope_attainment"), "share"),
    Metric("ttft_p50", "TTFT p50 (ms)", _dig("ttft_ms", "p50"), "latency", 0, False),
    Metric("ttft_p99", "TTFT p99 (ms)", _dig("ttft_ms", "p99"), "latency", 0, False, True),
    Metric("max_tpot_p50", "max-TPOT p50 (ms)", _dig("tpot_ms", "p50"), "latency", 1, False),
    Metric("max_tpot_p99", "max-TPOT p99 (ms)", _dig("tpot_ms", "p99"), "latency", 1, False, True),
    Metric("mean_tpot_p99", "mean TPOT p99 (ms)", _dig("mean_tpot_ms", "p99"), "latency", 1, False),
    Metric("max_tbt_p50", "max TBT p50 (ms)", _dig("max_tbt_ms", "p50"), "latency", 0, False, True),
    Metric("max_tbt_p99", "max TBT p99 (ms)", _dig("max_tbt_ms", "p99"), "latency", 0, False),
    *(m for name in REPLAY_CLASSES for m in (
        Metric(f"{name}_attainment", f"{name} attainment", _dig("per_class", name, "attainment"),
               "share", compare=True),
        Metric(f"{name}_ttft_p99", f"{name} TTFT p99 (ms)", _dig("per_class", name, "ttft_ms", "p99"),
               "latency", 0, False),
    )),
    Metric("output_tok_s", "output tok/s", _dig("output_tokens_per_s"), "rate", 0, compare=True),
    Metric("requests", "requests", _dig("requests"), "count"),
    # who pays -- per prompt-length bucket and SLO class, the worst of each, and
    # token goodput (the simulator's definitions, sglang_ext.sim.metrics)
    *(m for label in PROMPT_BUCKETS for m in (
        Metric(f"bucket:{label}", f"{label} tokens attainment",
               _dig("by_prompt_tokens", label, "attainment"), "share"),
        Metric(f"bucket:{label}:requests", f"{label} tokens requests",
               _dig("by_prompt_tokens", label, "requests"), "count"),
    )),
    Metric("worst_bucket_attainment", "worst prompt bucket attainment",
           _dig("worst_prompt_bucket", "attainment"), "share", compare=True),
    Metric("worst_class_attainment", "worst SLO class attainment",
           _dig("worst_slo_class", "attainment"), "share", compare=True),
    Metric("token_goodput", "token goodput (tok/s)", _dig("token_goodput"), "rate", 0, compare=True),
)
METRICS = {"random": RANDOM_METRICS, "replay": REPLAY_METRICS}
# The worst-group labels a cell names (the most frequent over its seeds), and where they are.
WORST_GROUPS = {"worst_bucket_attainment": "worst_prompt_bucket", "worst_class_attainment": "worst_slo_class"}


def _groups_of(workload: str, result: dict) -> dict:
    """Where a result keeps the simulator's group summary: the replay's at its top level,
    (a)'s under ``"groups"``."""
    return result if workload == "replay" else (result.get("groups") or {})
METRIC = {(w, m.key): m for w, ms in METRICS.items() for m in ms}
# The headline metric that picks the best stock-mixed chunk size; ties: the lower p99 TPOT.
HEADLINE = {"random": "goodput", "replay": "attainment"}
TIEBREAK = {"random": "tpot_p99", "replay": "max_tpot_p99"}


def select_points(points: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the points the tables show, the saved points they leave out): per workload the
    points run with the parameters of the last point saved for that workload, per config
    those with its last launch flags, one point per (config, workload, rate, seed) -- the
    last good one, else the last failed one."""
    last_params = {p["workload"]: canonical(p.get("params")) for p in points}
    last_args = {p["config"]: canonical(p.get("launch_args")) for p in points}
    shown = [p for p in points if canonical(p.get("params")) == last_params[p["workload"]]
             and canonical(p.get("launch_args")) == last_args[p["config"]]]
    shown = latest_by_key(shown, POINT_KEY)
    ids = {id(p) for p in shown}
    return shown, [p for p in points if id(p) not in ids]


Cells = dict[tuple[str, float, str], dict]


def aggregate(points: list[dict]) -> Cells:
    """(workload, rate, config) -> {"seeds": finished seeds, "failed": [errors of seeds that
    did not finish], "metrics": {key: mean/min/max/n over the finished seeds}}."""
    groups: dict[tuple[str, float, str], list[dict]] = {}
    for p in points:
        groups.setdefault((p["workload"], p["rate"], p["config"]), []).append(p)
    cells = {}
    for (workload, rate, config), group in groups.items():
        good = [p for p in group if "error" not in p and "result" in p]
        cells[(workload, rate, config)] = {
            "seeds": sorted(p["seed"] for p in good),
            "failed_seeds": sorted(p["seed"] for p in group if p not in good),
            "failed": [f"seed {p['seed']}: {p.get('error')}" for p in group if p not in good],
            "metrics": {m.key: spread(m.get(p["result"]) for p in good) for m in METRICS[workload]},
            "labels": {key: worst_labels(_groups_of(workload, p["result"]).get(group) for p in good)
                       for key, group in WORST_GROUPS.items()},
        }
    return cells


def worst_labels(groups: Iterable[dict | None]) -> list[list]:
    """The worst group's label over the seeds: ``[[label, seeds], ...]``, most frequent
    first (``None``: no group was large enough; results without the field are skipped)."""
    counts: dict[str | None, int] = {}
    for group in groups:
        if isinstance(group, dict):
            counts[group.get("label")] = counts.get(group.get("label"), 0) + 1
    return [[label, n] for label, n in sorted(counts.items(), key=lambda kv: -kv[1])]


def _mean(cells: Cells, workload: str, rate: float, config: str, key: str) -> float | None:
    stats = cells.get((workload, rate, config), {}).get("metrics", {}).get(key)
    return None if stats is None else stats["mean"]


def best_of(cells: Cells, workload: str, rate: float, names: Sequence[str]) -> str | None:
    """The config among ``names`` with the highest mean headline metric at (workload, rate);
    ties: the lower mean p99 TPOT, then the earlier config."""
    ranked = []
    for name in names:
        head = _mean(cells, workload, rate, name, HEADLINE[workload])
        if head is None:
            continue
        tie = _mean(cells, workload, rate, name, TIEBREAK[workload])
        ranked.append((-head, math.inf if tie is None else tie, CONFIG_ORDER.get(name, 99), name))
    return min(ranked)[-1] if ranked else None


def rates_of(cells: Cells, workload: str) -> list[float]:
    return sorted({rate for (w, rate, _) in cells if w == workload})


def best_stock_mixed(cells: Cells) -> dict[tuple[str, float], str]:
    out = {}
    for workload in WORKLOADS:
        for rate in rates_of(cells, workload):
            best = best_of(cells, workload, rate, MIXED_NAMES)
            if best is not None:
                out[(workload, rate)] = best
    return out


LATENCY_MARGIN = 0.10  # latency percentiles: 10%
THROUGHPUT_MARGIN = 0.05  # rates: 5%; attainment: 1 percentage point
MARGINS_TEXT = ("more than 1 percentage point (attainment), 10% (latency percentiles) or 5% "
                "(throughput, goodput)")


def _verdict(fb: float, other: float, higher: bool, is_share: bool) -> int:
    """-1: FairBatching worse beyond the margin, +1: better beyond it, 0: within it."""
    if is_share:
        return -1 if fb < other - 0.01 else (1 if fb > other + 0.01 else 0)
    margin = THROUGHPUT_MARGIN if higher else LATENCY_MARGIN
    if higher:
        return -1 if fb < other * (1 - margin) else (1 if fb > other * (1 + margin) else 0)
    return -1 if fb > other * (1 + margin) else (1 if fb < other * (1 - margin) else 0)


def comparisons(cells: Cells, best_mixed: dict[tuple[str, float], str]) -> list[dict]:
    """FairBatching's means against the best stock-mixed's at every (workload, rate, metric);
    ``within_noise``: the difference is no larger than the wider of the two seeds' spreads."""
    out = []
    for workload in WORKLOADS:
        for rate in rates_of(cells, workload):
            baseline = best_mixed.get((workload, rate))
            fb = cells.get((workload, rate, "fairbatching"))
            if baseline is None or fb is None:
                continue
            other = cells[(workload, rate, baseline)]
            for metric in METRICS[workload]:
                a, b = fb["metrics"].get(metric.key), other["metrics"].get(metric.key)
                if not metric.compare or a is None or b is None:
                    continue
                noise = max(a["max"] - a["min"], b["max"] - b["min"])
                out.append({
                    "workload": workload, "rate": rate, "metric": metric.key, "label": metric.label,
                    "baseline": baseline, "fairbatching": a, "best_stock_mixed": b,
                    "verdict": _verdict(a["mean"], b["mean"], metric.higher, metric.kind == "share"),
                    "within_noise": abs(a["mean"] - b["mean"]) <= noise,
                })
    return out


def targets(cells: Cells, best_mixed: dict[tuple[str, float], str]) -> list[dict]:
    """The three targets on the replay workload, each PASS (every rate with data passes
    and no rate lacks data), MISS (some rate misses) or n/a (no rate has data)."""
    rates = rates_of(cells, "replay")

    def fb(key: str, rate: float) -> float | None:
        return _mean(cells, "replay", rate, "fairbatching", key)

    def pct(v: float) -> str:
        return f"{100 * v:.1f}%"

    checks: dict[str, list[tuple[float, bool | None, str]]] = {"i": [], "ii": [], "iii": []}
    for rate in rates:
        best = best_of(cells, "replay", rate, STOCK_NAMES)
        mixed = best_mixed.get(("replay", rate))
        # (i) attainment within 1 pp of the best stock configuration, or better
        a, b = fb("attainment", rate), best and _mean(cells, "replay", rate, best, "attainment")
        if a is None or b is None:
            checks["i"].append((rate, None, f"{rate:g} req/s: no data"))
        else:
            ok = a >= b - 0.01
            checks["i"].append((rate, ok, f"{rate:g} req/s: fairbatching {pct(a)} vs {pct(b)} "
                                f"(`{best}`), {100 * (a - b):+.1f} pp{'' if ok else ' -- miss'}"))
        # (ii) max-TPOT p99 no worse than that best stock configuration's
        a, b = fb("max_tpot_p99", rate), best and _mean(cells, "replay", rate, best, "max_tpot_p99")
        if a is None or b is None:
            checks["ii"].append((rate, None, f"{rate:g} req/s: no data"))
        else:
            ok = a <= b
            checks["ii"].append((rate, ok, f"{rate:g} req/s: {a:.1f} vs {b:.1f} ms (`{best}`)"
                                 f"{'' if ok else ' -- miss'}"))
        # (iii) median longest token gap within 1.5x of the best stock-mixed's
        a, b = fb("max_tbt_p50", rate), mixed and _mean(cells, "replay", rate, mixed, "max_tbt_p50")
        if a is None or b is None or b <= 0:
            checks["iii"].append((rate, None, f"{rate:g} req/s: no data"))
        else:
            ok = a <= 1.5 * b
            checks["iii"].append((rate, ok, f"{rate:g} req/s: {a:.0f} vs {b:.0f} ms (`{mixed}`), "
                                  f"{a / b:.2f}x{'' if ok else ' -- miss'}"))
    titles = {
        "i": "replay attainment (mean over seeds) within 1 pp of the best stock configuration "
             "(any stock config) at every rate, or better",
        "ii": "replay max-TPOT p99 (mean over seeds) no worse than that of the best stock "
              "configuration (best attainment) at every rate",
        "iii": "replay median longest token gap (max TBT p50, mean over seeds) within 1.5x of "
               "the best stock-mixed's at every rate",
    }
    out = []
    for name, rows in checks.items():
        verdicts = [ok for _, ok, _ in rows]
        if not verdicts or all(ok is None for ok in verdicts):
            verdict = "n/a"
        elif False in verdicts:
            verdict = "MISS"
        elif None in verdicts:
            verdict = "n/a"  # some rate lacks data: not a pass
        else:
            verdict = "PASS"
        out.append({"target": name, "verdict": verdict, "title": titles[name],
                    "rates": [{"rate": rate, "ok": ok, "text": text} for rate, ok, text in rows]})
    return out


def target_lines(rows: list[dict]) -> list[str]:
    return [f"- ({t['target']}) **{t['verdict']}** -- {t['title']}: "
            + ("; ".join(r["text"] for r in t["rates"]) or "no replay points") + "."
            for t in rows]


# ------------------------------------------------------------------ report
def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _value(metric: Metric, value: float) -> str:
    return _pct(value) if metric.kind == "share" else _fmt(value, metric.digits)


def _cell(cells: Cells, workload: str, rate: float, config: str, key: str) -> str:
    """Mean over seeds, and the min-max spread in small type when the seeds differ."""
    stats = cells.get((workload, rate, config), {}).get("metrics", {}).get(key)
    if stats is None:
        return "-"
    metric = METRIC[(workload, key)]
    text = _value(metric, stats["mean"])
    if stats["n"] > 1:
        if metric.kind == "share":
            lo, hi = f"{100 * stats['min']:.1f}", f"{100 * stats['max']:.1f}%"
        else:
            lo, hi = _fmt(stats["min"], metric.digits), _fmt(stats["max"], metric.digits)
        if lo != hi.rstrip("%"):
            text += f" <sub>{lo}–{hi}</sub>"
    return text


def _stats_text(metric: Metric, stats: dict) -> str:
    text = _value(metric, stats["mean"])
    if stats["n"] > 1:
        text += f" ({_value(metric, stats['min'])}–{_value(metric, stats['max'])}, n={stats['n']})"
    return text


def _ordered(cells: Cells, workload: str) -> list[tuple[float, str]]:
    return sorted(((rate, config) for (w, rate, config) in cells if w == workload),
                  key=lambda rc: (rc[0], CONFIG_ORDER.get(rc[1], 99), rc[1]))


def _row_head(cells: Cells, best_mixed: dict, workload: str, rate: float, config: str) -> str:
    cell = cells[(workload, rate, config)]
    name = config + (" *(best mixed)*" if best_mixed.get((workload, rate)) == config else "")
    seeds = ",".join(str(s) for s in cell["seeds"]) or "none"
    if cell["failed_seeds"]:
        seeds += "; failed: " + ",".join(str(s) for s in cell["failed_seeds"])
    return f"| {rate:g} | {name} | {len(cell['seeds'])} ({seeds}) "


def random_table(cells: Cells, best_mixed: dict) -> list[str]:
    lines = [
        "| rate req/s | config | seeds | goodput req/s | SLO attainment | TTFT att. | TPOT att. "
        "| TTFT p50 / p99 ms | TPOT p50 / p99 ms | throughput req/s | output tok/s | completed "
        "| worst prompt bucket | token goodput tok/s |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for rate, config in _ordered(cells, "random"):
        head = _row_head(cells, best_mixed, "random", rate, config)
        if not cells[("random", rate, config)]["seeds"]:
            lines.append(head + "| failed: " + "; ".join(cells[("random", rate, config)]["failed"])
                         + " " + "|" * 11)
            continue
        c = lambda key: _cell(cells, "random", rate, config, key)  # noqa: E731
        lines.append(
            f"{head}| {c('goodput')} | {c('attainment')} | {c('ttft_attainment')} | {c('tpot_attainment')} "
            f"| {c('ttft_p50')} / {c('ttft_p99')} | {c('tpot_p50')} / {c('tpot_p99')} "
            f"| {c('throughput')} | {c('output_tok_s')} | {c('completed')} "
            f"| {_worst_cell(cells, 'random', rate, config, 'worst_bucket_attainment')} "
            f"| {c('token_goodput')} |"
        )
    return lines


def replay_table(cells: Cells, best_mixed: dict) -> list[str]:
    class_heads = "".join(f" {name}: att., TTFT p99 ms |" for name in REPLAY_CLASSES)
    lines = [
        "| rate req/s | config | seeds | requests | attainment | TTFT att. | max-TPOT att. | effective RPS "
        "| envelope att. | TTFT p50 / p99 ms | max-TPOT p50 / p99 ms | mean TPOT p99 ms "
        "| max TBT p50 / p99 ms |" + class_heads + " output tok/s |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---|" * len(REPLAY_CLASSES) + "---:|",
    ]
    for rate, config in _ordered(cells, "replay"):
        head = _row_head(cells, best_mixed, "replay", rate, config)
        if not cells[("replay", rate, config)]["seeds"]:
            lines.append(head + "| failed: " + "; ".join(cells[("replay", rate, config)]["failed"])
                         + " " + "|" * (11 + len(REPLAY_CLASSES)))
            continue
        c = lambda key: _cell(cells, "replay", rate, config, key)  # noqa: E731
        classes = "".join(f" {c(f'{n}_attainment')}, {c(f'{n}_ttft_p99')} |" for n in REPLAY_CLASSES)
        lines.append(
            f"{head}| {c('requests')} | {c('attainment')} | {c('ttft_attainment')} | {c('tpot_attainment')} "
            f"| {c('effective_rps')} | {c('envelope_attainment')} "
            f"| {c('ttft_p50')} / {c('ttft_p99')} | {c('max_tpot_p50')} / {c('max_tpot_p99')} "
            f"| {c('mean_tpot_p99')} | {c('max_tbt_p50')} / {c('max_tbt_p99')} |{classes} {c('output_tok_s')} |"
        )
    return lines


def _worst_cell(cells: Cells, workload: str, rate: float, config: str, key: str) -> str:
    """The worst group's label (the most frequent over the seeds; how many seeds named it
    when they disagree) and its attainment, mean and spread over the seeds."""
    cell = cells.get((workload, rate, config), {})
    labels = cell.get("labels", {}).get(key) or []
    value = _cell(cells, workload, rate, config, key)
    if not labels:
        return value
    seeds = sum(n for _, n in labels)
    label, n = labels[0]
    if label is None:
        return f"- <sub>no group of >= {MIN_GROUP_REQUESTS}</sub>"
    named = f"`{label}`" + (f" ({n} of {seeds} seeds)" if n < seeds else "")
    return f"{named} {value}"


def replay_groups_table(cells: Cells, best_mixed: dict) -> list[str]:
    """Who pays: attainment per prompt-length bucket (mean requests per bucket in small
    type), the worst bucket, attainment per SLO class, the worst class, token goodput."""
    lines = [
        "| rate req/s | config | " + " | ".join(f"{label} tokens" for label in PROMPT_BUCKETS)
        + " | worst bucket | " + " | ".join(REPLAY_CLASSES) + " | worst class | token goodput tok/s |",
        "|---:|---|" + "---:|" * len(PROMPT_BUCKETS) + "---|" + "---:|" * len(REPLAY_CLASSES) + "---|---:|",
    ]
    for rate, config in _ordered(cells, "replay"):
        if not cells[("replay", rate, config)]["seeds"]:
            continue
        name = config + (" *(best mixed)*" if best_mixed.get(("replay", rate)) == config else "")

        def c(key: str, rate: float = rate, config: str = config) -> str:
            return _cell(cells, "replay", rate, config, key)

        buckets = []
        for label in PROMPT_BUCKETS:
            att = c(f"bucket:{label}")
            size = _mean(cells, "replay", rate, config, f"bucket:{label}:requests")
            buckets.append(att if size is None else f"{att} <sub>n={size:.0f}</sub>")
        lines.append(
            f"| {rate:g} | {name} | " + " | ".join(buckets)
            + f" | {_worst_cell(cells, 'replay', rate, config, 'worst_bucket_attainment')} | "
            + " | ".join(c(f"{n}_attainment") for n in REPLAY_CLASSES)
            + f" | {_worst_cell(cells, 'replay', rate, config, 'worst_class_attainment')} | {c('token_goodput')} |"
        )
    return lines


def best_mixed_line(cells: Cells, best_mixed: dict, workload: str) -> str:
    metric = METRIC[(workload, HEADLINE[workload])]
    parts = []
    for rate in rates_of(cells, workload):
        best = best_mixed.get((workload, rate))
        if best is None:
            continue
        others = ", ".join(
            f"{name.removeprefix(MIXED_PREFIX)}: {_value(metric, value)}"
            for name in MIXED_NAMES
            if (value := _mean(cells, workload, rate, name, metric.key)) is not None
        )
        parts.append(f"{rate:g} req/s: `{best}` ({others})")
    return (f"Best stock-mixed chunk per rate (by mean {metric.label}; ties: lower mean "
            f"{METRIC[(workload, TIEBREAK[workload])].label}): " + ("; ".join(parts) or "none") + ".")


def comparison_lines(rows: list[dict], want: int) -> list[str]:
    out = []
    for row in rows:
        if row["verdict"] != want:
            continue
        metric = METRIC[(row["workload"], row["metric"])]
        out.append(f"{row['workload']} @ {row['rate']:g} req/s, {row['label']}: fairbatching "
                   f"{_stats_text(metric, row['fairbatching'])} vs `{row['baseline']}` "
                   f"{_stats_text(metric, row['best_stock_mixed'])}"
                   + (" -- *within noise* (no larger than the seeds' spread)" if row["within_noise"] else ""))
    return out


def comparison_summary(rows: list[dict]) -> str:
    worse = [r for r in rows if r["verdict"] == -1]
    better = [r for r in rows if r["verdict"] == 1]
    same = [r for r in rows if r["verdict"] == 0]
    noisy = lambda rs: sum(r["within_noise"] for r in rs)  # noqa: E731
    return (f"worse at {len(worse)} ({noisy(worse)} of them within noise), better at {len(better)} "
            f"({noisy(better)} within noise) and within the margin at {len(same)} of {len(rows)}")


def observations(cells: Cells, best_mixed: dict) -> list[str]:
    """FairBatching's replay envelope vs max-TPOT attainment and token gaps, per rate (means)."""
    rates = [r for r in rates_of(cells, "replay") if ("replay", r, "fairbatching") in cells]
    if not rates:
        return []

    def series(name_of: Callable[[float], str | None], key: str, fmt: Callable[[float], str]) -> str:
        values = []
        for rate in rates:
            name = name_of(rate)
            value = None if name is None else _mean(cells, "replay", rate, name, key)
            values.append("-" if value is None else fmt(value))
        return " / ".join(values)

    at = " / ".join(f"{r:g}" for r in rates)
    fb = lambda rate: "fairbatching"  # noqa: E731
    mixed = lambda rate: best_mixed.get(("replay", rate))  # noqa: E731
    stock = lambda rate: "stock"  # noqa: E731
    gap = lambda v: f"{v:.0f}"  # noqa: E731
    return [
        f"(b) at {at} req/s, `fairbatching` met the token-deadline envelope for "
        f"{series(fb, 'envelope_attainment', _pct)} of requests and the max-TPOT target for "
        f"{series(fb, 'tpot_attainment', _pct)} (means over seeds); the median per-request "
        f"longest token gap was {series(fb, 'max_tbt_p50', gap)} ms (best stock-mixed "
        f"{series(mixed, 'max_tbt_p50', gap)} ms, stock {series(stock, 'max_tbt_p50', gap)} ms)."
    ]


CAVEATS = [
    "The GPU is emulated: step times come from a roofline model of an H100 running "
    "Llama-3.1-8B, doubled; the scheduler, tokenizer, detokenizer, HTTP server and the load "
    "generator are real and share this VM's 2 CPUs (busy share per run in the last table). "
    "Where the CPUs are near 100% busy, SGLang's per-step Python work and per-token "
    "streaming can bound a configuration as much as the emulated GPU does, so absolute "
    "capacities are this machine's, not an H100's.",
    "FairBatching's initial step model is the shipped one scaled by the time scale; it is "
    "recalibrated online from measured step times, which here include this CPU's overheads.",
    "Each cell is the mean over the seeds listed, min–max in small type. The replay seed only "
    "changes which requests are interactive and which standard (arrival times and lengths are "
    "the trace's), so most of its spread is run-to-run noise of this shared VM; the random "
    "seed also changes prompts and Poisson arrivals. With a few seeds the range is a rough "
    "noise band, not a confidence interval; a difference inside it is not evidence.",
    "The best stock-mixed chunk is picked per point with hindsight (the best of three "
    "measured), which favours stock a little at points where the chunks are within noise.",
    "(a) gives every request the same SLO, so FairBatching's per-class ordering has nothing "
    "to separate; (b) mixes two classes.",
]


def _contention_caveat(points: list[dict]) -> list[str]:
    contended = [f"{p['config']} {p['workload']} @ {p['rate']:g} seed {p['seed']}" for p in points
                 if p.get("machine_during_run", {}).get("foreign_sglang_servers")]
    if not contended:
        return ["No other SGLang server ran on the machine during any run."]
    return ["**Another SGLang server (someone else's) ran on the machine during: "
            + "; ".join(contended) + "** -- those points had less CPU and are not comparable."]


def _provenance_caveat(points: list[dict]) -> list[str]:
    states = {}
    for p in points:
        label = f"{p.get('commit', '?')}{' + uncommitted changes' if p.get('dirty') else ''}"
        states[label] = states.get(label, 0) + 1
    if len(states) <= 1:
        return []
    return ["The points were measured at different code states: "
            + ", ".join(f"{label} ({n} points)" for label, n in states.items()) + "."]


def _latest_per_config(points: list[dict]) -> list[dict]:
    latest: dict[str, dict] = {}
    for p in points:
        if "server" in p and ("server_info" in p["server"] or p["config"] not in latest):
            latest[p["config"]] = p
    return sorted(latest.values(), key=lambda p: CONFIG_ORDER.get(p["config"], 99))


def build_doc(all_points: list[dict], points_path: Path) -> dict:
    """results.json: the shown points, their aggregates, baselines, comparisons, targets."""
    points, ignored = select_points(all_points)
    cells = aggregate(points)
    best_mixed = best_stock_mixed(cells)
    return {
        "schema": "bench_sglang/2",
        "generated_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "points_file": str(relative(points_path)),
        "params": {p["workload"]: p.get("params") for p in points},
        "configs": [{**p["server"], "launch_args": p.get("launch_args")} for p in _latest_per_config(points)],
        "aggregates": [{"workload": w, "rate": r, "config": c, **cell} for (w, r, c), cell in
                       sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], CONFIG_ORDER.get(kv[0][2], 99)))],
        "best_stock_mixed": [{"workload": w, "rate": r, "config": c} for (w, r), c in sorted(best_mixed.items())],
        "comparisons": comparisons(cells, best_mixed),
        "targets": targets(cells, best_mixed),
        "caveats": CAVEATS + _contention_caveat(points) + _provenance_caveat(points),
        "ignored_points": len(ignored),
        "parts": list({p["raw_dir"]: {"raw_dir": p["raw_dir"], "argv": p.get("argv"), "machine": p.get("machine")}
                       for p in points if "raw_dir" in p}.values()),
        "points": points,
    }


# Fields of a point that results.json keeps once (in "params", "configs", "parts"), not per point.
_SHARED_FIELDS = ("params", "launch_args", "server", "machine", "argv")


def results_json(doc: dict) -> str:
    """``doc`` as JSON: indented, except the points, one compact line each (their shared
    fields dropped; the points file keeps everything)."""
    head = json.dumps({k: v for k, v in doc.items() if k != "points"}, indent=1)
    points = ",\n".join("  " + json.dumps({k: v for k, v in p.items() if k not in _SHARED_FIELDS})
                        for p in doc["points"])
    return head[:-2] + ',\n "points": [\n' + points + "\n ]\n}\n"


def render(doc: dict) -> str:
    points = doc["points"]
    cells = aggregate(points)
    best_mixed = best_stock_mixed(cells)
    good = [p for p in points if "error" not in p]
    params = doc["params"]
    seeds = sorted({p["seed"] for p in points})
    invocations: dict[str, int] = {}
    for p in points:
        command = "scripts/bench_sglang.sh" + "".join(" " + shlex.quote(a) for a in p.get("argv", []))
        invocations[command] = invocations.get(command, 0) + 1
    dates = sorted(p["date_utc"] for p in points if "date_utc" in p)
    starts = {(p.get("raw_dir"), p["config"]): p["server"].get("start_s") or 0
              for p in points if "server" in p}
    short = [w for w, ps in params.items() if ps and ps.get("seconds", DEFAULT_SECONDS) < DEFAULT_SECONDS]
    machine = next((p["machine"] for p in reversed(points) if "machine" in p), None)
    configs = _latest_per_config(points)
    version = next((c["server"]["server_info"].get("version") for c in configs
                    if "server_info" in c["server"]), "?")
    default_chunk = next((c["server"]["server_info"].get("chunked_prefill_size") for c in configs
                          if c["config"] == "stock" and "server_info" in c["server"]), None)
    lines = [
        "# SGLang side by side: stock, tuned stock, FairBatching (emulated GPU)",
        "",
        f"Generated by `python -m benchmarks.server.stock_vs_fairbatching` from {len(points)} saved points "
        f"(`{doc['points_file']}`; {len(good)} finished), measured "
        f"{dates[0] if dates else '?'} – {dates[-1] if dates else '?'} UTC by "
        + ", ".join(f"`{command}` ({n} points)" for command, n in invocations.items())
        + f". Run time: {sum(p.get('wall_s', 0) for p in points) / 60:.0f} min of runs plus "
        f"{len(starts)} server starts ({sum(starts.values()) / 60:.1f} min)."
        + (f" **Shorter runs than the full benchmark's {DEFAULT_SECONDS:g} s ({', '.join(short)}): "
           "a smoke check, not the benchmark.**" if short else ""),
        "",
    ]
    if doc.get("ignored_points"):
        lines += [f"({doc['ignored_points']} other saved points -- other run parameters or launch "
                  "flags, or superseded by a later run of the same point -- are not shown.)", ""]
    if machine:
        lines += [f"**Machine:** {machine['cpu_model']}, {machine['logical_cpus']} logical CPUs (server, "
                  "load generator and anything else running share them), "
                  f"{machine['python']}, {machine['platform']}.", ""]
    commits: dict[str, int] = {}
    for p in points:
        label = f"{p.get('commit', '?')}{' + uncommitted changes' if p.get('dirty') else ''}"
        commits[label] = commits.get(label, 0) + 1
    lines += [
        "**Code:** " + ", ".join(f"commit {label} ({n} points)" for label, n in commits.items()) + ".",
        "",
        f"**Emulated GPU:** profile `{PROFILE}`, time scale {TIME_SCALE:g} "
        f"(every modelled step time x2), SGLang {version} (`python -m sglang.launch_server`, "
        "tiny 2-layer model dir, dummy weights).",
        "",
        "**Configurations** (one server per configuration and part of the run, reused for all "
        f"its points; same KV size `--max-total-tokens {KV_TOKENS}` and `--max-prefill-tokens "
        f"{MAX_PREFILL_TOKENS}` for all):",
        "",
        "| config | what | launch flags after the CPU ones | resolved: chunked prefill, mixed chunk, overlap off |",
        "|---|---|---|---|",
    ]
    for p in configs:
        server = p["server"]
        info = server.get("server_info", {})
        env = " ".join(f"{k}={v}" for k, v in server["env"].items() if k == "FAIRBATCHING_CONFIG")
        lines.append(
            f"| {p['config']} | {server['description']} | `{' '.join(p.get('launch_args', []))}`"
            f"{' + `' + env + '`' if env else ''} | {info.get('chunked_prefill_size')}, "
            f"{info.get('enable_mixed_chunk')}, {info.get('disable_overlap_schedule')} |"
        )
    lines += [
        "",
        f"CPU flags of every server: `{' '.join(CPU_ARGS)}`; environment of every server: "
        f"`FAIRBATCHING_EMULATED_GPU={PROFILE} FAIRBATCHING_EMULATED_GPU_TIME_SCALE={TIME_SCALE:g}`. "
        + (f"SGLang's default chunked-prefill size on this CPU machine is {default_chunk} (on a real "
           "H100 it would be chosen from GPU memory). " if default_chunk is not None else "")
        + "Prefix cache flushed before every run.",
        "",
        f"**Seeds** {', '.join(str(s) for s in seeds) or 'none'}: every cell is the **mean over "
        "the seeds** that finished, with the **min–max spread** in small type (none when the "
        "seeds agree); the seeds column gives their number and list. Replay seed S: "
        f"`--seed S` draws the SLO class of each request (`--arrivals {REPLAY_ARRIVALS}`: the "
        "trace's own timestamps rescaled, the same for every seed). Random seed S: `--seed` = "
        "100000 x S + k, k = 1, 2, 3 at 10, 16, 22 req/s (seed 0 = the earlier one-seed runs), "
        "otherwise k = round(1000 x rate); it draws the prompts and the Poisson arrivals.",
        "",
        "**Baseline: the best stock-mixed chunk size per point.** For each workload and rate "
        "the `stock-mixed-N` with the highest mean headline metric (replay: attainment; random: "
        "goodput; ties: the lower mean p99 TPOT) is the baseline every comparison below uses; "
        "it is marked *(best mixed)* in the tables and named under each.",
        "",
    ]
    random_params = params.get("random")
    if random_params:
        seconds = random_params["seconds"]
        lines += [
            "## (a) `sglang.benchmark.serving`, random dataset, Poisson arrivals",
            "",
            f"Rates {', '.join(f'{r:g}' for r in rates_of(cells, 'random'))} req/s, {seconds:g} s "
            f"of arrivals each (num-prompts = rate x {seconds:g}); input {RANDOM_INPUT_LEN} / output "
            f"{RANDOM_OUTPUT_LEN} tokens, `--random-range-ratio {RANDOM_RANGE_RATIO}` (uniform in "
            f"[{int(RANDOM_INPUT_LEN * RANDOM_RANGE_RATIO)}, {RANDOM_INPUT_LEN}] / "
            f"[{int(RANDOM_OUTPUT_LEN * RANDOM_RANGE_RATIO)}, {RANDOM_OUTPUT_LEN}]); every request asks "
            f"`custom_params.slo = {json.dumps(RANDOM_SLO)}` (the `standard` class) and goodput counts a "
            f"request only if TTFT <= {RANDOM_SLO['ttft_ms']} ms and TPOT <= {RANDOM_SLO['tpot_ms']} ms. "
            "**This tool's TPOT is per request (latency - TTFT) / (output tokens - 1), a mean**: a "
            "request whose decode stalls for a while and then catches up still passes. The last "
            "two columns are the simulator's summary of the tool's per-request records "
            "(`--output-details`; by the same TTFT and mean-TPOT rule): the prompt-length bucket "
            f"with the lowest attainment among those of at least {MIN_GROUP_REQUESTS} requests, "
            "and token goodput (prompt + output tokens per second of the requests that met the "
            "SLO, over the tool's duration). One SLO class, so its worst class is every request.",
            "",
            *random_table(cells, best_mixed),
            "",
            best_mixed_line(cells, best_mixed, "random"),
            "",
        ]
    replay_params = params.get("replay")
    if replay_params:
        lines += [
            "## (b) `benchmarks.server.trace_replay`, Azure conversation sample",
            "",
            f"Rates {', '.join(f'{r:g}' for r in rates_of(cells, 'replay'))} req/s; trace timestamps "
            f"rescaled to the rate (`--arrivals {REPLAY_ARRIVALS}`), the head of the bundled sample "
            f"holding ~{replay_params['seconds']:g} s of arrivals at that rate (`--head` per run "
            f"below); exact prompt/output lengths (prompts capped at {MAX_PROMPT_TOKENS} "
            f"tokens), SLO classes `{REPLAY_SLO_MIX}` (interactive: TTFT 500 ms, standard: TTFT "
            "2000 ms; both TPOT 50 ms). A request attains its SLO if TTFT <= target and its "
            "**max-TPOT** -- the max over tokens j of (t_j - t_first) / j -- <= target (stricter "
            "than (a)'s mean, which is also shown: mean TPOT). Envelope att.: share of requests "
            "whose every token j came by arrival + TTFT target + j x TPOT target (the paper's "
            "token-deadline envelope). Max TBT: per request the longest gap between two tokens. "
            "Effective RPS = rate x attainment.",
            "",
            *replay_table(cells, best_mixed),
            "",
            best_mixed_line(cells, best_mixed, "replay"),
            "",
            "**Who pays** (the simulator's summary of the same runs, `sglang_ext.sim.metrics`): "
            "SLO attainment per prompt-length bucket (mean requests per bucket in small type; "
            f"prompts capped at {MAX_PROMPT_TOKENS} tokens) and per SLO class; the worst bucket "
            f"and the worst class are the lowest-attainment groups of at least {MIN_GROUP_REQUESTS} "
            "requests (named by the most frequent over the seeds, then its attainment); token "
            "goodput = prompt + output tokens per second of the requests that met their SLO "
            "(over the run's wall time, the drain included). A `-` in a worst column: no group "
            "that large, or a point saved before these fields existed.",
            "",
            *replay_groups_table(cells, best_mixed),
            "",
        ]
    lines += [
        "## Targets on the replay workload",
        "",
        "Computed from the replay points above (means over seeds). The best stock configuration "
        "at a rate is the one with the best mean attainment among all stock configurations "
        "(`stock` included; ties: lower mean max-TPOT p99).",
        "",
        *target_lines(doc["targets"]),
        "",
        "## Where FairBatching loses",
        "",
    ]
    rows = doc["comparisons"]
    lost, won = comparison_lines(rows, -1), comparison_lines(rows, 1)
    lines += [
        "Comparing the mean over seeds of `fairbatching` with that of the best stock-mixed "
        "configuration at every (workload, rate, metric) point of the tables above, counting a "
        f"difference only when it is {MARGINS_TEXT}; a difference no larger than the seeds' "
        "spread (the wider min–max range of the two) is marked *within noise*: "
        f"{comparison_summary(rows)}.",
        "",
        f"Points where it is worse than the best stock-mixed ({len(lost)}; mean (min–max, n)):",
        "",
    ]
    lines += [f"- {item}" for item in lost] or ["- none"]
    lines += ["", f"Points where it is better ({len(won)}):", ""]
    lines += [f"- {item}" for item in won] or ["- none"]
    notes = observations(cells, best_mixed)
    if notes:
        lines += ["", "Related numbers from the same runs:", ""]
        lines += [f"- {note}" for note in notes]
    lines += ["", "## Caveats", ""]
    lines += [f"- {c}" for c in doc["caveats"]]
    failed = [p for p in points if "error" in p]
    if failed:
        lines += ["", "## Failed points (run again with `--resume`)", ""]
        lines += [f"- {p['config']} {p['workload']} @ {p['rate']:g} seed {p['seed']}: {p['error']}"
                  for p in failed]
    lines += ["", "## Runs: exact commands and machine load", "",
              "| config | workload | rate | seed | wall s | CPU busy (per CPU) | foreign SGLang servers seen "
              "| commit | UTC | command |",
              "|---|---|---:|---:|---:|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: (p["workload"], p["rate"], CONFIG_ORDER.get(p["config"], 99),
                                           p["seed"])):
        watch = p.get("machine_during_run")
        busy = " / ".join(f"{v['busy_pct']:.0f}%" for _, v in sorted(watch["cpu"].items())) if watch else "-"
        foreign = len(watch["foreign_sglang_servers"]) if watch else 0
        command = f"`{p['command']}`" if "command" in p else "-"
        status = " (failed)" if "error" in p else ""
        lines.append(f"| {p['config']}{status} | {p['workload']} | {p['rate']:g} | {p['seed']} "
                     f"| {_fmt(p.get('wall_s'))} | {busy} | {foreign or 'none'} "
                     f"| {p.get('commit', '?')}{'+dirty' if p.get('dirty') else ''} "
                     f"| {p.get('date_utc', '?')} | {command} |")
    lines += ["", "Server launch commands (the last part of the run that used each):", ""]
    lines += [f"- {p['config']}: `{' '.join(f'{k}={v}' for k, v in p['server']['env'].items())} "
              f"{p['server']['launch']}`" for p in configs]
    raw_dirs = sorted({p["raw_dir"] for p in points if "raw_dir" in p})
    lines += ["", f"Raw outputs and server logs (not committed): {', '.join(f'`{d}`' for d in raw_dirs) or '-'}. "
              "All numbers: `results.json`.", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------ main
def parse_rates(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def parse_seeds(text: str) -> tuple[int, ...]:
    """``3`` -> seeds 0, 1, 2 (a count); ``0,4`` or ``4,`` -> those seeds (a list)."""
    try:
        if "," in text:
            seeds = tuple(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))
        else:
            count = int(text)
            if count < 1:
                raise ValueError
            seeds = tuple(range(count))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--seeds takes a count (3: seeds 0,1,2) or a comma list (0,4 or 4,), not {text!r}") from None
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"--seeds: no non-negative seeds in {text!r}")
    return seeds


def _names(text: str, known: Sequence[str], what: str, parser: argparse.ArgumentParser) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        parser.error(f"unknown {what} {unknown} (known: {', '.join(known)})")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one rate per workload, 20 s runs")
    parser.add_argument("--random-rates", type=parse_rates)
    parser.add_argument("--replay-rates", type=parse_rates)
    parser.add_argument("--random-seconds", type=float, help="seconds of arrivals per random run (default 60, quick 20)")
    parser.add_argument("--replay-seconds", type=float, help="seconds of arrivals per replay run (default 60, quick 20)")
    parser.add_argument("--seeds", type=parse_seeds, default=DEFAULT_SEEDS,
                        help="a count (3: seeds 0,1,2; the default) or a comma list (0,4)")
    parser.add_argument("--configs", default=",".join(c.name for c in CONFIGS),
                        help="comma-separated subset of " + ", ".join(c.name for c in CONFIGS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--resume", action="store_true",
                        help="keep the saved points and run only the missing (or failed) ones")
    parser.add_argument("--render-only", action="store_true",
                        help="run nothing: rebuild table.md and results.json from the saved points")
    parser.add_argument("--points", type=Path, default=DEFAULT_POINTS,
                        help="the points file (raw run folders go next to it)")
    parser.add_argument("--quiet-wait", type=float, default=600.0,
                        help="max seconds to wait before a run for other SGLang servers to stop")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for table.md and results.json")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    argv = list(argv if argv is not None else sys.argv[1:])
    points_path = args.points.resolve()
    out = args.out.resolve()
    os.chdir(REPO)  # the recorded commands and server paths are relative to the checkout

    code = 0
    if not args.render_only:
        names = _names(args.configs, [c.name for c in CONFIGS], "config(s)", parser)
        workloads = _names(args.workloads, WORKLOADS, "workload(s)", parser)
        plan = Plan(
            random_rates=args.random_rates or (QUICK_RANDOM_RATES if args.quick else DEFAULT_RANDOM_RATES),
            replay_rates=args.replay_rates or (QUICK_REPLAY_RATES if args.quick else DEFAULT_REPLAY_RATES),
            random_seconds=args.random_seconds or (QUICK_SECONDS if args.quick else DEFAULT_SECONDS),
            replay_seconds=args.replay_seconds or (QUICK_SECONDS if args.quick else DEFAULT_SECONDS),
            configs=tuple(c for c in CONFIGS if c.name in names),
            workloads=tuple(w for w in WORKLOADS if w in workloads),
            seeds=args.seeds,
            quiet_wait_s=args.quiet_wait,
        )
        if not args.resume:
            moved = move_aside(points_path)
            if moved is not None:
                print(f"starting a fresh points file; the old one is now {moved}", file=sys.stderr)
        done = done_keys(load_points(points_path), POINT_KEY)
        todo = {c.name: todo_points(plan, c, done) for c in plan.configs}
        total = sum(len(t) for t in todo.values())
        print(f"{total} points to run ({', '.join(f'{n}: {len(t)}' for n, t in todo.items())}); "
              f"{len(done)} already saved in {points_path}", file=sys.stderr, flush=True)
        if total:
            code = run_all(plan, todo, points_path, argv)
    points = load_points(points_path)
    if not points:
        print(f"no saved points in {points_path}; nothing to render", file=sys.stderr)
        return code or 1
    doc = build_doc(points, points_path)
    return _write(doc, render(doc), out, args.no_write) or code


def run_all(plan: Plan, todo: dict[str, list[tuple[str, float, int]]], points_path: Path,
            argv: list[str]) -> int:
    """Run every config's missing points (a server only for a config with some); 1 if any failed."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    raw = points_path.parent / stamp
    raw.mkdir(parents=True, exist_ok=True)
    from sglang_ext.adapter.emulated_gpu.tiny_model import write_tiny_model

    # Inputs live next to the raw outputs (relative paths), so the recorded commands rerun.
    inputs = Inputs(raw=raw, model_dir=relative(write_tiny_model(raw / "tiny-model")),
                    fb_config=relative(write_fb_config(raw)), datasets={})
    provenance = {"argv": argv, "raw_dir": str(relative(raw)), "machine": machine_info()}
    failed = 0
    for config in plan.configs:
        if todo[config.name]:
            saved = run_config(plan, config, todo[config.name], inputs, points_path, provenance)
            failed += sum("error" in p for p in saved)
    if failed:
        print(f"{failed} points failed (saved with their error; --resume runs them again)", file=sys.stderr)
    return 1 if failed else 0


def _write(doc: dict, text: str, out: Path, no_write: bool) -> int:
    print(text)
    if not no_write:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(results_json(doc))
        (out / "table.md").write_text(text)
        print(f"wrote {out / 'results.json'} and {out / 'table.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
