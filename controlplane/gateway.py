"""An OpenAI-compatible HTTP front door to the daemon, over the SDK (aiohttp).

    fairbatching-controlplane gateway --daemon tcp://127.0.0.1:5560 --listen 127.0.0.1:8000

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
  overridden, or SGLang's shape ``"custom_params": {"slo": ...}``. ``deadline_s``
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
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import math
import time
import types
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Generator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from controlplane.client import AsyncClient, Result, Stream, StreamChunk
from controlplane.errors import (
    Cancelled, ControlPlaneError, DaemonUnavailable, DeadlineExceeded, DuplicateRequest,
    InternalError, InvalidRequest, NoBudget, NoRanks, Overloaded, QueueTimeout, RankLost,
    RequestFailed, ShuttingDown,
)
from controlplane.openai_api import (
    DEFAULT_CHAT_MAX_TOKENS, ChatCompletionRequest, ChatRequestError, CompletionRequest, chat_chunk,
    chat_completion, chat_prompt, text_chunk, text_completion, usage,
)
from controlplane.protocol import Prompt, SamplingParams, SloSpec, StatusReply

MAX_BODY_BYTES = 4 * 1024 * 1024
CLIENT_KEY: web.AppKey[AsyncClient] = web.AppKey("client", AsyncClient)
SETTINGS_KEY: web.AppKey[GatewaySettings] = web.AppKey("settings")
RESPONSES_KEY: web.AppKey[Counter[int]] = web.AppKey("responses", Counter)
IN_FLIGHT_KEY: web.AppKey[InFlight] = web.AppKey("in_flight")
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID: ContextVar[str] = ContextVar("gateway_request_id")  # set per request by the middleware
T = TypeVar("T")


DEFAULT_MAX_IN_FLIGHT = 1024
GATEWAY_RETRY_AFTER_S = 1
ACCEPT_BACKLOG_MIN, ACCEPT_BACKLOG_MAX = 1024, 4096  # the latter: Linux's usual somaxconn


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    model: str = "fairbatching"  # the served name /v1/models lists; a request may name any model
    api_key: str | None = None  # required as ``Authorization: Bearer <key>`` when set
    chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS  # a chat request's limit when it sets none
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT  # completions held at once; one more is a 429

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


class BadRequest(ValueError):
    pass


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
    body = _parse(await request.read(), CompletionRequest)
    prompt = _completion_prompt(body)
    return await _serve(request, body, prompt, _TextEvents)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = _parse(await request.read(), ChatCompletionRequest)
    try:
        prompt = chat_prompt(body.messages)
    except ChatRequestError as error:
        raise BadRequest(str(error)) from None
    return await _serve(request, body, prompt, _ChatEvents)


async def _serve(request: web.Request, body: CompletionRequest | ChatCompletionRequest,
                 prompt: Prompt, events: type[_TextEvents | _ChatEvents]) -> web.StreamResponse:
    in_flight = request.app[IN_FLIGHT_KEY]
    if not in_flight.enter():
        return _error(429, f"the gateway holds {in_flight.limit} requests, its limit (--max-in-flight)",
                      "overloaded", "gateway_overloaded", {"Retry-After": str(GATEWAY_RETRY_AFTER_S)})
    try:
        return await _serve_admitted(request, body, prompt, events)
    finally:
        in_flight.leave()


async def _serve_admitted(request: web.Request, body: CompletionRequest | ChatCompletionRequest,
                          prompt: Prompt, events: type[_TextEvents | _ChatEvents]) -> web.StreamResponse:
    client, settings = request.app[CLIENT_KEY], request.app[SETTINGS_KEY]
    sampling, slo = _translate(body, settings.chat_max_tokens)
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
        return await _relay(request, stream, events(request_id, model, created, include_usage))


async def _relay(request: web.Request, stream: Stream, events: _Events) -> web.StreamResponse:
    """The stream as server-sent events. An error before any output is raised (an HTTP
    error status); after it, it is the last event before ``[DONE]``. Events are held while
    the next chunk is ready, so that chunks ready together go out in one HTTP write."""
    writer = _EventWriter(request, stream.request_id)
    pushing = False
    try:
        while True:
            piece = _run_until_wait(anext(stream))
            if isinstance(piece, _Waiting):
                await writer.flush_before(piece)
                if not pushing and writer.started:  # the headers are out: later chunks go straight
                    stream.push_chunks(functools.partial(writer.push, events.piece))
                    pushing = True
                piece = await _resume(piece)
            writer.add(events.piece(piece.text))
    except StopAsyncIteration:
        writer.add(events.last(stream.result))
    except ControlPlaneError as error:
        if not writer.started:
            raise
        _, message, kind, code = _describe(error)
        writer.add(_sse({"error": {"message": message, "type": kind, "code": code}}))
    writer.add(DONE_EVENT)
    return await writer.finish()


class _EventWriter:
    """Holds a streamed answer's events until they are written; the answer's headers go
    with the first write. Once they are out, :meth:`push` writes a chunk's event as it
    arrives, from the SDK's receiving callback, without waking the handler: one write per
    chunk and no task switch, while nothing is held or being written and the connection
    takes data without waiting."""

    def __init__(self, request: web.Request, request_id: str) -> None:
        self._request = request
        self._request_id = request_id
        self._held: list[bytes] = []
        self._response: web.StreamResponse | None = None
        self._writing = False  # the handler awaits a write
        self._draining: _Waiting | None = None  # a pushed write that waits for the connection

    @property
    def started(self) -> bool:
        """Whether the answer has begun: output was received, so an error is now an event."""
        return self._response is not None or bool(self._held)

    def add(self, event: bytes) -> None:
        self._held.append(event)

    def push(self, render: Callable[[str], bytes], chunk: StreamChunk) -> bool:
        """Write ``chunk``'s event now if that keeps the events in order and needs no wait;
        False leaves it to the handler."""
        response, transport = self._response, self._request.transport
        if (response is None or self._held or self._writing or self._draining is not None
                or transport is None or transport.is_closing()):
            return False
        try:
            step = _run_until_wait(response.write(render(chunk.text)))
        except ConnectionError:  # the client went: the handler finds out
            return False
        if isinstance(step, _Waiting):  # written; the connection's buffer is full
            self._draining = step
        return True

    async def flush_before(self, waiting: _Waiting) -> None:
        """Write what is held, as the stream's next chunk (``waiting``) is not ready; a
        failed write unwinds ``waiting``."""
        if not self._held:
            return
        self._writing = True
        try:
            await self._drained()
            response = self._response or await self._start()
            await response.write(self._take())
        except BaseException:
            await _unwind(waiting)
            raise
        finally:
            self._writing = False

    async def finish(self) -> web.StreamResponse:
        self._writing = True
        await self._drained()
        response = self._response or await self._start()
        await response.write_eof(self._take())
        return response

    async def _drained(self) -> None:
        """Wait for the connection to take what a push wrote past its buffer."""
        draining, self._draining = self._draining, None
        if draining is not None:
            await _resume(draining)

    def _take(self) -> bytes:
        data = b"".join(self._held)
        self._held.clear()
        return data

    async def _start(self) -> web.StreamResponse:
        response = self._response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            REQUEST_ID_HEADER: self._request_id})
        await response.prepare(self._request)
        return response


# ---------------------------------------------------------------------- awaiting in two halves
@dataclass(frozen=True, slots=True)
class _Waiting:
    """An awaitable run up to its first wait: it handed ``signal`` (a future) to the event loop."""

    steps: Generator[Any, None, Any]
    signal: Any


def _run_until_wait(awaitable: Awaitable[T]) -> T | _Waiting:
    """Run ``awaitable`` as an ``await`` would until it has to wait: its result when it
    did not, else where it stopped, to go on with :func:`_resume`."""
    steps = awaitable.__await__()
    try:
        signal = steps.send(None)
    except StopIteration as done:
        return done.value
    return _Waiting(steps, signal)


@types.coroutine
def _resume(waiting: _Waiting, error: BaseException | None = None) -> Generator[Any, None, Any]:
    """Await what :func:`_run_until_wait` started, exactly as an ``await`` from the start
    would have (a cancellation included); with ``error``, that is thrown in first."""
    steps, signal = waiting.steps, waiting.signal
    while True:
        if error is not None:
            try:
                signal = steps.throw(error)
            except StopIteration as done:
                return done.value
            error = None
        try:
            yield signal
        except BaseException as thrown:  # noqa: BLE001  (the awaitable's, as with yield from)
            error = thrown
        else:
            return (yield from steps)


async def _unwind(waiting: _Waiting) -> None:
    """Cancel a started awaitable whose result is no longer wanted; its ``finally``
    blocks run (a stream cancels its request at the daemon)."""
    try:
        await _resume(waiting, asyncio.CancelledError())
    except asyncio.CancelledError:
        return


# ---------------------------------------------------------------------- event rendering
DONE_EVENT = b"data: [DONE]\n\n"
_OPEN_TEXT = "\x00text\x00"  # a placeholder, spliced out of an encoded chunk


def _sse(payload: Mapping[str, object]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


@dataclass(frozen=True, slots=True)
class _Spliced:
    """A chunk's event with its text left open: ``event(text)`` is the event of the chunk
    with that text, byte for byte, without encoding the rest again."""

    before: bytes
    after: bytes

    @classmethod
    def of(cls, chunk: Mapping[str, object]) -> _Spliced:
        """``chunk`` has ``_OPEN_TEXT`` as its text. The last placeholder is the text's:
        the client's field (the model's name) comes before it."""
        before, _, after = _sse(chunk).rpartition(msgspec.json.encode(_OPEN_TEXT))
        return cls(before, after)

    def event(self, text: str) -> bytes:
        return self.before + msgspec.json.encode(text) + self.after


class _Events:
    """The events of one streamed answer."""

    whole: Callable[[Result, str, int], dict[str, object]]

    def __init__(self, request_id: str, model: str, created: int, include_usage: bool) -> None:
        self.request_id, self.model, self.created = request_id, model, created
        self.include_usage = include_usage
        self._usage_field: dict[str, object] = {"usage": None} if include_usage else {}
        self._piece = _Spliced.of(self._open_chunk())

    def piece(self, text: str) -> bytes:
        return self._piece.event(text)

    def last(self, result: Result) -> bytes:
        """The finish chunk and, with ``include_usage``, the usage chunk."""
        finish = _sse(self._finish_chunk(str(result.finish_reason)))
        if not self.include_usage:
            return finish
        return finish + _sse({**self._finish_chunk(None), "choices": [], "usage": usage(result)})

    def _open_chunk(self) -> dict[str, object]:
        """A chunk of text ``_OPEN_TEXT``."""
        raise NotImplementedError

    def _finish_chunk(self, finish: str | None) -> dict[str, object]:
        raise NotImplementedError


class _TextEvents(_Events):
    whole = staticmethod(text_completion)

    def _open_chunk(self) -> dict[str, object]:
        return self._chunk(_OPEN_TEXT, None)

    def _finish_chunk(self, finish: str | None) -> dict[str, object]:
        return self._chunk("", finish)

    def _chunk(self, text: str, finish: str | None) -> dict[str, object]:
        chunk = text_chunk(self.request_id, self.model, self.created, text, finish)
        return {**chunk, **self._usage_field}


class _ChatEvents(_Events):
    """The first delta states the role, as OpenAI's does."""

    whole = staticmethod(chat_completion)

    def __init__(self, request_id: str, model: str, created: int, include_usage: bool) -> None:
        super().__init__(request_id, model, created, include_usage)
        self._role_sent = False

    def piece(self, text: str) -> bytes:
        if self._role_sent:
            return self._piece.event(text)
        self._role_sent = True
        return _sse(self._chunk({"role": "assistant", "content": text}, None))

    def _open_chunk(self) -> dict[str, object]:
        return self._chunk({"content": _OPEN_TEXT}, None)

    def _finish_chunk(self, finish: str | None) -> dict[str, object]:
        return self._chunk({} if self._role_sent else {"role": "assistant", "content": ""}, finish)

    def _chunk(self, delta: dict[str, str], finish: str | None) -> dict[str, object]:
        chunk = chat_chunk(self.request_id, self.model, self.created, delta, finish)
        return {**chunk, **self._usage_field}


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
    text = prometheus_text(status, request.app[RESPONSES_KEY], request.app[IN_FLIGHT_KEY])
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
            return _error(401, "missing or wrong API key (Authorization: Bearer ...)",
                          "invalid_request_error", "invalid_api_key")
    try:
        return await handler(request)
    except BadRequest as error:
        return _error(400, str(error), "invalid_request_error", "invalid_request")
    except ControlPlaneError as error:
        status, message, error_type, code = _describe(error)
        retry_after = getattr(error, "retry_after_s", None) or (
            GATEWAY_RETRY_AFTER_S if status == 429 else None)  # every 429 says when to retry
        headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after else None
        return _error(status, message, error_type, code, headers)
    except web.HTTPException as error:  # aiohttp's own: no such route, wrong method, body too large
        if error.status < 400:
            raise
        return _error(error.status, _HTTP_ERRORS.get(error.status, error.reason),
                      "invalid_request_error", error.reason.lower().replace(" ", "_"),
                      {"Allow": error.headers["Allow"]} if "Allow" in error.headers else None)


