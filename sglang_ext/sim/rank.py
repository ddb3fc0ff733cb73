"""A simulated rank process: the simulator's engine in real time behind a rank agent.

    python -m sglang_ext.sim.rank --agent-id sim --ranks 2 --time-scale 1.0

SIGTERM drains (``Draining``, the running requests finish, ``Goodbye``, exit 0; at most
``--drain-timeout`` seconds); SIGINT or a second SIGTERM leaves at once.

``--coalesce-ms MS`` (0 to 50, default 0) lets the agent hold output up to MS ms so that
the steps within it share one message (``RankAgent(coalesce_s=...)``): fewer messages per
streamed token, up to MS ms added per token.

Each rank is one :class:`SimEngine` whose virtual clock follows the wall clock
(``virtual = (monotonic - start) / time_scale``): the stepping loop runs one step,
sleeps until the step's virtual end is reached in real time and only then emits its
tokens, so the engine is never more than one step ahead of real time. Outputs are
fake (``" tok"`` per token, deterministic token ids); timings, batching, KV use and
the reported budgets (the default class's PAB and each SLO class's, from the policy's
``class_budgets``) are the simulator's.

``--daemon`` may be given more than once: the ranks then serve every daemon named, each
over an agent of its own (active-active daemons). A rank reports to every daemon that
welcomed it, each report echoing that daemon's own dispatch numbering; its budgets are
the rank's, so they count what either daemon dispatched once it arrived.

A chat dispatch (``Prompt.messages``) is rendered with a fixed template of its own
(:func:`render_chat`) and counted like text.

A dispatch that cannot fit this rank's KV cache even alone is refused as invalid (it
can never be served); one the policy's admission refuses (``+reject`` or the ``*-pab``
policies) is refused for lack of budget (the daemon answers ``no_budget``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import math
import signal
import sys
import time
import zlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from controlplane.cli_args import (
    MAX_COALESCE_MS,
    coalesce_ms,
    positive_float,
    positive_int,
    refuse_repeats,
)
from controlplane.curve import CurvePeer
from controlplane.protocol import Dispatch, FinishReason, Prompt, Welcome, pack_class_budgets
from controlplane.rank_agent import InvalidRequest, NoBudget, OutputSink, RankAgent
from controlplane.reporter import HEARTBEAT_S, MIN_GAP_S, ReportPublisher, ReportThrottle, budget_bucket
from sglang_ext.policy.batch_former import DEFAULT_MAX_TOKEN_BUDGET
from sglang_ext.policy.policies import POLICIES, BatchPolicy, PolicyContext
from sglang_ext.policy.slo import SloCatalog, SloError
from sglang_ext.sim.engine import SimEngine
from sglang_ext.sim.fitting.calibration import offline_step_model
from sglang_ext.sim.profile import (
    PROFILES_DIR,
    HardwareProfile,
    ProfileError,
    bundled_profile_path,
    load_profile,
)
from sglang_ext.sim.runner import PolicySpecError, parse_policy

logger = logging.getLogger(__name__)

DEFAULT_DAEMON = "tcp://127.0.0.1:5561"
DEFAULT_PROFILE = "llama3.1-8b-h100"
DEFAULT_POLICY = "fb-anchor-margin"
DEFAULT_SLO_FILE = PROFILES_DIR.parent / "slo.toml"
CHARS_PER_TOKEN = 4.0  # the daemon's default estimate for text prompts
TOKEN_TEXT = " tok"
VOCAB_SIZE = 32000
EXIT_USAGE = 2


def prompt_tokens(prompt: Prompt) -> int:
    """Token ids count as given; text, and a conversation rendered with
    :func:`render_chat`, count ``ceil(utf8 bytes / CHARS_PER_TOKEN)``."""
    if prompt.token_ids is not None:
        return len(prompt.token_ids)
    text = render_chat(prompt) if prompt.messages is not None else prompt.text or ""
    return max(1, math.ceil(len(text.encode()) / CHARS_PER_TOKEN))


def render_chat(prompt: Prompt) -> str:
    """A simulated rank's chat template (it has no model): ``<|role|>content<|end|>`` per
    turn, then the assistant's header: 20 bytes (5 counted tokens) of markup per turn,
    near the daemon's default ``chat_tokens_per_message``."""
    turns = "".join(f"<|{m.role:>9}|>{m.content}<|end|>" for m in prompt.messages or ())
    return turns + f"<|{'assistant':>9}|>"


