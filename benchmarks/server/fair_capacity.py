"""Benchmark: fair capacity in the real server: FairBatching's shipped
configuration against stock SGLang at its best, by the simulator's measures
(``benchmarks.sim.fair_capacity``), on the emulated GPU.

Configurations, each one ``python -m sglang.launch_server`` (SGLang 0.5.23, emulated GPU
``llama3.1-8b-h100`` at time scale 2; ``benchmarks.server.admission`` builds them):

* ``mixed-C-queue-Q``: stock's best mixed chunk C with its best queue limit Q (both from the
  admission benchmark's saved points, ``out/bench_sglang_admission/points.jsonl``; without
  them C = 512 and Q = 16, what ``docs/bench/sglang_admission.md`` found; ``--queue-limits``
  adds others);
* ``mixed-C-timeout``: chunk C with SGLang's waiting timeout at the TTFT target;
* ``mixed-C-queue-Q-priority``: with SGLang's priority scheduling, priority = the SLO class
  (tightest TTFT first; the three-class setting only: with one class it changes nothing);
* ``mixed-C-queue-Q-sjf``: priority scheduling, priority = the prompt length (shortest first)
  (``--priority-on timeout``: both priority configurations on ``mixed-C-timeout`` instead,
  as the simulator's ``sarathi-priority-queue-timeout`` and ``sarathi-sjf-queue-timeout``);
* ``fb-defer``: the shipped config (``configs/fairbatching.toml``, ``[admission] mode =
  "defer"``, the shipped default).

Settings: one class (every request ``standard``: TTFT 2 s, TPOT 50 ms) or three
(``interactive:0.2,standard:0.5,relaxed:0.3``, drawn per request by the replay seed) x the
arrivals (``gamma:4``: bursty, seeded; ``trace``: the bundled sample's own timestamps
rescaled to the rate, the same for every seed). Workload: ``python -m
benchmarks.server.trace_replay`` of the bundled Azure sample's head that spans
``--seconds`` of arrivals at the rate, or more where fewer than ``--min-requests`` would
arrive in them (so that the worst group is decided by groups of >= 20), prompts capped at
6144 tokens.

A **probe** runs every seed at one rate (the server's prefix cache flushed before each,
after waiting for other SGLang servers to stop) and pools their requests: attainment
overall, per prompt-length bucket and per SLO class over every request of every seed; the
worst bucket and class among groups of >= 20 requests (``sglang_ext.sim.metrics``).

Per configuration and setting, **capacity** at 90% and 99% (overall, worst bucket, worst
class) by ``sglang_ext.sim.capacity.bisect_capacity`` from ``--start`` to ``--tolerance``
(at most ``--max-probes`` probes: a bracket left wider is marked ``*``). Then
**overload**: every configuration at 1.5x and 2x the best stock configuration's overall
capacity at 90% in that setting: effective RPS and the worst bucket.

One server launch per configuration serves its probes in every setting; a stock
configuration whose overload loads are not known yet (a later stock configuration still
to bisect) is launched again for them. Every replay is saved as a point at once
(``RAW/points.jsonl``, key: configuration, setting, seconds, minimum requests, rate,
seed); ``--resume`` replays the bisections from the saved points and runs only what is
missing (more seeds or arrivals reuse every saved run that matches), and the tables
(``docs/bench/server_fair_capacity.{md,json}``) are always rendered from the saved points
the same way (``--render-only``: run nothing, with the plan of the last run)::

    scripts/bench_server_fair_capacity.sh --resume --seeds 0 --arrivals gamma:4 --targets 0.9
    scripts/bench_server_fair_capacity.sh --dry-run     # the plan and its duration, at most
    scripts/bench_server_fair_capacity.sh --render-only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Self

import benchmarks.server.admission as adm
from benchmarks.server.emulated import PROFILE, TIME_SCALE
from benchmarks.server.machine_watch import wait_quiet
from benchmarks.server.priority import CLASS, PROMPT_LENGTH
from benchmarks.server.stock_server import Server, launch
from benchmarks.server.stock_vs_fairbatching import QUEUE_LIMIT
from benchmarks.sim.fair_capacity import CLASS_MIX, MIXES, OVERLOADS, TOLERANCE, _ratio, _share
from benchmarks.support.machine import machine_info, machine_line
from benchmarks.support.outputs import write_outputs
from benchmarks.support.paths import DOCS_BENCH, REPO, relative
from benchmarks.support.points import append_point, load_points, move_aside, point_key
from sglang_ext.sim.capacity import (
    MEASURE_TITLES,
    MEASURES,
    TARGETS,
    CapacitySearch,
    bisect_capacity,
    capacity_from_probes,
    capacity_text,
    round_rate,
    target_key,
)
from sglang_ext.sim.metrics import MIN_GROUP_REQUESTS, prompt_bucket_labels, worst_group

ONE_CLASS, THREE_CLASSES = MIXES
SLO_MIXES = {ONE_CLASS: f"{adm.SLO_CLASS}:1", THREE_CLASSES: CLASS_MIX}
ARRIVALS = ("gamma:4", "trace")  # trace_replay --arrivals: bursty, and the trace's own
SEEDS = (0, 1, 2)
SECONDS = 30.0
START_RATE = 5.0  # req/s: near stock's capacity in docs/bench/sglang_admission.md
#: the bisection's bounds (req/s): below MIN_RATE a run of MIN_REQUESTS lasts minutes
MIN_RATE, MAX_RATE = 1.0, 40.0
#: a run lasts long enough for this many requests (at least --seconds): with three classes,
#: 20% interactive, fewer than 150 leave the worst class undefined (a group of < 20) too often
MIN_REQUESTS = 150
MAX_PROBES = 24
DEFAULT_CHUNK = 512  # docs/bench/sglang_admission.md: mixed-512 the best chunk
DEFAULT_QUEUE = QUEUE_LIMIT  # 16: that benchmark's best queue limit (by mean effective RPS)
SHIPPED = "fb-defer"
#: a probe's time besides its arrivals, per seed (client start, drain, cache flush), and a
#: server launch's, measured on a 2-core machine; for --dry-run's estimate
PROBE_OVERHEAD_S = 15.0  # the tiny run, on a busy 2-core machine: 12-22 s
LAUNCH_S = 60.0
RETRIES = 1  # a failed run (a server that dropped a connection) is run again this many times
RAW = REPO / "out" / "bench_server_fair_capacity"
STEM = "server_fair_capacity"
PLAN_FILE = "plan.json"
#: a saved point's resume key (with "error" it is not done)
KEY = ("config", "mix", "arrivals", "seconds", "min_requests", "rate", "seed")
BISECTION, OVERLOAD = "bisection", "overload"
EMULATED_CAVEAT = (
    "**The GPU is emulated.** SGLang's scheduler, HTTP server, tokenizer and detokenizer run "
    "for real on a CPU-only machine; each forward step takes the step time of the "
    f"`{PROFILE}` profile x{TIME_SCALE:g} instead of a GPU's, so what is measured is the "
    f"scheduling policy and the server's own overheads at {TIME_SCALE:g}x an H100's step "
    "times, not an H100. "
    "CPU contention (other processes, another SGLang server) slows the CPU-side work: the "
    "machine's load during each probe is recorded below.")


# ------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class Setting:
    """The workload a bisection runs on: a class setting and an arrival process."""

    mix: str  # ONE_CLASS or THREE_CLASSES
    arrivals: str  # trace_replay's --arrivals

    @property
    def slo_mix(self) -> str:
        return SLO_MIXES[self.mix]

    @property
    def label(self) -> str:
        return f"{self.mix}, {self.arrivals} arrivals"

    def tag(self, seconds: float) -> str:
        """Part of a probe's file names."""
        classes = "1class" if self.mix == ONE_CLASS else "3class"
        return f"-{classes}-{self.arrivals.replace(':', '')}-t{seconds:g}"


