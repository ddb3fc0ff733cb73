"""An OpenAI-compatible HTTP front door to the daemon, over the SDK (aiohttp).

    fairbatching-controlplane gateway --daemon tcp://127.0.0.1:5560 --listen 127.0.0.1:8000

``--daemon`` repeated names active-active daemons: the SDK inside holds one at a time and
moves to the next when it is lost (:class:`controlplane.client.AsyncClient`).

- ``POST /v1/completions``: one prompt (text, or token ids) per request; ``stream``
  (server-sent events, ``stream_options.include_usage``), ``max_tokens``,
  ``temperature``, ``top_p``, ``stop``, ``seed``, and SGLang's ``top_k``, ``min_tokens``,
  ``ignore_eos``. What it cannot honour (``n`` > 1, ``best_of`` > 1, ``logprobs``,
  ``echo``, ``suffix``, several prompts) is a 400, never silently ignored.
- ``POST /v1/chat/completions``: ``messages``, rendered by the serving rank with its
  model's chat template; the same sampling fields (``max_completion_tokens`` or
  ``max_tokens``; without either, ``GatewaySettings.chat_max_tokens``, by default 2,048:
  below). What it accepts and refuses (tools, ``n`` > 1, logprobs, images and other
  media, ...) is listed in :mod:`controlplane.openai_api`; a model without a chat
  template is the rank's 400.
- Both: ``model`` may name any model: the ranks serve the model they have, and the
  answer's ``model`` echoes the request's (as SGLang's server does), else the served name
  (``GatewaySettings.model``, the one ``GET /v1/models`` lists). The SLO is ``"slo":
  "tight"``, ``{"ttft_ms": .., "tpot_ms": ..}``, ``{"e2e_ms": ..}`` (end-to-end,
  optionally with ``ttft_ms``; not with ``tpot_ms``) or a ``"class"`` with targets
  overridden, or SGLang's shape ``"custom_params": {"slo": ...}``; without one, what
  ``service_tier``, ``priority`` and smg's and llm-d's headers name
  (:mod:`controlplane.slo_hints`, ``GatewaySettings.slo_hints``). ``deadline_s``
  bounds the request. Usage is in every unstreamed answer and, streamed, only with
  ``stream_options.include_usage`` (a last chunk with empty ``choices``; the others carry
  ``"usage": null``). Chunks that are ready together go out in one HTTP write.
- ``GET /v1/models``, ``GET /health`` (200 when the daemon answers a ping, else 503),
  ``GET /metrics`` (Prometheus text: the daemon's counters and per-rank load, one status
  request per scrape, plus this gateway's responses by status).

**Overload.** The gateway holds at most ``GatewaySettings.max_in_flight`` completion
requests (``--max-in-flight``, 1,024), waiting for the daemon or streaming; one more is
answered 429 at once (code ``gateway_overloaded``, ``Retry-After: 1``) instead of waiting in
the gateway. Behind it the daemon refuses what it cannot dispatch within the request's TTFT
target (429 ``queue_timeout`` / ``no_budget`` / ``overloaded``, see docs/controlplane.md,
*Overload*). Every 429 carries ``Retry-After``.

Every answer, errors included, carries ``X-Request-Id``: the client's header, else a fresh
id; it is the request's id at the daemon, and retries inside the SDK keep it. Every
failure has OpenAI's shape ``{"error": {"message", "type", "code"}}``: 400 invalid, 404
unknown endpoint, 405 wrong method, 413 body too large, 401 bad API key, 429 no budget /
overloaded / queue timeout (with ``Retry-After``), 500 the daemon or the rank failed the
request (code ``internal`` when the daemon failed handling it), 502 rank lost, 503 no
ranks / daemon unavailable or draining, 504 deadline. After a stream has started an
error is sent as a last ``data: {"error": ..}`` event before ``data: [DONE]``. A client
that disconnects cancels its request.

**Chat's default output limit**: 2,048 tokens (``openai_api.DEFAULT_CHAT_MAX_TOKENS``).
vLLM and SGLang let a chat request without a limit run to the end of the model's
context. The gateway does not know the context, and SGLang refuses a request whose
prompt plus limit is past it (unless the server runs with ``--allow-auto-truncate``), so
the default is bounded. 2,048 is twice the longest reply of the Azure LLM conversation
trace (p99 622, longest 1,000 in ``sglang_ext/data/azure_conv_sample.csv``), so a reply
that ends on its own is practically never cut, and it leaves about 6,000 tokens of
prompt on an 8k-context model. The ranks plan with it: an ``e2e_ms`` SLO is paced for
it, and simulated and emulated-GPU ranks run every request to its limit.
``--chat-max-tokens`` changes it.

The parts: this module is the aiohttp app (routes, request ids, errors, auth, the
in-flight limit); :mod:`controlplane.gateway_sse` streams an answer as server-sent events;
:mod:`controlplane.gateway_translate` turns a body into the SDK's request and an SDK error
into an HTTP status; :mod:`controlplane.gateway_metrics` renders ``/metrics``. The
command line (``gateway``, ``serve --http``) is :mod:`controlplane.cli`.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

from aiohttp import web

from controlplane.client import AsyncClient
from controlplane.errors import ControlPlaneError
from controlplane.gateway_metrics import prometheus_text
from controlplane.gateway_sse import ChatEvents, TextEvents, relay
from controlplane.gateway_translate import (
    BadRequest, completion_prompt, describe, error_response, parse_body, translate,
)
from controlplane.openai_api import (
    DEFAULT_CHAT_MAX_TOKENS, ChatCompletionRequest, ChatRequestError, CompletionRequest, chat_prompt,
)
from controlplane.protocol import Prompt
from controlplane.slo_hints import SloHints

MAX_BODY_BYTES = 4 * 1024 * 1024
CLIENT_KEY: web.AppKey[AsyncClient] = web.AppKey("client", AsyncClient)
SETTINGS_KEY: web.AppKey[GatewaySettings] = web.AppKey("settings")
RESPONSES_KEY: web.AppKey[Counter[int]] = web.AppKey("responses", Counter)
IN_FLIGHT_KEY: web.AppKey[InFlight] = web.AppKey("in_flight")
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID: ContextVar[str] = ContextVar("gateway_request_id")  # set per request by the middleware


DEFAULT_MAX_IN_FLIGHT = 1024
GATEWAY_RETRY_AFTER_S = 1
ACCEPT_BACKLOG_MIN, ACCEPT_BACKLOG_MAX = 1024, 4096  # the latter: Linux's usual somaxconn


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    model: str = "fairbatching"  # the served name /v1/models lists; a request may name any model
    api_key: str | None = None  # required as ``Authorization: Bearer <key>`` when set
    chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS  # a chat request's limit when it sets none
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT  # completions held at once; one more is a 429
    slo_hints: SloHints = field(default_factory=SloHints)  # service_tier, priority, headers -> SLO

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")


class InFlight:
    """How many completion requests the gateway holds (waiting for the daemon or streaming),
    bounded: past ``limit`` a request is refused at once instead of waiting in the gateway."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0
        self.refused = 0

    def enter(self) -> bool:
        if self.count >= self.limit:
            self.refused += 1
            return False
        self.count += 1
        return True

    def leave(self) -> None:
        self.count -= 1


