"""Benchmark: the real SGLang server on an emulated GPU the step-model file was not fitted
to, FairBatching against SGLang's own orders.

The emulated device is ``qwen3-32b-h100nvl`` at time scale 1 (a decode-only step of about
20 ms, a large share of a 50 ms TPOT). Every server is the stock ``python -m
sglang.launch_server`` with this project's plugin installed. Configurations:

* ``stock-256-hrrn`` and ``stock-256-spf``: ``--enable-mixed-chunk --chunked-prefill-size
  256`` with ``--schedule-policy hrrn`` / ``shortest-prefill-first`` and SGLang's waiting
  timeout (``SGLANG_REQ_WAITING_TIMEOUT``) at what the simulator tuned on this device
  for each SLO setting (``docs/bench/unfamiliar_gpu.json``: budget 256 for every order);
* ``fb-smooth``: the shipped ``configs/fairbatching.toml`` as an operator runs it here,
  its H100 step-model file unchanged;
* ``fb-steady``: the same with ``policy = "fb-steady"``;
* ``fb-steady-calibrated``: ``fb-steady`` with ``calibrate = true`` (the start-up
  calibration fits the model on the device before the server reports ready; the
  default when no file is named).

Workload: ``python -m benchmarks.server.trace_replay`` of the bundled Azure sample's head
spanning ``--seconds`` of arrivals at each rate (its own timestamps, rescaled), one SLO
class (``standard``: TTFT 2 s, TPOT 50 ms) or three (``interactive:1,standard:1,relaxed:1``).
Every figure is requests on time, overall, per class and per prompt-length bucket. Runs
wait for other SGLang servers to stop, and each records the machine's load. From the
repository root, on a quiet machine::

    python -m benchmarks.server.unfamiliar_gpu                      # about 40 min
    python -m benchmarks.server.unfamiliar_gpu --rates 4 --seconds 30   # a shorter check

Writes ``docs/bench/server_unfamiliar_gpu.{md,json}``; raw outputs and server logs go to
``out/server_unfamiliar_gpu/``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.server.client_runs import flush_cache, replay_command, replay_head_seconds, run_command
from benchmarks.server.machine_watch import Watch, wait_quiet
from benchmarks.server.stock_server import launch
from benchmarks.support.outputs import write_outputs
from benchmarks.support.paths import DOCS_BENCH, REPO
from sglang_ext.provenance import git_state

PROFILE = "qwen3-32b-h100nvl"
TIME_SCALE = 1.0
KV_TOKENS = 200_000
CHUNK = 256
SETTINGS = {"one": ("one class (standard: TTFT 2 s, TPOT 50 ms)", "standard:1"),
            "three": ("three classes (interactive 500/50, standard 2000/50, relaxed 5000/200 ms)",
                      "interactive:1,standard:1,relaxed:1")}
STOCK_ORDERS = {"hrrn": "sarathi-hrrn-queue-timeout", "spf": "sarathi-spf-queue-timeout"}
TUNED_FROM = DOCS_BENCH / "unfamiliar_gpu.json"
COMMON_ARGS = ("--max-total-tokens", str(KV_TOKENS))


@dataclass(frozen=True)
class Config:
    name: str
    args: tuple[str, ...] = COMMON_ARGS
    env: dict[str, str] = field(default_factory=dict)
    #: (old, new) replacements in the shipped config; None: stock (no FAIRBATCHING_CONFIG)
    fb_edits: tuple[tuple[str, str], ...] | None = None


def stock_timeouts(tuned_from: Path) -> dict[str, dict[str, float]]:
    """``{setting: {order: waiting timeout s}}`` as the simulator tuned them on this device."""
    doc = json.loads(tuned_from.read_text())
    out = {}
    for setting, entry in doc["scenarios"].items():
        tuned = {row["policy"]: label for label, row in entry["rows"].items() if row.get("baseline")}
        out[setting] = {order: float(re.search(r"timeout=([0-9.]+)", tuned[name]).group(1))
                        for order, name in STOCK_ORDERS.items()}
    return out


def configs(setting: str, timeouts: dict[str, dict[str, float]]) -> list[Config]:
    policies = {"hrrn": "hrrn", "spf": "shortest-prefill-first"}
    stock = [Config(f"stock-{CHUNK}-{order}",
                    (*COMMON_ARGS, "--enable-mixed-chunk", "--chunked-prefill-size", str(CHUNK),
                     "--schedule-policy", policies[order]),
                    {"SGLANG_REQ_WAITING_TIMEOUT": f"{timeouts[setting][order]:g}"})
             for order in STOCK_ORDERS]
    steady = ('policy = "fb-smooth"', 'policy = "fb-steady"')
    return [*stock,
            Config("fb-smooth", fb_edits=()),
            Config("fb-steady", fb_edits=(steady,)),
            Config("fb-steady-calibrated", fb_edits=(steady, ("calibrate = false", "calibrate = true")))]


def write_fb_config(directory: Path, edits: tuple[tuple[str, str], ...]) -> Path:
    """The shipped config with absolute paths and ``edits``, in ``directory``."""
    text = (REPO / "configs" / "fairbatching.toml").read_text()
    for old, new in (
        ('slo_file = "slo.toml"', f'slo_file = "{REPO / "configs" / "slo.toml"}"'),
        ('step_model = "step_models/', f'step_model = "{REPO / "configs" / "step_models"}/'),
        *edits,
    ):
        if old not in text:
            raise SystemExit(f"configs/fairbatching.toml no longer contains {old!r}; "
                             "update benchmarks/server/unfamiliar_gpu.py")
        text = text.replace(old, new)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "fairbatching.toml"
    path.write_text(text)
    return path


def run_setting(setting: str, config: Config, rates: Sequence[float], seconds: float,
                raw: Path, model_dir: Path) -> list[dict]:
    env = {"FAIRBATCHING_EMULATED_GPU": PROFILE,
           "FAIRBATCHING_EMULATED_GPU_TIME_SCALE": f"{TIME_SCALE:g}", **config.env}
    if config.fb_edits is not None:
        env["FAIRBATCHING_CONFIG"] = str(write_fb_config(raw / f"{setting}-{config.name}", config.fb_edits))
    wait_quiet(None, 600.0)
    started = time.monotonic()
    server = launch(model_dir, config.args, env, raw / f"server-{setting}-{config.name}.log",
                    timeout=600.0)
    start_s = time.monotonic() - started
    points = []
    try:
        for rate in rates:
            flush_cache(server.url)
            output = raw / f"{setting}-{config.name}-{rate:g}.json"
            command = replay_command(server.url, rate, replay_head_seconds(rate, seconds), "trace",
                                     0, SETTINGS[setting][1], output)
            with Watch(None) as watch:
                code, wall = run_command(command, output.with_suffix(".log"), timeout_s=seconds * 10 + 300)
            summary = json.loads(output.read_text()) if code == 0 else None
            print(f"[{setting} {config.name} {rate:g}] exit {code}, "
                  f"{summary and round(summary['attainment'], 3)}", file=sys.stderr, flush=True)
            points.append({"setting": setting, "config": config.name, "rate": rate, "exit_code": code,
                           "wall_s": round(wall, 1), "server_start_s": round(start_s, 1),
                           "machine": watch.record(), "args": list(config.args), "env": env,
                           "summary": summary})
    finally:
        server.stop()
    return points


def render(doc: dict) -> str:
    lines = [
        "# The real server on a GPU the step-model file was not fitted to",
        "",
        f"Stock `python -m sglang.launch_server` (SGLang 0.5.23, this project's plugin) on the "
        f"emulated `{doc['profile']}` at time scale {doc['time_scale']:g}; the bundled Azure "
        f"sample at its own arrivals, {doc['seconds']:g} s of arrivals per point. FairBatching "
        "runs the shipped config with its H100 step-model file. "
        "`python -m benchmarks.server.unfamiliar_gpu`.",
    ]
    for setting, (title, _) in SETTINGS.items():
        points = [p for p in doc["points"] if p["setting"] == setting]
        if not points:
            continue
        lines += ["", f"## {title}", "",
                  "| configuration | req/s | on time | per class | per prompt bucket (<512 / 512-1023 / "
                  "1024-2047 / 2048-4095 / >=4096) | TPOT p50 | busy CPU |",
                  "|---|---|---|---|---|---|---|"]
        for point in points:
            summary = point["summary"]
            if summary is None:
                lines.append(f"| {point['config']} | {point['rate']:g} | failed (exit {point['exit_code']}) | | | | |")
                continue
            classes = ", ".join(f"{k} {v['attainment']:.2f}" for k, v in summary["by_slo_class"].items())
            buckets = " / ".join(f"{v['attainment']:.2f}" for v in summary["by_prompt_tokens"].values())
            per_cpu = [entry["busy_pct"] for entry in point["machine"]["cpu"].values()]
            busy = f"{sum(per_cpu) / len(per_cpu):.0f}%" if per_cpu else "-"
            lines.append(f"| {point['config']} | {point['rate']:g} | {summary['attainment']:.3f} | "
                         f"{classes} | {buckets} | {summary['tpot_ms']['p50']:.0f} ms | {busy} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="3,5", help="offered loads, req/s (default 3,5)")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds of arrivals per point")
    parser.add_argument("--settings", default="one,three")
    parser.add_argument("--configs", help="only these configuration names (default: all)")
    parser.add_argument("--raw", type=Path, default=REPO / "out" / "server_unfamiliar_gpu")
    parser.add_argument("--out", type=Path, default=DOCS_BENCH)
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    settings = [s for s in args.settings.split(",") if s]
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        parser.error(f"unknown settings {sorted(unknown)}; expected {sorted(SETTINGS)}")
    from sglang_ext.adapter.emulated_gpu.tiny_model import write_tiny_model

    args.raw.mkdir(parents=True, exist_ok=True)
    model_dir = write_tiny_model(args.raw / "tiny-model")
    timeouts = stock_timeouts(TUNED_FROM)
    started = time.monotonic()
    points = []
    for setting in settings:
        chosen = configs(setting, timeouts)
        if args.configs:
            names = set(args.configs.split(","))
            chosen = [c for c in chosen if c.name in names]
        for config in chosen:
            points += run_setting(setting, config, rates, args.seconds, args.raw, model_dir)
    doc = {"profile": PROFILE, "time_scale": TIME_SCALE, "seconds": args.seconds, "rates": rates,
           "points": points,
           "provenance": {**git_state(REPO), "wall_s": round(time.monotonic() - started),
                          "command": "python -m benchmarks.server.unfamiliar_gpu " + " ".join(argv or sys.argv[1:])}}
    text = render(doc)
    print(text)
    write_outputs(args.out, "server_unfamiliar_gpu", text, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