@dataclass(frozen=True)
class StockTuning:
    """Stock's best chunk and queue limit, and where they come from."""

    chunk: int
    queue: int
    source: str


@dataclass(frozen=True)
class Plan:
    """What a run measures (saved beside its points, so that ``--render-only`` replays it)."""

    settings: tuple[Setting, ...]
    seeds: tuple[int, ...]
    seconds: float
    min_requests: int
    targets: tuple[float, ...]
    tolerance: float
    max_probes: int
    start: float
    min_rate: float
    max_rate: float
    overloads: tuple[float, ...]
    configs: tuple[adm.Config, ...]
    tuning: StockTuning

    def settings_of(self, config: adm.Config) -> list[Setting]:
        return [s for s in self.settings if runs_in(config, s)]

    def run_seconds(self, rate: float) -> float:
        """A run's arrivals: ``seconds``, longer where fewer than ``min_requests`` arrive."""
        return max(self.seconds, self.min_requests / rate)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: dict) -> Plan:
        configs = tuple(adm.Config(c["name"], tuple(c["args"]), tuple(tuple(e) for e in c["env"]),
                                   c["admission"], c["priority"]) for c in data["configs"])
        return Plan(tuple(Setting(**s) for s in data["settings"]), tuple(data["seeds"]),
                    data["seconds"], data["min_requests"], tuple(data["targets"]),
                    data["tolerance"], data["max_probes"], data["start"], data["min_rate"],
                    data["max_rate"], tuple(data["overloads"]), configs,
                    StockTuning(**data["tuning"]))


def runs_in(config: adm.Config, setting: Setting) -> bool:
    """Priority by class runs in the three-class setting only (one class: nothing to order)."""
    return config.priority != CLASS or setting.mix != ONE_CLASS


def is_stock(config: adm.Config) -> bool:
    return config.admission is None


def stock_tuning(admission_points: list[dict]) -> StockTuning:
    """The admission benchmark's best chunk and queue limit from its saved points, else the
    defaults its table found."""
    chunk = adm.best_chunk(admission_points)
    if chunk is None:
        return StockTuning(DEFAULT_CHUNK, DEFAULT_QUEUE,
                           f"no saved points in {relative(adm.POINTS)}: chunk {DEFAULT_CHUNK} "
                           f"and queue limit {DEFAULT_QUEUE}, the best in "
                           "docs/bench/sglang_admission.md")
    queue = adm.best_queue(admission_points, chunk)
    if queue is None:
        return StockTuning(chunk, DEFAULT_QUEUE,
                           f"chunk {chunk} from {relative(adm.POINTS)} (best mean effective RPS); "
                           f"no queue limit measured there: {DEFAULT_QUEUE}")
    return StockTuning(chunk, queue, f"chunk {chunk} and queue limit {queue} from "
                       f"{relative(adm.POINTS)} (best mean effective RPS over the rates)")


