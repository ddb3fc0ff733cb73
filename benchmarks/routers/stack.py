"""The stack under test: two SGLang servers (FairBatching, emulated GPU) as ranks of one
daemon, and in front of them the daemon with its gateway or smg."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shlex
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.controlplane.sim_ranks_and_gateway import start_gateway
from benchmarks.routers.process_probes import StepLogTail, group_cpu_s, proc_cpu_s
from benchmarks.routers.traffic import chars_per_token
from benchmarks.server.emulated import PROFILE, TIME_SCALE, write_fb_config
from benchmarks.server.stock_server import launch
from benchmarks.support.paths import REPO, pythonpath_with_checkout
from benchmarks.support.ports import free_ports
from benchmarks.support.processes import spawn, stop_group
from controlplane.config import DaemonConfig
from sglang_ext.policy.slo import SloCatalog

KV_TOKENS = 65_536  # per server: holds half of the shared prefixes with room to run, not all
MAX_PREFILL_TOKENS = 16_384
SERVER_ARGS = ("--max-total-tokens", str(KV_TOKENS), "--max-prefill-tokens", str(MAX_PREFILL_TOKENS))

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

ROUTERS = ("smg-rr", "smg-ca", "smg-ll", "smg-prio", "cp-default", "cp-one", "cp-pab", "cp-least",
           "cp-spill")
#: the smg routers whose admission limits (``--max-concurrent-requests``, ``--queue-size``)
#: are swept per workload and rate, and the smg policy each runs
TUNED_SMG = {"smg-ca": "cache_aware", "smg-ll": "least_load", "smg-prio": "cache_aware"}
#: the smg routers that run smg's priority admission scheduler, each request's class named
#: by the ``x-smg-priority`` header; their limits add the slots reserved for ``interactive``
PRIORITY_SMG = frozenset({"smg-prio"})
SMG_PRIORITY_HEADER = "x-smg-priority"
#: the SLO classes of ``configs/slo.toml`` as smg's priority classes name them
SMG_PRIORITY_CLASS = {"interactive": "interactive", "standard": "default", "relaxed": "bulk"}


def limits_key(limits: dict | None) -> tuple[int, ...] | None:
    """A tuned smg router's limits as the points key them: (C, Q), and the interactive
    class's reserved slots R for the priority scheduler's routers."""
    if limits is None:
        return None
    key = (limits["max_concurrent"], limits["queue_size"])
    return key + (limits["interactive_reserved"],) if "interactive_reserved" in limits else key


def priority_scheduler_yaml(limits: dict, ttft_s: dict[str, float]) -> str:
    """smg's ``--priority-scheduler-config``: per class (:data:`SMG_PRIORITY_CLASS`) a queue
    of ``queue_size`` whose timeout and starvation threshold are the class's TTFT target
    rounded up to whole seconds (smg's fields are integers; a request queued past its TTFT
    has missed it), ``interactive`` with ``interactive_reserved`` slots of
    ``max_concurrent`` reserved and the right to preempt requests not yet streaming."""
    lines = ["classes:"]
    for slo_class, smg_class in SMG_PRIORITY_CLASS.items():
        seconds = max(1, math.ceil(ttft_s[slo_class]))
        interactive = smg_class == "interactive"
        reserved = limits["interactive_reserved"] if interactive else 0
        lines.append(
            f"  {smg_class}: {{reserved_floor: {reserved}, reserved_per_slot: 0.0, "
            f"queue_size: {limits['queue_size']}, queue_timeout_secs: {seconds}, "
            f"starvation_threshold_secs: {seconds}, can_preempt: {str(interactive).lower()}}}")
    return "\n".join(lines) + "\n"
_DAEMON_DEFAULTS = DaemonConfig()
#: What ``cp-default`` runs: the daemon's own default (``pab_cache_aware``).
DAEMON_DEFAULT_POLICY: str = _DAEMON_DEFAULTS.policy
DAEMON_DEFAULT_ON_NO_BUDGET: str = _DAEMON_DEFAULTS.on_no_budget


@dataclass(frozen=True)
class DaemonSettings:
    """The keys a daemon router sets in the daemon's config; None (or the daemon's default)
    leaves a key unset."""

    policy: str | None = None
    on_no_budget: str | None = None

    def normalised(self) -> DaemonSettings:
        return DaemonSettings(
            None if self.policy == _DAEMON_DEFAULTS.policy else self.policy,
            None if self.on_no_budget == _DAEMON_DEFAULTS.on_no_budget else self.on_no_budget)

    def set_keys(self) -> list[tuple[str, str]]:
        """The keys it sets, in the config's order."""
        return [(key, value) for key, value in
                (("policy", self.policy), ("on_no_budget", self.on_no_budget)) if value is not None]

    def toml_lines(self) -> list[str]:
        return [f'{key} = "{value}"' for key, value in self.set_keys()]

    @property
    def described(self) -> str:
        text = f"policy = {self.policy or f'default ({DAEMON_DEFAULT_POLICY})'}"
        return text + (f", on_no_budget = {self.on_no_budget}" if self.on_no_budget else "")

    @property
    def tag(self) -> str:
        return (self.policy or f"default-{DAEMON_DEFAULT_POLICY}") + (
            f"-{self.on_no_budget}" if self.on_no_budget else "")


