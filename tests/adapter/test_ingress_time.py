"""The HTTP process's receive time, stamped before dispatch and read by the scheduler, on
SGLang's own request and time-stats objects."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]


def _scheduler_req(custom_params, received: float):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req("r", None, [1, 2, 3], SamplingParams(max_new_tokens=4, custom_params=custom_params))
    req.time_stats.set_scheduler_recv_time(received)
    return req


def test_the_stamp_carries_created_time_and_replaces_a_forged_one() -> None:
    from sglang.srt.observability.req_time_stats import APIServerReqTimeStats
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_ext.adapter.ingress_time import RECEIVED_KEY, arrival_time, stamp_received

    time_stats = APIServerReqTimeStats()
    time_stats.set_created_time(100.0)
    tokenized = SimpleNamespace(time_stats=time_stats, sampling_params=SamplingParams(
        custom_params={"slo": {"class": "standard"}, RECEIVED_KEY: 1.0}))
    stamp_received(tokenized)
    custom_params = tokenized.sampling_params.custom_params
    assert custom_params == {"slo": {"class": "standard"}, RECEIVED_KEY: 100.0}
    assert arrival_time(_scheduler_req(custom_params, 100.04)) == 100.0


def test_without_a_plausible_stamp_the_scheduler_receive_time_counts() -> None:
    from sglang_ext.adapter.ingress_time import MAX_INGRESS_S, RECEIVED_KEY, arrival_time

    for custom_params in (None, {}, {RECEIVED_KEY: "100"}, {RECEIVED_KEY: True},
                          {RECEIVED_KEY: 100.05},  # after the scheduler received it
                          {RECEIVED_KEY: 100.04 - MAX_INGRESS_S - 1},  # implausibly early
                          {RECEIVED_KEY: float("nan")}):
        assert arrival_time(_scheduler_req(custom_params, 100.04)) == 100.04
