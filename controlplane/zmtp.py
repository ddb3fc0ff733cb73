"""The ZeroMQ wire protocol, ZMTP 3.1 (rfc.zeromq.org/spec/37), for the NULL mechanism:
what :mod:`controlplane.loop_router` needs to speak to libzmq peers without libzmq.

A connection opens with a 64-octet greeting each way, then a ``READY`` command each way
(its metadata names the socket type and, for a DEALER, its routing id), then frames:

    frame   = flags size body
    flags   = bit 0 MORE (another frame of the message follows), bit 1 LONG (size is 8
              octets, else 1), bit 2 COMMAND (a command, not a message frame)
    command = name-size name data      (PING: 2-octet TTL + context; PONG: the context)

Everything here is pure: building bytes, and :class:`FrameReader`, which cuts a byte
stream into frames, skipping (not buffering) a frame larger than its limit.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping

GREETING_SIZE = 64
SIGNATURE_END = 9  # octet 0 is 0xFF, octet 9 is 0x7F: the 8 between are padding
VERSION = (3, 1)
NULL_MECHANISM = b"NULL"
MORE, LONG, COMMAND = 0x01, 0x02, 0x04
MAX_SHORT = 255
_LONG_SIZE = struct.Struct(">Q")
_PROPERTY_SIZE = struct.Struct(">I")


class ProtocolError(ValueError):
    """The peer does not speak ZMTP 3 with the NULL mechanism, or broke its framing."""


def greeting() -> bytes:
    """This side's greeting: ZMTP 3.1, the NULL mechanism, not a server (NULL has none)."""
    mechanism = NULL_MECHANISM.ljust(20, b"\x00")
    return b"\xff" + b"\x00" * 8 + b"\x7f" + bytes(VERSION) + mechanism + b"\x00" + b"\x00" * 31


def check_greeting(data: bytes | memoryview) -> tuple[int, int]:
    """The peer's version from its 64-octet greeting; :class:`ProtocolError` for anything
    but ZMTP 3.x with the NULL mechanism."""
    if len(data) < GREETING_SIZE or data[0] != 0xFF or data[SIGNATURE_END] != 0x7F:
        raise ProtocolError("not a ZMTP greeting")
    major, minor = data[10], data[11]
    if major < 3:
        raise ProtocolError(f"ZMTP {major}.{minor}: version 3 or later expected")
    mechanism = bytes(data[12:32]).rstrip(b"\x00")
    if mechanism != NULL_MECHANISM:
        raise ProtocolError(f"security mechanism {mechanism.decode(errors='replace')!r}: only NULL here")
    return major, minor


def frame(body: bytes | memoryview, *, more: bool = False, command: bool = False) -> bytes:
    flags = (MORE if more else 0) | (COMMAND if command else 0)
    size = len(body)
    if size <= MAX_SHORT:
        return bytes((flags, size)) + body
    return bytes((flags | LONG,)) + _LONG_SIZE.pack(size) + body


def command(name: bytes, data: bytes = b"") -> bytes:
    return frame(bytes((len(name),)) + name + data, command=True)


def ready(socket_type: bytes, properties: Mapping[bytes, bytes] | None = None) -> bytes:
    """The ``READY`` command with ``Socket-Type`` and any further metadata."""
    metadata = {b"Socket-Type": socket_type, **(properties or {})}
    body = b"".join(bytes((len(name),)) + name + _PROPERTY_SIZE.pack(len(value)) + value
                    for name, value in metadata.items())
    return command(b"READY", body)


def split_command(body: bytes | memoryview) -> tuple[bytes, bytes]:
    """A command frame's body as (name, data)."""
    if not len(body) or len(body) < 1 + body[0]:
        raise ProtocolError("truncated command")
    end = 1 + body[0]
    return bytes(body[1:end]), bytes(body[end:])


def parse_metadata(data: bytes) -> dict[str, bytes]:
    """A ``READY`` command's properties, names lower-cased (ZMTP names are case-insensitive)."""
    properties: dict[str, bytes] = {}
    at = 0
    while at < len(data):
        name_end = at + 1 + data[at]
        if name_end + 4 > len(data):
            raise ProtocolError("truncated metadata")
        (size,) = _PROPERTY_SIZE.unpack_from(data, name_end)
        value_end = name_end + 4 + size
        if value_end > len(data):
            raise ProtocolError("truncated metadata")
        properties[data[at + 1:name_end].decode("ascii", errors="replace").lower()] = data[name_end + 4:value_end]
        at = value_end
    return properties


def pong(ping_data: bytes) -> bytes:
    """The answer to a ``PING`` whose data (after its name) is ``ping_data``: its context."""
    return command(b"PONG", ping_data[2:])


class FrameReader:
    """Cuts a byte stream into frames: ``feed`` data, then iterate ``frames()`` for
    ``(flags, body)``. A frame whose body is over ``max_body`` is skipped as it arrives
    (never held) and comes out as ``(flags, None)`` once it has passed."""

    __slots__ = ("_buffer", "_max_body", "_skip_flags", "_skipping")

    def __init__(self, max_body: int) -> None:
        self._buffer = bytearray()
        self._max_body = max_body
        self._skipping = 0
        self._skip_flags = 0

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def take(self, size: int) -> bytes | None:
        """The next ``size`` raw octets (the greeting), or None until they are all there."""
        if len(self._buffer) < size:
            return None
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    def frames(self) -> Iterator[tuple[int, bytearray | None]]:
        buffer = self._buffer
        at = 0
        try:
            while True:
                if self._skipping:
                    skipped = min(self._skipping, len(buffer) - at)
                    at += skipped
                    self._skipping -= skipped
                    if self._skipping:
                        return
                    yield self._skip_flags, None
                    continue
                if len(buffer) - at < 2:
                    return
                flags = buffer[at]
                if flags & LONG:
                    if len(buffer) - at < 9:
                        return
                    (size,) = _LONG_SIZE.unpack_from(buffer, at + 1)
                    start = at + 9
                else:
                    size = buffer[at + 1]
                    start = at + 2
                if size > self._max_body:
                    self._skipping, self._skip_flags = size, flags
                    at = start
                    continue
                end = start + size
                if end > len(buffer):
                    return
                body = buffer[start:end]  # a copy: the buffer moves on
                at = end
                yield flags, body
        finally:
            del buffer[:at]