#: The daemon's routers: name -> the daemon keys it sets (none: the daemon's defaults).
DAEMON_ROUTERS: dict[str, DaemonSettings] = {
    "cp-default": DaemonSettings(), "cp-one": DaemonSettings(), "cp-pab": DaemonSettings("pab"),
    "cp-least": DaemonSettings("pab_least_loaded"), "cp-spill": DaemonSettings(on_no_budget="spill"),
}
#: The daemon's routers whose gateway runs in the daemon's process (``serve --http``);
#: the others run ``gateway`` as a second process.
EMBEDDED_ROUTERS = frozenset({"cp-one"})


def daemon_router_name(settings: DaemonSettings, embedded: bool = False) -> str:
    """The router name of the daemon run with ``settings`` (:data:`DAEMON_ROUTERS`
    inverted; the defaults' own name is ``cp-default`` too), its gateway ``embedded`` or not."""
    settings = settings.normalised()
    for name, value in DAEMON_ROUTERS.items():
        if value == settings and (name in EMBEDDED_ROUTERS) == embedded:
            return name
    raise KeyError(f"no router runs the daemon with {settings.described} (embedded gateway: "
                   f"{embedded}); known: {DAEMON_ROUTERS}, embedded: {sorted(EMBEDDED_ROUTERS)}")


def class_ttfts() -> dict[str, float]:
    """Each SLO class's TTFT target, from ``configs/slo.toml`` (what the servers load)."""
    catalog = SloCatalog.from_toml(REPO / "configs" / "slo.toml")
    return {name: slo.ttft_s for name, slo in catalog.classes.items()}


def check_daemon_config(text: str, source: object = "<bench daemon config>") -> None:
    """Parse ``text`` as the daemon will (keys, types, ranges; every key not set takes its
    default): a bad config fails here, before any process starts."""
    DaemonConfig.from_mapping(tomllib.loads(text).get("daemon", {}), source=str(source))


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


