"""A ZMQ ROUTER socket served on the asyncio loop's own thread: the daemon's rank socket.

libzmq reads every TCP connection on its I/O thread and wakes the application's thread
through an eventfd: two thread wake-ups per message received. The rank socket takes a
message per engine step from every rank, so those wake-ups are most of what a streamed
token costs the daemon at low load. :class:`LoopRouter` listens on the same address and
speaks ZMTP 3.1 (:mod:`controlplane.zmtp`, NULL mechanism) to the ranks' unchanged libzmq
DEALER sockets, from the event loop: one wake-up per read, however many messages it holds.

What it keeps of a libzmq ROUTER (as the daemon sets it):

- a message comes with its sender's routing id (the DEALER's ``Identity``; a peer without
  one gets a fresh id that starts with a zero byte, as libzmq makes them);
- ``ROUTER_HANDOVER`` (``handover``): a new connection with a connected peer's id takes it
  over (the old one is closed); without it the new connection is closed, and a peer may
  not state an id that starts with a zero byte (those are the router's own);
- ``ROUTER_MANDATORY``: a send to an id with no connection fails (``send`` returns False);
- a send high-water mark: ``send`` returns False while the connection holds more than
  ``send_high_water_bytes`` unsent;
- the peers' ZMTP heartbeats: a ``PING`` is answered with a ``PONG``.

A frame over ``max_frame_bytes`` is skipped as it streams in, never held, and reported as
an oversized message. A peer that breaks the protocol (not ZMTP 3 with NULL security, a
socket type a ROUTER cannot talk to, bad framing, a message of more than ``MAX_PARTS``
parts) or has not finished its handshake ``HANDSHAKE_TIMEOUT_S`` after connecting (as
libzmq's ``ZMQ_HANDSHAKE_IVL``) is disconnected. CURVE and ``inproc://``
stay with libzmq (:func:`serves`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import os
import select
import socket as socketlib
import stat
from collections.abc import Callable
from pathlib import Path

from controlplane import zmtp

#: the DEALER-like peers a ROUTER talks to (ZMTP's socket compatibility table)
PEER_TYPES = frozenset((b"DEALER", b"REQ", b"ROUTER"))
LISTEN_BACKLOG = 128
HANDSHAKE_TIMEOUT_S = 30.0
#: the parts of one message held at most (the daemon's messages have one)
MAX_PARTS = 16


class OversizedMessage:
    """Stands in for a frame over the size limit in the parts handed to ``on_message``."""

    __slots__ = ("size_over",)

    def __init__(self, limit: int) -> None:
        self.size_over = limit

    def __len__(self) -> int:
        return self.size_over + 1


def serves(address: str) -> bool:
    """Whether ``address`` is one :class:`LoopRouter` binds: ``tcp://`` with a numeric
    port on an IP address, ``*`` or ``localhost``, or ``ipc://``."""
    if address.startswith("ipc://"):
        return bool(address.removeprefix("ipc://"))
    if not address.startswith("tcp://"):
        return False
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if not port.isdigit() or not host:
        return False
    host = host.strip("[]")
    if host in ("*", "localhost"):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def listening_socket(address: str) -> socketlib.socket:
    """Bind and listen on ``address`` (:func:`serves`), now: ``OSError`` if it cannot."""
    if address.startswith("ipc://"):
        path = address.removeprefix("ipc://")
        try:  # as libzmq does: a socket file left by an earlier process is replaced
            if stat.S_ISSOCK(os.stat(path).st_mode):
                os.unlink(path)
        except FileNotFoundError:
            pass
        listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        bind_to: object = path
    else:
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        host = host.strip("[]")
        host = {"*": "0.0.0.0", "localhost": "127.0.0.1"}.get(host, host)
        family = socketlib.AF_INET6 if ":" in host else socketlib.AF_INET
        listener = socketlib.socket(family, socketlib.SOCK_STREAM)
        listener.setsockopt(socketlib.SOL_SOCKET, socketlib.SO_REUSEADDR, 1)
        bind_to = (host, int(port))
    try:
        listener.bind(bind_to)
        listener.listen(LISTEN_BACKLOG)
    except OSError:
        listener.close()
        raise
    listener.setblocking(False)
    return listener


