"""When the server received a request, carried from the HTTP process to the scheduler.

A client's TTFT starts when it sends the request; the scheduler sees a request only
after the HTTP process parsed and tokenized it, and only between two steps, so its own
receive time (``scheduler_recv_time``) is late: on the emulated GPU under load by 26 ms
at the median and 74 ms at p99 (``docs/admission.md``). SGLang measures the HTTP
process's receive time (``time_stats.created_time``) but does not send it to the
scheduler, so a hook before ``TokenizerManager._send_one_request`` stamps it into the
request's ``custom_params`` (``RECEIVED_KEY``), overwriting any value a client sent,
and the scheduler counts TTFT deadlines from it (:func:`arrival_time`).

Both processes read ``time.perf_counter`` (CLOCK_MONOTONIC, shared by every process on
the machine). A stamp after the scheduler's receive time, or more than
``MAX_INGRESS_S`` before it, is not trusted (another machine's clock, a forged value
that slipped past the hook): the receive time is used.
"""

from __future__ import annotations

import math
import time
from typing import Any

from sglang_ext.adapter.custom_params import custom_param, set_custom_param

RECEIVED_KEY = "_fairbatching_received"
MAX_INGRESS_S = 10.0
SEND_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._send_one_request"


def stamp_received(tokenized: Any) -> None:
    """Stamp ``tokenized``'s HTTP receive time (now, if SGLang has none); copies the dict."""
    params = getattr(tokenized, "sampling_params", None)
    if params is None or not hasattr(params, "custom_params"):
        return
    created = getattr(getattr(tokenized, "time_stats", None), "created_time", 0.0) or time.perf_counter()
    set_custom_param(params, RECEIVED_KEY, float(created))


def arrival_time(req: Any) -> float:
    """``req``'s HTTP receive time if stamped and plausible, else the scheduler's."""
    received = req.time_stats.scheduler_recv_time
    stamp = custom_param(req, RECEIVED_KEY)
    if (isinstance(stamp, float) and math.isfinite(stamp)
            and 0.0 <= received - stamp <= MAX_INGRESS_S):
        return stamp
    return received


def install_ingress_time() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def before_send(_tokenizer_manager: Any, tokenized: Any, *args: Any, **kwargs: Any) -> None:
        stamp_received(tokenized)

    HookRegistry.register(SEND_TARGET, before_send, HookType.BEFORE)
