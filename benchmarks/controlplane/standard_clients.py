"""Standard clients against the OpenAI-compatible gateway, unmodified:
SGLang's own serving benchmark, ``python -m sglang.benchmark.serving`` (SGLang 0.5.23),
with its OpenAI completions backend (``--backend sglang-oai``, ``POST /v1/completions``)
and chat backend (``--backend sglang-oai-chat``, ``POST /v1/chat/completions``), each
streamed and not, with ``--goodput``; and what the gateway answers to the SGLang-only
endpoints that benchmark calls.

    scripts/bench_clients.sh [--quick] [--runs oai,oai-chat] [--rate 8] [--seconds 30]
    scripts/bench_clients.sh --render-only          # docs/bench/clients.md from clients.json

One machine, loopback: the daemon (``python -m controlplane serve``), one process of
``--ranks`` simulated ranks (``python -m sglang_ext.sim.rank``, Llama-3.1-8B on an H100
in real time, ``fb-anchor-margin``), the gateway (``python -m controlplane gateway``)
and the benchmark, a subprocess run exactly as a user would run it against an SGLang
server (no wrapper, no monkeypatching). The benchmark needs a tokenizer on this machine
(it counts prompt tokens and retokenizes the output): the tiny model's
(``python -m sglang_ext.adapter.emulated_gpu.tiny_model DIR``), given as ``--tokenizer DIR``;
the model name it sends comes from the gateway's ``GET /v1/models``. Prompts are cut
from a generated local ShareGPT-format file (``--dataset-name random --dataset-path``,
as :mod:`benchmarks.server.stock_vs_fairbatching` does; no hub access). Every request carries the SLO that
``--goodput`` measures (``custom_params.slo``, SGLang's own shape).

Each run is recorded separately: a backend the gateway does not serve fails (the
benchmark exits 1 at its warm-up request) and the table says so; the script goes on.
Raw outputs (the benchmark's log and JSONL, the tiny model, the dataset, the daemon's,
ranks' and gateway's logs) go to ``out/bench_clients/<UTC stamp>/``; the table to
``docs/bench/clients.md`` and ``clients.json`` (``--out``).

All processes share this machine's cores (and other people's processes do too), so the
latencies are an upper bound on what the gateway adds; the simulated ranks step in real
time whatever the CPU load, but their tokens reach the client late when it is busy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.controlplane.live_daemon import loopback_config, start_process_daemon
from benchmarks.controlplane.sim_ranks_and_gateway import start_gateway, start_sim_ranks, wait_for_ranks
from benchmarks.server.client_runs import write_random_dataset
from benchmarks.support.machine import cpu_times, cpu_usage, machine_info
from benchmarks.support.paths import DOCS_BENCH, REPO, relative
from benchmarks.support.ports import free_port
from benchmarks.support.processes import stop_group
from controlplane.client import Client
from sglang_ext.adapter.emulated_gpu.tiny_model import write_tiny_model
from sglang_ext.provenance import git_state

PROFILE = "llama3.1-8b-h100"
POLICY = "fb-anchor-margin"
INPUT_LEN = 1024
OUTPUT_LEN = 128
RANGE_RATIO = 0.5  # lengths uniform in [0.5 L, L]
SLO = {"ttft_ms": 2000, "tpot_ms": 50}  # the "standard" class of configs/slo.toml
DEFAULT_OUT = DOCS_BENCH
RAW_ROOT = REPO / "out" / "bench_clients"


@dataclass(frozen=True)
class Run:
    name: str
    backend: str
    stream: bool
    route: str


RUNS = {
    "oai": Run("oai", "sglang-oai", True, "POST /v1/completions"),
    "oai-chat": Run("oai-chat", "sglang-oai-chat", True, "POST /v1/chat/completions"),
    "oai-nostream": Run("oai-nostream", "sglang-oai", False, "POST /v1/completions"),
    "oai-chat-nostream": Run("oai-chat-nostream", "sglang-oai-chat", False, "POST /v1/chat/completions"),
}

# What SGLang 0.5.23's sglang/benchmark/serving.py calls besides the generation route
# (read from its source), with the exact method and parameters; the probe sends the same.
# (path, method, query, JSON body or None, when it calls it, what a failure does, what it reads)
ENDPOINTS = (
    ("/v1/models", "GET", "", None,
     "before the run, always: polled every 1 s until 200 (`--ready-check-timeout-sec`, default 60; "
     "0 skips it), then read for the model name unless `--model` is given",
     "**fatal**: `sys.exit(1)` when not 200 in time, or when the body is not JSON",
     "`data[0].id` (the `model` every request sends)"),
    ("/model_info", "GET", "", None,
     "before the run, only without `--tokenizer`",
     "tolerated (any exception or non-200 ignored); the tokenizer then falls back to the model name, "
     "here `fairbatching`, which is no local path or hub model: **fatal** at tokenizer load",
     "`tokenizer_path` or `model_path`"),
    ("/flush_cache", "POST", "?timeout=60", None,
     "after the warm-up request, only with `--flush-cache` or with `SGLANG_IS_IN_CI=true` in the "
     "environment (any backend whose name contains `sglang`)",
     "**fatal**: `raise_for_status()`, uncaught (traceback, exit 1)", "nothing"),
    ("/start_profile", "POST", "", {"activities": [], "num_steps": None, "output_dir": "/tmp/x"},
     "before the run, only with `--profile`", "tolerated (prints nothing)", "the status only"),
    ("/stop_profile", "POST", "", {},
     "after the run, only with `--profile`", "tolerated", "the status only"),
    ("/server_info", "GET", "", None,
     "after the run, twice, for any backend whose name contains `sglang` (the first call is inside "
     "the measured duration)",
     "tolerated when the answer is not 200 (a refused connection raises, uncaught; a 200 that is not "
     "JSON would raise too)",
     "1st: `decode[0]` if present, then `internal_states[0].avg_spec_accept_length` (> 0 switches "
     "ITL to retokenized per-token gaps); 2nd: the whole body, stored as `server_info` in the result "
     "file"),
    ("/get_server_info", "GET", "", None, "never (older SGLang versions' name)", "-", "-"),
    ("/get_model_info", "GET", "", None, "never (older SGLang versions' name)", "-", "-"),
    ("/health", "GET", "", None, "never by this benchmark (the gateway's readiness route)", "-", "-"),
)


# ---------------------------------------------------------------------- processes
def wait_ready(client_address: str, base_url: str, ranks: int, gateway: subprocess.Popen,
               timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    wait_for_ranks(client_address, ranks, timeout_s)
    while http(base_url, "/health", "GET")["status"] != 200:
        if gateway.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not answer /health")
        time.sleep(0.2)


def daemon_counters(client_address: str) -> dict[str, int]:
    with Client(client_address) as client:
        return dict(client.status().counters)


# ---------------------------------------------------------------------- HTTP probes
def http(base_url: str, path: str, method: str, body: dict | None = None, timeout_s: float = 10.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            status, content_type, raw = reply.status, reply.headers.get("Content-Type", ""), reply.read()
    except urllib.error.HTTPError as error:
        status, content_type, raw = error.code, error.headers.get("Content-Type", ""), error.read()
    except (urllib.error.URLError, ConnectionError) as error:
        return {"status": None, "content_type": "", "body": f"connection failed: {error}"}
    return {"status": status, "content_type": content_type.split(";")[0],
            "body": raw.decode(errors="replace")[:300]}


def probe(base_url: str) -> list[dict]:
    rows = []
    for path, method, query, body, when, failure, reads in ENDPOINTS:
        rows.append({"path": path, "method": method, "query": query, "when": when, "failure": failure,
                     "reads": reads, "answer": http(base_url, path + query, method, body)})
    for path in ("/v1/completions", "/v1/chat/completions"):  # the two generation routes, minimal bodies
        body = ({"prompt": "Hello", "max_tokens": 2, "ignore_eos": True} if path == "/v1/completions"
                else {"messages": [{"role": "user", "content": "Hello"}], "max_completion_tokens": 2,
                      "ignore_eos": True})
        rows.append({"path": path, "method": "POST", "query": "", "when": "every request",
                     "failure": "the request counts as failed", "reads": "see below",
                     "answer": http(base_url, path, "POST", body)})
    return rows


def gateway_responses(base_url: str) -> dict[str, int]:
    """The gateway's responses so far by HTTP status (its ``/metrics``)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = re.findall(r'fairbatching_gateway_responses_total\{status="(\d+)"\} (\d+)', text)
    return {status: int(count) for status, count in found}


