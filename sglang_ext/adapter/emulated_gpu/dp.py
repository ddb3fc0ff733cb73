"""A DataParallelController event loop that sleeps while no request arrives.

SGLang's own loop polls its socket without blocking in a busy loop, which takes a whole
core -- harmless next to a GPU, ruinous on the small CPU machines the emulated GPU runs on.
This loop blocks in ``zmq.Poller.poll`` first, then drains exactly as SGLang does.
"""

from __future__ import annotations

from typing import Any

import zmq
from sglang.srt.managers.io_struct import sock_recv

__all__ = ["blocking_event_loop"]

_POLL_TIMEOUT_MS = 1000  # wake up at least this often to feed the soft watchdog


def blocking_event_loop(controller: Any) -> None:
    """REPLACE hook for ``DataParallelController.event_loop``."""
    poller = zmq.Poller()
    poller.register(controller.recv_from_tokenizer, zmq.POLLIN)
    while True:
        controller.soft_watchdog.feed()
        poller.poll(_POLL_TIMEOUT_MS)
        while True:
            controller.soft_watchdog.feed()
            try:
                recv_req = sock_recv(controller.recv_from_tokenizer, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            controller._request_dispatcher(recv_req)
