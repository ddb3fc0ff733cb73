"""Benchmark: admission control in the real server (emulated GPU), FairBatching's
``reject`` and ``defer`` against the best stock configuration with the admission
controls stock SGLang has.

Configurations, each one ``python -m sglang.launch_server`` (SGLang 0.5.23, emulated GPU
``llama3.1-8b-h100`` at time scale 2, the same KV size and ``--max-prefill-tokens``):

* ``mixed-256``, ``mixed-512``, ``mixed-1024``: ``--enable-mixed-chunk
  --chunked-prefill-size N``, stock's best tuning for this workload (Sarathi-style);
* ``mixed-best-queue-Q``: the best of those (by mean effective RPS over the rates) with
  ``--max-queued-requests Q`` (SGLang refuses an arrival while Q requests wait);
* ``mixed-best-timeout``: the best with ``SGLANG_REQ_WAITING_TIMEOUT`` = the TTFT target
  (SGLang ends a request still waiting that long);
* ``mixed-best-queue-Q-sjf``: the best queue limit (by mean effective RPS over the rates)
  with SGLang's priority scheduling shortest prompt first (``--enable-priority-scheduling
  --schedule-low-priority-values-first``); **it needs the client to set each request's
  priority to its prompt length** (``trace_replay --priority prompt-length``): a full
  queue then drops its longest waiting prompt for a shorter arrival. (Every request here
  is in one class, so a priority from the class would change nothing.) SGLang's
  semantics: ``benchmarks/server/priority.py``;
* ``fb-reject``, ``fb-defer``: ``FAIRBATCHING_CONFIG`` = the shipped config (step model x
  time scale) with ``[admission] mode = "reject"`` / ``"defer"``.

Workload: ``python -m benchmarks.server.trace_replay`` of the bundled Azure conversation sample, exact
prompt and output lengths, ``gamma:4`` arrivals (bursty, seeded) at each rate, every
request in the ``standard`` class (TTFT 2 s, TPOT 50 ms). Effective RPS = rate x
attainment; a refused (429), ended (503) or unfinished request is a miss for every
configuration. Besides effective RPS the table has, per point, attainment per prompt-length
bucket, the worst bucket and the worst SLO class (groups of at least 20 requests) and
token goodput (prompt + output tokens per second of the requests that met their SLO), the
simulator's definitions (``sglang_ext.sim.metrics``).

Every finished point is appended to ``out/bench_sglang_admission/points.jsonl`` at once;
``--resume`` skips the points already there, ``--configs`` runs a subset, and the table
(``docs/bench/sglang_admission.md``) is always rendered from the saved points
(``scripts/bench_sglang_admission.sh`` runs ``python -m benchmarks.server.admission``)::

    scripts/bench_sglang_admission.sh [--resume] [--rates 10,16] [--configs ...]
    scripts/bench_sglang_admission.sh --render-only
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.server.client_runs import (
    flush_cache,
    replay_command,
    replay_head_seconds,
    run_command,
)
from benchmarks.server.emulated import PROFILE, TIME_SCALE, write_fb_config
from benchmarks.server.machine_watch import Watch, wait_quiet
from benchmarks.server.priority import CLASS, NONE, PROMPT_LENGTH
from benchmarks.server.priority import launch_args as priority_args
from benchmarks.server.stock_server import launch
from benchmarks.server.stock_vs_fairbatching import COMMON_ARGS
from benchmarks.support.paths import DOCS_BENCH, REPO
from benchmarks.support.points import append_point, done_keys
from benchmarks.support.points import load_points as _load_points
from sglang_ext.sim.metrics import MIN_GROUP_REQUESTS

ARRIVALS = "gamma:4"
SLO_CLASS = "standard"
TTFT_S = 2.0
CHUNKS = (256, 512, 1024)
CHUNK_NAMES = {f"mixed-{chunk}" for chunk in CHUNKS}
QUEUE_LIMITS = (4, 8, 16, 32)
DEFAULT_RATES = (10.0, 16.0)
SECONDS = 60.0
RAW = REPO / "out" / "bench_sglang_admission"
POINTS = RAW / "points.jsonl"
DOC = DOCS_BENCH / "sglang_admission.md"


@dataclass(frozen=True)
class Config:
    name: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    admission: str | None = None  # FairBatching's [admission] mode; None: stock
    priority: str = NONE  # the replay client's --priority (benchmarks/server/priority.py)


def mixed(chunk: int) -> tuple[str, ...]:
    return (*COMMON_ARGS, "--enable-mixed-chunk", "--chunked-prefill-size", str(chunk))


def stock_configs() -> list[Config]:
    return [Config(f"mixed-{chunk}", mixed(chunk)) for chunk in CHUNKS]


def queue_config(chunk: int, queue: int) -> Config:
    """``mixed-CHUNK`` with SGLang's queue limit (an arrival is refused while ``queue`` wait)."""
    return Config(f"mixed-{chunk}-queue-{queue}",
                  (*mixed(chunk), "--max-queued-requests", str(queue)))


