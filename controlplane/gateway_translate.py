"""What the gateway translates between OpenAI's HTTP API and the SDK: a request body into
the SDK's prompt, sampling parameters and SLO (:func:`parse_body`,
:func:`completion_prompt`, :func:`translate`; a body it cannot honour is a
:class:`BadRequest`), and an SDK error into an HTTP status and OpenAI's error fields
(:func:`describe`, :func:`error_response`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import msgspec
from aiohttp import web

from controlplane.errors import (
    Cancelled, ControlPlaneError, DaemonUnavailable, DeadlineExceeded, DuplicateRequest,
    InternalError, InvalidRequest, NoBudget, NoRanks, Overloaded, QueueTimeout, RankLost,
    RequestFailed, ShuttingDown,
)
from controlplane.openai_api import ChatCompletionRequest, CompletionRequest
from controlplane.protocol import Prompt, SamplingParams, SloSpec, as_slo_spec
from controlplane.slo_hints import HintError, SloHints


class BadRequest(ValueError):
    """A request body the gateway refuses (a 400, with this message)."""


# ---------------------------------------------------------------------- requests
Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest)


def parse_body(raw: bytes, kind: type[Body]) -> Body:
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


def completion_prompt(body: CompletionRequest) -> Prompt:
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


def translate(body: CompletionRequest | ChatCompletionRequest, chat_max_tokens: int,
              hints: SloHints | None = None,
              headers: Mapping[str, str] | None = None) -> tuple[SamplingParams, SloSpec | None]:
    """The SDK's sampling parameters and SLO for ``body``: its ``slo`` (or
    ``custom_params.slo``), else what ``hints`` make of its ``service_tier``, ``priority``
    and ``headers`` (:mod:`controlplane.slo_hints`)."""
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
        slo = as_slo_spec(slo)
        if slo is None and hints is not None:
            slo = hints.slo(headers or {}, body.service_tier, body.priority)
    except HintError as error:
        raise BadRequest(str(error)) from None
    except (msgspec.ValidationError, ValueError) as error:
        message = str(error).replace("max_new_tokens", max_name).replace("min_new_tokens", "min_tokens")
        raise BadRequest(f"invalid request body: {message}") from None
    return sampling, slo


# ---------------------------------------------------------------------- errors
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


def describe(error: ControlPlaneError) -> tuple[int, str, str, str]:
    """``error`` as an HTTP status and OpenAI's ``message``, ``type`` and ``code``."""
    for kind, status, error_type in _STATUS:
        if isinstance(error, kind):
            code = str(getattr(error, "reason", type(error).__name__))
            return status, str(error), error_type, code
    return 500, str(error), "server_error", type(error).__name__


def error_response(status: int, message: str, error_type: str, code: str,
                   headers: Mapping[str, str] | None = None) -> web.Response:
    """A failure in OpenAI's shape: ``{"error": {"message", "type", "code"}}``."""
    return web.json_response({"error": {"message": message, "type": error_type, "code": code}},
                             status=status, headers=headers)