# ---------------------------------------------------------------------- the benchmark
def bench_command(run: Run, base_url: str, tokenizer: Path, dataset: Path, rate: float, prompts: int,
                  seed: int, output: Path, extra: tuple[str, ...] = ()) -> list[str]:
    command = [
        "python", "-m", "sglang.benchmark.serving", "--backend", run.backend, "--base-url", base_url,
        "--tokenizer", str(tokenizer),
        "--dataset-name", "random", "--dataset-path", str(dataset),
        "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
        "--random-range-ratio", str(RANGE_RATIO),
        "--num-prompts", str(prompts), "--request-rate", f"{rate:g}", "--seed", str(seed),
        "--goodput", f"ttft:{SLO['ttft_ms']}", f"tpot:{SLO['tpot_ms']}",
        "--extra-request-body", json.dumps({"custom_params": {"slo": SLO}}),
        "--disable-tqdm", "--output-details", "--output-file", str(output),
    ]  # fmt: skip
    if not run.stream:
        command.append("--disable-stream")
    return command + list(extra)


def bench_env() -> dict[str, str]:
    """This environment, offline for the hub (the benchmark loads the tokenizer from a path,
    and its chat-template check of the served name fails fast instead of reaching out), and
    without the variables that change what the benchmark sends: API keys (the gateway runs
    without one) and ``SGLANG_IS_IN_CI`` (which adds ``POST /flush_cache``)."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("OPENAI_API_KEY", "API_KEY", "SGLANG_IS_IN_CI")}
    return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def failure_reason(log: str) -> str:
    """The benchmark's own last word on a failed run: its exception line, else its last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[A-Za-z_.]*(Error|Exception)\b.*:", line):
            return line[:400]
    return lines[-1][:400] if lines else "(no output)"


