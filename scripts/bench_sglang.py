"""Benchmark: stock SGLang vs tuned stock vs FairBatching, side by side, on the emulated GPU.

Three server configurations of the stock ``python -m sglang.launch_server`` (SGLang 0.5.23,
this project's plugin installed), all on the emulated GPU (profile ``llama3.1-8b-h100``,
step times x2 -- ``FAIRBATCHING_EMULATED_GPU_TIME_SCALE=2``) with the same KV size
(``--max-total-tokens``) and the same explicit ``--max-prefill-tokens``:

* ``stock``        -- SGLang's defaults (``FAIRBATCHING_CONFIG`` unset: the plugin is inert);
* ``stock-mixed``  -- tuned stock: ``--enable-mixed-chunk --chunked-prefill-size 512``
  (decodes ride along with small prefill chunks, Sarathi-style; 512 is the "small chunk");
* ``fairbatching`` -- ``FAIRBATCHING_CONFIG`` = the shipped ``configs/fairbatching.toml``
  with its initial step model scaled by the time scale (as a deployment starts from
  coefficients fitted on its own GPU) and the SLO classes of ``configs/slo.toml``.

Each configuration gets one server, reused for all its runs. Two workloads at each rate:

(a) ``python -m sglang.benchmark.serving --backend sglang-oai --dataset-name random``:
    Poisson arrivals; prompts cut from a generated local ShareGPT-format file of random
    words (no hub access; distinct per request, so the radix cache cannot serve prefills);
    one SLO for every request, sent in ``custom_params`` and used for ``--goodput``. Its
    TPOT is per request ``(latency - TTFT) / (output tokens - 1)``, a mean.
(b) ``python -m sglang_ext.replay``: the bundled Azure conversation sample at trace
    timestamps (rescaled to the rate; the head of the trace holding about
    ``--replay-seconds`` of arrivals at that rate), exact prompt/output lengths, SLO classes
    ``interactive:0.5,standard:0.5``. Its TPOT is the simulator's: per request the *max*
    over tokens j of ``(t_j - t_first) / j``, stricter than (a)'s mean.

The prefix cache is flushed before every run. Writes ``docs/bench/sglang/results.json``
and ``table.md``; raw outputs and server logs go to ``out/bench_sglang/<date>/``::

    scripts/bench_sglang.sh              # everything (~25 min on the 2-vCPU VM)
    scripts/bench_sglang.sh --quick      # one rate, short runs: a smoke check (~5 min)

The server and the load generator share this machine's CPUs, and so do other people's
processes: each run records the CPU use and any foreign SGLang server seen while it ran
(the script first waits, up to ``--quiet-wait`` s, for such servers to go away).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decision import cpu_times, cpu_usage, machine_info  # noqa: E402

from sglang_ext.server_launch import CPU_ARGS, Server, launch  # noqa: E402

PROFILE = "llama3.1-8b-h100"
TIME_SCALE = 2.0
KV_TOKENS = 200_000
MAX_PREFILL_TOKENS = 16_384
SMALL_CHUNK = 512
COMMON_ARGS = ("--max-total-tokens", str(KV_TOKENS), "--max-prefill-tokens", str(MAX_PREFILL_TOKENS))

# (a) the random workload
RANDOM_INPUT_LEN = 1024
RANDOM_OUTPUT_LEN = 128
RANDOM_RANGE_RATIO = 0.5  # lengths uniform in [0.5 L, L]
RANDOM_SLO = {"ttft_ms": 2000, "tpot_ms": 50}  # = the "standard" class of configs/slo.toml
# (b) the trace replay
REPLAY_SLO_MIX = "interactive:0.5,standard:0.5"
REPLAY_MAX_PROMPT_TOKENS = 6144  # the tiny model's context is 8192 (prompt + output)

DEFAULT_RANDOM_RATES = (10.0, 16.0, 22.0)
DEFAULT_REPLAY_RATES = (2.0, 4.0, 7.0)
QUICK_RANDOM_RATES = (16.0,)
QUICK_REPLAY_RATES = (4.0,)

DEFAULT_OUT = REPO / "docs" / "bench" / "sglang"
RAW_ROOT = REPO / "out" / "bench_sglang"


@dataclass(frozen=True)
class ServerConfig:
    name: str
    args: tuple[str, ...]
    fairbatching: bool
    description: str


CONFIGS = (
    ServerConfig("stock", COMMON_ARGS, False, "SGLang defaults; plugin installed, FAIRBATCHING_CONFIG unset"),
    ServerConfig(
        "stock-mixed",
        (*COMMON_ARGS, "--enable-mixed-chunk", "--chunked-prefill-size", str(SMALL_CHUNK)),
        False,
        f"tuned stock: mixed prefill/decode batches, {SMALL_CHUNK}-token prefill chunks",
    ),
    ServerConfig("fairbatching", COMMON_ARGS, True,
                 "FAIRBATCHING_CONFIG = configs/fairbatching.toml (step model x time scale)"),
)


# ------------------------------------------------------------------ inputs
def write_fb_config(directory: Path) -> Path:
    """The shipped config with its initial step model scaled by the emulated GPU's time
    scale (tests/e2e/test_fairbatching_e2e.py's ``fb_config`` does the same)."""
    from sglang_ext.config import ExtensionConfig

    shipped_path = REPO / "configs" / "fairbatching.toml"
    coefficients = ExtensionConfig.load(shipped_path).initial_step_model
    type(coefficients)(
        coefficients.a_s * TIME_SCALE,
        coefficients.b_s_per_token * TIME_SCALE,
        coefficients.c_s_per_context_token * TIME_SCALE,
    ).save(directory / "step_model.toml")
    text = shipped_path.read_text()
    for old, new in (
        ('slo_file = "slo.toml"', f'slo_file = "{REPO / "configs" / "slo.toml"}"'),
        ('step_model = "step_models/llama3.1-8b-h100.toml"', 'step_model = "step_model.toml"'),
    ):
        if old not in text:
            raise SystemExit(f"configs/fairbatching.toml no longer contains {old!r}; update this script")
        text = text.replace(old, new)
    config = directory / "fairbatching.toml"
    config.write_text(text)
    return config


_WORDS = (
    "large language model serving systems batch many requests into every forward step a "
    "prefill processes the prompt tokens of new and decode produces one token for each "
    "running request scheduler decides which join next how chunk may take when wait time "
    "to first per output are latency targets that users feel throughput is what operator "
    "pays quick brown fox jumps over lazy dog numbers"
).split()


def write_random_dataset(path: Path, conversations: int, words: int = 1400, seed: int = 0) -> Path:
    """A ShareGPT-format file for ``--dataset-name random``: each conversation's first turn
    is ``words`` random words (> RANDOM_INPUT_LEN tokens with the tiny model's tokenizer),
    so the prompts the benchmark cuts from different conversations share no prefix."""
    rng = random.Random(seed)
    rows = [
        {"id": str(i), "conversations": [
            {"from": "human", "value": " ".join(rng.choices(_WORDS, k=words))},
            {"from": "gpt", "value": " ".join(rng.choices(_WORDS, k=20))},
        ]}
        for i in range(conversations)
    ]
    path.write_text(json.dumps(rows))
    return path


def replay_head_seconds(rate: float, target_s: float) -> float:
    """The shortest head (whole seconds of the bundled trace) whose requests, rescaled to
    ``rate``, arrive over at least ``target_s`` seconds."""
    from sglang_ext.sim.workloads import bundled_sample

    trace = bundled_sample()
    total = trace.requests[-1].arrival_s - trace.requests[0].arrival_s
    for head in range(5, int(total) + 1):
        if (len(trace.head(head).requests) - 1) / rate >= target_s:
            return float(head)
    return float(math.ceil(total))


# ------------------------------------------------------------------ machine watch
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


# ------------------------------------------------------------------ runs
@dataclass
class Plan:
    random_rates: tuple[float, ...]
    replay_rates: tuple[float, ...]
    random_seconds: float
    replay_seconds: float
    configs: tuple[ServerConfig, ...]
    workloads: tuple[str, ...]
    quiet_wait_s: float
    runs: list[dict] = field(default_factory=list)


def flush_cache(url: str) -> None:
    request = urllib.request.Request(f"{url}/flush_cache?timeout=120", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=180) as reply:
            reply.read()
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"/flush_cache: HTTP {error.code}: {error.read()[:200]!r}") from None


