"""An OpenAI-compatible HTTP front door to the daemon, over the SDK (aiohttp).

    fairbatching-controlplane gateway --daemon tcp://127.0.0.1:5560 --listen 127.0.0.1:8000

- ``POST /v1/completions``: one prompt (text, or token ids) per request; ``stream``
  (server-sent events, ``stream_options.include_usage``), ``max_tokens``,
  ``temperature``, ``top_p``, ``stop``, ``seed``, and SGLang's ``top_k``, ``min_tokens``,
  ``ignore_eos``. What it cannot honour (``n`` > 1, ``best_of`` > 1, ``logprobs``,
  ``echo``, ``suffix``, several prompts) is a 400, never silently ignored.
- ``POST /v1/chat/completions``: ``messages``, rendered by the serving rank with its
  model's chat template; the same sampling fields (``max_completion_tokens`` or
  ``max_tokens``; without either, ``GatewaySettings.chat_max_tokens``). What it accepts
  and refuses (tools, ``n`` > 1, logprobs, images and other media, ...) is listed in
  :mod:`controlplane.openai_api`; a model without a chat template is the rank's 400.
- Both: the SLO is ``"slo": "tight"``, ``{"ttft_ms": .., "tpot_ms": ..}``,
  ``{"e2e_ms": ..}`` (end-to-end, optionally with ``ttft_ms``; not with ``tpot_ms``) or a
  ``"class"`` with targets overridden, or SGLang's shape ``"custom_params": {"slo":
  ...}``. ``deadline_s`` bounds the request. Usage is in every unstreamed answer and,
  streamed, only with ``stream_options.include_usage`` (a last chunk with empty
  ``choices``; the others carry ``"usage": null``). The ``X-Request-Id`` header names
  the request (else a fresh id); retries inside the SDK keep it.
- ``GET /v1/models``, ``GET /health`` (200 when the daemon answers a ping, else 503),
  ``GET /metrics`` (Prometheus text: the daemon's counters and per-rank load, one status
  request per scrape, plus this gateway's responses by status).

Every failure has OpenAI's shape ``{"error": {"message", "type", "code"}}``: 400 invalid,
404 unknown model or endpoint, 405 wrong method, 413 body too large, 401 bad API key,
429 no budget / overloaded / queue timeout (with ``Retry-After``), 500 the daemon or the
rank failed the request (code ``internal`` when the daemon failed handling it), 502
rank lost, 503 no ranks / daemon unavailable or draining, 504 deadline. After a stream
has started an error is sent as a last ``data: {"error": ..}`` event before ``data:
[DONE]``. A client that disconnects cancels its request.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from aiohttp import web

from controlplane.client import AsyncClient
from controlplane.errors import (
    Cancelled, ControlPlaneError, DaemonUnavailable, DeadlineExceeded, DuplicateRequest,
    InternalError, InvalidRequest, NoBudget, NoRanks, Overloaded, QueueTimeout, RankLost,
    RequestFailed, ShuttingDown,
)
from controlplane.openai_api import (
    ChatCompletionRequest, ChatRequestError, CompletionRequest, chat_chunk, chat_completion, chat_prompt,
    text_chunk, text_completion, usage,
)
from controlplane.protocol import Prompt, SamplingParams, SloSpec, StatusReply

MAX_BODY_BYTES = 4 * 1024 * 1024
CLIENT_KEY: web.AppKey[AsyncClient] = web.AppKey("client", AsyncClient)
SETTINGS_KEY: web.AppKey[GatewaySettings] = web.AppKey("settings")
RESPONSES_KEY: web.AppKey[Counter[int]] = web.AppKey("responses", Counter)


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    model: str = "fairbatching"
    api_key: str | None = None  # required as ``Authorization: Bearer <key>`` when set
    chat_max_tokens: int = 1024  # a chat request's output limit when it sets none


class BadRequest(ValueError):
    pass


def build_app(client: AsyncClient, settings: GatewaySettings) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors_and_auth])
    app[CLIENT_KEY] = client
    app[SETTINGS_KEY] = settings
    app[RESPONSES_KEY] = Counter()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


# ---------------------------------------------------------------------- handlers
async def completions(request: web.Request) -> web.StreamResponse:
    body = _parse(await request.read(), CompletionRequest)
    prompt = _completion_prompt(body)
    return await _serve(request, body, prompt, _TextRender())


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = _parse(await request.read(), ChatCompletionRequest)
    try:
        prompt = chat_prompt(body.messages)
    except ChatRequestError as error:
        raise BadRequest(str(error)) from None
    return await _serve(request, body, prompt, _ChatRender())


async def _serve(request: web.Request, body: CompletionRequest | ChatCompletionRequest, prompt: Prompt,
                 render: _TextRender | _ChatRender) -> web.StreamResponse:
    client, settings = request.app[CLIENT_KEY], request.app[SETTINGS_KEY]
    if body.model is not None and body.model != settings.model:
        return _error(404, f"model {body.model!r} is not served here (it is {settings.model!r})",
                      "invalid_request_error", "model_not_found")
    sampling, slo = _translate(body, settings.chat_max_tokens)
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    created = int(time.time())
    model = settings.model
    if not body.stream:
        result = await client.generate(prompt, sampling=sampling, slo=slo, deadline_s=body.deadline_s,
                                       request_id=request_id)
        return web.json_response(render.whole(result, model, created))
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    stream = client.stream(prompt, sampling=sampling, slo=slo, deadline_s=body.deadline_s,
                           request_id=request_id)
    response: web.StreamResponse | None = None
    usage_field = {"usage": None} if include_usage else {}
    async with stream:
        try:
            async for piece in stream:
                if response is None:
                    response = await _start_events(request, stream.request_id)
                await _event(response, {**render.piece(stream.request_id, model, created, piece.text),
                                        **usage_field})
        except ControlPlaneError as error:
            if response is None:
                raise
            status, message, kind, code = _describe(error)
            await _event(response, {"error": {"message": message, "type": kind, "code": code}})
            await response.write(b"data: [DONE]\n\n")
            return response
    result = stream.result
    if response is None:  # finished without output
        response = await _start_events(request, result.request_id)
    await _event(response, {**render.last(result.request_id, model, created, str(result.finish_reason)),
                            **usage_field})
    if include_usage:
        await _event(response, {**render.last(result.request_id, model, created, None), "choices": [],
                                "usage": usage(result)})
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


class _TextRender:
    whole = staticmethod(text_completion)

    @staticmethod
    def piece(request_id: str, model: str, created: int, text: str) -> dict[str, object]:
        return text_chunk(request_id, model, created, text)

    @staticmethod
    def last(request_id: str, model: str, created: int, finish: str | None) -> dict[str, object]:
        return text_chunk(request_id, model, created, "", finish)


class _ChatRender:
    """The first delta states the role, as OpenAI's does."""

    whole = staticmethod(chat_completion)

    def __init__(self) -> None:
        self._role_sent = False

    def piece(self, request_id: str, model: str, created: int, text: str) -> dict[str, object]:
        return chat_chunk(request_id, model, created, self._delta(text))

    def last(self, request_id: str, model: str, created: int, finish: str | None) -> dict[str, object]:
        return chat_chunk(request_id, model, created, self._delta("") if not self._role_sent else {}, finish)

    def _delta(self, text: str) -> dict[str, str]:
        delta = {"content": text} if self._role_sent else {"role": "assistant", "content": text}
        self._role_sent = True
        return delta


