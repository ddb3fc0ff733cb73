"""An SGLang server as one control-plane rank per DP rank (``docs/controlplane.md``).

Switched on by environment variables read in every SGLang process::

    FAIRBATCHING_CONTROLPLANE=tcp://127.0.0.1:5561          # the daemon's rank address
    FAIRBATCHING_CONTROLPLANE_REPORTS=tcp://127.0.0.1:5562  # its report address
    FAIRBATCHING_RANK_NAME=<prefix>                         # optional; default <host>:<port>
    FAIRBATCHING_CONTROLPLANE_CURVE_SERVER_KEY=<daemon.key>  # optional, both or neither:
    FAIRBATCHING_CONTROLPLANE_CURVE_SECRET_KEY=<own.key_secret>  # a daemon serving CURVE
    FAIRBATCHING_CONTROLPLANE_COALESCE_MS=<0..50>           # optional; default 0

Active-active daemons: both addresses take comma-separated lists, paired in order
(``FAIRBATCHING_CONTROLPLANE=tcp://a:5561,tcp://b:5561`` with
``FAIRBATCHING_CONTROLPLANE_REPORTS=tcp://a:5562,tcp://b:5562``). The server then runs one
agent per daemon, and each scheduler publishes its reports to every daemon. A dispatch
carries its daemon's slot (the index in the list) with its sequence number
(``_fairbatching_controlplane_seq``: ``[slot, seq]``), and each daemon's reports echo its
own numbering.

FairBatching must be on (``FAIRBATCHING_CONFIG``): reports carry the PAB its policy
computes, and without one the daemon's ``pab`` policy could never route here.

``FAIRBATCHING_CONTROLPLANE_COALESCE_MS`` lets the agent hold an engine step's output up to
that long so that the steps within it share one message (``RankAgent(coalesce_s=...)``):
fewer messages per streamed token when steps are shorter than the window, at the cost of
up to that much added latency per token. 0 (the default) sends each event-loop pass's
output at once. Negative, non-numeric or above 50 ms is refused at start-up (a longer
window would eat a 50 ms TPOT SLO on its own).

- **Ingress** (the HTTP / TokenizerManager process): a :class:`controlplane.rank_agent.RankAgent`
  with agent id ``<prefix>`` serves ranks ``<prefix>/0 .. <prefix>/<dp_size-1>``. It runs
  as a task of the TokenizerManager (``asyncio_tasks``), started when SGLang creates the
  TokenizerManager's handle loop (the start-up warmup request, else the first request).
  On SIGTERM, SGLang lets its running requests finish before it exits; the agent
  follows suit: ``Draining`` (the daemon dispatches nothing new here), its requests
  finish with their ``Done``, then ``Goodbye``. Its engine,
  :class:`SGLangRankEngine`, turns each ``Dispatch`` into a
  ``GenerateReqInput``, pinned with ``routed_dp_rank`` when ``dp_size > 1`` (a chat
  conversation goes through SGLang's own chat handler, so the server's chat template
  renders it), and feeds ``TokenizerManager.generate_request``; a request the client did
  not stream is not streamed here either (SGLang yields its output once, at the finish, and
  the agent sends it once, in the ``Done``). A request the admission gate refuses
  (:mod:`sglang_ext.adapter.admission.budget_refusal`, checked against the rank it is pinned to) ends with
  ``Done(no_budget=True)``: the daemon answers the client ``no_budget`` (retryable,
  with its ``retry_after_s``) and releases the debit; it does not re-dispatch it.
- **Reports** come from each scheduler process (:mod:`sglang_ext.adapter.scheduler.controlplane_reports`).
- **Epoch**: one per server incarnation, shared by the ingress (``Hello``) and every
  scheduler (``Report``). The server's first process (the launcher, which SGLang makes
  load the plugins before it spawns anything) sets ``FAIRBATCHING_RANK_EPOCH`` to
  ``time.time_ns()``; the spawned processes inherit it.

Importing this module imports neither sglang nor zmq: a bad variable is reported before
any SGLang process starts.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import re
import socket
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from controlplane.cli_args import parse_coalesce_ms  # stdlib only

logger = logging.getLogger("sglang_ext.fairbatching")

CONTROLPLANE_ENV = "FAIRBATCHING_CONTROLPLANE"
REPORTS_ENV = "FAIRBATCHING_CONTROLPLANE_REPORTS"
RANK_NAME_ENV = "FAIRBATCHING_RANK_NAME"
EPOCH_ENV = "FAIRBATCHING_RANK_EPOCH"
CURVE_SERVER_KEY_ENV = "FAIRBATCHING_CONTROLPLANE_CURVE_SERVER_KEY"
CURVE_SECRET_KEY_ENV = "FAIRBATCHING_CONTROLPLANE_CURVE_SECRET_KEY"
COALESCE_ENV = "FAIRBATCHING_CONTROLPLANE_COALESCE_MS"

INGRESS_ATTR = "fairbatching_controlplane"  # on the TokenizerManager
#: a dispatch's ``[daemon slot, dispatch seq]`` in ``custom_params``; each scheduler echoes
#: the highest seq per slot in that daemon's reports
CONTROLPLANE_SEQ_KEY = "_fairbatching_controlplane_seq"
MAX_DAEMONS = 8
RID_REUSE_WAIT_S = 2.0  # a re-dispatched id waits this long for its aborted predecessor

_TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_SIGNAL_HANDLER = "sglang.srt.managers.tokenizer_manager.SignalHandler"
_RANK_ID = re.compile(r"^[\x21-\x7e]+$")
_MAX_RANK_ID = 64
_ADDRESS = re.compile(r"^(tcp://[^\s]+:\d+|ipc://\S+)$")
_ANY_HOST = {"", "0.0.0.0", "::", "[::]"}


class ControlPlaneConfigError(ValueError):
    """A malformed or incomplete ``FAIRBATCHING_CONTROLPLANE*`` setting."""


@dataclass(frozen=True)
class ControlPlaneSettings:
    rank_addresses: tuple[str, ...]  # one per daemon (active-active: several)
    report_addresses: tuple[str, ...]  # paired with rank_addresses
    rank_prefix: str | None  # None: <host>:<port> of the server
    epoch: int
    curve_server_key: str | None = None  # the daemon's .key, when it serves CURVE
    curve_secret_key: str | None = None  # this server's .key_secret
    coalesce_s: float = 0.0  # how long the agent holds output to share a message

    @property
    def rank_address(self) -> str:
        """The first daemon's rank address."""
        return self.rank_addresses[0]

    @property
    def report_address(self) -> str:
        """The first daemon's report address."""
        return self.report_addresses[0]

    def curve_peer(self) -> Any:
        """The :class:`controlplane.curve.CurvePeer` for this server's sockets, or None."""
        from controlplane.curve import CurvePeer

        return CurvePeer.from_optional_files(self.curve_server_key, self.curve_secret_key)


