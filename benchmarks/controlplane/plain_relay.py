"""The gateway's streamed answer with aiohttp's own streaming, the baseline of
``benchmarks.controlplane.relay_cost``; imported by the gateway of that benchmark's scratch
checkout only."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from controlplane.client import Stream
from controlplane.errors import ControlPlaneError
from controlplane.gateway_sse import DONE_EVENT, Events, sse
from controlplane.gateway_translate import describe


async def plain_relay(request: web.Request, stream: Stream, events: Events,
                      headers: Mapping[str, str]) -> web.StreamResponse:
    """``gateway_sse.relay``'s answer with aiohttp's own streaming: each chunk's event
    written and awaited as it is read; nothing held, nothing pushed."""
    response: web.StreamResponse | None = None

    async def start() -> web.StreamResponse:
        answer = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
        await answer.prepare(request)
        return answer

    try:
        async for piece in stream:
            if response is None:
                response = await start()
            await response.write(events.piece(piece.text))
        tail = events.last(stream.result)
    except ControlPlaneError as error:
        if response is None:
            raise
        _, message, kind, code = describe(error)
        tail = sse({"error": {"message": message, "type": kind, "code": code}})
    if response is None:
        response = await start()
    await response.write_eof(tail + DONE_EVENT)
    return response