# ---------------------------------------------------------------------- metrics
def prometheus_text(status: StatusReply, responses: Mapping[int, int],
                    in_flight: InFlight | None = None) -> str:
    """The daemon's status and the gateway's responses (and requests held) in Prometheus'
    text format."""
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
    if in_flight is not None:
        family("fairbatching_gateway_in_flight", "gauge", "Completion requests this gateway holds.",
               [("", in_flight.count)])
        family("fairbatching_gateway_in_flight_limit", "gauge", "Its limit (--max-in-flight).",
               [("", in_flight.limit)])
        family("fairbatching_gateway_refused_total", "counter",
               "Requests refused (429) because the gateway held its limit.", [("", in_flight.refused)])
    return "\n".join(lines) + "\n"


def _labels(**labels: str) -> str:
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{key}="{escape(value)}"' for key, value in labels.items()) + "}"


def _number(value: float) -> str:
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


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
            announce(listening_line(settings, host, port, client.address))
        await stop.wait()
    finally:
        await runner.cleanup()


def listening_line(settings: GatewaySettings, host: str, port: int, daemon: str) -> str:
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    auth = ", API key required" if settings.api_key is not None else ""
    return f"gateway listening on {url} (model {settings.model}, daemon {daemon}{auth})"


def parse_listen(text: str, allow_non_loopback: bool, flag: str = "--listen") -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 in brackets); loopback unless ``allow_non_loopback``. ``flag``
    names the option in the errors."""
    host, _, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{flag} {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8000")
    if host not in ("127.0.0.1", "localhost", "::1") and not allow_non_loopback:
        raise ValueError(f"{flag} {text!r} is not loopback; the gateway speaks plain HTTP, so say "
                         "--allow-non-loopback (and set --api-key-file) to expose it")
    return host, int(port_text)