PRIORITY_BASES = ("queue", "timeout")


def configurations(tuning: StockTuning, extra_queues: Sequence[int] = (),
                   priority_on: str = "queue") -> tuple[adm.Config, ...]:
    """Every configuration in run order: stock first (their capacities place the overload
    loads), the shipped FairBatching last; priority scheduling on the best queue limit or
    on the waiting timeout."""
    queues = dict.fromkeys((tuning.queue, *extra_queues))
    timeout = adm.timeout_config(tuning.chunk)
    base = adm.queue_config(tuning.chunk, tuning.queue) if priority_on == "queue" else timeout
    return (
        *(adm.queue_config(tuning.chunk, q) for q in queues),
        timeout,
        adm.with_priority(base, CLASS),
        adm.with_priority(base, PROMPT_LENGTH),
        adm.fairbatching_config("defer"),
    )


def point_key_of(config: str, setting: Setting, plan: Plan, rate: float, seed: int) -> tuple:
    return point_key({"config": config, "mix": setting.mix, "arrivals": setting.arrivals,
                      "seconds": plan.seconds, "min_requests": plan.min_requests, "rate": rate,
                      "seed": seed}, KEY)


# ------------------------------------------------------------------ probes
def pool_groups(parts: Sequence[dict[str, dict]],
                order: Sequence[str] | None = None) -> dict[str, dict]:
    """Groups (``by_prompt_tokens`` or ``by_slo_class`` of several runs) pooled: each
    group's requests summed, its attainment the share met among them all."""
    pooled: dict[str, list[int]] = {}
    for groups in parts:
        for name, group in groups.items():
            total = pooled.setdefault(name, [0, 0])
            total[0] += group["requests"]
            total[1] += round(group["attainment"] * group["requests"])
    names = [n for n in order if n in pooled] if order is not None else sorted(pooled)
    return {name: {"requests": pooled[name][0], "attainment": pooled[name][1] / pooled[name][0]}
            for name in names}


def pooled_load(runs: Sequence[dict], rate: float) -> dict:
    """One load point from a probe's runs (one per seed): every request of every run
    counted once, overall and per group; the worst bucket and class over the pooled groups
    (``sglang_ext.sim.metrics.worst_group``); token goodput and max-TPOT p99 the mean over
    the runs."""
    requests = sum(run["requests"] for run in runs)
    met = sum(round(run["attainment"] * run["requests"]) for run in runs)
    buckets = pool_groups([run["by_prompt_tokens"] for run in runs], prompt_bucket_labels())
    classes = pool_groups([run["by_slo_class"] for run in runs])
    return {
        "rate": rate, "seeds": sorted(run["seed"] for run in runs), "requests": requests,
        "attainment": met / requests, "effective_rps": rate * met / requests,
        "refused": sum(run["rejected"] + run["aborted"] for run in runs),
        "by_prompt_tokens": buckets, "by_slo_class": classes,
        "worst_prompt_bucket": worst_group(buckets), "worst_slo_class": worst_group(classes),
        "token_goodput": _mean([run["token_goodput"] for run in runs]),
        "max_tpot_p99_ms": _mean([(run.get("tpot_ms") or {}).get("p99") for run in runs]),
    }


class NotProbed(LookupError):
    """A probe with no successful run saved (and, when rendering, none to be run)."""


