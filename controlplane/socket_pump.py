"""Reading a plain (blocking-API) ZMQ socket from an asyncio loop without a future per message.

A :class:`SocketPump` watches the socket's ``FD`` with ``loop.add_reader``. On a wake-up it
reads every message available with ``zmq.NOBLOCK``, in passes of at most ``max_per_pass``
(another pass is scheduled when one fills, so one busy socket cannot starve the loop),
hands each to ``on_message`` and calls ``on_pass_end`` once per pass (where a caller
flushes what the pass produced).

ZMQ's ``FD`` is edge-triggered: it signals a change of the socket's state, and any send
or receive may consume that signal. Hence a pass reads until ``ZMQ_EVENTS`` says nothing
waits (read after each message: cheaper than the ``zmq.Again`` a read past the last one
raises), and a caller that sends on the socket outside a pass calls
:meth:`SocketPump.poke` afterwards, which schedules a pass when ``ZMQ_EVENTS`` says
messages wait. Messages are read frame by frame (``Frame.more``), not with
``recv_multipart``, which asks for ``ZMQ_RCVMORE`` through a Python-level enum lookup
per frame.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq

MAX_PER_PASS = 512
# plain ints: ``int & PollEvent`` would run the enum's Python-level ``__rand__`` on every check
_EVENTS, _POLLIN, _POLLOUT = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)


def _nothing() -> None:
    pass


class SocketPump:
    def __init__(
        self,
        socket: zmq.Socket,
        on_message: Callable[[list[zmq.Frame]], None],
        on_pass_end: Callable[[], None] | None = None,
        *,
        max_per_pass: int = MAX_PER_PASS,
        on_writable: Callable[[], None] | None = None,
    ) -> None:
        self.socket = socket
        self._on_message = on_message
        self._on_pass_end = on_pass_end if on_pass_end is not None else _nothing
        self._pass_end_sends = on_pass_end is not None  # without one, a drained pass needs no poke
        self._on_writable = on_writable
        self._max_per_pass = max_per_pass
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        self._fd: int | None = None

    def start(self) -> None:
        """Watch the socket on the running loop; reads what already waits."""
        self._loop = asyncio.get_running_loop()
        self._fd = self.socket.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._wake)
        self._schedule()

    def stop(self) -> None:
        if self._loop is not None and self._fd is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._fd = None

    @property
    def running(self) -> bool:
        return self._fd is not None

    def poke(self) -> None:
        """After a send outside a pass: read what waits (the send may have eaten the edge)."""
        if self._fd is None or self._scheduled:
            return
        if self.socket.getsockopt(_EVENTS) & _POLLIN:
            self._schedule()

    def read_now(self) -> None:
        """A pass at once (before acting on news from another socket, such as a monitor's
        disconnect, that must come after what this one already holds)."""
        if self._fd is not None:
            self._pass()

    def _schedule(self) -> None:
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._pass)

    def _wake(self) -> None:
        if self._on_writable is not None and self.socket.getsockopt(_EVENTS) & _POLLOUT:
            self._on_writable()
        self._pass()

    def _pass(self) -> None:
        self._scheduled = False
        if self._fd is None:
            return
        socket = self.socket
        receive = socket.recv
        events = socket.getsockopt
        handle = self._on_message
        count = 0
        drained = False  # ZMQ_EVENTS, read after the last handle, said nothing waits
        try:
            while count < self._max_per_pass:
                try:
                    frame = receive(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    drained = True
                    break
                frames = [frame]
                while frame.more:  # the rest of a multipart message is there with its first part
                    frame = receive(zmq.NOBLOCK, copy=False)
                    frames.append(frame)
                count += 1
                handle(frames)
                # stop on the events flag rather than on an EAGAIN (an exception per pass);
                # reading it also rearms the edge-triggered FD, as an EAGAIN would
                if not events(_EVENTS) & _POLLIN:
                    drained = True
                    break
            self._on_pass_end()
        except BaseException:
            self._schedule()  # what still waits is read on the next pass
            raise
        if not drained:
            self._schedule()
        elif self._pass_end_sends:
            self.poke()  # on_pass_end may have sent on the socket