# --------------------------------------------------------------------- settings
def settings_from_environment(
    environ: MutableMapping[str, str] | None = None, *, fairbatching_on: bool
) -> ControlPlaneSettings | None:
    """The control-plane settings, or None when ``FAIRBATCHING_CONTROLPLANE`` is unset.
    Also makes sure this server incarnation has its epoch (:func:`ensure_epoch`)."""
    env = os.environ if environ is None else environ
    rank_address = env.get(CONTROLPLANE_ENV, "").strip()
    report_address = env.get(REPORTS_ENV, "").strip()
    coalesce_text = env.get(COALESCE_ENV, "").strip()
    if not rank_address:
        if report_address:
            raise ControlPlaneConfigError(
                f"{REPORTS_ENV} is set but {CONTROLPLANE_ENV} is not; set both to join a "
                "control plane, or neither"
            )
        if coalesce_text:
            raise ControlPlaneConfigError(
                f"{COALESCE_ENV} is set but {CONTROLPLANE_ENV} is not; it only applies to a "
                "server that joins a control plane"
            )
        return None
    if not report_address:
        raise ControlPlaneConfigError(
            f"{CONTROLPLANE_ENV}={rank_address} needs {REPORTS_ENV} (the daemon's report "
            "address): each scheduler process publishes its own load reports"
        )
    if not fairbatching_on:
        raise ControlPlaneConfigError(
            f"{CONTROLPLANE_ENV} needs FairBatching on (set FAIRBATCHING_CONFIG): a rank "
            "reports the Prefill Admission Budget its FairBatching policy computes"
        )
    rank_addresses = _address_list(CONTROLPLANE_ENV, rank_address)
    report_addresses = _address_list(REPORTS_ENV, report_address)
    if len(rank_addresses) != len(report_addresses):
        raise ControlPlaneConfigError(
            f"{CONTROLPLANE_ENV} names {len(rank_addresses)} daemons and {REPORTS_ENV} "
            f"{len(report_addresses)}: give each daemon's report address, in the same order"
        )
    prefix = env.get(RANK_NAME_ENV, "").strip() or None
    if prefix is not None:
        check_rank_prefix(prefix, dp_size=1, source=RANK_NAME_ENV)
    try:
        coalesce_ms = parse_coalesce_ms(coalesce_text) if coalesce_text else 0.0
    except ValueError as error:
        raise ControlPlaneConfigError(f"{COALESCE_ENV}: {error}") from None
    server_key = env.get(CURVE_SERVER_KEY_ENV, "").strip() or None
    secret_key = env.get(CURVE_SECRET_KEY_ENV, "").strip() or None
    settings = ControlPlaneSettings(rank_addresses, report_addresses, prefix, ensure_epoch(env),
                                    server_key, secret_key, coalesce_s=coalesce_ms / 1e3)
    try:
        settings.curve_peer()
    except ValueError as error:  # controlplane.curve.CurveError
        raise ControlPlaneConfigError(f"{CURVE_SERVER_KEY_ENV} / {CURVE_SECRET_KEY_ENV}: {error}") from None
    return settings