class ProbeLog:
    """The saved points in memory; a new one is appended to the points file at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.points = load_points(path)

    def add(self, point: dict) -> None:
        append_point(self.path, point)
        self.points.append(point)

    def runs(self, config: str, setting: Setting, plan: Plan, rate: float,
             seeds: Sequence[int]) -> list[dict]:
        """The successful run of each seed at this probe (the last saved), in seed order."""
        wanted = {point_key_of(config, setting, plan, rate, seed): seed for seed in seeds}
        found: dict[int, dict] = {}
        for point in self.points:
            seed = wanted.get(point_key(point, KEY))
            if seed is not None and "error" not in point:
                found[seed] = point
        return [found[seed] for seed in seeds if seed in found]

    def saved_load(self, config: str, setting: Setting, plan: Plan, rate: float) -> dict:
        runs = self.runs(config, setting, plan, rate, plan.seeds)
        if not runs:
            raise NotProbed(f"{config} / {setting.label} @ {rate:g} req/s")
        return pooled_load(runs, rate)


def search_capacity(evaluate: Callable[[float], dict], plan: Plan) -> dict:
    """The bisection of one configuration in one setting (``bisect_capacity`` with the plan's
    targets, start, tolerance and probe limit): ``{"capacity", "loads", "complete"}``. A
    probe that cannot be had (:class:`NotProbed`) ends it: the capacity is then read from
    the loads probed so far and ``complete`` is False."""
    probed: dict[float, dict] = {}

    def recorded(rate: float) -> dict:
        probed[rate] = evaluate(rate)
        return probed[rate]

    try:
        search: CapacitySearch = bisect_capacity(
            recorded, targets=plan.targets, start=plan.start, tolerance=plan.tolerance,
            min_rate=plan.min_rate, max_rate=plan.max_rate, max_simulations=plan.max_probes)
        capacity, complete = search.capacity, True
    except NotProbed:
        capacity, complete = partial_capacity(list(probed.values()), plan), False
    loads = {f"{rate:g}": load for rate, load in sorted(probed.items())}
    return {"capacity": capacity, "loads": loads, "complete": complete}


def partial_capacity(loads: list[dict], plan: Plan) -> dict:
    """Capacity per target and measure over the loads probed, none of it resolved."""
    return {target_key(t): {m: {**capacity_from_probes(loads, t, m), "resolved": False}
                            for m in MEASURES} for t in plan.targets}


def overall_capacity(search: dict | None, target: float = 0.9) -> float | None:
    if search is None:
        return None
    return search["capacity"][target_key(target)]["overall"]["capacity"]


def best_stock(plan: Plan, searches: dict[tuple[str, Setting], dict],
               setting: Setting) -> tuple[str, float] | None:
    """The stock configuration with the highest overall capacity at 90% in ``setting`` among
    those searched, and that capacity (None when none has one)."""
    found = [(config.name, overall_capacity(searches.get((config.name, setting))))
             for config in plan.configs if is_stock(config) and runs_in(config, setting)]
    found = [(name, value) for name, value in found if value]
    return max(found, key=lambda item: item[1]) if found else None


def overload_rates(plan: Plan, best_capacity: float) -> dict[str, float]:
    return {f"{share:g}x": round_rate(share * best_capacity) for share in plan.overloads}


# ------------------------------------------------------------------ running
@dataclass(frozen=True)
class Bench:
    plan: Plan
    raw: Path
    model_dir: Path
    quiet_wait_s: float


class LazyServer:
    """A configuration's server, launched by the first probe that needs it and reused by the
    ones after (none launched when every probe is saved; launched again if it died)."""

    def __init__(self, bench: Bench, config: adm.Config) -> None:
        self.bench, self.config = bench, config
        self.env = adm.launch_env(config, bench.raw)
        self.server: Server | None = None

    def get(self) -> Server:
        if self.server is not None and not self.server.alive():
            print(f"[{self.config.name}] the server died (exit code "
                  f"{self.server.process.returncode}); starting it again", file=sys.stderr)
            self.server.stop()
            self.server = None
        if self.server is None:
            wait_quiet(None, self.bench.quiet_wait_s)
            print(f"[{self.config.name}] starting server", file=sys.stderr, flush=True)
            self.server = launch(self.bench.model_dir, self.config.args, self.env,
                                 self.bench.raw / f"server-{self.config.name}.log",
                                 python=sys.executable)
        return self.server

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.stop()


def run_probe(bench: Bench, log: ProbeLog, server: LazyServer, setting: Setting, rate: float,
              phase: str) -> dict:
    """Every seed at ``rate`` not saved yet, run and saved at once (a failed run is saved
    with its error and run again, ``RETRIES`` times); the pooled load (raises
    :class:`NotProbed` when every seed failed)."""
    plan, config = bench.plan, server.config
    for seed in plan.seeds:
        for _ in range(1 + RETRIES):
            if log.runs(config.name, setting, plan, rate, (seed,)):
                break
            point = run_seed(bench, server, setting, rate, seed)
            point.update(mix=setting.mix, arrivals=setting.arrivals, seconds=plan.seconds,
                         min_requests=plan.min_requests, run_seconds=plan.run_seconds(rate),
                         slo_mix=setting.slo_mix, phase=phase, launch_args=list(config.args),
                         env=adm.recorded_env(server.env),
                         date_utc=datetime.now(UTC).strftime("%Y-%m-%d %H:%M"))
            log.add(point)
            print(f"    {_point_line(point)}", file=sys.stderr, flush=True)
    return log.saved_load(config.name, setting, plan, rate)


def run_seed(bench: Bench, server: LazyServer, setting: Setting, rate: float, seed: int) -> dict:
    """One replay (``benchmarks.server.admission.run_point``); a server that fails to start
    or to flush its cache gives a point with an ``error``."""
    try:
        running = server.get()
        return adm.run_point(running.url, server.config, rate, seed, bench.raw,
                             bench.quiet_wait_s, running.process.pid,
                             arrivals=setting.arrivals, seconds=bench.plan.run_seconds(rate),
                             slo_mix=setting.slo_mix, tag=setting.tag(bench.plan.seconds))
    except (OSError, RuntimeError) as error:  # ServerFailed is a RuntimeError
        return {"config": server.config.name, "rate": rate, "seed": seed,
                "error": f"{type(error).__name__}: {str(error)[-500:]}"}


def run_benchmark(bench: Bench, log: ProbeLog, selected: set[str]) -> None:
    """Bisect every selected configuration in each of its settings, then run its overload
    probes: in the same launch when the best stock capacity is known by then (no selected
    stock configuration left to bisect), else in a second launch after the others.
    Configurations not selected are searched over their saved points only."""
    plan = bench.plan
    searches: dict[tuple[str, Setting], dict] = {}
    waiting: list[adm.Config] = []
    for index, config in enumerate(plan.configs):
        if config.name not in selected:
            for setting in plan.settings_of(config):
                searches[(config.name, setting)] = search_capacity(
                    lambda rate, s=setting, c=config: log.saved_load(c.name, s, plan, rate), plan)
            continue
        with LazyServer(bench, config) as server:
            for setting in plan.settings_of(config):
                search = search_capacity(
                    lambda rate, s=setting: run_probe(bench, log, server, s, rate, BISECTION), plan)
                searches[(config.name, setting)] = search
                print(f"[{config.name}] {setting.label}: {_search_line(search)}", file=sys.stderr)
            later = [c for c in plan.configs[index + 1:] if is_stock(c) and c.name in selected]
            if is_stock(config) and later:
                waiting.append(config)
            else:
                run_overloads(bench, log, server, searches)
    for config in waiting:
        with LazyServer(bench, config) as server:
            run_overloads(bench, log, server, searches)


def run_overloads(bench: Bench, log: ProbeLog, server: LazyServer, searches: dict) -> None:
    for setting in bench.plan.settings_of(server.config):
        best = best_stock(bench.plan, searches, setting)
        if best is None:
            print(f"[{server.config.name}] {setting.label}: no stock capacity to place the "
                  "overload loads", file=sys.stderr)
            continue
        for name, rate in overload_rates(bench.plan, best[1]).items():
            try:
                load = run_probe(bench, log, server, setting, rate, OVERLOAD)
                print(f"[{server.config.name}] {setting.label}: overload {name} ({rate:g} req/s): "
                      f"effective RPS {load['effective_rps']:.2f}", file=sys.stderr)
            except NotProbed as error:
                print(f"[{server.config.name}] overload probe failed: {error}", file=sys.stderr)


def _search_line(search: dict) -> str:
    cap = search["capacity"][target_key(0.9)] if target_key(0.9) in search["capacity"] else next(
        iter(search["capacity"].values()))
    cells = ", ".join(f"{MEASURE_TITLES[m]} {_cap_text(cap[m])}" for m in MEASURES)
    done = "" if search["complete"] else " (incomplete: a probe failed)"
    return f"capacity {cells} after {len(search['loads'])} probes{done}"


def _point_line(point: dict) -> str:
    if "error" in point:
        return f"{point['config']} @ {point['rate']:g} seed {point['seed']}: {point['error']}"
    return (f"{point['config']} @ {point['rate']:g} seed {point['seed']}: attainment "
            f"{point['attainment']:.1%} of {point['requests']}, {point['wall_s']:.0f} s")


# ------------------------------------------------------------------ the document
def build_document(plan: Plan, log: ProbeLog, points_path: Path) -> dict:
    """Everything the tables show, from the saved points alone: each bisection replayed
    (``search_capacity`` over the saved probes), the overload probes at the loads the best
    stock capacity places, each probe's machine load."""
    searches = {(config.name, setting): search_capacity(
        lambda rate, c=config, s=setting: log.saved_load(c.name, s, plan, rate), plan)
        for setting in plan.settings for config in plan.configs if runs_in(config, setting)}
    entries = []
    for setting in plan.settings:
        configs = [c for c in plan.configs if runs_in(c, setting)]
        best = best_stock(plan, searches, setting)
        loads = overload_rates(plan, best[1]) if best else {}
        overload = {name: {c.name: _overload_point(log, c.name, setting, plan, rate)
                           for c in configs}
                    for name, rate in loads.items()}
        entries.append({
            "setting": asdict(setting), "label": setting.label, "slo_mix": setting.slo_mix,
            "configs": [c.name for c in configs],
            "stock": [c.name for c in configs if is_stock(c)],
            "capacity": {c.name: searches[(c.name, setting)] for c in configs},
            "best_stock": None if best is None else {"config": best[0], "capacity_90": best[1]},
            "loads": loads, "overload": overload,
            "machine": {c.name: _machine_summary(_probe_points(log, c.name, setting, plan))
                        for c in configs},
        })
    info = machine_info()
    return {"generated_by": "python -m benchmarks.server.fair_capacity",
            "machine": machine_line(info),
            "plan": plan.to_json(), "points_file": str(relative(points_path)),
            "points": len(log.points), "settings": entries,
            "contended_probes": _contended(log.points)}


