"""A streamed answer as server-sent events: :func:`relay` reads an SDK stream and writes
OpenAI's chunks (:class:`TextEvents` for ``/v1/completions``, :class:`ChatEvents` for
``/v1/chat/completions``), then ``data: [DONE]``.

Three things keep the CPU per streamed token low.

- **Events ready together go out in one HTTP write.** The handler holds the events it has
  and writes them only when the stream's next chunk is not ready yet (it takes the read
  in two steps, :mod:`controlplane.stepped_await`).
- **Once the headers are out, chunks are pushed.** The SDK's receiving callback writes a
  chunk's event as it arrives (``Stream.push_chunks``), without waking the handler: one
  write per chunk and no task switch. The handler takes over again (its events in order)
  whenever it holds events, is writing, or the connection is closing or holds more than
  ``PUSH_HIGH_WATER`` bytes unsent. Errors and the end always come through it.
- **A pushed chunk is one transport write.** On HTTP/1.1 the answer is chunked
  (``Transfer-Encoding: chunked``, asked for before the headers), so the callback writes
  a pushed event to the connection itself, framed as an HTTP chunk
  (``<size in hex>\r\n<event>\r\n``), not through aiohttp's write coroutine.
  Everything before it (the headers, with the first events) and after it (the last
  events and the terminating chunk, ``write_eof``) goes through aiohttp, on the same
  connection in order. An HTTP/1.0 client, which cannot take chunks, gets every event
  through aiohttp.

Each chunk's event is spliced from a template encoded once per answer (:class:`Spliced`),
byte for byte the chunk's own encoding.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgspec
from aiohttp import HttpVersion11, web

from controlplane.client import Result, Stream, StreamChunk
from controlplane.errors import ControlPlaneError
from controlplane.gateway_translate import describe
from controlplane.openai_api import chat_chunk, chat_completion, text_chunk, text_completion, usage
from controlplane.stepped_await import Waiting, resume, run_until_wait, unwind

DONE_EVENT = b"data: [DONE]\n\n"
#: a chunk is pushed only while the connection holds at most this many bytes unsent
PUSH_HIGH_WATER = 64 * 1024
_OPEN_TEXT = "\x00text\x00"  # a placeholder, spliced out of an encoded chunk


async def relay(request: web.Request, stream: Stream, events: Events,
                headers: Mapping[str, str]) -> web.StreamResponse:
    """The stream as server-sent events, the answer carrying ``headers``. An error before
    any output is raised (an HTTP error status); after it, it is the last event before
    ``[DONE]``. Events are held while the next chunk is ready, so that chunks ready
    together go out in one HTTP write."""
    writer = EventWriter(request, headers)
    pushing = False
    try:
        while True:
            piece = run_until_wait(anext(stream))
            if isinstance(piece, Waiting):
                await writer.flush_before(piece)
                if not pushing and writer.started:  # the headers are out: later chunks go straight
                    stream.push_chunks(functools.partial(writer.push, events.piece))
                    pushing = True
                piece = await resume(piece)
            writer.add(events.piece(piece.text))
    except StopAsyncIteration:
        writer.add(events.last(stream.result))
    except ControlPlaneError as error:
        if not writer.started:
            raise
        _, message, kind, code = describe(error)
        writer.add(sse({"error": {"message": message, "type": kind, "code": code}}))
    writer.add(DONE_EVENT)
    return await writer.finish()


class EventWriter:
    """Holds a streamed answer's events until they are written; the answer's headers go
    with the first write. Once they are out on a chunked answer, :meth:`push` writes a
    chunk's event to the connection as it arrives, from the SDK's receiving callback:
    one transport write per chunk and no task switch, while nothing is held or being
    written and the connection holds at most ``PUSH_HIGH_WATER`` bytes unsent.

    What waits unsent is bounded: pushes stop at ``PUSH_HIGH_WATER``, and the handler's
    own writes wait for the connection past aiohttp's limit (64 KiB of them)."""

    def __init__(self, request: web.Request, headers: Mapping[str, str]) -> None:
        self._request = request
        self._headers = headers
        self._held: list[bytes] = []
        self._response: web.StreamResponse | None = None
        self._writing = False  # the handler awaits a write
        self._pushing_to: asyncio.Transport | None = None  # the headers are out on a chunked answer

    @property
    def started(self) -> bool:
        """Whether the answer has begun: output was received, so an error is now an event."""
        return self._response is not None or bool(self._held)

    def add(self, event: bytes) -> None:
        self._held.append(event)

    def push(self, render: Callable[[str], bytes], chunk: StreamChunk) -> bool:
        """Write ``chunk``'s event now, as one HTTP chunk, if that keeps the events in order
        and the connection takes it; False leaves it to the handler."""
        transport = self._pushing_to
        if (transport is None or self._held or self._writing or transport.is_closing()
                or transport.get_write_buffer_size() > PUSH_HIGH_WATER):
            return False
        event = render(chunk.text)
        transport.write(b"%x\r\n%b\r\n" % (len(event), event))
        return True

    async def flush_before(self, waiting: Waiting) -> None:
        """Write what is held, as the stream's next chunk (``waiting``) is not ready; a
        failed write unwinds ``waiting``."""
        if not self._held:
            return
        self._writing = True
        try:
            response = self._response or await self._start()
            await response.write(self._take())
            if response.chunked:  # the headers went out with that write
                self._pushing_to = self._request.transport
        except BaseException:
            await unwind(waiting)
            raise
        finally:
            self._writing = False

    async def finish(self) -> web.StreamResponse:
        self._writing = True
        response = self._response or await self._start()
        await response.write_eof(self._take())
        return response

    def _take(self) -> bytes:
        data = b"".join(self._held)
        self._held.clear()
        return data

    async def _start(self) -> web.StreamResponse:
        response = self._response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", **self._headers})
        if self._request.version >= HttpVersion11:
            response.enable_chunked_encoding()
        await response.prepare(self._request)
        return response