RESULT_KEYS = (
    "completed", "duration", "request_throughput", "output_throughput", "input_throughput",
    "total_input_tokens", "total_output_tokens", "total_output_tokens_retokenized",
    "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "p90_itl_ms", "p99_itl_ms",
    "mean_e2e_latency_ms", "median_e2e_latency_ms", "p90_e2e_latency_ms", "p99_e2e_latency_ms",
    "max_concurrent_requests", "request_goodput", "slo_attainment", "slo_attainment_by_metric",
    "goodput_slos_ms", "accept_length", "server_info",
)


def run_bench(run: Run, command: list[str], log_path: Path, output: Path, prompts: int,
              timeout_s: float, client_address: str, base_url: str) -> dict:
    argv = [sys.executable, *command[1:]]
    counters_before = daemon_counters(client_address)
    responses_before = gateway_responses(base_url)
    cpu_before = cpu_times()
    started = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(command) + "\n")
        log.flush()
        try:
            code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=bench_env(),
                                  timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = None
    wall_s = time.monotonic() - started
    log_text = log_path.read_text()
    counters_after = daemon_counters(client_address)
    responses_after = gateway_responses(base_url)
    record: dict = {
        "run": run.name, "backend": run.backend, "stream": run.stream, "route": run.route,
        "command": shlex.join(command), "exit_code": code, "wall_s": round(wall_s, 1), "num_prompts": prompts,
        "cpu": cpu_usage(cpu_before, cpu_times()),
        "daemon_counters": {key: counters_after.get(key, 0) - counters_before.get(key, 0)
                            for key in sorted(set(counters_after) | set(counters_before))
                            if counters_after.get(key, 0) != counters_before.get(key, 0)},
        "gateway_responses": {key: responses_after.get(key, 0) - responses_before.get(key, 0)
                              for key in sorted(set(responses_after) | set(responses_before))
                              if responses_after.get(key, 0) != responses_before.get(key, 0)},
        "log": str(relative(log_path)),
    }
    lines = [line for line in output.read_text().splitlines() if line.strip()] if output.exists() else []
    if code == 0 and lines:
        result = json.loads(lines[-1])
        record["result"] = {key: result.get(key) for key in RESULT_KEYS}
        errors = [error for error in result.get("errors", []) if error]
        record["failed"] = prompts - int(result.get("completed", 0))
        record["errors"] = sorted({failure_reason(error) for error in errors})[:5]
    else:
        record["failure"] = "timed out" if code is None else failure_reason(log_text)
    return record