async def models(request: web.Request) -> web.Response:
    model = request.app[SETTINGS_KEY].model
    return web.json_response({"object": "list", "data": [
        {"id": model, "object": "model", "created": 0, "owned_by": "fairbatching"}]})


async def health(request: web.Request) -> web.Response:
    try:
        pong = await request.app[CLIENT_KEY].ping(timeout_s=2.0)
    except ControlPlaneError as error:
        return _error(503, f"the daemon does not answer: {error}", "service_unavailable", "daemon_unavailable")
    status = 503 if pong.draining else 200
    return web.json_response({"status": "draining" if pong.draining else "ok", "daemon_id": pong.daemon_id},
                             status=status)


async def metrics(request: web.Request) -> web.Response:
    try:
        status = await request.app[CLIENT_KEY].status(timeout_s=2.0)
    except ControlPlaneError as error:
        return _error(503, f"the daemon does not answer: {error}", "service_unavailable", "daemon_unavailable")
    text = prometheus_text(status, request.app[RESPONSES_KEY])
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


# ---------------------------------------------------------------------- translation
Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest)


def _parse(raw: bytes, kind: type[Body]) -> Body:
    try:
        body = msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as error:
        raise BadRequest(f"invalid request body: {error}") from None
    except msgspec.DecodeError as error:
        raise BadRequest(f"the body is not JSON: {error}") from None
    unsupported = body.refusals()
    if unsupported:
        raise BadRequest(f"not supported by this gateway: {', '.join(unsupported)}")
    return body