def _address_list(name: str, text: str) -> tuple[str, ...]:
    addresses = tuple(part.strip() for part in text.split(","))
    for address in addresses:
        if not _ADDRESS.match(address):
            raise ControlPlaneConfigError(
                f"{name}={text!r}: expected tcp://host:port or ipc://path (comma-separated "
                "for several daemons)"
            )
    if len(set(addresses)) != len(addresses) or len(addresses) > MAX_DAEMONS:
        raise ControlPlaneConfigError(
            f"{name}={text!r}: at most {MAX_DAEMONS} distinct addresses"
        )
    return addresses


def ensure_epoch(environ: MutableMapping[str, str]) -> int:
    """This incarnation's epoch. The server's first process (no multiprocessing parent)
    always draws a fresh one, so a value left in the caller's shell cannot make a
    restarted server look like the old one; spawned processes inherit it."""
    root = multiprocessing.parent_process() is None
    value = environ.get(EPOCH_ENV, "")
    if not root:
        try:
            epoch = int(value)
        except ValueError:
            epoch = 0
        if 1 <= epoch < 2**63:
            return epoch
        logger.warning("%s missing in a spawned process; drawing a new epoch", EPOCH_ENV)
    epoch = time.time_ns()
    environ[EPOCH_ENV] = str(epoch)
    return epoch


def check_rank_prefix(prefix: str, dp_size: int, source: str = "rank prefix") -> None:
    longest = f"{prefix}/{max(0, dp_size - 1)}"
    if not _RANK_ID.match(prefix) or len(longest) > _MAX_RANK_ID:
        raise ControlPlaneConfigError(
            f"{source}={prefix!r}: rank names ({longest!r}) must be printable ASCII without "
            f"spaces and at most {_MAX_RANK_ID} characters"
        )


def default_rank_prefix(host: str | None, port: int) -> str:
    """``<host>:<port>``; a wildcard bind address becomes this machine's host name."""
    host = (host or "").strip()
    if host in _ANY_HOST:
        host = socket.gethostname()
    return f"{host}:{port}"