def run_command(command: Sequence[str], log_path: Path, timeout_s: float) -> tuple[int, float]:
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(command) + "\n")
        log.flush()
        try:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                  timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = -9
    return code, time.monotonic() - start


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
        "--flush-cache", "--disable-tqdm", "--output-file", str(output),
    ]  # fmt: skip


def replay_command(url: str, rate: float, head_s: float, output: Path) -> list[str]:
    return [
        sys.executable, "-m", "sglang_ext.replay", "--url", url,
        "--rate", f"{rate:g}", "--head", f"{head_s:g}", "--slo-mix", REPLAY_SLO_MIX,
        "--max-prompt-tokens", str(REPLAY_MAX_PROMPT_TOKENS), "--out", str(output),
    ]  # fmt: skip


RANDOM_KEYS = (
    "completed", "duration", "request_throughput", "output_throughput", "input_throughput",
    "request_goodput", "slo_attainment", "slo_attainment_by_metric",
    "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_ttft_ms",
    "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms", "mean_tpot_ms",
    "median_itl_ms", "p99_itl_ms", "median_e2e_latency_ms", "p99_e2e_latency_ms",
    "total_input_tokens", "total_output_tokens", "max_concurrent_requests",
)


def parse_random(output: Path) -> dict:
    lines = [line for line in output.read_text().splitlines() if line.strip()]
    result = json.loads(lines[-1])
    return {key: result.get(key) for key in RANDOM_KEYS}


