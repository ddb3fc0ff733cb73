"""OpenAI's shapes for the gateway: the bodies of ``/v1/completions`` and
``/v1/chat/completions`` it accepts, the conversation it forwards, and the responses and
stream chunks it answers with.

Chat completions. Accepted: ``messages`` (roles ``system``, ``developer``, ``user``, ``assistant``; content
a string, or a list of ``{"type": "text", "text": ...}`` parts, joined with newlines;
an optional ``name``), ``model``, ``max_completion_tokens`` (or the older
``max_tokens``), ``temperature``, ``top_p``, ``stop``, ``seed``, ``stream``,
``stream_options.include_usage``, ``user`` (ignored, as it only labels the caller),
SGLang's ``top_k``, ``min_tokens``, ``ignore_eos``, and this gateway's ``slo`` /
``custom_params.slo`` and ``deadline_s``.

Refused with a 400 that names the field: tools and function calling (``tools``,
``tool_choice`` other than ``"none"``, ``functions``, ``function_call``, ``tool`` and
``function`` messages, an assistant's ``tool_calls``), ``n`` > 1, ``logprobs`` /
``top_logprobs``, images, audio, video and files in content, ``response_format`` other
than text, non-zero ``presence_penalty`` / ``frequency_penalty``, ``logit_bias``, and
``audio`` / non-text ``modalities``. Any other field is ignored, as OpenAI's clients
send more than any server honours.
"""

from __future__ import annotations

from typing import Any

import msgspec

from controlplane.client import Result
from controlplane.protocol import ChatMessage, Prompt

ROLES = ("system", "developer", "user", "assistant")
DEFAULT_CHAT_MAX_TOKENS = 2048  # the gateway's, when a chat request sets no limit (why: controlplane.gateway)
_MEDIA = {"image_url": "images", "input_image": "images", "input_audio": "audio", "audio_url": "audio",
          "video_url": "video", "file": "files", "input_file": "files"}


class ChatRequestError(ValueError):
    """A chat request this gateway refuses; the message names the field."""


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class CompletionRequest(msgspec.Struct, frozen=True):
    """The body of ``POST /v1/completions``; unknown fields are ignored, as OpenAI's
    clients send more than any server honours."""

    prompt: str | list[int | str | list[int]]
    model: str | None = None
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    slo: str | dict[str, object] | None = None
    custom_params: dict[str, object] | None = None
    deadline_s: float | None = None
    service_tier: str | None = None  # OpenAI's; an SLO hint (controlplane.slo_hints)
    priority: int | None = None  # SGLang's; an SLO hint

    def refusals(self) -> list[str]:
        """What this request asks for that the gateway cannot honour."""
        checks = (("n > 1", self.n != 1), ("best_of > 1", (self.best_of or 1) != 1),
                  ("logprobs", self.logprobs is not None), ("echo", self.echo),
                  ("suffix", bool(self.suffix)))
        return [name for name, used in checks if used]

    @property
    def output_tokens(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(msgspec.Struct, frozen=True):
    """The body of ``POST /v1/chat/completions`` (module docstring); ``messages`` is
    checked by :func:`chat_prompt`, so that an error can name the message and field."""

    messages: list[Any]
    model: str | None = None
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    audio: Any = None
    modalities: list[str] | None = None
    slo: str | dict[str, object] | None = None
    custom_params: dict[str, object] | None = None
    deadline_s: float | None = None
    service_tier: str | None = None  # OpenAI's; an SLO hint (controlplane.slo_hints)
    priority: int | None = None  # SGLang's; an SLO hint

    def refusals(self) -> list[str]:
        """What this request asks for that the gateway cannot honour."""
        checks = (
            ("tools (function calling)", bool(self.tools) or self.functions is not None
             or self.function_call not in (None, "none")),
            ("tool_choice", self.tool_choice not in (None, "none")),
            ("n > 1", (self.n or 1) != 1),
            ("logprobs", bool(self.logprobs) or self.top_logprobs is not None),
            ("response_format other than text",
             self.response_format is not None and self.response_format.get("type", "text") != "text"),
            ("presence_penalty", bool(self.presence_penalty)),
            ("frequency_penalty", bool(self.frequency_penalty)),
            ("logit_bias", bool(self.logit_bias)),
            ("audio output", self.audio is not None or any(m != "text" for m in self.modalities or ())),
            ("stream_options without stream", self.stream_options is not None and not self.stream),
        )
        return [name for name, used in checks if used]

    @property
    def output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def chat_prompt(messages: list[Any]) -> Prompt:
    """The conversation as the protocol carries it; raises :class:`ChatRequestError`
    naming the message and field at fault."""
    if not messages:
        raise ChatRequestError("messages: at least one message is required")
    return Prompt(messages=[_message(index, raw) for index, raw in enumerate(messages)])


def _message(index: int, raw: Any) -> ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise ChatRequestError(f"{where}: expected an object with role and content")
    role = raw.get("role")
    if role in ("tool", "function"):
        raise ChatRequestError(f"{where}.role: {role!r} messages need tools, which this gateway "
                               "does not support")
    if role not in ROLES:
        raise ChatRequestError(f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}")
    if raw.get("tool_calls") or raw.get("function_call"):
        raise ChatRequestError(f"{where}.tool_calls: tools are not supported by this gateway")
    name = raw.get("name")
    if name is not None and not (isinstance(name, str) and 1 <= len(name) <= 64):
        raise ChatRequestError(f"{where}.name: expected a string of 1-64 characters")
    return ChatMessage(role, _content(where, raw.get("content")), name)


def _content(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatRequestError(f"{where}.content: expected a string or a list of text parts, "
                               f"got {type(content).__name__ if content is not None else 'null'}")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA:
            raise ChatRequestError(f"{where}.content[{index}]: {_MEDIA[kind]} are not supported by this "
                                   "gateway (text only)")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ChatRequestError(f"{where}.content[{index}]: expected {{\"type\": \"text\", \"text\": "
                                   "<string>}")
        texts.append(part["text"])
    return "\n".join(texts)


def text_completion(result: Result, model: str, created: int) -> dict[str, object]:
    return {"id": f"cmpl-{result.request_id}", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": result.text, "logprobs": None,
                         "finish_reason": finish_reason(str(result.finish_reason))}],
            "usage": usage(result)}


def text_chunk(request_id: str, model: str, created: int, text: str,
               finish: str | None = None) -> dict[str, object]:
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(finish)}]}


def chat_completion(result: Result, model: str, created: int) -> dict[str, object]:
    return {"id": f"chatcmpl-{result.request_id}", "object": "chat.completion", "created": created,
            "model": model, "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                         "logprobs": None, "finish_reason": finish_reason(str(result.finish_reason))}],
            "usage": usage(result)}


def chat_chunk(request_id: str, model: str, created: int, delta: dict[str, str],
               finish: str | None = None) -> dict[str, object]:
    return {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk", "created": created,
            "model": model, "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason(finish)}]}


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else {"length": "length", "stop": "stop"}.get(reason, reason)


def usage(result: Result) -> dict[str, int]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}