def _overload_point(log: ProbeLog, config: str, setting: Setting, plan: Plan,
                    rate: float) -> dict | None:
    try:
        load = log.saved_load(config, setting, plan, rate)
    except NotProbed:
        return None
    bucket, klass = load["worst_prompt_bucket"], load["worst_slo_class"]
    return {"rate": rate, "effective_rps": load["effective_rps"], "attainment": load["attainment"],
            "worst_bucket": bucket["attainment"], "worst_bucket_label": bucket["label"],
            "worst_class": klass["attainment"], "worst_class_label": klass["label"],
            "refused": load["refused"], "requests": load["requests"], "seeds": load["seeds"],
            "max_tpot_p99_ms": load["max_tpot_p99_ms"]}


def _probe_points(log: ProbeLog, config: str, setting: Setting, plan: Plan) -> list[dict]:
    return [p for p in log.points if p.get("config") == config and p.get("mix") == setting.mix
            and p.get("arrivals") == setting.arrivals and p.get("seconds") == plan.seconds
            and p.get("min_requests") == plan.min_requests and p.get("seed") in plan.seeds]


def _machine_summary(points: list[dict]) -> dict:
    """CPU busy (mean over the probes of the mean over CPUs), the highest 1-minute load
    average after a probe, probes with a foreign SGLang server, wall seconds in all."""
    watched = [p["machine_during_run"] for p in points if p.get("machine_during_run")]
    busy = [_mean([cpu["busy_pct"] for cpu in w["cpu"].values()]) for w in watched if w.get("cpu")]
    return {"probes": len(points), "failed": sum("error" in p for p in points),
            "cpu_busy_pct": _mean(busy),
            "load_average_max": max((w["load_average_after"][0] for w in watched), default=None),
            "with_foreign_sglang": sum(bool(w.get("foreign_sglang_servers")) for w in watched),
            "wall_s": sum(p.get("wall_s", 0.0) for p in points)}