def run_one(plan: Plan, config: ServerConfig, server: Server, workload: str, rate: float,
            seed: int, model_dir: Path, dataset: Path, raw: Path) -> dict:
    stem = f"{config.name}-{workload}-r{rate:g}"
    waited = wait_quiet(server.process.pid, plan.quiet_wait_s)
    if workload == "random":
        prompts = max(20, round(rate * plan.random_seconds))
        output = raw / f"{stem}.jsonl"
        output.unlink(missing_ok=True)
        command = random_command(server.url, model_dir, dataset, rate, prompts, seed,
                                 output.relative_to(REPO))
        extra = {"num_prompts": prompts, "seed": seed}
    else:
        flush_cache(server.url)
        head = replay_head_seconds(rate, plan.replay_seconds)
        output = raw / f"{stem}.json"
        output.unlink(missing_ok=True)
        command = replay_command(server.url, rate, head, output.relative_to(REPO))
        extra = {"head_s": head}
    print(f"  {stem}: {shlex.join(command[1:])[:160]} ...", file=sys.stderr)
    with Watch(server.process.pid) as watch:
        code, wall = run_command(command, raw / f"{stem}.log", timeout_s=900)
    record = {"config": config.name, "workload": workload, "rate": rate, **extra,
              "command": shlex.join(["python", *command[1:]]), "exit_code": code,
              "wall_s": round(wall, 1), "waited_for_quiet_s": round(waited, 1),
              "machine_during_run": watch.record()}
    if code != 0 or not output.exists():
        record["error"] = f"exit code {code}; see {raw / (stem + '.log')}"
        print(f"  {stem}: FAILED ({record['error']})", file=sys.stderr)
        return record
    if workload == "random":
        record["result"] = parse_random(output)
    else:
        record["result"] = json.loads(output.read_text())
    if not server.alive():
        record["error"] = "server died during the run"
    print(f"  {stem}: done in {wall:.0f} s", file=sys.stderr)
    return record