def timeout_config(chunk: int) -> Config:
    """``mixed-CHUNK`` with SGLang's waiting timeout at the TTFT target."""
    return Config(f"mixed-{chunk}-timeout", mixed(chunk),
                  (("SGLANG_REQ_WAITING_TIMEOUT", f"{TTFT_S:g}"),))


def fairbatching_config(mode: str) -> Config:
    """``fb-MODE``: the shipped config with ``[admission] mode = MODE``."""
    return Config(f"fb-{mode}", COMMON_ARGS, admission=mode)


def admission_configs(best_chunk: int) -> list[Config]:
    return [
        *(queue_config(best_chunk, q) for q in QUEUE_LIMITS),
        timeout_config(best_chunk),
        fairbatching_config("reject"),
        fairbatching_config("defer"),
    ]


#: the configuration name's suffix of each priority mode (as in stock_vs_fairbatching)
PRIORITY_SUFFIXES = {PROMPT_LENGTH: "sjf", CLASS: "priority"}


def with_priority(base: Config, mode: str) -> Config:
    """A stock configuration with SGLang's priority scheduling in a client priority mode
    (``-sjf``: shortest prompt first, the client sends priority = prompt length;
    ``-priority``: the SLO class, tightest TTFT first)."""
    return Config(f"{base.name}-{PRIORITY_SUFFIXES[mode]}", (*base.args, *priority_args(mode)),
                  base.env, priority=mode)


def priority_config(chunk: int, queue: int, mode: str) -> Config:
    """``mixed-CHUNK-queue-QUEUE`` with priority scheduling (:func:`with_priority`): a full
    queue then drops its least urgent waiting request for a more urgent arrival."""
    return with_priority(queue_config(chunk, queue), mode)


def sjf_config(best_chunk: int, queue: int) -> Config:
    """The best queue limit with SGLang's priority scheduling, shortest prompt first (the
    client sends priority = prompt length)."""
    return priority_config(best_chunk, queue, PROMPT_LENGTH)


def best_queue(points: list[dict], chunk: int) -> int | None:
    """The queue limit of ``chunk`` with the highest mean effective RPS over the rates every
    measured limit has (None before any is measured)."""
    names = {f"mixed-{chunk}-queue-{q}": q for q in QUEUE_LIMITS}
    measured: dict[int, dict[float, list[float]]] = {}
    for p in points:
        if p["config"] in names and "effective_rps" in p:
            measured.setdefault(names[p["config"]], {}).setdefault(p["rate"], []).append(p["effective_rps"])
    if not measured:
        return None
    common = set.intersection(*(set(rates) for rates in measured.values()))
    if not common:
        return None
    return max(sorted(measured), key=lambda q: sum(
        sum(values) / len(values) for rate, values in measured[q].items() if rate in common))


def load_points() -> list[dict]:
    return _load_points(POINTS)


def best_chunk(points: list[dict]) -> int | None:
    """The stock chunk size with the highest mean effective RPS over the rates every chunk
    was measured at (None before there is one)."""
    measured: dict[int, dict[float, list[float]]] = {chunk: {} for chunk in CHUNKS}
    for p in points:
        chunk = int(p["config"].removeprefix("mixed-")) if p["config"] in CHUNK_NAMES else None
        if chunk is not None and "effective_rps" in p:
            measured[chunk].setdefault(p["rate"], []).append(p["effective_rps"])
    common = set.intersection(*(set(rates) for rates in measured.values()))
    if not common:
        return None
    return max(CHUNKS, key=lambda chunk: sum(
        sum(values) / len(values) for rate, values in measured[chunk].items() if rate in common))