def _contended(points: list[dict]) -> list[str]:
    return [f"{p['config']} {p.get('mix')} {p.get('arrivals')} @ {p['rate']:g} seed {p['seed']}"
            for p in points if (p.get("machine_during_run") or {}).get("foreign_sglang_servers")]


def capacity_of(search: dict | None, target: str, measure: str) -> float:
    """A capacity (0 when there is none: not probed, or the lowest probe fails)."""
    if search is None or target not in search["capacity"]:
        return 0.0
    return search["capacity"][target][measure]["capacity"] or 0.0


def render(document: dict) -> str:
    plan = Plan.from_json(document["plan"])
    lines = [
        "# Fair capacity in the real server: FairBatching against stock SGLang at its best", "",
        (f"`{document['generated_by']}` from {document['points']} saved points "
         f"(`{document['points_file']}`); rendered on {document['machine']}."), "",
        EMULATED_CAVEAT, "",
        _method_text(plan), "",
        f"Stock's tuning: {plan.tuning.source}.", "",
        "## Summary: the shipped configuration over the best stock configuration", "",
        ("Each measure divided by the best stock configuration for that measure (any of "
         "them). Overload cells: the effective RPS ratio, then the worst-bucket attainment of "
         f"`{SHIPPED}` against the highest of any stock configuration at that load. The "
         "targets: capacity at 90% >= 1.2x in the worst bucket and the worst class; "
         "overload effective RPS >= 1.2x."), "",
        "| setting | " + " | ".join(_measure_title(t, m) for t in plan.targets for m in MEASURES)
        + " | " + " | ".join(f"overload {share:g}x eff RPS" for share in plan.overloads)
        + " | targets met |",
        "|---" * (2 + len(plan.targets) * len(MEASURES) + len(plan.overloads)) + "|",
    ]
    for entry in document["settings"]:
        lines.append(_summary_row(entry, plan))
    for entry in document["settings"]:
        lines += _setting_table(entry, plan)
    if document["contended_probes"]:
        lines += ["", "**Another SGLang server ran on the machine during:** "
                  + "; ".join(document["contended_probes"]) + " (less CPU: not comparable)."]
    else:
        lines += ["", "No other SGLang server ran on the machine during any probe."]
    return "\n".join(lines) + "\n"


def _method_text(plan: Plan) -> str:
    arrivals = ", ".join(sorted({s.arrivals for s in plan.settings}))
    return (
        "Workload: `benchmarks.server.trace_replay` of the bundled Azure conversation sample "
        f"({arrivals} arrivals; `trace`: its own timestamps rescaled), {plan.seconds:g} s of "
        f"arrivals per run (longer below {plan.min_requests / plan.seconds:g} req/s: at least "
        f"{plan.min_requests} requests), seeds {', '.join(map(str, plan.seeds))} pooled per "
        "probe (every "
        "request of every seed counted once). One class: every request `standard` (TTFT 2 s, "
        f"TPOT 50 ms); three classes: `{CLASS_MIX}` (`configs/slo.toml`). Capacity: the "
        "highest load (req/s) with at least the target share "
        f"({', '.join(f'{t:.0%}' for t in plan.targets)}) of requests on time, every lower "
        f"probed load too, bisected from {plan.start:g} req/s (within {plan.min_rate:g}-"
        f"{plan.max_rate:g}) to {plan.tolerance:.0%} (at most {plan.max_probes} probes; `*`: "
        "the bracket is wider, `>=`: the highest probe met it, `<`: the lowest failed); worst "
        f"bucket / class: the lowest-attainment prompt-length bucket / SLO class of >= "
        f"{MIN_GROUP_REQUESTS} requests (`sglang_ext.sim.capacity`, `sglang_ext.sim.metrics`). "
        "Overload: every configuration at "
        f"{' and '.join(f'{s:g}x' for s in plan.overloads)} the best stock configuration's "
        "overall capacity at 90%. A refused (429), ended (503) or unfinished request is a miss.")


def _measure_title(target: float, measure: str) -> str:
    return f"cap{round(target * 100)} {MEASURE_TITLES[measure]}"


def _summary_row(entry: dict, plan: Plan) -> str:
    width = len(plan.targets) * len(MEASURES) + len(plan.overloads) + 1
    if not entry["capacity"].get(SHIPPED, {}).get("loads"):
        return f"| {entry['label']} | " + " | ".join(["not run"] * width) + " |"
    ratios: dict[str, float | None] = {}
    cells = []
    for target in plan.targets:
        for measure in MEASURES:
            key = f"{target_key(target)} {measure}"
            cells.append(_capacity_ratio(entry, target_key(target), measure, ratios, key))
    for name in plan_load_names(plan):
        cells.append(_overload_ratio(entry, name, ratios))
    return f"| {entry['label']} | " + " | ".join(cells) + f" | {_targets_met(ratios)} |"


