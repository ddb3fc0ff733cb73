"""Admission mode ``reject`` at SGLang's front door: a request whose prompt exceeds the
budget its rank published for its SLO class is refused with an HTTP 429 before it
reaches a scheduler (the decision: :mod:`sglang_ext.adapter.admission.budget_gate`). Runs in the
HTTP / TokenizerManager process; installed through HookRegistry, no patch:

- ``TokenizerManager.__init__`` (after): the gate, with its counters when the server
  runs with ``--enable-metrics``;
- ``TokenizerManager._send_one_request`` (before): the check, on the tokenized request
  (its prompt length, its ``custom_params`` SLO, its ``routed_dp_rank``). A refusal
  raises :class:`AdmissionRefused` before anything is dispatched; ``generate_request``
  then drops the request's state (``_release_req_states_on_failure``), so nothing is
  left behind. Every caller of ``generate_request`` goes through it: the HTTP routes
  and the control plane's ingress agent (:mod:`sglang_ext.adapter.controlplane_agent`, which
  turns it into the daemon's ``no_budget``);
- ``http_server.serve_generate_request`` (around, a step of
  :mod:`sglang_ext.adapter.front_door`): ``/generate`` answers the refusal as
  a 429, streamed or not. A streamed request's body is started before the response
  is returned and the response waits until the request is dispatched (or refused),
  not for its first token;
- ``OpenAIServingBase.handle_request`` (around, a step of the same): the OpenAI routes
  (``/v1/completions``, ``/v1/chat/completions``, streamed or not) answer the same 429
  instead of their header-less error response.

The 429's body is SGLang's ``ErrorResponse`` (``object``, ``message``, ``type``,
``param``, ``code``) with the same fields nested under ``error`` as OpenAI clients read
them, plus ``reason``; ``Retry-After`` is ``retry_after_s`` rounded up to whole seconds.
Counted as ``fairbatching:admission_refused_total{slo_class}`` and, for requests
admitted without a trusted budget (fail open, see :mod:`sglang_ext.adapter.admission.budget_gate`),
``fairbatching:admission_unchecked_total{reason}``; refusals are logged at most once
per ``LOG_INTERVAL_S`` with the number left out.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import HTTPException

from controlplane.ratelimited_log import RateLimitedLog
from sglang_ext.adapter.admission.budget_gate import (
    ADMISSION_STAMP_KEY,
    BudgetGate,
    PublishedBudgets,
    Verdict,
)
from sglang_ext.adapter.custom_params import set_custom_param
from sglang_ext.adapter.extension_config import ExtensionConfig
from sglang_ext.policy.admission import AdmissionMode
from sglang_ext.policy.slo import Slo, SloError

logger = logging.getLogger("sglang_ext.fairbatching")

TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
GATE_ATTR = "fairbatching_gate"
REASON = "admission_budget"
LOG_INTERVAL_S = 10.0


class AdmissionRefused(HTTPException):
    """A request refused by the gate: status 429 with ``Retry-After``. Not a ValueError,
    so SGLang's routes do not turn it into a 400."""

    def __init__(self, message: str, retry_after_s: float, slo_class: str, rank: int | None) -> None:
        super().__init__(status_code=429, detail=message,
                         headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})
        self.slo_class = slo_class
        self.rank = rank


def error_body(exc: AdmissionRefused) -> dict[str, Any]:
    error = {"message": exc.detail, "type": "rate_limit_error", "param": None,
             "code": exc.status_code}
    return {"object": "error", **error, "error": {**error, "reason": REASON}}


def refusal_response(exc: AdmissionRefused) -> Any:
    from fastapi.responses import ORJSONResponse

    return ORJSONResponse(content=error_body(exc), status_code=exc.status_code, headers=exc.headers)


@dataclass
class _Pending:
    """What the gate decided for the request being served in this context."""

    decided: asyncio.Future | None = None  # set when the request was admitted
    refusal: AdmissionRefused | None = None


_PENDING: contextvars.ContextVar[_Pending | None] = contextvars.ContextVar(
    "fairbatching_admission_pending", default=None)


@dataclass
class GateMetrics:
    refused: Any
    unchecked: Any

    @classmethod
    def create(cls) -> GateMetrics:
        from prometheus_client import Counter

        return cls(
            Counter("fairbatching:admission_refused",
                    "Requests refused by admission control (HTTP 429)", ["slo_class"]),
            Counter("fairbatching:admission_unchecked",
                    "Requests admitted without a trusted budget (stale or none published)",
                    ["reason"]),
        )