def _completion_prompt(body: CompletionRequest) -> Prompt:
    prompt = body.prompt
    if isinstance(prompt, list) and not all(isinstance(item, int) for item in prompt):
        if len(prompt) != 1:
            raise BadRequest("one prompt per request (send several requests)")
        prompt = prompt[0]
        if isinstance(prompt, int):
            raise BadRequest("prompt: expected text, token ids, or a list of one of them")
    try:
        body_prompt = Prompt(text=prompt) if isinstance(prompt, str) else Prompt(token_ids=prompt)
        body_prompt.validate()
    except ValueError as error:
        raise BadRequest(f"prompt: {error}") from None
    return body_prompt


def _translate(body: CompletionRequest | ChatCompletionRequest,
               chat_max_tokens: int) -> tuple[SamplingParams, SloSpec | None]:
    output_tokens = body.output_tokens
    fields: dict[str, object] = {"max_new_tokens": 16 if output_tokens is None else output_tokens,
                                 "ignore_eos": body.ignore_eos}
    if isinstance(body, ChatCompletionRequest) and output_tokens is None:
        fields["max_new_tokens"] = chat_max_tokens
    for name, value in (("temperature", body.temperature), ("top_p", body.top_p), ("top_k", body.top_k),
                        ("min_new_tokens", body.min_tokens), ("seed", body.seed)):
        if value is not None:
            fields[name] = value
    if body.stop is not None:
        fields["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    slo = body.slo
    if slo is None and body.custom_params is not None:
        slo = body.custom_params.get("slo")
    max_name = "max_tokens" if isinstance(body, CompletionRequest) or body.max_completion_tokens is None \
        else "max_completion_tokens"
    try:
        sampling = msgspec.convert(fields, SamplingParams)
        if isinstance(slo, str):
            slo = SloSpec(slo_class=slo)
        elif slo is not None:
            slo = msgspec.convert(slo, SloSpec)
    except (msgspec.ValidationError, ValueError) as error:
        message = str(error).replace("max_new_tokens", max_name).replace("min_new_tokens", "min_tokens")
        raise BadRequest(f"invalid request body: {message}") from None
    return sampling, slo


async def _start_events(request: web.Request, request_id: str) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": request_id})
    await response.prepare(request)
    return response


async def _event(response: web.StreamResponse, payload: Mapping[str, object]) -> None:
    await response.write(b"data: " + msgspec.json.encode(payload) + b"\n\n")


# ---------------------------------------------------------------------- errors, auth
_STATUS: tuple[tuple[type[ControlPlaneError], int, str], ...] = (
    (InvalidRequest, 400, "invalid_request_error"),
    (DuplicateRequest, 409, "conflict"),
    (NoBudget, 429, "overloaded"), (Overloaded, 429, "overloaded"), (QueueTimeout, 429, "overloaded"),
    (RankLost, 502, "upstream_error"), (RequestFailed, 500, "server_error"),
    (InternalError, 500, "server_error"),
    (NoRanks, 503, "service_unavailable"), (ShuttingDown, 503, "service_unavailable"),
    (DaemonUnavailable, 503, "service_unavailable"), (Cancelled, 503, "service_unavailable"),
    (DeadlineExceeded, 504, "timeout"),
)


def _describe(error: ControlPlaneError) -> tuple[int, str, str, str]:
    for kind, status, error_type in _STATUS:
        if isinstance(error, kind):
            code = str(getattr(error, "reason", type(error).__name__))
            return status, str(error), error_type, code
    return 500, str(error), "server_error", type(error).__name__


def _error(status: int, message: str, error_type: str, code: str,
           headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": error_type, "code": code}},
                             status=status, headers=headers)


_HTTP_ERRORS = {
    404: "no such endpoint (this gateway serves /v1/completions, /v1/chat/completions, /v1/models, "
         "/health, /metrics)",
    405: "method not allowed on this endpoint",
    413: f"the request body is over {MAX_BODY_BYTES} bytes",
}


@web.middleware
async def _errors_and_auth(request: web.Request, handler) -> web.StreamResponse:
    settings = request.app[SETTINGS_KEY]
    if settings.api_key is not None and request.path != "/health":
        supplied = request.headers.get("Authorization", "")
        if not hmac.compare_digest(supplied.encode(), f"Bearer {settings.api_key}".encode()):
            response = _error(401, "missing or wrong API key (Authorization: Bearer ...)",
                              "invalid_request_error", "invalid_api_key")
            request.app[RESPONSES_KEY][response.status] += 1
            return response
    try:
        response = await handler(request)
    except BadRequest as error:
        response = _error(400, str(error), "invalid_request_error", "invalid_request")
    except ControlPlaneError as error:
        status, message, error_type, code = _describe(error)
        retry_after = getattr(error, "retry_after_s", None)
        headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after else None
        response = _error(status, message, error_type, code, headers)
    except web.HTTPException as error:  # aiohttp's own: no such route, wrong method, body too large
        if error.status < 400:
            request.app[RESPONSES_KEY][error.status] += 1
            raise
        response = _error(error.status, _HTTP_ERRORS.get(error.status, error.reason),
                          "invalid_request_error", error.reason.lower().replace(" ", "_"),
                          {"Allow": error.headers["Allow"]} if "Allow" in error.headers else None)
    request.app[RESPONSES_KEY][response.status] += 1
    return response


# ---------------------------------------------------------------------- metrics
def prometheus_text(status: StatusReply, responses: Mapping[int, int]) -> str:
    """The daemon's status and the gateway's responses in Prometheus' text format."""
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {_number(value)}" for labels, value in samples)

    prefix = "fairbatching_controlplane"
    family(f"{prefix}_in_flight", "gauge", "Requests dispatched and not finished.", [("", status.in_flight)])
    family(f"{prefix}_queued", "gauge", "Requests in the admission queue.", [("", status.queued)])
    family(f"{prefix}_draining", "gauge", "1 while the daemon drains.", [("", float(status.draining))])
    family(f"{prefix}_uptime_seconds", "gauge", "Seconds since the daemon started.", [("", status.uptime_s)])
    family(f"{prefix}_events_total", "counter", "The daemon's event counters.",
           [(_labels(event=name), value) for name, value in sorted(status.counters.items())])
    per_rank = (
        ("rank_pab_tokens", "Effective prefill admission budget (reported minus unreported debits).",
         lambda r: r.pab_tokens),
        ("rank_running", "Requests running, as last reported.", lambda r: r.running),
        ("rank_waiting", "Requests waiting, as last reported.", lambda r: r.waiting),
        ("rank_in_flight", "Requests the daemon has in flight on the rank.", lambda r: r.in_flight),
        ("rank_free_kv_tokens", "Free KV-cache tokens, as last reported.", lambda r: r.free_kv_tokens),
        ("rank_report_age_seconds", "Age of the last report.", lambda r: r.report_age_s),
        ("rank_stale", "1 when the rank's reports are stale (load unknown).", lambda r: float(r.stale)),
        ("rank_draining", "1 when the rank gets no new requests.", lambda r: float(r.draining)),
        ("rank_report_seq_gaps", "Reports missed, by sequence number.", lambda r: r.seq_gaps),
    )
    for name, help_text, value_of in per_rank:
        samples = [(_labels(rank=r.rank), value_of(r)) for r in status.ranks if value_of(r) is not None]
        family(f"{prefix}_{name}", "gauge", help_text, samples)
    family("fairbatching_gateway_responses_total", "counter", "HTTP responses of this gateway by status.",
           [(_labels(status=str(code)), count) for code, count in sorted(responses.items())])
    return "\n".join(lines) + "\n"


def _labels(**labels: str) -> str:
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{key}="{escape(value)}"' for key, value in labels.items()) + "}"


def _number(value: float) -> str:
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


# ---------------------------------------------------------------------- running
async def serve(client: AsyncClient, settings: GatewaySettings, host: str, port: int,
                stop: asyncio.Event) -> None:
    """Serve HTTP on ``host:port`` until ``stop`` is set; a client that disconnects
    cancels its handler, and with it its request at the daemon."""
    runner = web.AppRunner(build_app(client, settings), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        await stop.wait()
    finally:
        await runner.cleanup()


def parse_listen(text: str, allow_non_loopback: bool) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 in brackets); loopback unless ``allow_non_loopback``."""
    host, _, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"--listen {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8000")
    if host not in ("127.0.0.1", "localhost", "::1") and not allow_non_loopback:
        raise ValueError(f"--listen {text!r} is not loopback; the gateway speaks plain HTTP, so say "
                         "--allow-non-loopback (and set --api-key-file) to expose it")
    return host, int(port_text)