def plan_load_names(plan: Plan) -> list[str]:
    return [f"{share:g}x" for share in plan.overloads]


def _capacity_ratio(entry: dict, target: str, measure: str, ratios: dict, key: str) -> str:
    """The shipped configuration's capacity over the best stock one's (into ``ratios``)."""
    capacity = entry["capacity"]
    ours = capacity_of(capacity[SHIPPED], target, measure)
    best = max((capacity_of(capacity[c], target, measure) for c in entry["stock"]), default=0.0)
    ratios[key] = ours / best if best else None
    return _ratio(ours, best)


def _overload_ratio(entry: dict, name: str, ratios: dict) -> str:
    """The shipped configuration's effective RPS over the best stock one's at an overload
    load, and its worst bucket against the highest of any stock configuration's."""
    points = entry["overload"].get(name, {})
    stock = [points[c] for c in entry["stock"] if points.get(c)]
    ours = points.get(SHIPPED)
    if ours is None or not stock:
        ratios[name] = None
        return "-"
    best = max(p["effective_rps"] for p in stock)
    ratios[name] = ours["effective_rps"] / best if best else None
    stock_bucket = max(p["worst_bucket"] or 0 for p in stock)
    return (f"{_ratio(ours['effective_rps'], best)} (worst bucket "
            f"{_share(ours['worst_bucket'])} vs {_share(stock_bucket)})")


def _targets_met(ratios: dict[str, float | None]) -> str:
    """The targets (1.2x the best stock configuration): which hold, which do not, which are
    not measured."""
    checks = {"cap90 worst bucket": ratios.get("0.9 worst_prompt_bucket"),
              "cap90 worst class": ratios.get("0.9 worst_slo_class"),
              **{f"overload {name}": value for name, value in ratios.items() if name.endswith("x")}}
    return "; ".join(f"{name} {'n/a' if value is None else ('yes' if value >= 1.2 else 'no')}"
                     for name, value in checks.items())


def _setting_table(entry: dict, plan: Plan) -> list[str]:
    best = entry["best_stock"]
    loads = entry["loads"]
    place = ("Overload loads not placed: no stock capacity yet." if best is None else
             f"Overload at {' and '.join(f'{rate:g}' for rate in loads.values())} req/s "
             f"({' and '.join(loads)} `{best['config']}`'s overall capacity at 90%, "
             f"{best['capacity_90']:g} req/s).")
    columns = ["config",
               *(f"cap{round(t * 100)} overall / worst bucket / worst class" for t in plan.targets),
               *(f"{name}: eff RPS (worst bucket)" for name in loads),
               "bisection probes", "machine during its probes"]
    lines = ["", f"## {entry['label']}", "", place, "",
             "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for name in entry["configs"]:
        search = entry["capacity"][name]
        cells = [" / ".join(_cap_text(search["capacity"][target_key(t)][m]) for m in MEASURES)
                 for t in plan.targets]
        for load in loads:
            point = entry["overload"][load].get(name)
            cells.append("-" if point is None else
                         f"{point['effective_rps']:.2f} ({_share(point['worst_bucket'])} "
                         f"`{point['worst_bucket_label']}`)")
        probes = len(search["loads"]) if search["loads"] else "not run"
        if search["loads"] and not search["complete"]:
            probes = f"{probes} (incomplete)"
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {probes} | "
                     f"{_machine_text(entry['machine'][name])} |")
    return lines


def _cap_text(entry: dict) -> str:
    text = capacity_text(entry)
    return text + ("" if entry.get("resolved", True) or text == "n/a" else "*")


def _machine_text(summary: dict) -> str:
    if not summary["probes"]:
        return "-"
    busy = "-" if summary["cpu_busy_pct"] is None else f"{summary['cpu_busy_pct']:.0f}%"
    load = "-" if summary["load_average_max"] is None else f"{summary['load_average_max']:.1f}"
    text = f"CPU busy {busy}, load avg <= {load}, {summary['wall_s'] / 60:.0f} min"
    if summary["with_foreign_sglang"]:
        text += f", **{summary['with_foreign_sglang']} with another SGLang server**"
    if summary["failed"]:
        text += f", {summary['failed']} failed"
    return text