@dataclass(frozen=True)
class Router:
    """A router as a run uses it: where to send requests, its processes (for their CPU time),
    and its command line as the page shows it."""

    name: str
    url: str
    model: str | None
    pids: tuple[int, ...]
    command: str
    limits: dict | None = None

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
        self.daemon_settings: DaemonSettings | None = None  # None: never started
        self.daemon_embedded = False
        self.smg_process: subprocess.Popen | None = None
        client, rank, report, self.gateway_port = free_ports(4)
        self.addresses = {"client": f"tcp://127.0.0.1:{client}", "rank": f"tcp://127.0.0.1:{rank}",
                          "report": f"tcp://127.0.0.1:{report}"}
        self.model_dir = raw / "model"
        self.step_logs = [raw / "steps-a.jsonl", raw / "steps-b.jsonl"]
        self.tails = [StepLogTail(p) for p in self.step_logs]
        self.chars_per_token = round(chars_per_token(words), 2)
        self.restarts = 0
        self.smg_ca_extra: tuple[str, ...] = SMG_CA_EXTRA

    # ---- servers
    def start_servers(self, suffix: str = "") -> None:
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
                "PYTHONPATH": pythonpath_with_checkout(os.environ),
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
    def daemon_config_text(self, settings: DaemonSettings) -> str:
        lines = ["[daemon]"] + [f'{k}_address = "{v}"' for k, v in self.addresses.items()]
        lines += settings.toml_lines()
        lines.append(f"chars_per_token = {self.chars_per_token}  # the benchmark's text (one word = one token)")
        lines.append('log_level = "warning"')
        return "\n".join(lines) + "\n"

    def daemon_config_comment(self) -> str:
        """The daemon's config as the page's command lines show it: one line, the policy a
        placeholder (each router's own keys are on its command line)."""
        return "# daemon config: " + self.daemon_config_text(DaemonSettings("POLICY")).strip().replace("\n", "; ")

    def start_daemon(self, settings: DaemonSettings, embedded: bool = False) -> Router:
        """The daemon with ``settings`` and its gateway (``embedded``: in the daemon's
        process), the two servers joined as ranks: started afresh for every run, as smg is
        (a prefix-tree balancer's tree, like its ledger, must start empty like the servers'
        flushed caches)."""
        self.spawn_daemon(settings, embedded)
        self.wait_daemon()
        return self._daemon_router(settings)

    def spawn_daemon(self, settings: DaemonSettings, embedded: bool = False) -> None:
        self.stop_daemon()
        # the raw logs name what ran
        tag = settings.tag + ("-embedded" if embedded else "")
        config = self.raw / f"daemon-{tag}.toml"
        text = self.daemon_config_text(settings)
        check_daemon_config(text, config)
        config.write_text(text)
        http = ("--http", f"127.0.0.1:{self.gateway_port}", "--model", self.served_model) if embedded else ()
        self.daemon = spawn([self.python, "-m", "controlplane", "serve", "--config", str(config), *http],
                            self.raw / f"daemon-{tag}.log")
        self.gateway = None if embedded else start_gateway(
            self.addresses["client"], self.gateway_port, self.raw / f"gateway-{tag}.log",
            ("--model", self.served_model))
        self.daemon_settings, self.daemon_embedded = settings, embedded

    def wait_daemon(self) -> None:
        asyncio.run(self._wait_ranks(90.0))
        deadline = time.monotonic() + 30
        while http_json(f"http://127.0.0.1:{self.gateway_port}/health", timeout=5)[0] != 200:
            if time.monotonic() > deadline or (self.gateway or self.daemon).poll() is not None:
                raise RuntimeError(f"the gateway did not become healthy; see {self.raw}")
            time.sleep(0.5)

    def _daemon_router(self, settings: DaemonSettings) -> Router:
        assert self.daemon is not None and (self.daemon_embedded or self.gateway is not None)
        described = settings.described
        if self.daemon_embedded:
            pids, command = (self.daemon.pid,), (f"fairbatching-controlplane serve --config daemon.toml "
                                                 f"--http 127.0.0.1:PORT  # {described}")
        else:
            pids, command = (self.daemon.pid, self.gateway.pid), (
                f"fairbatching-controlplane serve --config daemon.toml  # {described}; "
                "+ gateway --listen 127.0.0.1:PORT")
        return Router(daemon_router_name(settings, self.daemon_embedded), f"http://127.0.0.1:{self.gateway_port}",
                      self.served_model, pids, command)

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
        port, metrics_port = free_ports(2)
        command = [self.smg, "launch", "--host", "127.0.0.1", "--port", str(port),
                   "--worker-urls", *self.server_urls, "--policy", policy,
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                   "--log-level", "warn"]
        if policy in TUNED_SMG.values():
            command += list(self.smg_ca_extra)
        if limits is not None:
            command += ["--max-concurrent-requests", str(limits["max_concurrent"]),
                        "--queue-size", str(limits["queue_size"]),
                        "--queue-timeout-secs", str(limits["queue_timeout_s"])]
        if name in PRIORITY_SMG:
            config = self.raw / f"smg-{tag}-priority.yaml"
            config.write_text(priority_scheduler_yaml(limits, class_ttfts()))
            command += ["--priority-scheduler-enabled", "--priority-scheduler-config", str(config),
                        "--priority-scheduler-default-max-class", "interactive"]
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
        if "--priority-scheduler-config" in shown:
            shown[shown.index("--priority-scheduler-config") + 1] = "PRIORITY.yaml"
        i = shown.index("--worker-urls")
        shown[i + 1:i + 3] = ["http://127.0.0.1:A", "http://127.0.0.1:B"]
        return Router(name, url, self.served_model, (self.smg_process.pid,), shlex.join(shown), limits)

    def stop_smg(self) -> None:
        stop_group(self.smg_process, timeout=10)
        self.smg_process = None

    def restart(self) -> None:
        settings = self.daemon_settings or DaemonSettings()
        embedded = self.daemon_embedded
        self.stop_smg()
        self.stop_daemon()
        for server in self.servers:
            server.stop()
        self.servers = []
        self.restarts += 1
        for i, path in enumerate(self.step_logs):
            self.step_logs[i] = path.with_name(f"{path.stem.split('.')[0]}.{self.restarts}.jsonl")
        self.tails = [StepLogTail(p) for p in self.step_logs]
        self.spawn_daemon(settings, embedded)
        self.start_servers(suffix=f".{self.restarts}")
        self.wait_daemon()

    def close(self) -> None:
        self.stop_smg()
        self.stop_daemon()
        for server in self.servers:
            server.stop()
        self.servers = []