# ---------------------------------------------------------------------- event rendering
def sse(payload: Mapping[str, object]) -> bytes:
    """``payload`` as one server-sent event."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


@dataclass(frozen=True, slots=True)
class Spliced:
    """A chunk's event with its text left open: ``event(text)`` is the event of the chunk
    with that text, byte for byte, without encoding the rest again."""

    before: bytes
    after: bytes

    @classmethod
    def of(cls, chunk: Mapping[str, object]) -> Spliced:
        """``chunk`` has ``_OPEN_TEXT`` as its text. The last placeholder is the text's:
        the client's field (the model's name) comes before it."""
        before, _, after = sse(chunk).rpartition(msgspec.json.encode(_OPEN_TEXT))
        return cls(before, after)

    def event(self, text: str) -> bytes:
        return self.before + msgspec.json.encode(text) + self.after


class Events:
    """The events of one streamed answer."""

    whole: Callable[[Result, str, int], dict[str, object]]

    def __init__(self, request_id: str, model: str, created: int, include_usage: bool) -> None:
        self.request_id, self.model, self.created = request_id, model, created
        self.include_usage = include_usage
        self._usage_field: dict[str, object] = {"usage": None} if include_usage else {}
        self._piece = Spliced.of(self._open_chunk())

    def piece(self, text: str) -> bytes:
        return self._piece.event(text)

    def last(self, result: Result) -> bytes:
        """The finish chunk and, with ``include_usage``, the usage chunk."""
        finish = sse(self._finish_chunk(str(result.finish_reason)))
        if not self.include_usage:
            return finish
        return finish + sse({**self._finish_chunk(None), "choices": [], "usage": usage(result)})

    def _open_chunk(self) -> dict[str, object]:
        """A chunk of text ``_OPEN_TEXT``."""
        raise NotImplementedError

    def _finish_chunk(self, finish: str | None) -> dict[str, object]:
        raise NotImplementedError


class TextEvents(Events):
    whole = staticmethod(text_completion)

    def _open_chunk(self) -> dict[str, object]:
        return self._chunk(_OPEN_TEXT, None)

    def _finish_chunk(self, finish: str | None) -> dict[str, object]:
        return self._chunk("", finish)

    def _chunk(self, text: str, finish: str | None) -> dict[str, object]:
        chunk = text_chunk(self.request_id, self.model, self.created, text, finish)
        return {**chunk, **self._usage_field}


class ChatEvents(Events):
    """The first delta states the role, as OpenAI's does."""

    whole = staticmethod(chat_completion)

    def __init__(self, request_id: str, model: str, created: int, include_usage: bool) -> None:
        super().__init__(request_id, model, created, include_usage)
        self._role_sent = False

    def piece(self, text: str) -> bytes:
        if self._role_sent:
            return self._piece.event(text)
        self._role_sent = True
        return sse(self._chunk({"role": "assistant", "content": text}, None))

    def _open_chunk(self) -> dict[str, object]:
        return self._chunk({"content": _OPEN_TEXT}, None)

    def _finish_chunk(self, finish: str | None) -> dict[str, object]:
        return self._chunk({} if self._role_sent else {"role": "assistant", "content": ""}, finish)

    def _chunk(self, delta: dict[str, str], finish: str | None) -> dict[str, object]:
        chunk = chat_chunk(self.request_id, self.model, self.created, delta, finish)
        return {**chunk, **self._usage_field}