def _mean(values: Sequence[float | None]) -> float | None:
    numbers = [v for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
    return sum(numbers) / len(numbers) if numbers else None


# ------------------------------------------------------------------ the estimate
def estimate(plan: Plan, selected: set[str]) -> dict:
    """At most how many probes and launches the selected configurations need, and how long
    that takes at ``PROBE_OVERHEAD_S`` per run besides its arrivals (nothing saved)."""
    configs = [c for c in plan.configs if c.name in selected]
    bisections = sum(len(plan.settings_of(c)) for c in configs)
    overloads = bisections * len(plan.overloads)
    stock = [c for c in configs if is_stock(c)]
    launches = len(configs) + max(0, len(stock) - 1)
    run_s = plan.seconds + PROBE_OVERHEAD_S
    probe_s = run_s * len(plan.seeds)
    worst = (bisections * plan.max_probes + overloads) * probe_s + launches * LAUNCH_S
    return {"bisections": bisections, "max_probes": bisections * plan.max_probes,
            "overload_probes": overloads, "launches": launches, "seconds_per_probe": probe_s,
            "at_most_s": worst}


def estimate_text(plan: Plan, selected: set[str]) -> str:
    e = estimate(plan, selected)
    return (f"{e['bisections']} bisections of at most {plan.max_probes} probes, "
            f"{e['overload_probes']} overload probes, {e['launches']} launches; "
            f"about {e['seconds_per_probe']:.0f} s a probe ({len(plan.seeds)} seed(s) x "
            f"({plan.seconds:g} s + ~{PROBE_OVERHEAD_S:g} s); longer below "
            f"{plan.min_requests / plan.seconds:g} req/s): at most {_duration(e['at_most_s'])} "
            "(a bisection may stop before its limit)")


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


# ------------------------------------------------------------------ main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.server.fair_capacity",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)),
                        help="replay seeds pooled per probe")
    parser.add_argument("--arrivals", default=",".join(ARRIVALS),
                        help="trace_replay --arrivals values, comma-separated (gamma:4, trace)")
    parser.add_argument("--mixes", default="one,three", help="class settings: one, three or both")
    parser.add_argument("--seconds", type=float, default=SECONDS,
                        help="seconds of arrivals per run")
    parser.add_argument("--min-requests", type=int, default=MIN_REQUESTS,
                        help="a run lasts at least as long as this many requests take to arrive")
    parser.add_argument("--targets", default=",".join(f"{t:g}" for t in TARGETS))
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument("--max-probes", type=int, default=MAX_PROBES, help="per bisection")
    parser.add_argument("--start", type=float, default=START_RATE, help="a bisection's first rate")
    parser.add_argument("--min-rate", type=float, default=MIN_RATE, help="the lowest rate probed")
    parser.add_argument("--max-rate", type=float, default=MAX_RATE, help="the highest rate probed")
    parser.add_argument("--overloads", default=",".join(f"{s:g}" for s in OVERLOADS),
                        help="shares of the best stock capacity at 90%%")
    parser.add_argument("--queue-limits", default="", help="queue limits to add to stock's best")
    parser.add_argument("--priority-on", choices=PRIORITY_BASES, default="queue",
                        help="priority scheduling on stock's best queue limit or its timeout")
    parser.add_argument("--configs", help="comma-separated configurations to run (default: all)")
    parser.add_argument("--raw", type=Path, default=RAW, help="points.jsonl, logs and the plan")
    parser.add_argument("--out", type=Path, default=DOCS_BENCH, help=f"where {STEM}.md/.json go")
    parser.add_argument("--resume", action="store_true", help="keep the saved points, run the rest")
    parser.add_argument("--render-only", action="store_true",
                        help="run nothing; render the saved points with the saved plan")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and its duration")
    parser.add_argument("--quiet-wait", type=float, default=600.0,
                        help="seconds to wait for other SGLang servers to stop before each run")
    return parser.parse_args(argv)


def plan_from_args(args: argparse.Namespace) -> Plan:
    mixes = {"one": ONE_CLASS, "three": THREE_CLASSES}
    settings = tuple(Setting(mixes[m.strip()], a.strip()) for m in args.mixes.split(",")
                     for a in args.arrivals.split(","))
    tuning = stock_tuning(adm.load_points())
    extra = tuple(int(q) for q in args.queue_limits.split(",") if q.strip())
    return Plan(settings, tuple(int(s) for s in args.seeds.split(",")), args.seconds,
                args.min_requests, tuple(float(t) for t in args.targets.split(",")),
                args.tolerance, args.max_probes, args.start, args.min_rate, args.max_rate,
                tuple(float(s) for s in args.overloads.split(",")),
                configurations(tuning, extra, args.priority_on), tuning)


def selected_configs(plan: Plan, names: str | None) -> set[str]:
    known = [c.name for c in plan.configs]
    if names is None:
        return set(known)
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = wanted - set(known)
    if unknown:
        raise SystemExit(f"unknown configurations {sorted(unknown)}; known: {', '.join(known)}")
    return wanted


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(REPO)
    points_path, plan_path = args.raw / "points.jsonl", args.raw / PLAN_FILE
    if args.render_only:
        if not plan_path.is_file():
            raise SystemExit(f"{plan_path}: no saved plan (nothing run with --raw {args.raw})")
        plan = Plan.from_json(json.loads(plan_path.read_text()))
    else:
        plan = plan_from_args(args)
        selected = selected_configs(plan, args.configs)
        print(f"plan: {estimate_text(plan, selected)}; stock's tuning: {plan.tuning.source}",
              file=sys.stderr)
        if args.dry_run:
            return 0
        args.raw.mkdir(parents=True, exist_ok=True)
        if not args.resume and (moved := move_aside(points_path)) is not None:
            print(f"earlier points moved to {moved} (--resume keeps them)", file=sys.stderr)
        plan_path.write_text(json.dumps(plan.to_json(), indent=1) + "\n")
        from sglang_ext.adapter.emulated_gpu.tiny_model import write_tiny_model

        model_dir = relative(write_tiny_model(args.raw / "tiny-model"))
        bench = Bench(plan, args.raw, model_dir, args.quiet_wait)
        run_benchmark(bench, ProbeLog(points_path), selected)
    document = build_document(plan, ProbeLog(points_path), points_path)
    text = render(document)
    print(text)
    write_outputs(args.out, STEM, text, document)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