def build_app(client: AsyncClient, settings: GatewaySettings) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors_and_auth])
    app[CLIENT_KEY] = client
    app[SETTINGS_KEY] = settings
    app[RESPONSES_KEY] = Counter()
    app[IN_FLIGHT_KEY] = InFlight(settings.max_in_flight)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


# ---------------------------------------------------------------------- handlers
async def completions(request: web.Request) -> web.StreamResponse:
    body = parse_body(await request.read(), CompletionRequest)
    prompt = completion_prompt(body)
    return await _serve(request, body, prompt, TextEvents)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = parse_body(await request.read(), ChatCompletionRequest)
    try:
        prompt = chat_prompt(body.messages)
    except ChatRequestError as error:
        raise BadRequest(str(error)) from None
    return await _serve(request, body, prompt, ChatEvents)


async def _serve(request: web.Request, body: CompletionRequest | ChatCompletionRequest,
                 prompt: Prompt, events: type[TextEvents | ChatEvents]) -> web.StreamResponse:
    in_flight = request.app[IN_FLIGHT_KEY]
    if not in_flight.enter():
        message = f"the gateway holds {in_flight.limit} requests, its limit (--max-in-flight)"
        return error_response(429, message, "overloaded", "gateway_overloaded",
                              {"Retry-After": str(GATEWAY_RETRY_AFTER_S)})
    try:
        return await _serve_admitted(request, body, prompt, events)
    finally:
        in_flight.leave()


async def _serve_admitted(request: web.Request, body: CompletionRequest | ChatCompletionRequest,
                          prompt: Prompt, events: type[TextEvents | ChatEvents]) -> web.StreamResponse:
    client, settings = request.app[CLIENT_KEY], request.app[SETTINGS_KEY]
    sampling, slo = translate(body, settings.chat_max_tokens, settings.slo_hints, request.headers)
    request_id = _REQUEST_ID.get()
    model = body.model or settings.model
    created = int(time.time())
    if not body.stream:
        result = await client.generate(prompt, sampling=sampling, slo=slo, deadline_s=body.deadline_s,
                                       request_id=request_id)
        return web.json_response(events.whole(result, model, created))
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    stream = client.stream(prompt, sampling=sampling, slo=slo, deadline_s=body.deadline_s,
                           request_id=request_id)
    async with stream:
        return await relay(request, stream, events(request_id, model, created, include_usage),
                           {REQUEST_ID_HEADER: stream.request_id})