def write_admission_config(directory: Path, mode: str) -> Path:
    base = write_fb_config(directory)
    text = base.read_text()
    if "\n[admission]" not in text:
        raise SystemExit("configs/fairbatching.toml has no [admission] table; update this script")
    head, _, tail = text.partition("\n[admission]")
    lines = tail.splitlines()
    for index, line in enumerate(lines):
        if line.startswith("mode = "):
            lines[index] = f'mode = "{mode}"'
            break
    else:
        raise SystemExit("the [admission] table of configs/fairbatching.toml has no mode line")
    path = directory / f"fairbatching-{mode}.toml"
    path.write_text(head + "\n[admission]" + "\n".join(lines) + "\n")
    return path


def run_point(url: str, config: Config, rate: float, seed: int, raw: Path, quiet_wait_s: float,
              pid: int, *, arrivals: str = ARRIVALS, seconds: float = SECONDS,
              slo_mix: str = f"{SLO_CLASS}:1", tag: str = "") -> dict:
    """One replay against a running server (its cache flushed first, after waiting for other
    SGLang servers to stop), its machine load watched; ``tag`` goes into the file names."""
    stem = f"{config.name}{tag}-r{rate:g}-s{seed}"
    waited = wait_quiet(pid, quiet_wait_s)
    flush_cache(url)
    head = replay_head_seconds(rate, seconds)
    output = raw / f"{stem}.json"
    output.unlink(missing_ok=True)
    command = replay_command(url, rate, head, arrivals, seed, slo_mix, output,
                             priority=config.priority)
    print(f"  {stem} ...", file=sys.stderr, flush=True)
    with Watch(pid) as watch:
        code, wall = run_command(command, raw / f"{stem}.log", timeout_s=1200)
    point = {"config": config.name, "rate": rate, "seed": seed, "head_s": head,
             "command": shlex.join(["python", *command[1:]]), "exit_code": code,
             "wall_s": round(wall, 1), "waited_for_quiet_s": round(waited, 1),
             "machine_during_run": watch.record()}
    if code != 0 or not output.exists():
        point["error"] = f"exit code {code}; see {raw / (stem + '.log')}"
        return point
    return {**point, **point_result(json.loads(output.read_text()))}


def point_result(result: dict) -> dict:
    """What a point keeps of the replay's summary (per SLO class: requests and attainment)."""
    kept = {key: result[key] for key in (
        "effective_rps", "attainment", "ttft_attainment", "tpot_attainment", "rejected",
        "aborted", "unfinished", "requests", "ttft_ms", "tpot_ms", "by_prompt_tokens",
        "worst_prompt_bucket", "worst_slo_class", "token_goodput")}
    kept["by_slo_class"] = {name: {"requests": group["requests"], "attainment": group["attainment"]}
                            for name, group in result["by_slo_class"].items()}
    return kept


def launch_env(config: Config, raw: Path) -> dict[str, str]:
    """The server's environment for ``config``: the emulated GPU, the configuration's own
    variables and, for FairBatching, its config file (written into ``raw``)."""
    env = {"FAIRBATCHING_EMULATED_GPU": PROFILE,
           "FAIRBATCHING_EMULATED_GPU_TIME_SCALE": f"{TIME_SCALE:g}", **dict(config.env)}
    if config.admission is not None:
        env["FAIRBATCHING_CONFIG"] = str(write_admission_config(raw, config.admission))
    return env


def recorded_env(env: dict[str, str]) -> dict[str, str]:
    """What a point records of the server's environment (the emulated GPU's variables are
    the same for every point)."""
    return {k: v for k, v in env.items() if not k.startswith("FAIRBATCHING_EMULATED")}


