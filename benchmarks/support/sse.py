"""Server-sent events as SGLang and the gateway stream them: one ``data: <JSON>`` line per
event, other lines (blank separators, comments) ignored, ``data: [DONE]`` the end."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

_DONE = object()
_NOT_DATA = object()


def _event(line: bytes | str) -> Any:
    """The decoded JSON of a ``data:`` line, ``_DONE`` for ``[DONE]``, else ``_NOT_DATA``."""
    prefix, done = (b"data:", b"[DONE]") if isinstance(line, bytes) else ("data:", "[DONE]")
    if not line.startswith(prefix):
        return _NOT_DATA
    payload = line[5:].strip()
    return _DONE if payload == done else json.loads(payload)


def json_events(lines: Iterable[bytes | str]) -> Iterator[Any]:
    """The events of a stream read line by line (e.g. ``requests``' ``iter_lines``)."""
    for line in lines:
        if (event := _event(line)) is _DONE:
            return
        if event is not _NOT_DATA:
            yield event


async def json_events_async(lines: AsyncIterable[bytes]) -> AsyncIterator[Any]:
    """The events of a stream read line by line (e.g. an aiohttp ``response.content``)."""
    async for line in lines:
        if (event := _event(line)) is _DONE:
            return
        if event is not _NOT_DATA:
            yield event