async def models(request: web.Request) -> web.Response:
    model = request.app[SETTINGS_KEY].model
    return web.json_response({"object": "list", "data": [
        {"id": model, "object": "model", "created": 0, "owned_by": "fairbatching"}]})


async def health(request: web.Request) -> web.Response:
    try:
        pong = await request.app[CLIENT_KEY].ping(timeout_s=2.0)
    except ControlPlaneError as error:
        return error_response(503, f"the daemon does not answer: {error}", "service_unavailable",
                              "daemon_unavailable")
    status = 503 if pong.draining else 200
    return web.json_response({"status": "draining" if pong.draining else "ok", "daemon_id": pong.daemon_id},
                             status=status)


async def metrics(request: web.Request) -> web.Response:
    try:
        status = await request.app[CLIENT_KEY].status(timeout_s=2.0)
    except ControlPlaneError as error:
        return error_response(503, f"the daemon does not answer: {error}", "service_unavailable",
                              "daemon_unavailable")
    text = prometheus_text(status, request.app[RESPONSES_KEY], request.app[IN_FLIGHT_KEY])
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


# ---------------------------------------------------------------------- request ids, errors, auth
_HTTP_ERRORS = {
    404: "no such endpoint (this gateway serves /v1/completions, /v1/chat/completions, /v1/models, "
         "/health, /metrics)",
    405: "method not allowed on this endpoint",
    413: f"the request body is over {MAX_BODY_BYTES} bytes",
}


@web.middleware
async def _errors_and_auth(request: web.Request, handler) -> web.StreamResponse:
    """Every answer gets the request's ``X-Request-Id`` and is counted by status."""
    request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
    token = _REQUEST_ID.set(request_id)
    try:
        response = await _answer(request, handler)
    except web.HTTPException as error:  # aiohttp's own below 400: a redirect
        error.headers[REQUEST_ID_HEADER] = request_id
        request.app[RESPONSES_KEY][error.status] += 1
        raise
    finally:
        _REQUEST_ID.reset(token)
    if not response.prepared:
        response.headers[REQUEST_ID_HEADER] = request_id
    request.app[RESPONSES_KEY][response.status] += 1
    return response


async def _answer(request: web.Request, handler) -> web.StreamResponse:
    settings = request.app[SETTINGS_KEY]
    if settings.api_key is not None and request.path != "/health":
        supplied = request.headers.get("Authorization", "")
        if not hmac.compare_digest(supplied.encode(), f"Bearer {settings.api_key}".encode()):
            return error_response(401, "missing or wrong API key (Authorization: Bearer ...)",
                                  "invalid_request_error", "invalid_api_key")
    try:
        return await handler(request)
    except BadRequest as error:
        return error_response(400, str(error), "invalid_request_error", "invalid_request")
    except ControlPlaneError as error:
        status, message, error_type, code = describe(error)
        retry_after = getattr(error, "retry_after_s", None) or (
            GATEWAY_RETRY_AFTER_S if status == 429 else None)  # every 429 says when to retry
        headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after else None
        return error_response(status, message, error_type, code, headers)
    except web.HTTPException as error:  # aiohttp's own: no such route, wrong method, body too large
        if error.status < 400:
            raise
        return error_response(error.status, _HTTP_ERRORS.get(error.status, error.reason),
                              "invalid_request_error", error.reason.lower().replace(" ", "_"),
                              {"Allow": error.headers["Allow"]} if "Allow" in error.headers else None)


# ---------------------------------------------------------------------- running
async def serve(client: AsyncClient, settings: GatewaySettings, host: str, port: int,
                stop: asyncio.Event, announce: Callable[[str], None] | None = None) -> None:
    """Serve HTTP on ``host:port`` until ``stop`` is set; a client that disconnects
    cancels its handler, and with it its request at the daemon. Once listening,
    ``announce`` gets :func:`listening_line`."""
    runner = web.AppRunner(build_app(client, settings), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        # connections the kernel holds before the gateway accepts them. aiohttp's default, 128,
        # left a burst of 240 clients retrying their SYNs for 1 s before their 429 (measured)
        backlog = max(ACCEPT_BACKLOG_MIN, min(settings.max_in_flight, ACCEPT_BACKLOG_MAX))
        await web.TCPSite(runner, host, port, backlog=backlog).start()
        if announce is not None:
            announce(listening_line(settings, host, port, ", ".join(client.addresses)))
        await stop.wait()
    finally:
        await runner.cleanup()


def listening_line(settings: GatewaySettings, host: str, port: int, daemon: str) -> str:
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    auth = ", API key required" if settings.api_key is not None else ""
    return f"gateway listening on {url} (model {settings.model}, daemon {daemon}{auth})"