def run_config(config: Config, rates: tuple[float, ...], seeds: tuple[int, ...], done: set,
               model_dir: Path, raw: Path, quiet_wait_s: float) -> None:
    todo = [(rate, seed) for rate in rates for seed in seeds if (config.name, rate, seed) not in done]
    if not todo:
        return
    env = launch_env(config, raw)
    wait_quiet(None, quiet_wait_s)
    print(f"[{config.name}] starting server", file=sys.stderr, flush=True)
    server = launch(model_dir, config.args, env, raw / f"server-{config.name}.log", python=sys.executable)
    try:
        for rate, seed in todo:
            point = run_point(server.url, config, rate, seed, raw, quiet_wait_s, server.process.pid)
            point["launch_args"] = list(config.args)
            point["env"] = recorded_env(env)
            point["date_utc"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M")
            append_point(POINTS, point)
            done.add((config.name, rate, seed))
    finally:
        server.stop()


def render(points: list[dict]) -> str:
    rates = sorted({p["rate"] for p in points})
    configs = list(dict.fromkeys(p["config"] for p in points))
    cell = {}
    for p in points:
        cell.setdefault((p["config"], p["rate"]), []).append(p)
    stock = [c for c in configs if c.startswith("mixed-")]
    best_stock = {
        rate: max((c for c in stock if (c, rate) in cell), default=None,
                  key=lambda c: _mean(cell[(c, rate)], "effective_rps"))
        for rate in rates
    }
    lines = [
        "# Admission control in the real server (emulated GPU)", "",
        f"Generated by `python -m benchmarks.server.admission` from {len(points)} saved points "
        f"(`{POINTS.relative_to(REPO)}`). Stock SGLang 0.5.23 servers on the emulated GPU "
        f"(`{PROFILE}`, step times x{TIME_SCALE:g}); `benchmarks.server.trace_replay` of the bundled Azure "
        f"conversation sample, {ARRIVALS} arrivals, every request in the `{SLO_CLASS}` class "
        f"(TTFT {TTFT_S:g} s, TPOT 50 ms, max-TPOT as in the simulator), {SECONDS:g} s of "
        "arrivals per point. Effective RPS = rate x attainment; a refused (429), ended or "
        "unfinished request is a miss. Ratio: against the best stock configuration at that "
        "rate (any chunk size, with or without a queue limit or timeout). Cells are means over "
        "seeds (n in brackets when > 1).", "",
        "| config | " + " | ".join(f"{r:g} req/s" for r in rates) + " |",
        "|---|" + "---|" * len(rates),
    ]
    for config in configs:
        cells = []
        for rate in rates:
            runs = [p for p in cell.get((config, rate), []) if "effective_rps" in p]
            if not runs:
                cells.append("-")
                continue
            value = _mean(runs, "effective_rps")
            text = f"{value:.2f}"
            top = best_stock[rate]
            if not config.startswith("mixed-") and top is not None:
                text += f" ({value / _mean(cell[(top, rate)], 'effective_rps'):.2f}x)"
            refused = _mean(runs, "rejected") + _mean(runs, "aborted")
            text += f" <sub>TTFT {_mean(runs, 'ttft_attainment'):.0%}, TPOT {_mean(runs, 'tpot_attainment'):.0%}, refused/ended {refused:.0f}"
            text += f", n={len(runs)}</sub>" if len(runs) > 1 else "</sub>"
            cells.append(text)
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    lines += ["", "Best stock per rate: " + ", ".join(
        f"{r:g} req/s: `{best_stock[r]}`" for r in rates if best_stock[r]) + "."]
    lines += _groups_table(cell, rates, configs)
    lines += _by_prompt_table(cell, rates, best_stock, configs)
    good = {(p["config"], p["rate"], p["seed"]) for p in points if "error" not in p}
    failed = [p for p in points if "error" in p and (p["config"], p["rate"], p["seed"]) not in good]
    if failed:
        lines += ["", "Failed points: " + "; ".join(f"{p['config']} @ {p['rate']:g} ({p['error']})" for p in failed)]
    return "\n".join(lines) + "\n"


def _worst_text(runs: list[dict], key: str) -> str:
    """The worst group over the seeds: its label (the most frequent; with how many seeds
    named it when they disagree) and its mean attainment."""
    groups = [p[key] for p in runs if isinstance(p.get(key), dict)]
    if not groups:
        return "-"
    labels = [g["label"] for g in groups]
    label = max(dict.fromkeys(labels), key=labels.count)
    if label is None:
        return f"- (no group of >= {MIN_GROUP_REQUESTS})"
    values = [g["attainment"] for g in groups if g["label"] == label]
    seeds = f" ({labels.count(label)} of {len(labels)} seeds)" if labels.count(label) < len(labels) else ""
    return f"`{label}` {sum(values) / len(values):.0%}{seeds}"


def _groups_table(cell: dict, rates: list[float], configs: list[str]) -> list[str]:
    """Per configuration and rate: the worst prompt-length bucket, the worst SLO class and
    token goodput (means over seeds)."""
    if not any("token_goodput" in p for runs in cell.values() for p in runs):
        return []
    lines = ["", ("Worst prompt-length bucket and worst SLO class (lowest attainment among groups "
                  f"of at least {MIN_GROUP_REQUESTS} requests) and token goodput (prompt + output "
                  "tokens per second of the requests that met their SLO), means over seeds:"), "",
             "| config | " + " | ".join(f"{r:g} req/s" for r in rates) + " |",
             "|---|" + "---|" * len(rates)]
    for config in configs:
        cells = []
        for rate in rates:
            runs = [p for p in cell.get((config, rate), []) if "token_goodput" in p]
            if not runs:
                cells.append("-")
                continue
            cells.append(f"bucket {_worst_text(runs, 'worst_prompt_bucket')}, class "
                         f"{_worst_text(runs, 'worst_slo_class')}, {_mean(runs, 'token_goodput'):,.0f} tok/s")
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return lines


def _by_prompt_table(cell: dict, rates: list[float], best_stock: dict, configs: list[str]) -> list[str]:
    """SLO attainment per prompt-length bucket at the highest rate the best stock
    configuration and FairBatching both have it for: who pays for each admission rule."""
    def runs_of(config, rate):
        return [p for p in cell.get((config, rate), []) if "by_prompt_tokens" in p]
    for rate in reversed(rates):
        rows = [c for c in (best_stock[rate], *(c for c in configs if c.startswith("fb-")))
                if c is not None and runs_of(c, rate)]
        if best_stock[rate] in rows and len(rows) > 1:
            break
    else:
        return []
    buckets = list(dict.fromkeys(b for c in rows for p in runs_of(c, rate) for b in p["by_prompt_tokens"]))
    lines = ["", f"SLO attainment by prompt length at {rate:g} req/s (requests per bucket, mean over seeds):", "",
             "| config | " + " | ".join(f"{b} tokens" for b in buckets) + " |",
             "|---|" + "---|" * len(buckets)]
    for config in rows:
        runs = runs_of(config, rate)
        cells = []
        for bucket in buckets:
            parts = [p["by_prompt_tokens"][bucket] for p in runs if bucket in p["by_prompt_tokens"]]
            cells.append(f"{_mean(parts, 'attainment'):.0%} <sub>n={_mean(parts, 'requests'):.0f}</sub>"
                         if parts else "-")
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return lines


def _mean(runs: list[dict], key: str) -> float:
    values = [r[key] for r in runs if key in r]
    return sum(values) / len(values) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default=",".join(f"{r:g}" for r in DEFAULT_RATES))
    parser.add_argument("--seeds", default="0", help="replay seeds (arrival draws), e.g. 0,1,2")
    parser.add_argument("--configs", help="comma-separated subset of configuration names")
    parser.add_argument("--resume", action="store_true", help="keep the saved points, run the rest")
    parser.add_argument("--render-only", action="store_true", help="run nothing; render the table")
    parser.add_argument("--quiet-wait", type=float, default=600.0)
    args = parser.parse_args()
    os.chdir(REPO)
    rates = tuple(float(x) for x in args.rates.split(","))
    seeds = tuple(int(x) for x in args.seeds.split(","))
    RAW.mkdir(parents=True, exist_ok=True)
    if not args.render_only:
        if not args.resume:
            POINTS.unlink(missing_ok=True)
        from sglang_ext.adapter.emulated_gpu.tiny_model import write_tiny_model

        model_dir = write_tiny_model(RAW / "tiny-model").relative_to(REPO)
        done = done_keys(load_points(), ("config", "rate", "seed"))
        wanted = None if args.configs is None else set(args.configs.split(","))
        for config in stock_configs():
            if wanted is None or config.name in wanted:
                run_config(config, rates, seeds, done, model_dir, RAW, args.quiet_wait)
        chunk = best_chunk(load_points())
        if chunk is None:
            print("no rate has every stock chunk size yet; the admission configurations need "
                  "the best of them", file=sys.stderr)
        else:
            for config in admission_configs(chunk):
                if wanted is None or config.name in wanted or config.name.split("-queue")[0] in wanted:
                    run_config(config, rates, seeds, done, model_dir, RAW, args.quiet_wait)
            queue = best_queue(load_points(), chunk)
            if queue is None:
                print("no queue limit measured yet; the shortest-first configuration needs the "
                      "best of them", file=sys.stderr)
            else:
                config = sjf_config(chunk, queue)
                if wanted is None or config.name in wanted or "sjf" in wanted:
                    run_config(config, rates, seeds, done, model_dir, RAW, args.quiet_wait)
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(render(load_points()))
    print(DOC.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