@dataclass
class HttpGate:
    """The gate of one TokenizerManager: reads the published budgets, decides, counts."""

    gate: BudgetGate
    reader: Any  # SGLang's load snapshot reader (read_all() -> [LoadSnapshot])
    metrics: GateMetrics | None = None
    refused: dict[str, int] = field(default_factory=dict)
    unchecked: dict[str, int] = field(default_factory=dict)
    log: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(logger, LOG_INTERVAL_S))

    def published(self) -> list[PublishedBudgets]:
        token = self.gate.token
        return [PublishedBudgets(s.dp_rank, s.timestamp, getattr(s, "fairbatching_admission", None),
                                 s.num_running_reqs == 0 and s.num_waiting_reqs == 0,
                                 (getattr(s, "fairbatching_admission_echo", None) or {}).get(token, 0))
                for s in self.reader.read_all()]

    def check(self, tokenized: Any) -> Verdict | None:
        """Raise :class:`AdmissionRefused` if ``tokenized`` must be refused; the verdict,
        or None for a request the gate does not concern (no prompt tokens, no sampling
        parameters: embeddings)."""
        input_ids = getattr(tokenized, "input_ids", None)
        params = getattr(tokenized, "sampling_params", None)
        if input_ids is None or params is None:
            return None
        try:
            slo = self.gate.catalog.resolve_custom_params(getattr(params, "custom_params", None))
        except SloError:
            return None  # the request validation answers it with a 400 before this
        verdict = self.gate.check(self.published(), time.time(), slo, len(input_ids),
                                  getattr(tokenized, "routed_dp_rank", None))
        # an unchecked admission carries no stamp, not even one a client sent
        set_custom_param(params, ADMISSION_STAMP_KEY,
                         None if verdict.seq is None else self.gate.stamp(verdict.seq))
        pending = _PENDING.get()
        if verdict.unchecked is not None:
            self.unchecked[verdict.unchecked] = self.unchecked.get(verdict.unchecked, 0) + 1
            if self.metrics is not None:
                self.metrics.unchecked.labels(reason=verdict.unchecked).inc()
        if verdict.admitted:
            if pending is not None and pending.decided is not None and not pending.decided.done():
                pending.decided.set_result(True)
            return verdict
        refusal = self._refusal(verdict, len(input_ids), slo)
        if pending is not None:
            pending.refusal = refusal
        raise refusal

    def _refusal(self, verdict: Verdict, prompt_tokens: int, slo: Slo) -> AdmissionRefused:
        slo_class = verdict.slo_class
        self.refused[slo_class] = self.refused.get(slo_class, 0) + 1
        if self.metrics is not None:
            self.metrics.refused.labels(slo_class=slo_class).inc()
        budget = max(0, math.floor(verdict.budget))
        retry_after_s = self.gate.settings.retry_after_s
        message = (
            f"admission refused: the prompt's {prompt_tokens} tokens exceed the {budget} that "
            f"DP rank {verdict.rank} can still prefill within the {_first_token(slo)} of "
            f"SLO class {slo_class!r}; retry after {retry_after_s:g} s"
        )
        self.log.warning(f"refused:{slo_class}", "FairBatching admission refused a request",
                         slo_class=slo_class, prompt_tokens=prompt_tokens, budget=budget,
                         rank=verdict.rank, total=self.refused[slo_class])
        return AdmissionRefused(message, retry_after_s, slo_class, verdict.rank)


def _first_token(slo: Slo) -> str:
    if slo.e2e_s is None:
        return f"TTFT ({slo.ttft_s * 1e3:g} ms)"
    return (f"first-token budget ({slo.ttft_s * 1e3:g} ms of the {slo.e2e_s * 1e3:g} ms "
            "end-to-end target)")


def install_admission_gate(config: ExtensionConfig) -> bool:
    """Register the TokenizerManager's hooks if the config's admission mode is ``reject``;
    whether it did. The routes' steps, :func:`around_generate` and :func:`around_openai`,
    are chained by ``sglang_ext.adapter.front_door``."""
    admission = config.effective_admission
    if admission.mode is not AdmissionMode.REJECT:
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    max_rate = 1.0 / config.initial_step_model.usable().b_s_per_token

    def after_init(_result: Any, tokenizer_manager: Any, *args: Any, **kwargs: Any) -> None:
        metrics = GateMetrics.create() if getattr(tokenizer_manager, "enable_metrics", False) else None
        gate = BudgetGate(config.catalog, admission, max_rate)
        setattr(tokenizer_manager, GATE_ATTR,
                HttpGate(gate, tokenizer_manager.load_snapshot_reader, metrics))

    HookRegistry.register(f"{TOKENIZER_MANAGER}.__init__", after_init, HookType.AFTER)
    HookRegistry.register(f"{TOKENIZER_MANAGER}._send_one_request", before_send, HookType.BEFORE)
    return True


def before_send(tokenizer_manager: Any, tokenized: Any, *args: Any, **kwargs: Any) -> None:
    gate: HttpGate | None = getattr(tokenizer_manager, GATE_ATTR, None)
    if gate is not None:
        gate.check(tokenized)


async def around_generate(original: Any, obj: Any, request: Any) -> Any:
    if not getattr(obj, "stream", False):
        try:
            return await original(obj, request)
        except AdmissionRefused as exc:
            return refusal_response(exc)
    from fastapi.responses import StreamingResponse

    pending = _Pending(decided=asyncio.get_running_loop().create_future())
    token = _PENDING.set(pending)
    try:
        response = await original(obj, request)
        if not isinstance(response, StreamingResponse):
            return response
        body = response.body_iterator
        first = asyncio.ensure_future(body.__anext__())  # runs in this context: sees `pending`
    finally:
        _PENDING.reset(token)
    await asyncio.wait({first, pending.decided}, return_when=asyncio.FIRST_COMPLETED)
    pending.decided.cancel()
    if first.done() and not first.cancelled() and isinstance(first.exception(), AdmissionRefused):
        return refusal_response(first.exception())
    response.body_iterator = _resumed(first, body)
    return response


async def _resumed(first: asyncio.Future, body: AsyncIterator[Any]) -> AsyncIterator[Any]:
    try:
        chunk = await first
    except StopAsyncIteration:
        return
    yield chunk
    async for chunk in body:
        yield chunk


async def around_openai(original: Any, serving: Any, request: Any, raw_request: Any = None,
                        *args: Any, **kwargs: Any) -> Any:
    pending = _Pending()
    token = _PENDING.set(pending)
    try:
        response = await original(serving, request, raw_request, *args, **kwargs)
    finally:
        _PENDING.reset(token)
    if pending.refusal is not None:
        return refusal_response(pending.refusal)
    return response
