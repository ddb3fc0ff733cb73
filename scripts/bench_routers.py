"""Benchmark: SGLang's own router (smg, the SGLang Model Gateway) against this project's
control-plane daemon, routing the same open-loop workloads to the same two SGLang servers.

Two stock ``python -m sglang.launch_server`` servers run on the emulated GPU (profile
``llama3.1-8b-h100``, step times x2) with FairBatching on (the shipped
``configs/fairbatching.toml``, step model scaled like the GPU) and join one control-plane
daemon as ranks ``bench-a/0`` and ``bench-b/0``. In front of them, in turn (every router
at one rate before the next rate, so the machine's drift touches all alike):

* ``smg-rr``       -- ``smg launch --policy round_robin`` (smg 1.13, its other defaults);
* ``smg-ca``       -- ``smg launch --policy cache_aware`` with ``--max-concurrent-requests C
  --queue-size Q --queue-timeout-secs 2`` (the TTFT target: a request queued longer has
  missed it), C and Q swept per workload at its top rate until the best goodput is interior
  to the grid (coordinate sweep: C at a fixed Q, then Q at the best C, each grid doubled
  or halved at an edge, at most ``MAX_EXTENSIONS`` times; ``Bench.sweep``), plus the fixed
  flags of ``SMG_CA_EXTRA`` (worker overload protection and the warm-up slice off; why:
  beside it);
* ``cp-default``   -- the daemon with its default balancer (``pab_least_loaded``) behind its
  OpenAI gateway (``fairbatching-controlplane gateway``);
* ``cp-pab``       -- the daemon with ``policy = "pab"`` (restarted between the two).

smg talks HTTP to the servers' ports; the daemon reaches them through their control-plane
ingress (ZeroMQ). Every request is ``POST /v1/completions``, streamed, with a text prompt
(single-token words of the tiny model's tokenizer, so a prompt of N words is N tokens),
``ignore_eos`` and the SLO of ``configs/slo.toml``'s ``standard`` class in
``custom_params`` (TTFT 2000 ms, TPOT 50 ms; also the servers' default class).

Workloads (Poisson arrivals, fixed seed; the same requests through every router):

* ``azure``  -- the first ``rate x seconds`` requests of the bundled Azure conversation
  sample (``sglang_ext/data/azure_conv_sample.csv``; prompt and output lengths as recorded,
  prompts capped at 6144 tokens for the tiny model's 8192 context), as
  ``scripts/bench_sglang.py``'s replay uses it, with fresh Poisson arrival times (the
  simulator's ``Workload.with_arrivals``); prompts distinct per request (no prefix reuse).
* ``prefix`` -- shared prefixes: each request is one of ``PREFIXES`` long system prompts
  (``PREFIX_TOKENS`` tokens, drawn uniformly) followed by a short unique suffix; its prefix
  is in a server's radix cache only if that server served it recently. The prefixes
  (24 x 4096 tokens) do not fit one server's KV pool (``KV_TOKENS``) but half of them do:
  a router that keeps each prefix on one server computes each prefill once.

Metrics per (workload, router, rate): goodput = rate x SLO attainment (a request meets the
SLO when it completes all its tokens with TTFT <= 2000 ms and TPOT <= 50 ms; TPOT per
request = (last token - first token) / (tokens - 1), a mean, as in
``sglang.benchmark.serving``; failures, 429s and timeouts are misses); TTFT/TPOT
percentiles over completed requests; the prefill tokens the servers actually computed
(from the emulated GPU's step log) over the prompt tokens sent; the router's CPU seconds
per 1000 requests (``/proc/<pid>/stat`` utime+stime over the run; smg: its one process;
the daemon: daemon + gateway processes; the SGLang servers' CPU beside it); and the
router's added latency: a sequential probe before each run (``PROBES`` 32-token prompts,
2 output tokens, alternately through the router and straight to a server) whose
TTFT median through the router minus the median direct is the router's cost unloaded.

Every finished run is appended to ``out/bench_routers/points.jsonl`` (raw logs beside it);
``docs/bench/routers.md`` and ``routers.json`` are rendered from the points::

    scripts/bench_routers.sh                  # the full run (about 40 min on 2 vCPUs)
    scripts/bench_routers.sh --quick          # one rate per workload, 12 s runs, 3-point sweep (~8 min)
    scripts/bench_routers.sh --render-only    # re-render docs/bench/routers.* from the points
    scripts/bench_routers.sh --workloads prefix --azure-rates 6 --prefix-rates 8,12

The daemon and the servers run in this project's SGLang environment; smg in its own small
one (``FB_EXTRAS=bench-router``; ``--smg PATH`` or ``$FB_SMG`` names its executable).

A server that dies mid-run (a FairBatching scheduler assertion was seen under KV pressure)
is recorded with that run's point (``server_died``, marked in the tables) and the servers
and the daemon are restarted before the next run. One seed per point: near a router's
knee, repeated runs of one configuration differ a lot on this shared machine (see the
page's sweep tables), so read single points with care.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))  # this checkout's packages, whatever the environment's install points at
from bench_points import append_point, git_state, load_points, move_aside  # noqa: E402

PROFILE = "llama3.1-8b-h100"
TIME_SCALE = 2.0
KV_TOKENS = 65_536  # per server: holds half of the shared prefixes with room to run, not all
MAX_PREFILL_TOKENS = 16_384
SERVER_ARGS = ("--max-total-tokens", str(KV_TOKENS), "--max-prefill-tokens", str(MAX_PREFILL_TOKENS))
SLO = {"ttft_ms": 2000, "tpot_ms": 50}  # configs/slo.toml's "standard" class (the default)
MAX_CONTEXT = 8192  # the tiny model's
AZURE_MAX_PROMPT = 6144
CONTEXT_MARGIN = 64

PREFIXES = 24
PREFIX_TOKENS = 4096
SUFFIX_TOKENS = (64, 192)  # uniform, inclusive
PREFIX_OUTPUT_TOKENS = (32, 128)

WORKLOADS = ("azure", "prefix")
DEFAULT_RATES = {"azure": (6.0, 9.0, 12.0), "prefix": (8.0, 13.0, 18.0)}
QUICK_RATES = {"azure": (9.0,), "prefix": (13.0,)}
DEFAULT_SECONDS = 30.0
QUICK_SECONDS = 12.0
SEED = 0
REQUEST_TIMEOUT_S = 60.0
PROBES = 16
PROBE_PROMPT_TOKENS = 32
PROBE_OUTPUT_TOKENS = 2

#: cache_aware's fixed tuning besides the swept limits. Worker overload protection (on by
#: default: a worker with >= 8 waiting requests or >= 0.8 KV usage is left out of routing)
#: breaks prefix affinity here, where the cached prefixes themselves fill most of a server's
#: KV: measured at 12 req/s on the prefix workload (C=64, Q=16), 40% of the prompt tokens
#: were computed and goodput was 5.9-7.6 req/s with it, 12% and 12.0 req/s without.
#: smg restarts for every run (its prefix tree must match the servers' flushed caches), so
#: its warm-up slice (the first 60 s of a worker: one cache miss in four and one hit in
#: eight go to a "thin" worker) is off: cache_aware runs in its steady state.
SMG_CA_EXTRA = ("--disable-worker-overload-protection", "--worker-warmup-secs", "0")
SMG_QUEUE_TIMEOUT_S = 2  # = the TTFT target (whole seconds: smg's flag is an integer)
SWEEP_CONCURRENCY = (16, 32, 64, 128)
SWEEP_QUEUE = (4, 16, 64)
SWEEP_QUEUE_AT = 16  # the queue size while the concurrency limit is swept
QUICK_SWEEP_CONCURRENCY = (16, 64, 256)
QUICK_SWEEP_QUEUE: tuple[int, ...] = ()
MAX_EXTENSIONS = 3  # per swept dimension

ROUTERS = ("smg-rr", "smg-ca", "cp-default", "cp-pab")
DAEMON_POLICY = {"cp-default": None, "cp-pab": "pab"}  # None: the daemon's default

RAW_ROOT = REPO / "out" / "bench_routers"
DEFAULT_POINTS = RAW_ROOT / "points.jsonl"
DEFAULT_OUT = REPO / "docs" / "bench"


# ====================================================================== workloads (pure)
@dataclass(frozen=True)
class Request:
    index: int
    at_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_id: int | None = None  # shared-prefix group (prefix workload)
    prefix_tokens: int = 0


def poisson_times(rate: float, n: int, seed: int) -> list[float]:
    """``n`` Poisson arrival times at ``rate`` req/s, the first at 0 (seeded)."""
    if rate <= 0 or n < 0:
        raise ValueError("rate must be > 0 and n >= 0")
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(n):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def request_count(rate: float, seconds: float) -> int:
    return max(1, round(rate * seconds))


def azure_requests(rate: float, seconds: float, seed: int, lengths: Sequence[tuple[int, int]],
                   max_prompt: int = AZURE_MAX_PROMPT, max_context: int = MAX_CONTEXT) -> list[Request]:
    """The first ``rate x seconds`` (prompt, output) pairs of ``lengths`` (trace order) at
    Poisson times; prompts capped at ``max_prompt``, outputs so that both fit the context."""
    n = request_count(rate, seconds)
    if n > len(lengths):
        raise ValueError(f"{n} requests asked, the trace has {len(lengths)}")
    requests = []
    for index, (at, (prompt, output)) in enumerate(zip(poisson_times(rate, n, seed), lengths)):
        prompt = max(1, min(prompt, max_prompt))
        output = max(1, min(output, max_context - prompt - CONTEXT_MARGIN))
        requests.append(Request(index, at, prompt, output))
    return requests


def prefix_requests(rate: float, seconds: float, seed: int, prefixes: int = PREFIXES,
                    prefix_tokens: int = PREFIX_TOKENS, suffix: tuple[int, int] = SUFFIX_TOKENS,
                    output: tuple[int, int] = PREFIX_OUTPUT_TOKENS) -> list[Request]:
    """``rate x seconds`` requests at Poisson times, each one of ``prefixes`` shared prefixes
    (uniform) plus a unique suffix; lengths uniform in the inclusive ranges."""
    n = request_count(rate, seconds)
    rng = random.Random(f"prefix-workload-{seed}")
    requests = []
    for index, at in enumerate(poisson_times(rate, n, seed)):
        group = rng.randrange(prefixes)
        tail = rng.randint(*suffix)
        requests.append(Request(index, at, prefix_tokens + tail, rng.randint(*output), group, prefix_tokens))
    return requests


def words_text(rng: random.Random, words: Sequence[str], n: int) -> str:
    return " ".join(rng.choices(words, k=n))


def prompt_text(request: Request, words: Sequence[str], seed: int) -> str:
    """The request's prompt: its shared prefix (the same text for every request of the
    group, seeded by the group) then words unique to the request. With single-token words,
    N words are N tokens (the first may take two)."""
    own = words_text(random.Random(f"request-{seed}-{request.index}"), words,
                     request.prompt_tokens - request.prefix_tokens)
    if request.prefix_id is None:
        return own
    prefix = words_text(random.Random(f"prefix-{seed}-{request.prefix_id}"), words, request.prefix_tokens)
    return f"{prefix} {own}" if own else prefix


def single_token_words(tokenizer_json: Path) -> list[str]:
    """Alphabetic words that the tokenizer encodes, with their leading space, as one token."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    words = sorted(t[1:] for t in tokenizer.get_vocab() if t.startswith("Ġ") and t[1:].isalpha())
    return [w for w in words if len(tokenizer.encode(" " + w).ids) == 1]