def rank_prefix_of(settings: ControlPlaneSettings, server_args: Any) -> str:
    return settings.rank_prefix or default_rank_prefix(server_args.host, server_args.port)


def rank_names(prefix: str, dp_size: int) -> list[str]:
    return [f"{prefix}/{index}" for index in range(dp_size)]


def check_server_args(server_args: Any) -> None:
    """Refuse server configurations a rank cannot serve correctly (at start-up)."""
    problems = []
    if getattr(server_args, "tokenizer_worker_num", 1) != 1:
        problems.append("--tokenizer-worker-num > 1 (one agent per server is needed)")
    if getattr(server_args, "enable_dp_attention", False):
        problems.append("--enable-dp-attention (ranks are DP replicas)")
    if getattr(server_args, "dp_size", 1) > 1 and getattr(server_args, "load_balance_method", "") == "pab":
        problems.append(
            "--load-balance-method pab (the daemon picks each request's DP rank itself and "
            "pins it there; keep SGLang's default method)"
        )
    if problems:
        raise ControlPlaneConfigError(
            f"{CONTROLPLANE_ENV} is set but this server cannot be a control-plane rank: "
            + "; ".join(problems)
        )


# --------------------------------------------------------------------- conversion
def dispatch_custom_params(dispatch: Any, daemon_slot: int) -> dict[str, Any]:
    """What a dispatch tells its rank's scheduler: its daemon's slot and sequence number
    (echoed in that daemon's reports) and its SLO."""
    custom_params: dict[str, Any] = {CONTROLPLANE_SEQ_KEY: [daemon_slot, dispatch.dispatch_seq]}
    if dispatch.slo is not None:
        custom_params["slo"] = dispatch.slo.as_custom_params()
    return custom_params


def generate_request_input(dispatch: Any, dp_index: int, dp_size: int, daemon_slot: int = 0) -> Any:
    """The ``GenerateReqInput`` for one ``Dispatch`` (streamed when the dispatch is: an
    unstreamed one yields once, its whole output, at the finish; pinned to ``dp_index``
    when the server has several DP ranks)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    sampling = dispatch.sampling
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_new_tokens": sampling.min_new_tokens,
        "ignore_eos": sampling.ignore_eos,
    }
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    params["custom_params"] = dispatch_custom_params(dispatch, daemon_slot)
    prompt = dispatch.prompt
    return GenerateReqInput(
        rid=dispatch.request_id,
        text=prompt.text,
        input_ids=list(prompt.token_ids) if prompt.token_ids is not None else None,
        sampling_params=params,
        stream=dispatch.stream,
        routed_dp_rank=dp_index if dp_size > 1 else None,
    )


def chat_request_input(dispatch: Any, serving_chat: Any, dp_index: int, dp_size: int,
                       daemon_slot: int = 0) -> Any:
    """The ``GenerateReqInput`` for a ``Dispatch`` whose prompt is ``messages``: what
    SGLang's own ``/v1/chat/completions`` handler (``serving_chat``, the server's
    ``OpenAIServingChat``) makes of the same conversation (its chat template, the
    template's stop strings, its content format), streamed as the dispatch is, with its id,
    sampling, SLO and dispatch sequence, pinned like :func:`generate_request_input`.
    Raises ``ValueError`` for a conversation the model cannot take, naming why."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    if not has_chat_template(serving_chat.template_manager, serving_chat.tokenizer_manager.tokenizer):
        raise ValueError("the model has no chat template (start its server with --chat-template, "
                         "or send a prompt to /v1/completions)")
    sampling = dispatch.sampling
    custom_params = dispatch_custom_params(dispatch, daemon_slot)
    messages = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
                for m in dispatch.prompt.messages]
    request = ChatCompletionRequest(
        messages=messages, max_completion_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        min_tokens=sampling.min_new_tokens, stop=list(sampling.stop) or None,
        ignore_eos=sampling.ignore_eos, seed=sampling.seed, stream=dispatch.stream, rid=dispatch.request_id,
        routed_dp_rank=dp_index if dp_size > 1 else None, custom_params=custom_params,
    )
    obj, _ = serving_chat._convert_to_internal_request(request, None)
    return obj