def server_settings(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/server_info", timeout=30) as reply:
        info = json.load(reply)
    keys = ("chunked_prefill_size", "max_prefill_tokens", "max_total_num_tokens",
            "enable_mixed_chunk", "disable_radix_cache", "schedule_policy",
            "disable_overlap_schedule", "max_running_requests", "stream_interval",
            "schedule_conservativeness", "version")
    return {key: info.get(key) for key in keys}


def run_config(plan: Plan, config: ServerConfig, model_dir: Path, dataset: Path,
               fb_config: Path, raw: Path) -> dict:
    env = {"FAIRBATCHING_EMULATED_GPU": PROFILE, "FAIRBATCHING_EMULATED_GPU_TIME_SCALE": f"{TIME_SCALE:g}"}
    if config.fairbatching:
        env["FAIRBATCHING_CONFIG"] = str(fb_config)
    wait_quiet(None, plan.quiet_wait_s)
    print(f"[{config.name}] starting server", file=sys.stderr)
    started = time.monotonic()
    server = launch(model_dir, config.args, env, raw / f"server-{config.name}.log", python=sys.executable)
    info = {"name": config.name, "description": config.description,
            "launch": shlex.join(["python", "-m", "sglang.launch_server", "--model-path", str(model_dir),
                                  *CPU_ARGS, *config.args]),
            "env": env,
            "start_s": round(time.monotonic() - started, 1)}
    try:
        info["server_info"] = server_settings(server.url)
        for index, rate in enumerate(plan.random_rates):
            if "random" in plan.workloads:
                plan.runs.append(run_one(plan, config, server, "random", rate, index + 1,
                                         model_dir, dataset, raw))
        for rate in plan.replay_rates:
            if "replay" in plan.workloads:
                plan.runs.append(run_one(plan, config, server, "replay", rate, 0,
                                         model_dir, dataset, raw))
        log = server.log_text()
        info["tracebacks_in_log"] = log.count("Traceback")
    finally:
        server.stop()
    return info


# ------------------------------------------------------------------ report
def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _runs(runs: list[dict], workload: str) -> list[dict]:
    order = {c.name: i for i, c in enumerate(CONFIGS)}
    return sorted((r for r in runs if r["workload"] == workload),
                  key=lambda r: (r["rate"], order.get(r["config"], 99)))


def random_table(runs: list[dict]) -> list[str]:
    lines = [
        "| rate req/s | config | goodput req/s | SLO attainment (TTFT / TPOT) | TTFT p50 / p99 ms "
        "| TPOT p50 / p99 ms | throughput req/s | output tok/s | completed |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for run in _runs(runs, "random"):
        r = run.get("result")
        if r is None:
            lines.append(f"| {run['rate']:g} | {run['config']} | failed: {run.get('error')} ||||||")
            continue
        by = r.get("slo_attainment_by_metric") or {}
        lines.append(
            f"| {run['rate']:g} | {run['config']} | {_fmt(r['request_goodput'], 2)} "
            f"| {_pct(r['slo_attainment'])} ({_pct(by.get('ttft'))} / {_pct(by.get('tpot'))}) "
            f"| {_fmt(r['median_ttft_ms'])} / {_fmt(r['p99_ttft_ms'])} "
            f"| {_fmt(r['median_tpot_ms'], 1)} / {_fmt(r['p99_tpot_ms'], 1)} "
            f"| {_fmt(r['request_throughput'], 2)} | {_fmt(r['output_throughput'])} "
            f"| {r['completed']}/{run['num_prompts']} |"
        )
    return lines


def replay_table(runs: list[dict]) -> list[str]:
    lines = [
        "| rate req/s | config | requests | attainment (TTFT / TPOT) | effective RPS "
        "| envelope att. | TTFT p50 / p99 ms | max-TPOT p50 / p99 ms | mean TPOT p99 ms "
        "| max TBT p50 / p99 ms | interactive: att., TTFT p99 ms "
        "| standard: att., TTFT p99 ms | output tok/s |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for run in _runs(runs, "replay"):
        r = run.get("result")
        if r is None:
            lines.append(f"| {run['rate']:g} | {run['config']} | failed: {run.get('error')} ||||||||||")
            continue
        classes = r.get("per_class", {})

        def cls(name: str) -> str:
            c = classes.get(name)
            return "-" if c is None else f"{_pct(c['attainment'])}, {_fmt(c['ttft_ms']['p99'])}"

        lines.append(
            f"| {run['rate']:g} | {run['config']} | {r['requests']} "
            f"| {_pct(r['attainment'])} ({_pct(r['ttft_attainment'])} / {_pct(r['tpot_attainment'])}) "
            f"| {_fmt(r['effective_rps'], 2)} | {_pct(r['envelope_attainment'])} "
            f"| {_fmt(r['ttft_ms']['p50'])} / {_fmt(r['ttft_ms']['p99'])} "
            f"| {_fmt(r['tpot_ms']['p50'], 1)} / {_fmt(r['tpot_ms']['p99'], 1)} "
            f"| {_fmt(r['mean_tpot_ms']['p99'], 1)} "
            f"| {_fmt(r['max_tbt_ms']['p50'])} / {_fmt(r['max_tbt_ms']['p99'])} "
            f"| {cls('interactive')} | {cls('standard')} | {_fmt(r['output_tokens_per_s'])} |"
        )
    return lines


def _metric_views(run: dict) -> dict[str, tuple[float | None, bool]]:
    """name -> (value, higher is better) for comparing configurations."""
    r = run["result"]
    if run["workload"] == "random":
        return {
            "goodput (req/s)": (r["request_goodput"], True),
            "SLO attainment": (r["slo_attainment"], True),
            "TTFT p99 (ms)": (r["p99_ttft_ms"], False),
            "TPOT p99 (ms)": (r["p99_tpot_ms"], False),
            "output tok/s": (r["output_throughput"], True),
        }
    views = {
        "attainment": (r["attainment"], True),
        "TTFT p99 (ms)": (r["ttft_ms"]["p99"], False),
        "max-TPOT p99 (ms)": (r["tpot_ms"]["p99"], False),
        "output tok/s": (r["output_tokens_per_s"], True),
    }
    for name, c in r.get("per_class", {}).items():
        views[f"{name} attainment"] = (c["attainment"], True)
    return views


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


def comparisons(runs: list[dict]) -> list[dict]:
    """FairBatching against each stock configuration at every (workload, rate, metric)."""
    out = []
    for workload in ("random", "replay"):
        by_rate: dict[float, dict[str, dict]] = {}
        for run in runs:
            if run["workload"] == workload and "result" in run:
                by_rate.setdefault(run["rate"], {})[run["config"]] = run
        for rate, configs in sorted(by_rate.items()):
            fb = configs.get("fairbatching")
            if fb is None:
                continue
            for metric, (fb_value, higher) in _metric_views(fb).items():
                row = {"workload": workload, "rate": rate, "metric": metric, "fairbatching": fb_value,
                       "higher_is_better": higher}
                for name in ("stock", "stock-mixed"):
                    if name in configs:
                        value = _metric_views(configs[name]).get(metric, (None, higher))[0]
                        row[name] = value
                        if value is not None and fb_value is not None:
                            row[f"vs_{name}"] = _verdict(fb_value, value, higher, "attainment" in metric)
                out.append(row)
    return out


def _value(metric: str, value: float) -> str:
    if "attainment" in metric:
        return _pct(value)
    return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"


def comparison_lines(rows: list[dict], want: int) -> list[str]:
    """Points where FairBatching is worse (``want`` -1) than *either* stock configuration,
    naming each it loses to, or better (+1) than *both*."""
    out = []
    for row in rows:
        names = [n for n in ("stock", "stock-mixed") if f"vs_{n}" in row]
        hits = [n for n in names if row[f"vs_{n}"] == want]
        if not hits or (want > 0 and len(hits) < len(names)):
            continue
        metric = row["metric"]
        others = ", ".join(f"{n} {_value(metric, row[n])}" for n in hits)
        out.append(f"{row['workload']} @ {row['rate']:g} req/s, {metric}: fairbatching "
                   f"{_value(metric, row['fairbatching'])} vs {others}")
    return out


def comparison_summary(rows: list[dict]) -> str:
    parts = []
    for name in ("stock", "stock-mixed"):
        verdicts = [row[f"vs_{name}"] for row in rows if f"vs_{name}" in row]
        if verdicts:
            parts.append(f"against `{name}` it is worse at {verdicts.count(-1)}, better at "
                         f"{verdicts.count(1)} and within the margin at {verdicts.count(0)} "
                         f"of {len(verdicts)}")
    return "; ".join(parts)


def observations(runs: list[dict]) -> list[str]:
    """FairBatching's replay envelope vs max-TPOT attainment and token gaps, per rate."""
    got = {(r["config"], r["workload"], r["rate"]): r["result"] for r in runs if "result" in r}
    rates = sorted(rate for (c, w, rate) in got if c == "fairbatching" and w == "replay")
    if not rates:
        return []

    def series(name: str, pick) -> str:
        return " / ".join(pick(got[(name, "replay", r)]) if (name, "replay", r) in got else "-"
                          for r in rates)

    at = " / ".join(f"{r:g}" for r in rates)
    gap = lambda r: _fmt(r["max_tbt_ms"]["p50"])  # noqa: E731
    return [
        f"(b) at {at} req/s, `fairbatching` met the token-deadline envelope for "
        f"{series('fairbatching', lambda r: _pct(r['envelope_attainment']))} of requests and the "
        f"max-TPOT target for {series('fairbatching', lambda r: _pct(r['tpot_attainment']))}; the "
        f"median per-request longest token gap was {series('fairbatching', gap)} ms "
        f"(stock-mixed {series('stock-mixed', gap)} ms, stock {series('stock', gap)} ms)."
    ]


def render(doc: dict) -> str:
    plan, machine = doc["plan"], doc["machine"]
    lines = [
        "# SGLang side by side: stock, tuned stock, FairBatching (emulated GPU)",
        "",
        f"Generated by `scripts/bench_sglang.sh{' ' + ' '.join(doc['argv']) if doc['argv'] else ''}` "
        f"on {doc['date_utc']} UTC in {doc['runtime_s'] / 60:.1f} min"
        f"{' -- **quick smoke check, not the full benchmark**' if plan['quick'] else ''}.",
        "",
        f"**Machine:** {machine['cpu_model']}, {machine['logical_cpus']} logical CPUs (server, load "
        f"generator and anything else running share them), {machine['python']}, "
        f"{machine['platform']}; commit {machine['git_commit']}.",
        "",
        f"**Emulated GPU:** profile `{PROFILE}`, time scale {TIME_SCALE:g} "
        "(every modelled step time x2), SGLang "
        f"{doc['configs'][0]['server_info'].get('version') if doc['configs'] and 'server_info' in doc['configs'][0] else '?'}"
        " (`python -m sglang.launch_server`, tiny 2-layer model dir, dummy weights).",
        "",
        "**Configurations** (one server each, reused for all its runs; same KV size "
        f"`--max-total-tokens {KV_TOKENS}` and `--max-prefill-tokens {MAX_PREFILL_TOKENS}` for all):",
        "",
        "| config | what | launch flags after the CPU ones | resolved: chunked prefill, mixed chunk, overlap off |",
        "|---|---|---|---|",
    ]
    for config in doc["configs"]:
        info = config.get("server_info", {})
        flags = " ".join(next(c.args for c in CONFIGS if c.name == config["name"]))
        env = " ".join(f"{k}={v}" for k, v in config["env"].items() if k == "FAIRBATCHING_CONFIG")
        lines.append(
            f"| {config['name']} | {config['description']} | `{flags}`{' + `' + env + '`' if env else ''} "
            f"| {info.get('chunked_prefill_size')}, {info.get('enable_mixed_chunk')}, "
            f"{info.get('disable_overlap_schedule')} |"
        )
    lines += [
        "",
        f"CPU flags of every server: `{' '.join(CPU_ARGS)}`; environment of every server: "
        f"`FAIRBATCHING_EMULATED_GPU={PROFILE} FAIRBATCHING_EMULATED_GPU_TIME_SCALE={TIME_SCALE:g}`. "
        "SGLang's default chunked-prefill size on this CPU machine is "
        f"{doc['configs'][0].get('server_info', {}).get('chunked_prefill_size')} (on a real H100 it would "
        "be chosen from GPU memory). Prefix cache flushed before every run.",
        "",
        "## (a) `sglang.benchmark.serving`, random dataset, Poisson arrivals",
        "",
        f"Rates {', '.join(f'{r:g}' for r in plan['random_rates'])} req/s, "
        f"{plan['random_seconds']:g} s of arrivals each (num-prompts = rate x {plan['random_seconds']:g}); "
        f"input {RANDOM_INPUT_LEN} / output {RANDOM_OUTPUT_LEN} tokens, `--random-range-ratio "
        f"{RANDOM_RANGE_RATIO}` (uniform in [{int(RANDOM_INPUT_LEN * RANDOM_RANGE_RATIO)}, {RANDOM_INPUT_LEN}] / "
        f"[{int(RANDOM_OUTPUT_LEN * RANDOM_RANGE_RATIO)}, {RANDOM_OUTPUT_LEN}]); every request asks "
        f"`custom_params.slo = {json.dumps(RANDOM_SLO)}` (the `standard` class) and goodput counts a "
        f"request only if TTFT <= {RANDOM_SLO['ttft_ms']} ms and TPOT <= {RANDOM_SLO['tpot_ms']} ms. "
        "**This tool's TPOT is per request (latency - TTFT) / (output tokens - 1), a mean**: a "
        "request whose decode stalls for a while and then catches up still passes.",
        "",
        *random_table(doc["runs"]),
        "",
        "## (b) `sglang_ext.replay`, Azure conversation sample",
        "",
        f"Rates {', '.join(f'{r:g}' for r in plan['replay_rates'])} req/s; trace timestamps rescaled "
        f"to the rate, the head of the bundled sample holding ~{plan['replay_seconds']:g} s of arrivals "
        f"at that rate (`--head` per run below); exact prompt/output lengths (prompts capped at "
        f"{REPLAY_MAX_PROMPT_TOKENS} tokens), SLO classes `{REPLAY_SLO_MIX}` (interactive: TTFT 500 ms, "
        "standard: TTFT 2000 ms; both TPOT 50 ms). A request attains its SLO if TTFT <= target and "
        "its **max-TPOT** -- the max over tokens j of (t_j - t_first) / j -- <= target (stricter "
        "than (a)'s mean, which is also shown: mean TPOT). Envelope att.: share of requests "
        "whose every token j came by arrival + TTFT target + j x TPOT target (the paper's "
        "token-deadline envelope). Max TBT: per request the longest gap "
        "between two tokens. Effective RPS = rate x attainment.",
        "",
        *replay_table(doc["runs"]),
        "",
        "## Where FairBatching loses",
        "",
    ]
    rows = doc["comparisons"]
    lost = comparison_lines(rows, -1)
    won = comparison_lines(rows, 1)
    lines += [
        f"Comparing `fairbatching` with each stock configuration at every (workload, rate, "
        f"metric) point of the tables above, counting a difference only when it is {MARGINS_TEXT}: "
        f"{comparison_summary(rows)}.",
        "",
        f"Points where it is worse than either stock configuration ({len(lost)}; each named "
        "with its value):",
        "",
    ]
    lines += [f"- {item}" for item in lost] or ["- none"]
    lines += ["", f"Points where it is better than both ({len(won)}):", ""]
    lines += [f"- {item}" for item in won] or ["- none"]
    notes = observations(doc["runs"])
    if notes:
        lines += ["", "Related numbers from the same runs:", ""]
        lines += [f"- {note}" for note in notes]
    lines += ["", "## Caveats", ""]
    lines += [f"- {c}" for c in doc["caveats"]]
    lines += ["", "## Runs: exact commands and machine load", "",
              "| config | workload | rate | wall s | CPU busy (cpu0 / cpu1) | foreign SGLang servers seen | command |",
              "|---|---|---:|---:|---|---|---|"]
    for run in doc["runs"]:
        cpu = run["machine_during_run"]["cpu"]
        busy = " / ".join(f"{v['busy_pct']:.0f}%" for _, v in sorted(cpu.items()))
        foreign = len(run["machine_during_run"]["foreign_sglang_servers"])
        lines.append(f"| {run['config']} | {run['workload']} | {run['rate']:g} | {run['wall_s']:.0f} "
                     f"| {busy} | {foreign or 'none'} | `{run['command']}` |")
    lines += ["", "Server launch commands:", ""]
    lines += [f"- {c['name']}: `{' '.join(f'{k}={v}' for k, v in c['env'].items())} {c['launch']}`"
              for c in doc["configs"]]
    lines += ["", f"Raw outputs (not committed): `{doc['raw_dir']}`. All numbers: `results.json`.", ""]
    return "\n".join(lines)


CAVEATS = [
    "The GPU is emulated: step times come from a roofline model of an H100 running "
    "Llama-3.1-8B, doubled; the scheduler, tokenizer, detokenizer, HTTP server and the load "
    "generator are real and share this VM's 2 CPUs (busy share per run in the last table). "
    "Where the CPUs are near 100% busy, SGLang's per-step Python work and per-token "
    "streaming can bound a configuration as much as the emulated GPU does, so absolute "
    "capacities are this machine's, not an H100's.",
    "FairBatching's initial step model is the shipped one scaled by the time scale; it is "
    "recalibrated online from measured step times, which here include this CPU's overheads.",
    "Each point is one run (one seed); run-to-run noise on this shared VM is a few percent "
    "in latency percentiles and can be larger near saturation.",
    "(a) gives every request the same SLO, so FairBatching's per-class ordering has nothing "
    "to separate; (b) mixes two classes.",
]


def parse_rates(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one rate per workload, short runs")
    parser.add_argument("--random-rates", type=parse_rates)
    parser.add_argument("--replay-rates", type=parse_rates)
    parser.add_argument("--random-seconds", type=float, help="seconds of arrivals per random run (default 60, quick 20)")
    parser.add_argument("--replay-seconds", type=float, help="seconds of arrivals per replay run (default 60, quick 20)")
    parser.add_argument("--configs", default=",".join(c.name for c in CONFIGS))
    parser.add_argument("--workloads", default="random,replay")
    parser.add_argument("--quiet-wait", type=float, default=600.0,
                        help="max seconds to wait before a run for other SGLang servers to stop")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--no-write", action="store_true", help="print the tables only")
    parser.add_argument("--from-results", type=Path, metavar="RESULTS_JSON",
                        help="run nothing: re-render table.md from a results.json of an earlier run")
    args = parser.parse_args(argv)
    os.chdir(REPO)  # the recorded commands and server paths are relative to the checkout

    if args.from_results is not None:
        doc = json.loads(args.from_results.read_text())
        for stale in ("fairbatching_losses", "fairbatching_wins", "compared_points"):  # older renders
            doc.pop(stale, None)
        doc["comparisons"] = comparisons(doc["runs"])
        doc["caveats"] = CAVEATS + _contention_caveat(doc["runs"])
        return _write(doc, render(doc), args.out, args.no_write)

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = set(names) - {c.name for c in CONFIGS}
    if unknown:
        parser.error(f"unknown config(s) {sorted(unknown)}")
    plan = Plan(
        random_rates=args.random_rates or (QUICK_RANDOM_RATES if args.quick else DEFAULT_RANDOM_RATES),
        replay_rates=args.replay_rates or (QUICK_REPLAY_RATES if args.quick else DEFAULT_REPLAY_RATES),
        random_seconds=args.random_seconds or (20.0 if args.quick else 60.0),
        replay_seconds=args.replay_seconds or (20.0 if args.quick else 60.0),
        configs=tuple(c for c in CONFIGS if c.name in names),
        workloads=tuple(w.strip() for w in args.workloads.split(",")),
        quiet_wait_s=args.quiet_wait,
    )

    started = time.monotonic()
    machine = machine_info()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    raw = RAW_ROOT / stamp
    raw.mkdir(parents=True, exist_ok=True)
    configs_info = []
    from sglang_ext.emulated_gpu.tiny_model import write_tiny_model

    # Inputs live next to the raw outputs (relative paths), so the recorded commands rerun.
    model_dir = write_tiny_model(raw / "tiny-model").relative_to(REPO)
    max_prompts = max(20, round(max(plan.random_rates, default=1) * plan.random_seconds))
    dataset = write_random_dataset(raw / "random-words-sharegpt.json", max_prompts + 50).relative_to(REPO)
    fb_config = write_fb_config(raw).relative_to(REPO)
    for config in plan.configs:
        configs_info.append(run_config(plan, config, model_dir, dataset, fb_config, raw))

    doc = {
        "schema": "bench_sglang/1",
        "argv": list(argv if argv is not None else sys.argv[1:]),
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "runtime_s": round(time.monotonic() - started, 1),
        "machine": machine,
        "profile": PROFILE,
        "time_scale": TIME_SCALE,
        "kv_tokens": KV_TOKENS,
        "max_prefill_tokens": MAX_PREFILL_TOKENS,
        "plan": {"quick": args.quick, "random_rates": plan.random_rates, "replay_rates": plan.replay_rates,
                 "random_seconds": plan.random_seconds, "replay_seconds": plan.replay_seconds,
                 "random_workload": {"input_len": RANDOM_INPUT_LEN, "output_len": RANDOM_OUTPUT_LEN,
                                     "range_ratio": RANDOM_RANGE_RATIO, "slo": RANDOM_SLO},
                 "replay_workload": {"trace": "bundled Azure conversation sample",
                                     "slo_mix": REPLAY_SLO_MIX, "max_prompt_tokens": REPLAY_MAX_PROMPT_TOKENS}},
        "configs": configs_info,
        "runs": plan.runs,
        "raw_dir": str(raw.relative_to(REPO)),
    }
    doc["comparisons"] = comparisons(plan.runs)
    doc["caveats"] = CAVEATS + _contention_caveat(plan.runs)
    (raw / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    code = _write(doc, render(doc), args.out, args.no_write)
    return 1 if any("error" in r for r in plan.runs) else code


def _write(doc: dict, text: str, out: Path, no_write: bool) -> int:
    print(text)
    if not no_write:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
        (out / "table.md").write_text(text)
        print(f"wrote {out / 'results.json'} and {out / 'table.md'}", file=sys.stderr)
    return 0


def _contention_caveat(runs: list[dict]) -> list[str]:
    contended = [f"{r['config']} {r['workload']} @ {r['rate']:g}" for r in runs
                 if r["machine_during_run"]["foreign_sglang_servers"]]
    if not contended:
        return ["No other SGLang server ran on the machine during any run."]
    return ["**Another SGLang server (someone else's) ran on the machine during: "
            + "; ".join(contended) + "** -- those points had less CPU and are not comparable."]


if __name__ == "__main__":
    sys.exit(main())