def fake_token_ids(request_id: str, start: int, stop: int) -> list[int]:
    base = zlib.crc32(request_id.encode())
    return [(base + index) % VOCAB_SIZE for index in range(start, stop)]


@dataclass(slots=True)
class _Live:
    """One admitted request, as the stepping loop and its ``serve`` share it."""

    received_s: float  # monotonic
    tokens: int = 0  # emitted so far
    first_token_s: float | None = None
    finished: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class SimRank:
    """One simulated rank in real time (see the module docstring)."""

    def __init__(
        self,
        name: str,
        engine: SimEngine,
        catalog: SloCatalog,
        *,
        time_scale: float = 1.0,
        report_interval_s: float = HEARTBEAT_S,
        report_address: str | None = None,  # None: the one the daemon's Welcome names
        clock: Callable[[], float] = time.monotonic,
        curve: CurvePeer | None = None,
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.name = name
        self.engine = engine
        self.catalog = catalog
        self.time_scale = time_scale
        # per daemon (its slot: the agent's index), the latest dispatch ingested
        self.echoed_dispatch_seqs: dict[int, int] = {}
        self.last_step_s = 0.0  # real seconds
        self.publishers: dict[int, ReportPublisher] = {}  # per daemon slot
        self._report_address = report_address
        self._curve = curve
        self._daemon_ids: dict[int, str] = {}
        self._throttle = ReportThrottle(report_interval_s, min(MIN_GAP_S, report_interval_s))
        self._load_key: Hashable = None  # the load as the latest report check saw it
        self._clock = clock
        self._start_s = clock()
        self._live: dict[Hashable, _Live] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()

    def virtual_now(self) -> float:
        return (self._clock() - self._start_s) / self.time_scale

    @property
    def echoed_dispatch_seq(self) -> int:
        """The first daemon's echo (the only one with a single daemon)."""
        return self.echoed_dispatch_seqs.get(0, 0)

    @property
    def publisher(self) -> ReportPublisher | None:
        """The first daemon's publisher (the only one with a single daemon)."""
        return self.publishers.get(0)

    # ---------------------------------------------------------------- RankEngine
    def welcomed(self, welcome: Welcome, slot: int = 0) -> None:
        """``slot``: which of the rank's daemons welcomed it (the index of its agent)."""
        if welcome.daemon_id != self._daemon_ids.get(slot):
            self._daemon_ids[slot] = welcome.daemon_id
            self.echoed_dispatch_seqs[slot] = 0  # a new daemon numbers this rank's dispatches from 1
            self._wake.set()
        address = self._report_address or welcome.report_address
        current = self.publishers.get(slot)
        if current and (current.address, current.epoch) == (address, welcome.epoch):
            return
        if current:
            current.close()
        self.publishers[slot] = ReportPublisher(address, self.name, welcome.epoch, curve=self._curve)
        self._wake.set()

    async def serve(self, dispatch: Dispatch, sink: OutputSink, slot: int = 0) -> None:
        received_s = self._clock()
        # NOTE: the latest, not the highest: dispatches arrive in order, and a daemon that
        # forgot the rank (restarted, or found it lost) numbers them from 1 again.
        self.echoed_dispatch_seqs[slot] = dispatch.dispatch_seq
        self._wake.set()
        prompt = prompt_tokens(dispatch.prompt)
        output = dispatch.sampling.max_new_tokens
        try:
            slo = self.catalog.resolve(dispatch.slo.as_custom_params() if dispatch.slo else None)
        except SloError as error:
            raise InvalidRequest(str(error)) from None
        refusal = self.engine.policy.refusal(slo)
        if refusal is not None:
            raise InvalidRequest(f"unserviceable SLO: {refusal}")
        if prompt + output > self.engine.kv_capacity:
            raise InvalidRequest(
                f"prompt ({prompt} tokens) + max_new_tokens ({output}) exceeds the rank's KV "
                f"capacity of {self.engine.kv_capacity} tokens"
            )
        engine_id = (dispatch.request_id, next(self._ids))  # an id may come back after it ends
        now = self.virtual_now()
        if not self.engine.has_work:
            self.engine.advance_to(now)  # an idle engine's clock jumps to the present
        slo_class = (dispatch.slo and dispatch.slo.slo_class) or self.catalog.default_class
        if not self.engine.submit(engine_id, min(now, self.engine.now), prompt, output, slo,
                                  slo_class):
            del self.engine.records[engine_id]
            raise NoBudget(f"rank refused admission: a prompt of {prompt} tokens exceeds its "
                           "admission budget for the request's SLO")
        live = self._live[engine_id] = _Live(received_s)
        try:
            sent = 0
            while True:
                # NOTE: read once: the stepping loop moves on while emit() waits for room
                target, finished = live.tokens, live.finished
                if target > sent:
                    token_ids = fake_token_ids(dispatch.request_id, sent, target)
                    await sink.emit(token_ids, TOKEN_TEXT * len(token_ids))
                    sent = target
                elif finished:
                    break
                else:
                    await live.changed.wait()
                    live.changed.clear()
            await sink.finish(
                FinishReason.LENGTH, prompt_tokens=prompt,
                ttft_s=live.first_token_s - received_s, latency_s=self._clock() - received_s,
            )
        finally:
            del self._live[engine_id]
            self.engine.abort(engine_id)
            self._wake.set()  # the load changed: the next report check sees it
            del self.engine.records[engine_id]  # a long-running rank keeps no history

    # ---------------------------------------------------------------- stepping loop
    async def run(self) -> None:
        """Step while there is work (in real time), publish reports; until cancelled."""
        try:
            while True:
                if self.engine.has_work:
                    await self._step()
                else:
                    await self._idle()
                self._maybe_report()
        finally:
            for publisher in self.publishers.values():
                publisher.close()

    async def _step(self) -> None:
        engine = self.engine
        start, steps = engine.now, engine.steps
        engine.step()
        if engine.steps > steps:
            self.last_step_s = (engine.now - start) * self.time_scale
        await self._sleep_until(engine.now)
        now_s = self._clock()
        for event in engine.drain_tokens():
            live = self._live.get(event.req_id)
            if live is None:  # aborted while its step ran
                continue
            live.tokens = event.index + 1
            if live.first_token_s is None:
                live.first_token_s = now_s
            live.finished = event.finished
            live.changed.set()

    async def _idle(self) -> None:
        timeout = None
        if self.publishers:
            timeout = max(0.0, self._throttle.next_due_s(self._load_key) - self._clock())
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            pass
        self._wake.clear()

    async def _sleep_until(self, virtual_s: float) -> None:
        delay = (virtual_s - self.virtual_now()) * self.time_scale
        await asyncio.sleep(max(0.0, delay))  # NOTE: yields even when behind real time

    def _maybe_report(self) -> None:
        """One report to each daemon, when due: the same load, each daemon's own echo."""
        if not self.publishers:
            return
        active = self.engine.active_requests
        waiting = sum(1 for r in active if r.context == 0)
        pab_tokens = self.engine.prefill_admission_budget()
        echoes = tuple(sorted(self.echoed_dispatch_seqs.items()))
        key = (len(active) - waiting, waiting, echoes, budget_bucket(pab_tokens))
        self._load_key = key
        now_s = self._clock()
        if not self._throttle.due(now_s, key):
            return
        total_tokens = sum(r.context + r.pending_prefill for r in active)
        class_budgets = self.reported_class_budgets(active)
        for slot, publisher in self.publishers.items():
            publisher.publish(
                pab_tokens=pab_tokens,
                running=key[0],
                waiting=waiting,
                total_tokens=total_tokens,
                free_kv_tokens=self.engine.kv_capacity - self.engine.kv_used,
                echoed_dispatch_seq=self.echoed_dispatch_seqs.get(slot, 0),
                step_time_s=self.last_step_s,
                class_budgets=class_budgets,
            )
        self._throttle.published(now_s, key)

    def reported_class_budgets(self, active: Sequence[object]) -> dict:
        """Each SLO class's budget from the engine's state, as a report carries it."""
        classes = self.catalog.classes
        self.engine.policy.observe_kv(self.engine.kv_outlook())
        budgets = self.engine.policy.class_budgets(active, self.engine.now, classes)
        return pack_class_budgets(budgets, {name: slo.ttft_s for name, slo in classes.items()})


class SimRanks:
    """The :class:`controlplane.rank_agent.RankEngine` of a process hosting sim ranks
    (for its first daemon; :meth:`via` for each other one)."""

    def __init__(self, ranks: Mapping[str, SimRank]) -> None:
        self.ranks = dict(ranks)

    async def serve(self, dispatch: Dispatch, sink: OutputSink) -> None:
        await self.ranks[dispatch.rank].serve(dispatch, sink)

    def welcomed(self, welcome: Welcome) -> None:
        self.ranks[welcome.rank].welcomed(welcome)

    def via(self, slot: int) -> _DaemonSlot:
        """The engine of the agent that serves daemon ``slot`` (0: the first)."""
        return _DaemonSlot(self, slot)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            for name, rank in self.ranks.items():
                group.create_task(rank.run(), name=f"sim rank {name}")


@dataclass(frozen=True, slots=True)
class _DaemonSlot:
    sims: SimRanks
    slot: int

    async def serve(self, dispatch: Dispatch, sink: OutputSink) -> None:
        await self.sims.ranks[dispatch.rank].serve(dispatch, sink, self.slot)

    def welcomed(self, welcome: Welcome) -> None:
        self.sims.ranks[welcome.rank].welcomed(welcome, self.slot)


def make_policy(name: str, profile: HardwareProfile, catalog: SloCatalog) -> BatchPolicy:
    spec = parse_policy(name)
    step_model = offline_step_model(profile)
    context = PolicyContext(
        global_slo=catalog.default,
        initial_step_model=step_model.model,
        initial_linear_model=step_model.linear,
        max_token_budget=DEFAULT_MAX_TOKEN_BUDGET,
        gpu_memory_gb=profile.memory_gb,
        token_budget=spec.token_budget,
        settings=spec.settings,
    )
    return POLICIES.get(spec.base)(context)


def load_named_profile(name: str) -> HardwareProfile:
    path = Path(name)
    if path.suffix == ".toml" or path.exists():
        return load_profile(path)
    return load_profile(bundled_profile_path(name))


def build_sim_ranks(
    names: Sequence[str],
    *,
    profile: HardwareProfile,
    policy: str,
    catalog: SloCatalog,
    seed: int = 0,
    time_scale: float = 1.0,
    report_interval_s: float = HEARTBEAT_S,
    report_address: str | None = None,
    curve: CurvePeer | None = None,
) -> SimRanks:
    return SimRanks({
        name: SimRank(
            name,
            SimEngine(profile, make_policy(policy, profile, catalog), seed=seed + index,
                      record_tokens=True),
            catalog,
            time_scale=time_scale,
            report_interval_s=report_interval_s,
            report_address=report_address,
            curve=curve,
        )
        for index, name in enumerate(names)
    })


# -------------------------------------------------------------------- process
def check_address(address: str | None) -> None:
    if address is None:
        return
    socket = zmq.Context.instance().socket(zmq.PUSH)
    try:
        socket.connect(address)
    except zmq.ZMQError as error:
        raise ValueError(f"cannot connect to {address!r}: {error}") from None
    finally:
        socket.close(linger=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_ext.sim.rank",
        description="Serve simulated ranks (the simulator's engine in real time) to a "
                    "FairBatching control-plane daemon.",
    )
    parser.add_argument("--daemon", action="append", metavar="ADDRESS",
                        help=f"a daemon's rank address (default {DEFAULT_DAEMON}); repeat it "
                             "to serve several daemons at once")
    parser.add_argument("--report-address",
                        help="where reports go (default: where each daemon's Welcome says; "
                             "with one daemon only)")
    parser.add_argument("--agent-id", default="sim", help="this agent's routing id")
    names = parser.add_mutually_exclusive_group()
    names.add_argument("--rank", help="the rank's name (default: the agent id)")
    names.add_argument("--ranks", type=positive_int,
                       help="host N ranks named AGENT/0 .. AGENT/N-1")
    parser.add_argument("--profile", default=DEFAULT_PROFILE,
                        help="bundled profile name or TOML path")
    parser.add_argument("--policy", default=DEFAULT_POLICY,
                        help="simulator policy, NAME or NAME@BUDGET")
    parser.add_argument("--slo-file", type=Path, default=DEFAULT_SLO_FILE, help="SLO classes TOML")
    parser.add_argument("--time-scale", type=positive_float, default=1.0,
                        help="real seconds per simulated second")
    parser.add_argument("--seed", type=int, default=0, help="GPU noise seed (rank i uses seed+i)")
    parser.add_argument("--report-interval-ms", type=positive_float, default=HEARTBEAT_S * 1e3,
                        help="report at least this often (and after a step that changed the load)")
    parser.add_argument("--coalesce-ms", type=coalesce_ms, default=0.0, metavar="MS",
                        help="hold output up to MS ms so that the engine steps within it share "
                             "one message: fewer messages per streamed token when steps are "
                             "shorter than MS, up to MS ms added per token (0, the default: "
                             f"each step's output at once; at most {MAX_COALESCE_MS:g})")
    parser.add_argument("--curve-server-key", metavar="FILE",
                        help="the daemon's public key (.key), when it serves CURVE")
    parser.add_argument("--curve-secret-key", metavar="FILE",
                        help="this rank's key pair (.key_secret); its .key must be authorized")
    parser.add_argument("--drain-timeout", type=positive_float, default=30.0, metavar="S",
                        help="on SIGTERM, let running requests finish for at most S seconds")
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"))
    refuse_repeats(parser, {
        "--rank": "one rank's name; --ranks N hosts N ranks named AGENT/0 .. AGENT/N-1",
        "--policy": "every rank of an agent runs the one policy; start one agent per policy",
    })
    return parser


async def serve(agents: RankAgent | Sequence[RankAgent], sims: SimRanks,
                drain_timeout_s: float = 30.0) -> int:
    """Run until SIGTERM (drain) or SIGINT (0), or until every agent's ranks are fenced
    (1); says Goodbye."""
    agents = [agents] if isinstance(agents, RankAgent) else list(agents)
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()

    def on_sigterm() -> None:
        first = not signalled.is_set()
        signalled.set()
        for agent in agents:
            agent.drain(drain_timeout_s) if first else agent.stop()

    def on_sigint() -> None:
        signalled.set()
        for agent in agents:
            agent.stop()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    loop.add_signal_handler(signal.SIGINT, on_sigint)
    try:
        async with asyncio.TaskGroup() as group:
            stepping = group.create_task(sims.run(), name="sim ranks")
            await asyncio.gather(*(agent.run() for agent in agents))
            stepping.cancel()
    finally:
        await asyncio.gather(*(agent.close(goodbye=True) for agent in agents))
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    if signalled.is_set():
        return 0
    logger.error("every rank was fenced by the daemon; exiting")
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = [args.rank or args.agent_id]
    if args.ranks:
        names = [f"{args.agent_id}/{index}" for index in range(args.ranks)]
    try:
        profile = load_named_profile(args.profile)
        catalog = SloCatalog.from_toml(args.slo_file)
        curve = CurvePeer.from_optional_files(args.curve_server_key, args.curve_secret_key)
        sims = build_sim_ranks(
            names, profile=profile, policy=args.policy, catalog=catalog, seed=args.seed,
            time_scale=args.time_scale, report_interval_s=args.report_interval_ms / 1e3,
            report_address=args.report_address, curve=curve,
        )
        daemons = args.daemon or [DEFAULT_DAEMON]
        if len(set(daemons)) != len(daemons):
            raise ValueError(f"--daemon names one daemon twice: {daemons}")
        if args.report_address and len(daemons) > 1:
            raise ValueError("--report-address applies to one daemon; with several, each "
                             "daemon's Welcome says where its reports go")
        for address in (*daemons, args.report_address):
            check_address(address)
        epoch = time.time_ns()
        agents = [RankAgent(address, args.agent_id, names, sims.via(slot), epoch=epoch,
                            curve=curve, coalesce_s=args.coalesce_ms / 1e3)
                  for slot, address in enumerate(daemons)]
    except (ProfileError, SloError, PolicySpecError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logger.info("agent %s serving %s (epoch %d) to %s", args.agent_id, ", ".join(names),
                epoch, ", ".join(daemons))
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(agents, sims, args.drain_timeout))
    return uvloop.run(serve(agents, sims, args.drain_timeout))


if __name__ == "__main__":
    sys.exit(main())