def has_chat_template(template_manager: Any, tokenizer: Any) -> bool:
    """Whether SGLang can render a conversation for this model: a named or Python chat
    template chosen by the server, or a Jinja template in the tokenizer."""
    return (template_manager.chat_template_name is not None
            or template_manager.python_chat_template is not None
            or getattr(tokenizer, "chat_template", None) is not None)


def server_serving_chat() -> Any:
    """The server's ``OpenAIServingChat`` (made at start-up, in this process)."""
    from sglang.srt.entrypoints import http_server

    serving_chat = getattr(http_server.app.state, "openai_serving_chat", None)
    if serving_chat is None:
        raise RuntimeError("this SGLang server has no chat handler (not started by launch_server?)")
    return serving_chat


@dataclass(frozen=True)
class FinishOutcome:
    """How SGLang ended a request, in the control plane's terms."""

    reason: str  # a controlplane.protocol.FinishReason value
    error: str = ""
    invalid: bool = False


def finish_outcome(meta_info: Mapping[str, Any] | None) -> FinishOutcome | None:
    """The outcome a chunk's ``meta_info["finish_reason"]`` states; None while running.

    length / stop are themselves; an abort with a 400 status is a request SGLang refused
    (invalid), one with another 4xx/5xx status an error, and one without a status
    (``/abort_request``, a scheduler-side abort) a cancellation."""
    finish = (meta_info or {}).get("finish_reason")
    if not finish:
        return None
    if not isinstance(finish, Mapping):
        return FinishOutcome("error", f"unrecognised finish reason {finish!r}")
    kind = finish.get("type")
    if kind in ("length", "stop"):
        return FinishOutcome(kind)
    if kind == "abort":
        message = str(finish.get("message") or "aborted")
        status = finish.get("status_code")
        if status == 400:
            return FinishOutcome("error", message, invalid=True)
        if isinstance(status, int) and status >= 400:
            return FinishOutcome("error", f"{status}: {message}")
        return FinishOutcome("cancelled", message)
    return FinishOutcome("error", f"unrecognised finish reason {finish!r}")


class OutputDeltas:
    """New token ids and text of each streamed chunk: SGLang's stream is cumulative by
    default (``output_ids`` / ``text`` so far), incremental with
    ``--incremental-streaming-output``."""

    def __init__(self, incremental: bool) -> None:
        self.incremental = incremental
        self._ids_seen = 0
        self._text_seen = 0

    def delta(self, chunk: Mapping[str, Any]) -> tuple[list[int], str]:
        ids = chunk.get("output_ids") or []
        text = chunk.get("text") or ""
        if self.incremental:
            return [int(t) for t in ids], text
        new_ids = [int(t) for t in ids[self._ids_seen:]]
        self._ids_seen = max(self._ids_seen, len(ids))
        new_text = text[self._text_seen:]
        self._text_seen = max(self._text_seen, len(text))
        return new_ids, new_text