def chars_per_token(words: Sequence[str]) -> float:
    """Mean characters per token of text made of ``words`` (each one token, plus a space)."""
    return sum(len(w) + 1 for w in words) / len(words)


def workload_requests(workload: str, rate: float, seconds: float, seed: int,
                      azure_lengths: Sequence[tuple[int, int]] | None = None) -> list[Request]:
    if workload == "azure":
        if azure_lengths is None:
            azure_lengths = bundled_azure_lengths()
        return azure_requests(rate, seconds, seed, azure_lengths)
    if workload == "prefix":
        return prefix_requests(rate, seconds, seed)
    raise ValueError(f"unknown workload {workload!r}")


def bundled_azure_lengths() -> list[tuple[int, int]]:
    from sglang_ext.sim.workloads import bundled_sample

    return [(r.prompt_tokens, r.output_tokens) for r in bundled_sample().requests]


# ====================================================================== metrics (pure)
@dataclass
class Record:
    """What the client saw of one request (times in seconds from the run's start)."""

    index: int
    sent_s: float
    expected_tokens: int
    status: int | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    completion_tokens: int = 0
    events: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return (self.status == 200 and self.error is None and self.first_token_s is not None
                and self.completion_tokens >= self.expected_tokens)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.first_token_s is None or self.last_token_s is None or self.completion_tokens < 2:
            return None
        return (self.last_token_s - self.first_token_s) / (self.completion_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.last_token_s is None else self.last_token_s - self.sent_s


def meets_slo(record: Record, slo: dict = SLO) -> bool:
    if not record.ok:
        return False
    ttft, tpot = record.ttft_s, record.tpot_s
    return ttft is not None and ttft * 1000 <= slo["ttft_ms"] and (tpot is None or tpot * 1000 <= slo["tpot_ms"])


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _pcts_ms(values: Sequence[float]) -> dict:
    return {f"p{q}": None if (v := percentile(values, q)) is None else round(v * 1000, 2)
            for q in (50, 90, 99)}


def summarize(records: Sequence[Record], rate: float, slo: dict = SLO) -> dict:
    """Goodput (rate x attainment) and the latency percentiles of one run."""
    n = len(records)
    good = sum(meets_slo(r, slo) for r in records)
    done = [r for r in records if r.ok]
    statuses: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = str(r.status) if r.error is None else f"{r.status}:{r.error.split(':')[0]}"
            statuses[key] = statuses.get(key, 0) + 1
    attainment = good / n if n else 0.0
    return {
        "requests": n, "completed": len(done), "good": good, "failed": n - len(done),
        "failures": statuses, "attainment": round(attainment, 4),
        "goodput": round(rate * attainment, 3),
        "ttft_ms": _pcts_ms([r.ttft_s for r in done]),
        "tpot_ms": _pcts_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "e2e_ms": _pcts_ms([r.e2e_s for r in done]),
        "ttft_attainment": round(sum(r.ttft_s * 1000 <= slo["ttft_ms"] for r in done) / n, 4) if n else 0.0,
    }


def added_latency(router_ttfts: Sequence[float], direct_ttfts: Sequence[float]) -> dict | None:
    """The router's added TTFT: median through it minus median direct (ms)."""
    if not router_ttfts or not direct_ttfts:
        return None
    via, direct = percentile(router_ttfts, 50), percentile(direct_ttfts, 50)
    return {"router_ms": round(via * 1000, 2), "direct_ms": round(direct * 1000, 2),
            "added_ms": round((via - direct) * 1000, 2), "n": min(len(router_ttfts), len(direct_ttfts))}


def prefill_summary(sent: int, served: int, computed: int) -> dict:
    """Prompt tokens the servers computed over those of the requests they accepted (HTTP
    200: a request a router refused never reached them)."""
    return {"prompt_tokens": sent, "served_prompt_tokens": served, "computed_tokens": computed,
            "computed_fraction": round(computed / served, 4) if served else None}


def cpu_per_1000(cpu_s: float, requests: int) -> float | None:
    return None if requests <= 0 else round(cpu_s / requests * 1000, 2)


# ====================================================================== the sweep (pure)
def pick_best(points: Sequence[dict], key: str) -> dict:
    """The best of ``points`` (each with ``key`` = the swept value, ``good`` and
    ``ttft_p99``): the most good requests; among ties an interior value first (a flat top
    reaching the grid's inside is not an edge optimum), then the lowest TTFT p99."""
    if not points:
        raise ValueError("no points")
    values = sorted(p[key] for p in points)
    top = max(p["good"] for p in points)
    tied = [p for p in points if p["good"] == top]
    interior = [p for p in tied if values[0] < p[key] < values[-1]]
    pool = interior or tied
    return min(pool, key=lambda p: (math.inf if p.get("ttft_p99") is None else p["ttft_p99"], p[key]))


def edge_extension(grid: Sequence[int], best: int, lower_bound: int = 0) -> int | None:
    """The value to add to ``grid`` so that ``best`` can become interior: twice the highest
    when ``best`` is the highest, half the lowest (not below ``lower_bound``) when it is the
    lowest; None when ``best`` is interior or already at ``lower_bound``."""
    values = sorted(set(grid))
    if best not in values:
        raise ValueError(f"{best} is not in the grid {values}")
    if best == values[-1]:
        return best * 2 if best > 0 else 1
    if best == values[0]:
        if best <= lower_bound:
            return None
        lower = max(lower_bound, best // 2)
        return None if lower in values else lower
    return None


def sweep_verdict(grid: Sequence[int], best: int, lower_bound: int = 0) -> str:
    """``interior``, ``at the lower bound`` (nothing lower exists), or ``edge``."""
    values = sorted(set(grid))
    if values[0] < best < values[-1]:
        return "interior"
    if best == values[0] and best <= lower_bound and best < values[-1]:
        return f"at the lower bound ({lower_bound})"
    return "edge"


# ====================================================================== rendering (pure)
def _fmt(value, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and digits == 0 and value >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else str(value)


def router_label(point: dict) -> str:
    router = point["router"]
    if router == "smg-ca":
        limits = point.get("limits") or {}
        return f"smg-ca (C={limits.get('max_concurrent')}, Q={limits.get('queue_size')})"
    return router


def main_points(points: Iterable[dict]) -> list[dict]:
    """The points of the comparison table: every router's at every rate (the tuned smg-ca
    point per workload; the last saved point per key)."""
    points = list(points)
    tuned = tuned_limits(points)
    at_rate = rate_tuned_limits(points)
    chosen: dict[tuple, dict] = {}
    for p in points:
        if "error" in p or "result" not in p:
            continue
        if p["router"] == "smg-ca":
            best = at_rate.get((p["workload"], p["rate"]), tuned.get(p["workload"]))
            if best is None or (p["limits"]["max_concurrent"], p["limits"]["queue_size"]) != best:
                continue
        chosen[(p["workload"], p["rate"], p["router"])] = p
    order = {r: i for i, r in enumerate(ROUTERS)}
    return sorted(chosen.values(), key=lambda p: (WORKLOADS.index(p["workload"]) if p["workload"] in WORKLOADS
                                                  else 99, p["rate"], order.get(p["router"], 99)))


def sweep_points(points: Iterable[dict], workload: str) -> list[dict]:
    chosen: dict[tuple, dict] = {}
    for p in points:
        if p.get("workload") == workload and p.get("router") == "smg-ca" and p.get("phase") in ("sweep", "rate-sweep") \
                and "result" in p:
            chosen[(p["rate"], p["limits"]["max_concurrent"], p["limits"]["queue_size"])] = p
    return list(chosen.values())


def tuned_limits(points: Iterable[dict]) -> dict[str, tuple[int, int]]:
    """Per workload, the (concurrency, queue) the last sweep chose (saved with its points)."""
    return {w: tuple(t["limits"]) for w, t in tuned_records(points).items()}


def rate_tuned_limits(points: Iterable[dict]) -> dict[tuple[str, float], tuple[int, int]]:
    """Per (workload, rate), the limits a per-rate concurrency sweep chose, where one ran."""
    return {(p["workload"], p["rate"]): tuple(p["rate_tuned"]["limits"]) for p in points
            if p.get("router") == "smg-ca" and p.get("rate_tuned") is not None}


def tuned_records(points: Iterable[dict]) -> dict[str, dict]:
    tuned = {}
    for p in points:
        if p.get("router") == "smg-ca" and p.get("tuned") is not None:
            tuned[p["workload"]] = p["tuned"]
    return tuned


def sweep_summary(points: Sequence[dict], workload: str) -> dict | None:
    """The sweep's points, its choice and whether it is interior in each swept dimension."""
    sweep = sweep_points(points, workload)
    if not sweep:
        return None
    tuned = tuned_records(points).get(workload) or {}
    rows = [{"max_concurrent": p["limits"]["max_concurrent"], "queue_size": p["limits"]["queue_size"],
             "rate": p["rate"], "good": p["result"]["good"], "goodput": p["result"]["goodput"],
             "attainment": p["result"]["attainment"], "ttft_p99": p["result"]["ttft_ms"]["p99"],
             "tpot_p99": p["result"]["tpot_ms"]["p99"], "failed": p["result"]["failed"],
             "server_died": bool(p.get("server_died"))} for p in sweep]
    rows.sort(key=lambda r: (-r["rate"], r["queue_size"], r["max_concurrent"]))
    per_rate = {f"{p['rate']:g}": p["rate_tuned"] for p in points
                if p.get("workload") == workload and p.get("router") == "smg-ca" and p.get("rate_tuned")}
    return {"rate": tuned.get("rate", rows[0]["rate"]), "points": rows, "best": tuned.get("limits"),
            "grids": {k: tuned.get(k) for k in ("concurrency_grid", "queue_grid", "queue_during_concurrency")},
            "verdicts": tuned.get("verdicts", {}), "per_rate": per_rate}


def probe_summary(points: Iterable[dict]) -> dict[str, dict]:
    """Per router, the added latency over every probe it had (pooled medians)."""
    pooled: dict[str, tuple[list, list]] = {}
    for p in points:
        probe = p.get("probe")
        if not probe:
            continue
        via, direct = pooled.setdefault(p["router"], ([], []))
        via.extend(probe.get("router_ttft_s", []))
        direct.extend(probe.get("direct_ttft_s", []))
    return {router: added_latency(via, direct) for router, (via, direct) in pooled.items()}


def cpu_summary(points: Iterable[dict]) -> dict[str, dict[str, float | None]]:
    """Per workload and router: router CPU s per 1000 requests, summed over its runs."""
    sums: dict[tuple, list[float]] = {}
    for p in main_points(points):
        cpu = p.get("cpu") or {}
        entry = sums.setdefault((p["workload"], p["router"]), [0.0, 0, 0.0])
        entry[0] += cpu.get("router_s", 0.0)
        entry[1] += p["result"]["requests"]
        entry[2] += cpu.get("servers_s", 0.0)
    out: dict[str, dict] = {}
    for (workload, router), (cpu_s, n, servers) in sums.items():
        out.setdefault(workload, {})[router] = {"router_s_per_1000": cpu_per_1000(cpu_s, n),
                                                "servers_s_per_1000": cpu_per_1000(servers, n)}
    return out


SIDES = {"smg": ("smg", "the daemon"), "cp": ("the daemon", "smg")}
WIN_MARGIN = 0.03  # goodputs within 3% are a tie (one seed per point; see the sweep tables' spread)


def wins(points: Sequence[dict], side: str) -> list[str]:
    """Plain sentences: where the best configuration of ``side`` ("smg" or "cp", the
    daemon) has more goodput than the best of the other (by more than ``WIN_MARGIN``); at a
    goodput tie, a TTFT p99 at most 2/3 of the other's; a lower added latency (every
    configuration of one side below every one of the other); less router CPU."""
    other = "cp" if side == "smg" else "smg"
    name, other_name = SIDES[side]
    lines = []
    by_cell: dict[tuple, dict[str, dict]] = {}
    for p in main_points(points):
        by_cell.setdefault((p["workload"], p["rate"]), {})[p["router"]] = p
    order = lambda kv: (WORKLOADS.index(kv[0][0]) if kv[0][0] in WORKLOADS else 99, kv[0][1])  # noqa: E731
    for (workload, rate), cell in sorted(by_cell.items(), key=order):
        mine = [p for r, p in cell.items() if r.startswith(side)]
        theirs = [p for r, p in cell.items() if r.startswith(other)]
        if not mine or not theirs:
            continue
        best = max(mine, key=lambda p: p["result"]["goodput"])
        rival = max(theirs, key=lambda p: p["result"]["goodput"])
        g, h = best["result"]["goodput"], rival["result"]["goodput"]
        if g > h * (1 + WIN_MARGIN):
            ratio = f"{g / h:.2f}x" if h else "the other serves nothing in its SLO"
            lines.append(f"goodput, {workload} at {rate:g} req/s: {g:.2f} ({best['router']}) against "
                         f"{h:.2f} ({rival['router']}), {ratio}")
        elif g >= h / (1 + WIN_MARGIN):  # a goodput tie: the tail TTFT among the tied
            top = max(g, h)
            tied = lambda ps: [p for p in ps if p["result"]["goodput"] >= top / (1 + WIN_MARGIN)  # noqa: E731
                               and p["result"]["ttft_ms"]["p99"] is not None]
            a, b = tied(mine), tied(theirs)
            if a and b:
                fa = min(a, key=lambda p: p["result"]["ttft_ms"]["p99"])
                fb = min(b, key=lambda p: p["result"]["ttft_ms"]["p99"])
                ta, tb = fa["result"]["ttft_ms"]["p99"], fb["result"]["ttft_ms"]["p99"]
                if ta * 1.5 <= tb:
                    lines.append(f"TTFT p99 at equal goodput (within {100 * WIN_MARGIN:.0f}%), {workload} at "
                                 f"{rate:g} req/s: {ta:.0f} ms ({fa['router']}) against {tb:.0f} ms ({fb['router']})")
    probes = probe_summary(points)
    mine_lat = [v["added_ms"] for r, v in probes.items() if r.startswith(side) and v]
    their_lat = [v["added_ms"] for r, v in probes.items() if r.startswith(other) and v]
    if mine_lat and their_lat and max(mine_lat) + 0.5 < min(their_lat):  # 0.5 ms: below that, a tie
        lines.append(f"added latency (unloaded): {max(mine_lat):.1f} ms or less through {name} against "
                     f"{min(their_lat):.1f} ms or more through {other_name}")
    for workload, routers in cpu_summary(points).items():
        m = [v["router_s_per_1000"] for r, v in routers.items() if r.startswith(side) and v["router_s_per_1000"]]
        t = [v["router_s_per_1000"] for r, v in routers.items() if r.startswith(other) and v["router_s_per_1000"]]
        if m and t and max(m) < min(t):
            lines.append(f"router CPU, {workload}: {max(m):.1f} s per 1000 requests or less for {name} "
                         f"against {min(t):.1f} s or more for {other_name} ({min(t) / max(m):.1f}x)")
    return lines


def smg_wins(points: Sequence[dict]) -> list[str]:
    return wins(points, "smg")


def auto_notes(points: Sequence[dict]) -> list[str]:
    """Notes the points call for: server crashes, the machine's load."""
    notes = []
    died = [p for p in points if p.get("server_died") and "result" in p]
    if died:
        seen = sorted({f"{p['workload']} at {p['rate']:g} req/s through {router_label(p)}" for p in died})
        first = next(iter(died[0]["server_died"].values()))
        notes.append(f"A FairBatching server crashed in {len(seen)} run(s) ({'; '.join(seen)}); "
                     f"its requests failed and the stack was restarted for the next run. Log: `{first[:400]}`")
    loads = [p["machine_during_run"]["load_average_after"][0] for p in points
             if p.get("machine_during_run")]
    if loads:
        notes.append(f"1-minute load average after each run: {min(loads):.1f}-{max(loads):.1f} "
                     f"(median {percentile(loads, 50):.1f}) on {os.cpu_count()} vCPUs.")
    return notes


def provenance_text(points: Sequence[dict], meta: dict) -> str:
    """The commits the points were measured at, with counts (a run may span a commit)."""
    counts: dict[str, int] = {}
    for p in points:
        if "result" in p and p.get("commit"):
            label = p["commit"] + (" + uncommitted changes" if p.get("dirty") else "")
            counts[label] = counts.get(label, 0) + 1
    if not counts:
        git = meta.get("git", {})
        return f"{git.get('commit', '?')}{' + uncommitted changes' if git.get('dirty') else ''}"
    return ", ".join(f"{c} ({n} points)" if len(counts) > 1 else c for c, n in counts.items())


def router_commands(points: Sequence[dict], commands: Sequence[str]) -> list[str]:
    """The run's command lines, then each router's as the comparison ran it."""
    lines = [c for c in commands if not c.startswith(tuple(f"# {r}:" for r in ROUTERS))]
    seen = set()
    for p in main_points(points):
        if p.get("command") and p["router"] not in seen:
            seen.add(p["router"])
            note = "  # C and Q per workload and rate: the tables" if p["router"] == "smg-ca" else ""
            lines.append(f"# {p['router']}: {p['command']}{note}")
    return lines


def render_markdown(points: Sequence[dict], meta: dict) -> str:
    rows = main_points(points)
    lines = [
        "# SGLang's router (smg) against the control-plane daemon, on the emulated GPU",
        "",
        "Generated by `scripts/bench_routers.py` from `out/bench_routers/points.jsonl`; do not edit.",
        "Method, workloads and metric definitions: the script's docstring.",
        "",
        f"- Points measured at commit {provenance_text(points, meta)}, from {meta.get('started', '?')}; "
        f"smg {meta.get('smg_version', '?')}, SGLang {meta.get('sglang_version', '?')}.",
        f"- **Machine caveats**: {meta.get('machine', '?')}. Two SGLang servers, the router, the "
        "load generator and other jobs share these cores; the GPU is emulated "
        f"(`{PROFILE}`, step times x{TIME_SCALE:g}: only model execution is replaced, SGLang's "
        "HTTP server, tokenizer, scheduler and radix cache are real). One seed per point. "
        "Latencies include this CPU contention; compare routers with each other, not with a real GPU.",
        f"- Servers: {' '.join(SERVER_ARGS)}, FairBatching on (shipped config), both ranks of one daemon.",
        f"- SLO: TTFT {SLO['ttft_ms']} ms, TPOT {SLO['tpot_ms']} ms (mean per request); goodput = rate x "
        "attainment (req/s); failures (429, 5xx, timeouts at "
        f"{REQUEST_TIMEOUT_S:g} s) are misses.",
        f"- Runs: {meta.get('seconds', '?')} s of Poisson arrivals (seed {SEED}) per point, "
        "the servers' prefix caches flushed before each, every router at a rate before the next rate.",
        "- Routers: `smg-rr` = smg `--policy round_robin`, its defaults; `smg-ca` = `--policy "
        f"cache_aware {' '.join(SMG_CA_EXTRA)}` with `--max-concurrent-requests C --queue-size Q "
        f"--queue-timeout-secs {SMG_QUEUE_TIMEOUT_S}`, C and Q swept (below); `cp-default` / `cp-pab` = "
        "the daemon (`pab_least_loaded` / `pab`, other keys default but `chars_per_token = "
        f"{meta.get('chars_per_token', '?')}`, this text's) behind its gateway. smg restarts for every run.",
        "- *prefill computed*: prompt tokens the servers' emulated GPUs actually prefilled over "
        + ("the prompt tokens of the requests they accepted (HTTP 200)"
           if all("served_prompt_tokens" in (p.get("prefill") or {}) for p in points if "result" in p)
           else "all prompt tokens sent (requests a router refused count in the denominator)")
        + " (the rest came from SGLang's radix cache).",
        "",
        "Command lines:",
        "",
        "```bash",
        *router_commands(points, meta.get("commands", [])),
        "```",
        "",
    ]
    lines += ["## Where smg wins", ""]
    lines += [f"- {w}" for w in wins(points, "smg")] or ["- nowhere in these runs"]
    lines += ["", "## Where the daemon wins", ""]
    lines += [f"- {w}" for w in wins(points, "cp")] or ["- nowhere in these runs"]
    lines += [""]
    for workload in WORKLOADS:
        wrows = [p for p in rows if p["workload"] == workload]
        if not wrows:
            continue
        title = {"azure": "Azure conversation sample (no shared prefixes)",
                 "prefix": f"Shared prefixes ({PREFIXES} x {PREFIX_TOKENS} tokens + "
                           f"{SUFFIX_TOKENS[0]}-{SUFFIX_TOKENS[1]} unique, {PREFIX_OUTPUT_TOKENS[0]}-"
                           f"{PREFIX_OUTPUT_TOKENS[1]} output tokens)"}[workload]
        lines += [f"## {title}", "",
                  "| rate | router | goodput | attainment | failed | TTFT p50 / p90 / p99 ms | "
                  "TPOT p50 / p90 / p99 ms | prefill computed | router CPU s / 1000 req |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        best = {}
        for p in wrows:
            if p["result"]["goodput"] > best.get(p["rate"], -1):
                best[p["rate"]] = p["result"]["goodput"]
        for p in wrows:
            r = p["result"]
            goodput = _fmt(r["goodput"], 2)
            if r["goodput"] == best[p["rate"]]:
                goodput = f"**{goodput}**"
            prefill = p.get("prefill") or {}
            frac = prefill.get("computed_fraction")
            cpu = (p.get("cpu") or {}).get("router_s_per_1000")
            t, o = r["ttft_ms"], r["tpot_ms"]
            crashed = " †" if p.get("server_died") else ""
            lines.append(
                f"| {p['rate']:g} | {router_label(p)}{crashed} | {goodput} | {r['attainment']:.3f} | {r['failed']} | "
                f"{_fmt(t['p50'])} / {_fmt(t['p90'])} / {_fmt(t['p99'])} | "
                f"{_fmt(o['p50'], 1)} / {_fmt(o['p90'], 1)} / {_fmt(o['p99'], 1)} | "
                f"{'-' if frac is None else f'{100 * frac:.0f}%'} | {_fmt(cpu, 1)} |")
        died = [p for p in wrows if p.get("server_died")]
        if died:
            first = next(iter(died[0]["server_died"].values()))
            lines.append(f"\n† a server died during this run (its requests failed; the stack was restarted "
                         f"before the next run): `{first[:300]}`")
        lines.append("")
        sweep = sweep_summary(points, workload)
        if sweep:
            lines += [f"smg cache_aware sweep at {sweep['rate']:g} req/s (queue timeout "
                      f"{SMG_QUEUE_TIMEOUT_S} s): best C={sweep['best'][0] if sweep['best'] else '?'}, "
                      f"Q={sweep['best'][1] if sweep['best'] else '?'}; concurrency "
                      f"{sweep['verdicts'].get('max_concurrent', '?')}, queue size "
                      f"{sweep['verdicts'].get('queue_size', '?')}.", "",
                      *[f"Per-rate concurrency sweep at {r} req/s (where the limits above left SLO misses; "
                        f"Q={t['limits'][1]}): best C={t['limits'][0]}, {t['verdict']} in {t['grid']}."
                        for r, t in sorted(sweep["per_rate"].items(), key=lambda kv: float(kv[0]))],
                      *([""] if sweep["per_rate"] else []),
                      "| rate | C (max concurrent) | Q (queue size) | goodput | attainment | failed | TTFT p99 ms | TPOT p99 ms |",
                      "|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for s in sweep["points"]:
                chosen = sweep["per_rate"].get(f"{s['rate']:g}", {}).get("limits") or (
                    sweep["best"] if s["rate"] == sweep["rate"] else None)
                mark = "**" if chosen and (s["max_concurrent"], s["queue_size"]) == tuple(chosen) else ""
                crashed = " †" if s.get("server_died") else ""
                lines.append(f"| {s['rate']:g} | {mark}{s['max_concurrent']}{mark}{crashed} | {mark}{s['queue_size']}{mark} | "
                             f"{s['goodput']:.2f} | {s['attainment']:.3f} | {s['failed']} | "
                             f"{_fmt(s['ttft_p99'])} | {_fmt(s['tpot_p99'], 1)} |")
            lines.append("")
    probes = probe_summary(points)
    if probes:
        lines += ["## Router added latency (unloaded) and CPU", "",
                  f"Sequential probes before every run: {PROBE_PROMPT_TOKENS}-token prompt, "
                  f"{PROBE_OUTPUT_TOKENS} output tokens, alternately through the router and straight "
                  "to a server; added = median TTFT through it minus median direct. CPU: utime + "
                  "stime of the router's processes (smg: one; daemon: daemon + gateway) over the "
                  "comparison runs, and of the two SGLang servers' process groups beside it.", "",
                  "| router | probes | TTFT direct ms | TTFT via router ms | added ms | "
                  + " | ".join(f"CPU s / 1000 req ({w}): router, servers" for w in WORKLOADS) + " |",
                  "|---|---:|---:|---:|---:|" + "---:|" * len(WORKLOADS)]
        cpu = cpu_summary(points)
        for router in ROUTERS:
            v = probes.get(router)
            if not v:
                continue
            cells = []
            for w in WORKLOADS:
                c = cpu.get(w, {}).get(router) or {}
                cells.append(f"{_fmt(c.get('router_s_per_1000'), 1)}, {_fmt(c.get('servers_s_per_1000'), 0)}")
            lines.append(f"| {router} | {v['n']} | {v['direct_ms']:.1f} | {v['router_ms']:.1f} | "
                         f"{v['added_ms']:.1f} | " + " | ".join(cells) + " |")
        lines.append("")
    notes = [*auto_notes(points), *meta.get("notes", [])]
    if notes:
        lines += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)


def render_json(points: Sequence[dict], meta: dict) -> dict:
    return {
        "meta": meta,
        "slo": SLO,
        "comparison": [{k: p.get(k) for k in ("workload", "rate", "router", "limits", "result", "prefill",
                                              "cpu", "probe_added")} for p in main_points(points)],
        "sweeps": {w: sweep_summary(points, w) for w in WORKLOADS},
        "added_latency": probe_summary(points),
        "cpu": cpu_summary(points),
        "smg_wins": wins(points, "smg"),
        "daemon_wins": wins(points, "cp"),
        "notes": [*auto_notes(points), *meta.get("notes", [])],
    }


# ====================================================================== processes
def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(process: subprocess.Popen | None, timeout: float = 15.0) -> None:
    """SIGTERM the process (its own group), then SIGKILL the group."""
    if process is None:
        return
    if process.poll() is None:
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(process.pid, signal.SIGKILL)
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        pass


def spawn(command: Sequence[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"$ {shlex.join(command)}\n".encode())
        log.flush()
        return subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=REPO, env=env or os.environ.copy(), start_new_session=True)


def proc_cpu_s(pid: int) -> float:
    """utime + stime of one process (all its threads), seconds; 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """utime + stime of every live process in the process group ``pgid``."""
    total = 0.0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def crash_summary(log_path: Path, lines: int = 3) -> str:
    """The last lines of a dead server's log that name an error (for the saved point)."""
    try:
        text = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return "log unreadable"
    starts = [i for i, line in enumerate(text) if "Traceback (most recent call last)" in line]
    if starts:  # the last traceback's last lines: where it failed and the exception
        block = []
        for line in text[starts[-1] + 1:]:
            if line.startswith("[") and block:
                break
            if line.strip() and not set(line.strip()) <= set("^~ "):
                block.append(line.strip())
        return f"{log_path.name}: " + " | ".join(block[-lines:])
    errors = [line.strip() for line in text if "Error" in line and "Ignore import error" not in line]
    return f"{log_path.name}: " + (" | ".join(errors[-lines:]) or "no error line in the log")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 30.0, method: str | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except (OSError, urllib.error.URLError) as error:
        return 0, str(error)


def flush_cache(url: str) -> None:
    for _ in range(60):
        status, text = http_json(f"{url}/flush_cache", {}, timeout=60, method="POST")
        if status == 200:
            return
        time.sleep(1.0)  # requests still running (a 400 until idle)
    raise RuntimeError(f"{url}/flush_cache kept failing: {status} {text[:200]}")


class StepLogTail:
    """Prefill tokens the emulated GPU computed, read from its step log since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def skip(self) -> None:
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def prefill_tokens(self) -> int:
        if not self.path.exists():
            return 0
        total = 0
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            if b'"prefill_tokens"' in line:
                total += json.loads(line).get("prefill_tokens", 0)
        return total


# ====================================================================== the client
async def run_requests(url: str, model: str | None, requests: Sequence[Request], texts: Sequence[str],
                       timeout_s: float = REQUEST_TIMEOUT_S) -> list[Record]:
    """Send every request at its time (open loop), streamed; one Record each."""
    import aiohttp

    records = [Record(r.index, r.at_s, r.output_tokens) for r in requests]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        origin = time.perf_counter()
        tasks = []
        for request, text, record in zip(requests, texts, records):
            delay = origin + request.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            record.sent_s = time.perf_counter() - origin
            tasks.append(asyncio.create_task(_one(session, url, model, request, text, record, origin)))
        await asyncio.gather(*tasks)
    return records


def completion_body(model: str | None, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
            "custom_params": {"slo": dict(SLO)}}
    if model is not None:
        body["model"] = model
    return body


async def _one(session, url: str, model: str | None, request: Request, text: str, record: Record,
               origin: float) -> None:
    import aiohttp

    body = completion_body(model, text, request.output_tokens)
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            record.status = response.status
            if response.status != 200:
                record.error = f"http {response.status}: {(await response.text())[:120]}"
                return
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                now = time.perf_counter() - origin
                chunk = json.loads(payload)
                if "error" in chunk:
                    record.error = f"stream error: {str(chunk['error'])[:120]}"
                    continue
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    record.events += 1
                    if record.first_token_s is None:
                        record.first_token_s = now
                    record.last_token_s = now
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    record.completion_tokens = usage["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
        record.error = f"client: {type(error).__name__}"
        return
    if record.completion_tokens == 0:
        record.completion_tokens = record.events  # no usage event: one token per event


async def probe(router_url: str, router_model: str | None, direct: Sequence[tuple[str, str | None]],
                words: Sequence[str], n: int = PROBES) -> dict:
    """Sequential probes, alternately through the router and straight to a server."""
    import aiohttp

    via: list[float] = []
    straight: list[float] = []
    rng = random.Random(f"probe-{time.time_ns()}")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for i in range(2 * n):
            through = i % 2 == 0
            url, model = (router_url, router_model) if through else direct[(i // 2) % len(direct)]
            text = words_text(rng, words, PROBE_PROMPT_TOKENS)
            request = Request(i, 0.0, PROBE_PROMPT_TOKENS, PROBE_OUTPUT_TOKENS)
            record = Record(i, 0.0, PROBE_OUTPUT_TOKENS)
            origin = time.perf_counter()
            await _one(session, url, model, request, text, record, origin)
            if record.ok and record.ttft_s is not None:
                (via if through else straight).append(record.ttft_s)
    return {"router_ttft_s": [round(v, 6) for v in via], "direct_ttft_s": [round(v, 6) for v in straight],
            **(added_latency(via, straight) or {})}


# ====================================================================== the stack
@dataclass
class Router:
    name: str
    url: str
    model: str | None
    pids: list[int]
    command: str
    limits: dict | None = None
    processes: list[subprocess.Popen] = field(default_factory=list)

    def cpu_s(self) -> float:
        return sum(proc_cpu_s(pid) for pid in self.pids)


class Stack:
    """Two servers as ranks of one daemon; the daemon + gateway or smg in front."""

    def __init__(self, raw: Path, smg: str, words: Sequence[str]) -> None:
        self.raw = raw
        self.smg = smg
        self.words = words
        self.python = sys.executable
        self.servers: list = []
        self.daemon: subprocess.Popen | None = None
        self.gateway: subprocess.Popen | None = None
        self.daemon_policy: str | None = "unset"
        self.smg_process: subprocess.Popen | None = None
        ports = [free_port() for _ in range(3)]
        self.addresses = {"client": f"tcp://127.0.0.1:{ports[0]}", "rank": f"tcp://127.0.0.1:{ports[1]}",
                          "report": f"tcp://127.0.0.1:{ports[2]}"}
        self.gateway_port = free_port()
        self.model_dir = raw / "model"
        self.step_logs = [raw / "steps-a.jsonl", raw / "steps-b.jsonl"]
        self.tails = [StepLogTail(p) for p in self.step_logs]
        self.chars_per_token = round(chars_per_token(words), 2)
        self.restarts = 0
        self.smg_ca_extra: tuple[str, ...] = SMG_CA_EXTRA

    # ---- servers
    def start_servers(self, suffix: str = "") -> None:
        sys.path.insert(0, str(REPO / "scripts"))
        from bench_sglang import write_fb_config

        from sglang_ext.server_launch import launch

        fb_config = write_fb_config(self.raw)
        results: dict[int, object] = {}

        def one(i: int, name: str) -> None:
            env = {
                "FAIRBATCHING_EMULATED_GPU": PROFILE,
                "FAIRBATCHING_EMULATED_GPU_TIME_SCALE": str(TIME_SCALE),
                "FAIRBATCHING_EMULATED_GPU_SEED": str(i),
                "FAIRBATCHING_EMULATED_GPU_LOG": str(self.step_logs[i]),
                "FAIRBATCHING_CONFIG": str(fb_config),
                "FAIRBATCHING_CONTROLPLANE": self.addresses["rank"],
                "FAIRBATCHING_CONTROLPLANE_REPORTS": self.addresses["report"],
                "FAIRBATCHING_RANK_NAME": f"bench-{name}",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            }
            try:
                results[i] = launch(self.model_dir, SERVER_ARGS, env, self.raw / f"server-{name}{suffix}.log")
            except BaseException as error:  # reported below
                results[i] = error

        threads = [threading.Thread(target=one, args=(i, n)) for i, n in enumerate("ab")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.servers = [results[i] for i in range(2) if not isinstance(results[i], BaseException)]
        errors = [results[i] for i in range(2) if isinstance(results[i], BaseException)]
        if errors:
            raise RuntimeError(f"a server failed to start: {errors[0]}")

    @property
    def server_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def served_model(self) -> str:
        return str(self.model_dir)

    def servers_cpu_s(self) -> float:
        return sum(group_cpu_s(s.process.pid) for s in self.servers)

    def flush(self) -> None:
        for url in self.server_urls:
            flush_cache(url)

    # ---- daemon + gateway
    def daemon_config_text(self, policy: str | None) -> str:
        lines = ["[daemon]"] + [f'{k}_address = "{v}"' for k, v in self.addresses.items()]
        if policy is not None:
            lines.append(f'policy = "{policy}"')
        lines.append(f"chars_per_token = {self.chars_per_token}  # the benchmark's text (one word = one token)")
        lines.append('log_level = "warning"')
        return "\n".join(lines) + "\n"

    def start_daemon(self, policy: str | None) -> Router:
        """The daemon with ``policy`` (None: its default) and its gateway, the two servers
        joined as ranks; restarted only when the policy changes."""
        if self.daemon is not None and self.daemon_policy == policy and self.daemon.poll() is None:
            return self._daemon_router(policy)
        self.spawn_daemon(policy)
        self.wait_daemon()
        return self._daemon_router(policy)

    def spawn_daemon(self, policy: str | None) -> None:
        self.stop_daemon()
        tag = policy or "default"
        config = self.raw / f"daemon-{tag}.toml"
        config.write_text(self.daemon_config_text(policy))
        self.daemon = spawn([self.python, "-m", "controlplane", "serve", "--config", str(config)],
                            self.raw / f"daemon-{tag}.log")
        self.gateway = spawn([self.python, "-m", "controlplane", "gateway", "--daemon", self.addresses["client"],
                              "--listen", f"127.0.0.1:{self.gateway_port}", "--model", self.served_model],
                             self.raw / f"gateway-{tag}.log")
        self.daemon_policy = policy

    def wait_daemon(self) -> None:
        asyncio.run(self._wait_ranks(90.0))
        deadline = time.monotonic() + 30
        while http_json(f"http://127.0.0.1:{self.gateway_port}/health", timeout=5)[0] != 200:
            if time.monotonic() > deadline or self.gateway.poll() is not None:
                raise RuntimeError(f"the gateway did not become healthy; see {self.raw}")
            time.sleep(0.5)

    def _daemon_router(self, policy: str | None) -> Router:
        assert self.daemon is not None and self.gateway is not None
        return Router("cp-pab" if policy == "pab" else "cp-default", f"http://127.0.0.1:{self.gateway_port}",
                      self.served_model, [self.daemon.pid, self.gateway.pid],
                      f"fairbatching-controlplane serve --config daemon.toml  # policy = "
                      f"{policy or 'default (pab_least_loaded)'}; + gateway --listen 127.0.0.1:PORT")

    async def _wait_ranks(self, timeout: float) -> None:
        from controlplane.client import AsyncClient

        deadline = time.monotonic() + timeout
        async with AsyncClient(self.addresses["client"], connect_timeout_s=2.0) as client:
            while True:
                try:
                    status = await client.status(timeout_s=2.0)
                    fresh = [r for r in status.ranks if not r.stale and r.reported_pab_tokens is not None]
                    if len(fresh) >= 2:
                        return
                except Exception:  # noqa: BLE001 - the daemon is still starting
                    pass
                if time.monotonic() > deadline or (self.daemon and self.daemon.poll() is not None):
                    raise RuntimeError(f"the servers did not join the daemon; see {self.raw}")
                await asyncio.sleep(0.5)

    def stop_daemon(self) -> None:
        stop_group(self.gateway)
        stop_group(self.daemon)
        self.gateway = self.daemon = None

    # ---- smg
    def start_smg(self, name: str, policy: str, limits: dict | None, tag: str) -> Router:
        self.stop_smg()
        port, metrics_port = free_port(), free_port()
        command = [self.smg, "launch", "--host", "127.0.0.1", "--port", str(port),
                   "--worker-urls", *self.server_urls, "--policy", policy,
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                   "--log-level", "warn"]
        if policy == "cache_aware":
            command += list(self.smg_ca_extra)
        if limits is not None:
            command += ["--max-concurrent-requests", str(limits["max_concurrent"]),
                        "--queue-size", str(limits["queue_size"]),
                        "--queue-timeout-secs", str(limits["queue_timeout_s"])]
        self.smg_process = spawn(command, self.raw / f"smg-{tag}.log")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            status, _ = http_json(f"{url}/v1/completions", {"model": self.served_model, "prompt": "the",
                                                           "max_tokens": 1}, timeout=10)
            if status == 200:
                break
            if time.monotonic() > deadline or self.smg_process.poll() is not None:
                raise RuntimeError(f"smg did not start; see {self.raw}/smg-{tag}.log")
            time.sleep(0.5)
        shown = [os.path.basename(command[0]), *command[1:]]
        shown[shown.index("--port") + 1] = "PORT"
        shown[shown.index("--prometheus-port") + 1] = "PORT2"
        i = shown.index("--worker-urls")
        shown[i + 1:i + 3] = ["http://127.0.0.1:A", "http://127.0.0.1:B"]
        return Router(name, url, self.served_model, [self.smg_process.pid], shlex.join(shown), limits)

    def stop_smg(self) -> None:
        stop_group(self.smg_process, timeout=10)
        self.smg_process = None

    def restart(self) -> None:
        policy = None if self.daemon_policy == "unset" else self.daemon_policy
        self.stop_smg()
        self.stop_daemon()
        for server in self.servers:
            server.stop()
        self.servers = []
        self.restarts += 1
        for i, path in enumerate(self.step_logs):
            self.step_logs[i] = path.with_name(f"{path.stem.split('.')[0]}.{self.restarts}.jsonl")
        self.tails = [StepLogTail(p) for p in self.step_logs]
        self.spawn_daemon(policy)
        self.start_servers(suffix=f".{self.restarts}")
        self.wait_daemon()

    def close(self) -> None:
        self.stop_smg()
        self.stop_daemon()
        for server in self.servers:
            server.stop()
        self.servers = []


# ====================================================================== runs
@dataclass
class Plan:
    workloads: tuple[str, ...]
    rates: dict[str, tuple[float, ...]]
    seconds: float
    sweep_concurrency: tuple[int, ...]
    sweep_queue: tuple[int, ...]
    sweep_queue_at: int
    max_extensions: int
    quick: bool
    routers: tuple[str, ...] = ROUTERS
    per_rate: bool = True


class Bench:
    def __init__(self, plan: Plan, stack: Stack, points_path: Path, meta: dict) -> None:
        self.plan = plan
        self.stack = stack
        self.points_path = points_path
        self.meta = meta
        self.azure = bundled_azure_lengths() if "azure" in plan.workloads else None
        self.runs: dict[tuple, dict] = {}
        for p in load_points(points_path):  # --append: runs already saved are not run again
            if "result" in p and "error" not in p:
                limits = p.get("limits")
                self.runs[(p["workload"], p["rate"], p["router"],
                           None if limits is None else (limits["max_concurrent"], limits["queue_size"]))] = p

    def router(self, name: str, limits: dict | None, tag: str) -> Router:
        if name == "smg-rr":
            return self.stack.start_smg(name, "round_robin", None, tag)
        if name == "smg-ca":
            return self.stack.start_smg(name, "cache_aware", limits, tag)
        self.stack.stop_smg()
        return self.stack.start_daemon(DAEMON_POLICY[name])

    def run(self, workload: str, rate: float, name: str, limits: dict | None = None, phase: str = "main",
            tuned: dict | None = None) -> dict:
        key = (workload, rate, name, None if limits is None else (limits["max_concurrent"], limits["queue_size"]))
        if key in self.runs:
            return self.runs[key]
        tag = f"{workload}-r{rate:g}-{name}" + ("" if limits is None else
                                                f"-c{limits['max_concurrent']}-q{limits['queue_size']}")
        print(f"  {tag} ...", file=sys.stderr, flush=True)
        requests = workload_requests(workload, rate, self.plan.seconds, SEED, self.azure)
        texts = [prompt_text(r, self.stack.words, SEED) for r in requests]
        point = {"workload": workload, "rate": rate, "router": name, "limits": limits, "phase": phase,
                 "seconds": self.plan.seconds, "seed": SEED, "requests": len(requests),
                 "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), **self.meta["provenance"]}
        started = time.monotonic()
        try:
            self.ensure_servers(tag)
            router = self.router(name, limits, tag)
            point["command"] = router.command
            direct = [(u, self.stack.served_model) for u in self.stack.server_urls]
            point["probe"] = asyncio.run(probe(router.url, router.model, direct, self.stack.words))
            self.stack.flush()
            for tail in self.stack.tails:
                tail.skip()
            cpu0, servers0 = router.cpu_s(), self.stack.servers_cpu_s()
            load0 = os.getloadavg()
            t0 = time.monotonic()
            records = asyncio.run(run_requests(router.url, router.model, requests, texts))
            wall = time.monotonic() - t0
            cpu1, servers1 = router.cpu_s(), self.stack.servers_cpu_s()
            time.sleep(0.3)  # the last steps reach the step logs
            dead = [s.log_path.name for s in self.stack.servers if not s.alive()]
            if dead:
                point["server_died"] = {name: crash_summary(self.stack.raw / name) for name in dead}
            computed = sum(t.prefill_tokens() for t in self.stack.tails)
            sent = sum(r.prompt_tokens for r in requests)
            served = sum(r.prompt_tokens for r, rec in zip(requests, records) if rec.status == 200)
            point["result"] = summarize(records, rate)
            point["prefill"] = prefill_summary(sent, served, computed)
            point["cpu"] = {"router_s": round(cpu1 - cpu0, 3), "servers_s": round(servers1 - servers0, 3),
                            "router_s_per_1000": cpu_per_1000(cpu1 - cpu0, len(requests)),
                            "servers_s_per_1000": cpu_per_1000(servers1 - servers0, len(requests)),
                            "run_wall_s": round(wall, 2)}
            point["machine_during_run"] = {"load_average_before": load0, "load_average_after": os.getloadavg()}
            point["probe_added"] = {k: point["probe"].get(k) for k in ("direct_ms", "router_ms", "added_ms")}
            if tuned is not None:
                point["tuned"] = tuned
            r = point["result"]
            print(f"  {tag}: goodput {r['goodput']:.2f} ({r['good']}/{r['requests']}), failed {r['failed']}, "
                  f"TTFT p99 {r['ttft_ms']['p99']} ms, TPOT p99 {r['tpot_ms']['p99']} ms, prefill computed "
                  f"{point['prefill']['computed_fraction']}, added {point['probe'].get('added_ms')} ms, "
                  f"router CPU {point['cpu']['router_s_per_1000']} s/1000 ({wall:.0f} s)", file=sys.stderr, flush=True)
        except Exception as error:  # noqa: BLE001 - saved with the point, the run goes on
            point["error"] = f"{type(error).__name__}: {error}"
            print(f"  {tag}: FAILED {point['error']}", file=sys.stderr, flush=True)
        point["wall_s"] = round(time.monotonic() - started, 1)
        append_point(self.points_path, point)
        self.runs[key] = point
        return point

    def ensure_servers(self, tag: str) -> None:
        """Restart the servers (and the daemon) when one has died (a crash is saved with the
        point of the run it happened in; the stack starts afresh for the next)."""
        if all(s.alive() for s in self.stack.servers):
            return
        note = f"before {tag}: a server had died; the servers and the daemon were restarted"
        print(f"  {note}", file=sys.stderr, flush=True)
        self.meta["notes"].append(note)
        self.stack.restart()

    def sweep(self, workload: str) -> dict:
        """Coordinate sweep of smg cache_aware's limits at the workload's top rate."""
        plan = self.plan
        rate = max(plan.rates[workload])

        def limits(c: int, q: int) -> dict:
            return {"max_concurrent": c, "queue_size": q, "queue_timeout_s": SMG_QUEUE_TIMEOUT_S}

        def measured(c: int, q: int) -> dict:
            p = self.run(workload, rate, "smg-ca", limits(c, q), phase="sweep")
            r = p.get("result") or {"good": -1, "ttft_ms": {"p99": None}}
            return {"c": c, "q": q, "good": r["good"], "ttft_p99": r["ttft_ms"]["p99"]}

        def line(key: str, grid: list[int], fixed: dict, lower: int) -> tuple[int, list[int]]:
            extensions = 0
            while True:
                results = [measured(**{**fixed, key: v}) for v in sorted(grid)]
                best = pick_best(results, key)[key]
                extra = edge_extension(grid, best, lower) if extensions < plan.max_extensions else None
                if extra is None:
                    return best, sorted(grid)
                grid.append(extra)
                extensions += 1

        q0 = plan.sweep_queue_at
        c_best, c_grid = line("c", list(plan.sweep_concurrency), {"q": q0}, 1)
        q_best, q_grid = q0, [q0]
        if plan.sweep_queue:
            q_best, q_grid = line("q", sorted(set(plan.sweep_queue) | {q0}), {"c": c_best}, 0)
        tuned = {"limits": [c_best, q_best], "rate": rate, "concurrency_grid": c_grid,
                 "queue_during_concurrency": q0, "queue_grid": q_grid,
                 "verdicts": {"max_concurrent": sweep_verdict(c_grid, c_best, 1),
                              "queue_size": sweep_verdict(q_grid, q_best, 0) if len(q_grid) > 1 else "not swept"}}
        key = (workload, rate, "smg-ca", (c_best, q_best))
        point = dict(self.runs[key], tuned=tuned)  # saved again, with the choice
        append_point(self.points_path, point)
        self.runs[key] = point
        print(f"  {workload}: smg-ca tuned to C={c_best}, Q={q_best} ({tuned['verdicts']})", file=sys.stderr)
        return tuned

    def workload(self, workload: str) -> None:
        tuned, limits = None, None
        if "smg-ca" in self.plan.routers:
            tuned = self.sweep(workload)
            c, q = tuned["limits"]
            limits = {"max_concurrent": c, "queue_size": q, "queue_timeout_s": SMG_QUEUE_TIMEOUT_S}
        for rate in self.plan.rates[workload]:
            for name in self.plan.routers:
                point = self.run(workload, rate, name, limits if name == "smg-ca" else None,
                                 tuned=tuned if name == "smg-ca" else None)
                if name == "smg-ca" and self.plan.per_rate and rate != tuned["rate"] \
                        and point.get("result", {}).get("attainment", 1.0) < 1.0:
                    self.rate_sweep(workload, rate, tuned)

    def rate_sweep(self, workload: str, rate: float, tuned: dict) -> None:
        """Where the limits tuned at the top rate leave SLO misses at a lower rate, sweep the
        concurrency limit at that rate too (the queue size as tuned), edges extended: each
        rate gets smg-ca at its best, as the other benchmarks tune baselines per point."""
        q = tuned["limits"][1]
        grid = sorted(set(self.plan.sweep_concurrency) | {tuned["limits"][0]})
        extensions = 0
        while True:
            results = []
            for c in sorted(grid):
                limits = {"max_concurrent": c, "queue_size": q, "queue_timeout_s": SMG_QUEUE_TIMEOUT_S}
                p = self.run(workload, rate, "smg-ca", limits, phase="rate-sweep")
                r = p.get("result") or {"good": -1, "ttft_ms": {"p99": None}}
                results.append({"c": c, "good": r["good"], "ttft_p99": r["ttft_ms"]["p99"]})
            best = pick_best(results, "c")["c"]
            extra = edge_extension(grid, best, 1) if extensions < self.plan.max_extensions else None
            if extra is None:
                break
            grid.append(extra)
            extensions += 1
        choice = {"limits": [best, q], "grid": sorted(grid), "verdict": sweep_verdict(grid, best, 1)}
        key = (workload, rate, "smg-ca", (best, q))
        point = dict(self.runs[key], rate_tuned=choice)
        append_point(self.points_path, point)
        self.runs[key] = point
        print(f"  {workload} at {rate:g}: smg-ca concurrency re-tuned to C={best} ({choice['verdict']})",
              file=sys.stderr, flush=True)


def versions(smg: str) -> dict:
    out = {}
    try:
        text = subprocess.run([str(Path(smg).parent / "python"), "-c",
                               "import importlib.metadata as m; print(m.version('smg'))"],
                              capture_output=True, text=True, timeout=60).stdout.strip()
        out["smg_version"] = text or "?"
    except (OSError, subprocess.TimeoutExpired):
        out["smg_version"] = "?"
    try:
        import importlib.metadata as md

        out["sglang_version"] = md.version("sglang")
    except Exception:  # noqa: BLE001
        out["sglang_version"] = "?"
    return out


def machine_text() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f", {kb / 1024 / 1024:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return f"{os.cpu_count()} vCPUs ({model}){memory}, shared with other jobs"


def find_smg(explicit: str | None) -> str | None:
    for candidate in (explicit, os.environ.get("FB_SMG")):
        if candidate:
            return candidate
    from shutil import which

    return which("smg")


def parse_rates(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def build_plan(args: argparse.Namespace) -> Plan:
    rates = dict(QUICK_RATES if args.quick else DEFAULT_RATES)
    if args.azure_rates:
        rates["azure"] = parse_rates(args.azure_rates)
    if args.prefix_rates:
        rates["prefix"] = parse_rates(args.prefix_rates)
    workloads = tuple(w for w in args.workloads.split(",") if w)
    for w in workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
    for r in args.routers.split(","):
        if r and r not in ROUTERS:
            raise SystemExit(f"unknown router {r!r}; known: {', '.join(ROUTERS)}")
    return Plan(
        workloads=workloads, rates=rates,
        seconds=args.seconds or (QUICK_SECONDS if args.quick else DEFAULT_SECONDS),
        sweep_concurrency=parse_ints(args.sweep_concurrency) if args.sweep_concurrency else
        (QUICK_SWEEP_CONCURRENCY if args.quick else SWEEP_CONCURRENCY),
        sweep_queue=parse_ints(args.sweep_queue) if args.sweep_queue is not None else
        (QUICK_SWEEP_QUEUE if args.quick else SWEEP_QUEUE),
        sweep_queue_at=args.sweep_queue_at,
        max_extensions=args.max_extensions if args.max_extensions is not None else
        (0 if args.quick else MAX_EXTENSIONS), quick=args.quick,
        routers=tuple(r for r in args.routers.split(",") if r),
        per_rate=not getattr(args, "no_per_rate", False),
    )


def write_outputs(points: list[dict], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "routers.md").write_text(render_markdown(points, meta))
    (out / "routers.json").write_text(json.dumps(render_json(points, meta), indent=1) + "\n")
    print(f"wrote {_rel(out / 'routers.md')} and {_rel(out / 'routers.json')}", file=sys.stderr)


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one rate per workload, short runs, a 3-point sweep")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--azure-rates", help="comma-separated req/s")
    parser.add_argument("--prefix-rates", help="comma-separated req/s")
    parser.add_argument("--seconds", type=float, help="seconds of arrivals per run")
    parser.add_argument("--sweep-concurrency", help="smg cache_aware --max-concurrent-requests grid")
    parser.add_argument("--sweep-queue", help="smg cache_aware --queue-size grid ('' = not swept)")
    parser.add_argument("--sweep-queue-at", type=int, default=SWEEP_QUEUE_AT,
                        help="the queue size while the concurrency limit is swept")
    parser.add_argument("--max-extensions", type=int, help=f"grid extensions per swept dimension "
                        f"(default {MAX_EXTENSIONS}; 0 with --quick)")
    parser.add_argument("--routers", default=",".join(ROUTERS), help="the comparison's routers (a subset)")
    parser.add_argument("--smg-ca-extra", default=shlex.join(SMG_CA_EXTRA),
                        help="extra smg flags for cache_aware (default: %(default)s)")
    parser.add_argument("--smg", help="the smg executable (default: $FB_SMG, then smg on PATH)")
    parser.add_argument("--points", type=Path, default=DEFAULT_POINTS)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for routers.md / routers.json")
    parser.add_argument("--render-only", action="store_true")
    parser.add_argument("--note", action="append", default=[],
                        help="with --render-only: add a note to the page (kept with the points)")
    parser.add_argument("--append", action="store_true",
                        help="keep the points file and run only what it lacks (e.g. a per-rate sweep)")
    parser.add_argument("--no-per-rate", action="store_true",
                        help="no per-rate concurrency sweep where the top rate's limits leave misses")
    args = parser.parse_args(argv)
    meta_path = args.points.with_suffix(".meta.json")
    if args.render_only:
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        if args.note:
            meta["notes"] = [*meta.get("notes", []), *args.note]
            meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        write_outputs(load_points(args.points), meta, args.out)
        return 0
    smg = find_smg(args.smg)
    if not smg or not Path(smg).exists():
        print("error: smg not found: install the bench-router extra (scripts/bench_routers.sh does) "
              "and pass --smg or set FB_SMG", file=sys.stderr)
        return 2
    plan = build_plan(args)
    os.chdir(REPO)  # the servers and the daemon import this checkout's packages
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    raw = args.points.parent / stamp
    raw.mkdir(parents=True, exist_ok=True)
    moved = None if args.append else move_aside(args.points)
    if moved:
        print(f"previous points kept as {_rel(moved)}", file=sys.stderr)
    from sglang_ext.adapter.emulated_gpu.tiny_model import write_tiny_model

    write_tiny_model(raw / "model")
    words = single_token_words(raw / "model" / "tokenizer.json")
    argv_text = shlex.join(sys.argv[1:] if argv is None else list(argv))
    meta = {
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_state(REPO),
        "machine": machine_text(), "seconds": plan.seconds, "quick": plan.quick, **versions(smg),
        "plan": asdict(plan), "raw": _rel(raw),
        "commands": [f"scripts/bench_routers.sh {argv_text}".strip(),
                     "# servers (x2): FAIRBATCHING_CONFIG=... FAIRBATCHING_EMULATED_GPU=llama3.1-8b-h100 "
                     "FAIRBATCHING_EMULATED_GPU_TIME_SCALE=2 FAIRBATCHING_CONTROLPLANE=tcp://127.0.0.1:R "
                     "FAIRBATCHING_CONTROLPLANE_REPORTS=tcp://127.0.0.1:P FAIRBATCHING_RANK_NAME=bench-a|b "
                     "python -m sglang.launch_server --model-path <tiny model> "
                     + " ".join(("--device cpu --load-format dummy --attention-backend torch_native "
                                 "--disable-cuda-graph --tp 1 --sleep-on-idle",) + SERVER_ARGS)],
        "words": len(words), "chars_per_token": round(chars_per_token(words), 2),
        "notes": [],
    }
    meta["provenance"] = {"commit": meta["git"]["commit"], "dirty": meta["git"]["dirty"]}
    if args.append and meta_path.exists():  # one page for both invocations
        old = json.loads(meta_path.read_text())
        meta["started"] = old.get("started", meta["started"])
        meta["commands"] = [*old.get("commands", [])[:1], meta["commands"][0], *old.get("commands", [])[1:]]
        meta["notes"] = old.get("notes", [])
        meta["raw"] = f"{old.get('raw', '?')}, {meta['raw']}"
    meta_path.parent.mkdir(parents=True, exist_ok=True)
    stack = Stack(raw, smg, words)
    stack.smg_ca_extra = tuple(shlex.split(args.smg_ca_extra))

    def on_signal(signum, frame):  # noqa: ARG001 - clean up the process groups on a kill
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        print(f"starting two servers (logs in {_rel(raw)}) ...", file=sys.stderr, flush=True)
        stack.spawn_daemon(None)  # first: the servers' ingress joins it at start-up
        stack.start_servers()
        stack.wait_daemon()
        bench = Bench(plan, stack, args.points, meta)
        for workload in plan.workloads:
            bench.workload(workload)
        if not any(c.startswith("# daemon config") for c in meta["commands"]):
            meta["commands"].append(f"# daemon config: {stack.daemon_config_text('POLICY').strip()}".replace("\n", "; "))
    finally:
        stack.close()
        meta["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    write_outputs(load_points(args.points), meta, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