class LoopRouter:
    """``on_message(routing_id, parts)`` for every message received, each part ``bytes``-
    like or an :class:`OversizedMessage`; ``on_pass_end()`` once after the messages of one
    read. Bind with :func:`listening_socket` (in ``__init__``: a bind error surfaces at
    once), then :meth:`start` on the loop."""

    def __init__(
        self,
        address: str,
        on_message: Callable[[bytes, list], None],
        on_pass_end: Callable[[], None],
        *,
        max_frame_bytes: int,
        send_high_water_bytes: int,
        handover: bool = False,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self.address = address
        self._handover = handover
        self._handshake_timeout_s = handshake_timeout_s
        self._on_message = on_message
        self._on_pass_end = on_pass_end
        self._max_frame_bytes = max_frame_bytes
        self._high_water = send_high_water_bytes
        self._listener: socketlib.socket | None = listening_socket(address)
        self._server: asyncio.AbstractServer | None = None
        self._peers: dict[bytes, _Connection] = {}
        self._connections: set[_Connection] = set()
        self._anonymous = itertools.count(1)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        listener, self._listener = self._listener, None
        if listener is None:
            raise RuntimeError("the router was closed or already started")
        if listener.family == socketlib.AF_UNIX:
            self._server = await loop.create_unix_server(lambda: _Connection(self), sock=listener)
        else:
            self._server = await loop.create_server(lambda: _Connection(self), sock=listener)

    def close(self, *, flush: bool = False) -> None:
        """Stop listening and close every connection: with ``flush``, after what it holds
        unsent is written (while the loop runs), else at once."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._server is not None:
            self._server.close()
            self._server = None
        for connection in list(self._connections):
            if flush:
                connection.close()
            else:
                connection.abort()
        self._peers.clear()
        if self.address.startswith("ipc://"):
            Path(self.address.removeprefix("ipc://")).unlink(missing_ok=True)

    @property
    def peers(self) -> frozenset[bytes]:
        return frozenset(self._peers)

    def send(self, routing_id: bytes, payload: bytes) -> bool:
        """Queue a one-part message to ``routing_id``; False when no connection has that id
        or it holds more than the high-water mark unsent."""
        connection = self._peers.get(routing_id)
        if connection is None:
            return False
        return connection.send(payload)

    def unread(self) -> bool:
        """Whether a connection has data the loop has not read yet (the loop is behind)."""
        poller = select.poll()
        for connection in self._connections:
            if connection.fileno is not None:
                poller.register(connection.fileno, select.POLLIN)
        return bool(poller.poll(0))

    # ------------------------------------------------------------------ from connections
    def _identify(self, connection: _Connection, routing_id: bytes) -> bytes:
        """The connection's routing id; :class:`~controlplane.zmtp.ProtocolError` when it
        may not have the one it states."""
        if not routing_id:
            routing_id = b"\x00" + next(self._anonymous).to_bytes(4, "big")
        elif routing_id[0] == 0:
            raise zmtp.ProtocolError("a routing id that starts with a zero byte is the router's to give")
        previous = self._peers.get(routing_id)
        if previous is not None and previous is not connection:
            if not self._handover:
                raise zmtp.ProtocolError("the routing id is taken")
            previous.abort()
        self._peers[routing_id] = connection
        return routing_id

    def _forget(self, connection: _Connection) -> None:
        self._connections.discard(connection)
        if connection.routing_id is not None and self._peers.get(connection.routing_id) is connection:
            del self._peers[connection.routing_id]


class _Connection(asyncio.Protocol):
    __slots__ = ("_deadline", "_parts", "_reader", "_router", "_state", "fileno", "routing_id", "transport")

    def __init__(self, router: LoopRouter) -> None:
        self._router = router
        self._reader = zmtp.FrameReader(router._max_frame_bytes)
        self._state = "greeting"
        self._parts: list = []
        self.routing_id: bytes | None = None
        self.transport: asyncio.Transport | None = None
        self.fileno: int | None = None
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        self.fileno = sock.fileno() if sock is not None else None
        if sock is not None and sock.family in (socketlib.AF_INET, socketlib.AF_INET6):
            sock.setsockopt(socketlib.IPPROTO_TCP, socketlib.TCP_NODELAY, 1)
        self._router._connections.add(self)
        self._deadline = asyncio.get_running_loop().call_later(self._router._handshake_timeout_s, self._late)
        transport.write(zmtp.greeting() + zmtp.ready(b"ROUTER"))  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        self._router._forget(self)
        self.fileno = None
        if self._deadline is not None:
            self._deadline.cancel()

    def _late(self) -> None:
        if self._state != "open":
            self.abort()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def send(self, payload: bytes) -> bool:
        transport = self.transport
        if transport is None or transport.is_closing() or self._state != "open":
            return False
        if transport.get_write_buffer_size() > self._router._high_water:
            return False
        transport.write(zmtp.frame(payload))
        return True

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        try:
            if self._state == "greeting":
                greeting = reader.take(zmtp.GREETING_SIZE)
                if greeting is None:
                    return
                zmtp.check_greeting(greeting)
                self._state = "handshake"
            delivered = self._read_frames(reader)
        except zmtp.ProtocolError:
            self.abort()
            return
        if delivered:
            self._router._on_pass_end()

    def _read_frames(self, reader: zmtp.FrameReader) -> bool:
        router = self._router
        delivered = False
        for flags, body in reader.frames():
            if flags & zmtp.COMMAND:
                if body is None:
                    raise zmtp.ProtocolError("oversized command")
                self._command(body)
                continue
            if self._state != "open":
                raise zmtp.ProtocolError("a message before the handshake")
            self._parts.append(OversizedMessage(router._max_frame_bytes) if body is None else body)
            if len(self._parts) > MAX_PARTS:
                raise zmtp.ProtocolError(f"a message of more than {MAX_PARTS} parts")
            if not flags & zmtp.MORE:
                parts, self._parts = self._parts, []
                delivered = True
                router._on_message(self.routing_id, parts)
                if self.transport is None or self.transport.is_closing():
                    break
        return delivered

    def _command(self, body: bytes) -> None:
        name, data = zmtp.split_command(body)
        if name == b"PING":
            if self.transport is not None:
                self.transport.write(zmtp.pong(data))
        elif name == b"READY" and self._state == "handshake":
            metadata = zmtp.parse_metadata(data)
            if metadata.get("socket-type") not in PEER_TYPES:
                raise zmtp.ProtocolError(f"socket type {metadata.get('socket-type')!r} cannot talk to a ROUTER")
            self.routing_id = self._router._identify(self, bytes(metadata.get("identity", b"")))
            self._state = "open"
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
        elif name == b"ERROR":
            raise zmtp.ProtocolError("the peer reported an error")
        # other commands (PONG, SUBSCRIBE, ...) mean nothing to a ROUTER