# --------------------------------------------------------------------- engine
class SGLangRankEngine:
    """``controlplane.rank_agent.RankEngine`` over a TokenizerManager."""

    def __init__(self, tokenizer_manager: Any, dp_index: Mapping[str, int], dp_size: int,
                 report_address: str, rid_reuse_wait_s: float = RID_REUSE_WAIT_S,
                 daemon_slot: int = 0) -> None:
        """``daemon_slot``: which of the server's daemons this engine's agent serves."""
        self.tokenizer_manager = tokenizer_manager
        self.dp_index = dict(dp_index)
        self.dp_size = dp_size
        self.report_address = report_address
        self.daemon_slot = daemon_slot
        self.rid_reuse_wait_s = rid_reuse_wait_s
        self._warned_report_address = False

    def welcomed(self, welcome: Any) -> None:
        if welcome.report_address != self.report_address and not self._warned_report_address:
            self._warned_report_address = True
            logger.warning(
                "control plane: the daemon takes reports at %s but this server's schedulers "
                "publish to %s=%s", welcome.report_address, REPORTS_ENV, self.report_address,
            )

    async def serve(self, dispatch: Any, sink: Any) -> None:
        from controlplane.protocol import FinishReason
        from controlplane.rank_agent import InvalidRequest, NoBudget
        from sglang_ext.adapter.admission.budget_refusal import AdmissionRefused

        tm = self.tokenizer_manager
        received = time.monotonic()
        dp_index = self.dp_index[dispatch.rank]
        if dispatch.prompt.messages is None:
            obj = generate_request_input(dispatch, dp_index, self.dp_size, self.daemon_slot)
        else:
            try:
                obj = chat_request_input(dispatch, server_serving_chat(), dp_index, self.dp_size,
                                         self.daemon_slot)
            except ValueError as error:  # SGLang's handler answers these with a 400
                raise InvalidRequest(str(error)) from None
        await self._wait_rid_free(dispatch.request_id)
        # an unstreamed request's one chunk holds its whole output, whatever the server's mode
        deltas = OutputDeltas(dispatch.stream and bool(getattr(tm, "incremental_streaming_output", False)))
        first_token_at: float | None = None
        outcome: FinishOutcome | None = None
        prompt_tokens = 0
        stream = tm.generate_request(obj, None)
        try:
            async for chunk in stream:
                token_ids, text = deltas.delta(chunk)
                if token_ids and first_token_at is None:
                    first_token_at = time.monotonic()
                await sink.emit(token_ids, text)
                meta_info = chunk.get("meta_info") or {}
                prompt_tokens = int(meta_info.get("prompt_tokens") or prompt_tokens)
                outcome = finish_outcome(meta_info) or outcome
        except ValueError as error:  # SGLang's "bad request" (HTTP 400)
            raise InvalidRequest(str(error)) from None
        except AdmissionRefused as error:  # the admission gate (HTTP 429)
            raise NoBudget(error.detail) from None
        except asyncio.CancelledError:
            tm.abort_request(dispatch.request_id)  # idempotent; generate_request aborts too
            raise
        finally:
            await _close_quietly(stream)  # a stream left mid-way releases its state now
        finished = time.monotonic()
        if outcome is None:
            outcome = FinishOutcome("error", "SGLang ended the stream without a finish reason")
        await sink.finish(
            FinishReason(outcome.reason), prompt_tokens=prompt_tokens,
            ttft_s=None if first_token_at is None else first_token_at - received,
            latency_s=finished - received, error=outcome.error, invalid=outcome.invalid,
        )

    async def _wait_rid_free(self, rid: str) -> None:
        """An aborted request keeps its SGLang state until the scheduler confirms; the
        same id dispatched again meanwhile waits for that instead of failing as a duplicate."""
        states = getattr(self.tokenizer_manager, "rid_to_state", {})
        if rid not in states:
            return
        deadline = time.monotonic() + self.rid_reuse_wait_s
        while rid in states:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"request id {rid} is still running on this server")
            await asyncio.sleep(0.01)


async def _close_quietly(stream: Any) -> None:
    try:
        await stream.aclose()
    except (RuntimeError, ValueError):
        pass