# ---------------------------------------------------------------------- rendering
def _f(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if round(value, digits) == 0:
        value = 0.0  # not "-0.0" (non-streamed, the benchmark's TTFT is a hair after its latency)
    return f"{value:.{digits}f}"


def render(results: dict) -> str:
    setup = results["setup"]
    lines = [
        "# Standard clients against the gateway, unmodified",
        "",
        "Generated by `scripts/bench_clients.sh` "
        "(`python -m benchmarks.controlplane.standard_clients`; "
        f"{results['date']}, commit {results['git']['commit']}"
        f"{' with uncommitted changes' if results['git']['dirty'] else ''}). SGLang "
        f"{results['sglang_version']}'s serving benchmark, `python -m sglang.benchmark.serving`, run "
        "as a subprocess exactly as against an SGLang server, against the control plane's OpenAI-"
        f"compatible gateway: the daemon, {setup['ranks']} simulated ranks (`{PROFILE}` in real time, "
        f"`{POLICY}`) and the gateway on one machine ({results['machine'].get('logical_cpus')} CPUs: "
        f"{results['machine'].get('cpu_model', '?')}), loopback. The `openai` package's own clients "
        "are covered by `tests/controlplane/processes/test_openai_client.py`.",
        "",
        "## Command lines",
        "",
        "The cluster (the script writes the daemon's config with free ports; the equivalent):",
        "",
        "```bash",
        *setup["commands"],
        "```",
        "",
        "The benchmark, one run per backend (paths under the run folder "
        f"`{setup['raw']}`; `HF_HUB_OFFLINE=1`, and `OPENAI_API_KEY`, `API_KEY`, "
        "`SGLANG_IS_IN_CI` unset):",
        "",
        "```bash",
        *[run["command"] for run in results["runs"]],
        "```",
        "",
        f"Workload: `--dataset-name random` over a generated local ShareGPT-format file, prompts "
        f"{int(INPUT_LEN * RANGE_RATIO)}-{INPUT_LEN} tokens, outputs {int(OUTPUT_LEN * RANGE_RATIO)}-"
        f"{OUTPUT_LEN} tokens (`ignore_eos`, the benchmark's default), Poisson arrivals at "
        f"{setup['rate']:g} req/s, {setup['prompts']} prompts, `--seed {setup['seed']}`; every request "
        f"carries the SLO `--goodput` measures, TTFT {SLO['ttft_ms']} ms / TPOT {SLO['tpot_ms']} ms "
        "(`custom_params.slo`). The benchmark's TPOT is per request (latency - TTFT) / (output tokens "
        "- 1), a mean; goodput counts the requests that succeeded and met both.",
        "",
        "## Results",
        "",
        "| run | backend | stream | exit | completed / failed | req/s | output tok/s | TTFT p50 / p99 ms "
        "| TPOT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 / p99 ms | goodput req/s | SLO attainment |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in results["runs"]:
        head = f"| {run['run']} | `{run['backend']}` | {'yes' if run['stream'] else 'no'} | {run['exit_code']} |"
        result = run.get("result")
        if result is None:
            lines.append(head + f" 0 / {run['num_prompts']} | - | - | - | - | - | - | - | - |")
            continue
        lines.append(
            head + f" {result['completed']} / {run['failed']} | {_f(result['request_throughput'], 2)} | "
            f"{_f(result['output_throughput'], 0)} | {_f(result['median_ttft_ms'])} / {_f(result['p99_ttft_ms'])} | "
            f"{_f(result['median_tpot_ms'])} / {_f(result['p99_tpot_ms'])} | "
            f"{_f(result['median_itl_ms'])} / {_f(result['p99_itl_ms'])} | "
            f"{_f(result['median_e2e_latency_ms'])} / {_f(result['p99_e2e_latency_ms'])} | "
            f"{_f(result.get('request_goodput'), 2)} | "
            f"{_f(100 * result['slo_attainment'] if result.get('slo_attainment') is not None else None)}% |")
    lines.append("")
    for run in results["runs"]:
        if "failure" in run:
            lines.append(f"- **{run['run']} failed** (exit {run['exit_code']}; log `{run['log']}`): "
                         f"`{run['failure']}`")
        elif run.get("errors"):
            lines.append(f"- {run['run']}: failed requests' errors: " + "; ".join(f"`{e}`" for e in run["errors"]))
        responses = ", ".join(f"{status}: {count}" for status, count in run["gateway_responses"].items())
        rejects = {k: v for k, v in run["daemon_counters"].items() if k.startswith("rejected")}
        busy = [cpu["busy_pct"] for cpu in run.get("cpu", {}).values()]
        lines.append(f"- {run['run']}: the gateway's responses by status during the run (its own `/metrics` "
                     f"scrape included): {responses or 'none'}"
                     + (f"; the daemon's rejects: {rejects}" if rejects else "")
                     + (f"; CPUs busy {sum(busy) / len(busy):.0f}% on average" if busy else "") + ".")
    if any(not run["stream"] for run in results["runs"]):
        lines += ["", "Without streaming (`--disable-stream`) the benchmark takes TTFT = the whole "
                  "latency, so TPOT and ITL are 0 and goodput only says whether the whole answer came "
                  "within the TTFT target."]
    lines += ["", "## What the gateway answers to SGLang-only endpoints", "", verdict(results), "",
              "Every HTTP call `sglang/benchmark/serving.py` (SGLang "
              f"{results['sglang_version']}) makes besides the generation route, with the same method; the "
              "gateway's answer is probed live (an OpenAI-style error body is shown by its status and "
              "`code`, its full text below the table). `/get_server_info` and `/get_model_info` (older "
              "SGLang names) are not called by this version.", "",
              "| endpoint | when the benchmark calls it | if it fails | what it reads | the gateway answers |",
              "|---|---|---|---|---|"]
    error_bodies: dict[str, str] = {}
    for row in results["endpoints"]:
        answer = row["answer"]
        lines.append(f"| `{row['method']} {row['path']}{row['query']}` | {row['when']} | {row['failure']} | "
                     f"{row['reads']} | {_answer(answer, error_bodies)} |")
    lines.append("")
    lines += [f"- {key}: `{body}`" for key, body in error_bodies.items()]
    if results.get("flush_probe"):
        probe_run = results["flush_probe"]
        lines += ["", "With `--flush-cache` (the completions backend, 4 prompts):", "", "```bash",
                  probe_run["command"], "```", "",
                  f"exit {probe_run['exit_code']}: "
                  + (f"`{probe_run['failure']}`" if "failure" in probe_run else "it completed")]
    lines += ["", "## What the benchmark sends and parses", "", *NOTES]
    return "\n".join(lines) + "\n"


def _answer(answer: dict, error_bodies: dict[str, str]) -> str:
    """``404 `not_found``` for an OpenAI-style error (its body kept once in ``error_bodies``),
    else the status, content type and the start of the body."""
    status, body = answer["status"], answer["body"]
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):
        key = f"{status} `{error.get('code')}`"
        error_bodies.setdefault(key, body.replace("|", "\\|"))
        return key + " (OpenAI error)"
    body = body.replace("|", "\\|").replace("\n", " ")
    return f"{status} `{answer['content_type']}`: `{body[:100]}{'...' if len(body) > 100 else ''}`"


def verdict(results: dict) -> str:
    """What the probes and runs say, in a paragraph (from the measured answers, not assumed)."""
    status = {row["path"]: row["answer"]["status"] for row in results["endpoints"]}
    ran = [run["run"] for run in results["runs"] if run.get("result") and run["exit_code"] == 0]
    text = (f"The benchmark ran unmodified ({', '.join(ran) or 'no run'} completed): `GET /v1/models` "
            f"answers {status.get('/v1/models')} with the served model, and `--tokenizer` names a tokenizer "
            f"on the client (`/model_info` answers {status.get('/model_info')}). The two `GET /server_info` "
            f"calls after the run get {status.get('/server_info')}")
    if status.get("/server_info") != 200:
        text += (", which the benchmark tolerates: it reports no speculative accept length and stores "
                 "`server_info: null`")
    text += f". `POST /flush_cache` gets {status.get('/flush_cache')}"
    if status.get("/flush_cache") != 200:
        text += (": with `--flush-cache` (or `SGLANG_IS_IN_CI=true`) the benchmark stops after its warm-up "
                 "request. That is deliberate: the gateway cannot flush the ranks' prefix caches (the "
                 "control plane has no such message), and a 200 would claim a flush that did not happen; "
                 "flush each server directly (`POST /flush_cache` on it) before a run instead")
    else:
        text += " (check that the ranks' caches were really flushed)"
    return text + f". `--profile` gets {status.get('/start_profile')} / {status.get('/stop_profile')}, tolerated."

NOTES = (
    "- `sglang-oai` → `POST /v1/completions` with `model`, `prompt` (text), `best_of: 1`, "
    "`max_tokens`, `stream` (true unless `--disable-stream`), `temperature: 0.0`, `ignore_eos: true` "
    "(false with `--disable-ignore-eos`), `logprobs` only with `--return-logprob`, then "
    "`--extra-request-body` merged over them; never `stream_options`.",
    "- Streamed completions: each `data:` line except `[DONE]` is parsed and `choices[0].text` read "
    "unconditionally, so an event without choices (OpenAI's `include_usage` chunk, `choices: []`, "
    "or the gateway's mid-stream `{\"error\": ...}` event) makes that request fail; the first "
    "non-empty text is TTFT, each later one an ITL sample. The output length is the requested "
    "`max_tokens` unless a text chunk carries `usage.completion_tokens`. Not streamed: the body is "
    "read as the same lines (one JSON line), TTFT = latency.",
    "- `sglang-oai-chat` → `POST /v1/chat/completions` with `model`, `messages: [{\"role\": \"user\", "
    "\"content\": <prompt>}]`, **`max_completion_tokens`** (not `max_tokens`), `stream`, "
    "`temperature: 0.0`, `ignore_eos: true`, then `--extra-request-body`; never `stream_options`.",
    "- Streamed chat: a chunk's `usage.completion_tokens` (any chunk, `choices: []` allowed) sets the "
    "output length, else the requested length is assumed; chunks without choices are skipped; the "
    "text is `choices[0].delta.reasoning_content` (or `reasoning`) + `delta.content`, and the first "
    "non-empty one is TTFT. A chunk without `choices` and without `usage` is skipped silently, so "
    "the gateway's mid-stream `{\"error\": ...}` event goes unseen and the cut-short request counts "
    "as a success of the requested length (the completions backend fails it). Not streamed: "
    "`choices[0].message.content` and `usage.completion_tokens`.",
    "- A response other than 200 fails the request (`reason: body` is kept as its error); the "
    "warm-up request (the first prompt, at most 32 output tokens) must succeed or the benchmark "
    "exits 1 before the run.",
    "- `--goodput ttft:T tpot:P` (ms; also `e2el`) is computed on the client only: a request is good "
    "if it succeeded and met every given SLO; `request_goodput` = good / duration, `slo_attainment` "
    "= good / requests sent. It sends nothing to the server; the SLO the ranks schedule for is the "
    "one in `--extra-request-body`.",
    "- A tokenizer is needed on the client (`--tokenizer`, else `/model_info`, else `--model`): the "
    "random dataset is cut and measured with it and every output is retokenized. Against the "
    "gateway give a local path (`python -m sglang_ext.adapter.emulated_gpu.tiny_model DIR` writes one) or "
    "the served model's hub name. `--dataset-name random` downloads ShareGPT unless "
    "`--dataset-path` names a local ShareGPT-format file; `random-ids` needs no file.",
    "- Auth: `OPENAI_API_KEY` is sent as `Authorization: Bearer <key>` (what `--api-key-file` "
    "expects); `API_KEY` is sent bare (`Authorization: <key>`), which the gateway refuses (401).",
)


# ---------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="oai,oai-chat,oai-nostream,oai-chat-nostream",
                        help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--rate", type=float, default=8.0, help="request rate (Poisson), req/s")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds of arrivals per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=2, help="simulated ranks")
    parser.add_argument("--quick", action="store_true", help="10 s of arrivals per run, no --flush-cache probe")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--render-only", action="store_true", help="rebuild clients.md from clients.json")
    args = parser.parse_args()
    if args.render_only:
        results = json.loads((args.out / "clients.json").read_text())
        (args.out / "clients.md").write_text(render(results))
        return 0
    runs = [RUNS[name] for name in args.runs.split(",") if name]
    seconds = 10.0 if args.quick else args.seconds
    prompts = max(1, round(args.rate * seconds))

    import sglang

    raw = RAW_ROOT / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    raw.mkdir(parents=True, exist_ok=True)
    tokenizer = relative(write_tiny_model(raw / "tiny-model"))
    dataset = relative(write_random_dataset(raw / "random-words-sharegpt.json", prompts + 50))
    config = loopback_config(stale_after_s=2.0, log_level="warning")
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    daemon = start_process_daemon(raw, config)
    ranks = gateway = None
    records: list[dict] = []
    flush_probe = None
    try:
        ranks = start_sim_ranks(config, raw / "ranks.log", ranks=args.ranks, agent_id="sim",
                                time_scale=1.0, extra=("--profile", PROFILE, "--policy", POLICY))
        gateway = start_gateway(config.client_address, port, raw / "gateway.log")
        wait_ready(config.client_address, base_url, args.ranks, gateway)
        endpoints = probe(base_url)
        for run in runs:
            output = relative(raw / f"{run.name}.jsonl")
            command = bench_command(run, base_url, tokenizer, dataset, args.rate, prompts, args.seed, output)
            print(f"$ {shlex.join(command)}", flush=True)
            record = run_bench(run, command, raw / f"{run.name}.log", output, prompts,
                               timeout_s=seconds + 300, client_address=config.client_address, base_url=base_url)
            print(json.dumps({k: v for k, v in record.items() if k not in ("cpu", "command")})[:1500], flush=True)
            records.append(record)
        if not args.quick:
            run = RUNS["oai"]
            output = relative(raw / "flush-probe.jsonl")
            command = bench_command(run, base_url, tokenizer, dataset, args.rate, 4, args.seed, output,
                                    extra=("--flush-cache",))
            flush_probe = run_bench(run, command, raw / "flush-probe.log", output, 4, timeout_s=300,
                                    client_address=config.client_address, base_url=base_url)
            print(json.dumps({k: v for k, v in flush_probe.items() if k not in ("cpu", "command")})[:800])
    finally:
        for process in (gateway, ranks):
            stop_group(process)
        try:
            daemon.terminate()
        finally:
            daemon.kill()

    setup_commands = [
        "fairbatching-controlplane serve --config <daemon.toml: loopback ports, stale_after_s = 2.0> &",
        f"python -m sglang_ext.sim.rank --daemon <rank address> --agent-id sim --ranks {args.ranks} "
        f"--profile {PROFILE} --policy {POLICY} --time-scale 1.0 &",
        f"fairbatching-controlplane gateway --daemon <client address> --listen 127.0.0.1:{port} &",
        f"python -m sglang_ext.adapter.emulated_gpu.tiny_model {tokenizer}",
    ]
    results = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "git": git_state(REPO), "machine": machine_info(), "sglang_version": sglang.__version__,
        "setup": {"ranks": args.ranks, "profile": PROFILE, "policy": POLICY, "time_scale": 1.0,
                  "rate": args.rate, "seconds": seconds, "prompts": prompts, "seed": args.seed,
                  "input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "range_ratio": RANGE_RATIO, "slo": SLO,
                  "raw": str(relative(raw)), "commands": setup_commands},
        "endpoints": endpoints, "runs": records, "flush_probe": flush_probe,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "clients.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "clients.md").write_text(render(results))
    print((args.out / "clients.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