# --------------------------------------------------------------------- ingress
class ControlPlaneIngress:
    """The rank agent of one TokenizerManager: built (and checked) with it, run on its
    event loop as one of its ``asyncio_tasks``."""

    def __init__(self, tokenizer_manager: Any, settings: ControlPlaneSettings) -> None:
        server_args = tokenizer_manager.server_args
        check_server_args(server_args)
        self.tokenizer_manager = tokenizer_manager
        self.settings = settings
        self.prefix = rank_prefix_of(settings, server_args)
        self.dp_size = max(1, int(getattr(server_args, "dp_size", 1) or 1))
        check_rank_prefix(self.prefix, self.dp_size)
        self.ranks = rank_names(self.prefix, self.dp_size)
        self.agents: list[Any] = []  # one per daemon
        self.task: asyncio.Task[None] | None = None
        self._stopping = False
        self._draining = False

    def start(self) -> None:
        """Start the agent on the running loop (once)."""
        if self.task is not None:
            return
        from controlplane.rank_agent import RankAgent

        settings = self.settings
        dp_index = {r: i for i, r in enumerate(self.ranks)}
        for slot, (rank_address, report_address) in enumerate(
                zip(settings.rank_addresses, settings.report_addresses)):
            engine = SGLangRankEngine(self.tokenizer_manager, dp_index, self.dp_size, report_address,
                                      daemon_slot=slot)
            self.agents.append(RankAgent(rank_address, self.prefix, self.ranks, engine,
                                         epoch=settings.epoch, curve=settings.curve_peer(),
                                         coalesce_s=settings.coalesce_s))
        if self._stopping or self._draining:  # nothing ran here yet: nothing to drain
            for agent in self.agents:
                agent.stop()
        self.task = asyncio.get_running_loop().create_task(self._run(), name="fairbatching-controlplane")
        self.tokenizer_manager.asyncio_tasks.add(self.task)
        logger.info("control plane: agent %s serving ranks %s (epoch %d) at %s (coalescing "
                    "window %g ms)", self.prefix, ", ".join(self.ranks), settings.epoch,
                    ", ".join(settings.rank_addresses), settings.coalesce_s * 1e3)

    @property
    def agent(self) -> Any:
        """The first daemon's agent (None before :meth:`start`)."""
        return self.agents[0] if self.agents else None

    def stop(self) -> None:
        """Leave the control plane (``Goodbye`` for every rank); requests still running
        are aborted here and fail ``rank_lost`` at the daemon."""
        self._stopping = True
        for agent in self.agents:
            agent.stop()

    def drain(self) -> None:
        """Leave gracefully, as SGLang does on SIGTERM: no new dispatches; ``Goodbye`` once
        the requests running here have finished. On the event loop."""
        self._draining = True
        if not self._stopping:
            for agent in self.agents:
                agent.drain()

    async def _run(self) -> None:
        await asyncio.gather(*(self._run_agent(agent) for agent in self.agents))

    async def _run_agent(self, agent: Any) -> None:
        try:
            await agent.run()
        except Exception:
            logger.exception("control plane: agent %s failed; this server left the daemon at %s",
                             self.prefix, agent.rank_address)
        finally:
            await agent.close()
            logger.info("control plane: agent %s stopped (daemon at %s)", self.prefix, agent.rank_address)


def install_controlplane_ingress(settings: ControlPlaneSettings) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after_init(_result: Any, tokenizer_manager: Any, *args: Any, **kwargs: Any) -> None:
        setattr(tokenizer_manager, INGRESS_ATTR, ControlPlaneIngress(tokenizer_manager, settings))

    HookRegistry.register(f"{_TOKENIZER_MANAGER}.__init__", after_init, HookType.AFTER)
    HookRegistry.register(f"{_TOKENIZER_MANAGER}.auto_create_handle_loop", _after_handle_loop,
                          HookType.AFTER)
    HookRegistry.register(f"{_SIGNAL_HANDLER}.sigterm_handler", _after_sigterm, HookType.AFTER)


def _after_handle_loop(_result: Any, tokenizer_manager: Any, *args: Any, **kwargs: Any) -> None:
    ingress = getattr(tokenizer_manager, INGRESS_ATTR, None)
    if ingress is None or ingress.task is not None or tokenizer_manager.event_loop is None:
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        return
    if running is tokenizer_manager.event_loop:
        ingress.start()


def _after_sigterm(_result: Any, handler: Any, *args: Any, **kwargs: Any) -> None:
    ingress = getattr(handler.tokenizer_manager, INGRESS_ATTR, None)
    if ingress is not None:
        logger.info("control plane: SIGTERM; agent %s drains, then leaves the control plane",
                    ingress.prefix)
        ingress.drain()
