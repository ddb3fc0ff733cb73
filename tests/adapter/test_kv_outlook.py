"""The KV outlook the scheduler gives the admission forecast, from SGLang's own ``Req``
objects and reservation rule."""

from __future__ import annotations

import importlib.util

import pytest

from sglang_ext.policy.slo import Slo
from sglang_ext.policy.view import RequestView

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]

SLO = Slo(2.0, 0.05)


def _req(rid: str, prompt: int, max_new: int, produced: int = 0, ignore_eos: bool = True):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, None, list(range(prompt)),
              SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos))
    req.output_ids = list(range(produced))
    return req


def _view(rid: str, prompt: int, produced: int, first_token_time: float | None) -> RequestView:
    return RequestView(rid, 10.0, SLO, produced, 0 if produced else prompt,
                       prompt + produced if produced else 0, prompt, 0, first_token_time)


def test_reserves_follow_sglangs_rule() -> None:
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    from sglang_ext.adapter.scheduler.kv_outlook import output_reserve

    assert output_reserve(_req("a", 10, 100, produced=40), 0.3) == 60  # ignore_eos: all of it
    assert output_reserve(_req("b", 10, 100, produced=40, ignore_eos=False), 0.3) == pytest.approx(18)
    huge = _req("c", 10, 10 * CLIP_MAX_NEW_TOKENS)
    assert output_reserve(huge, 0.5) == CLIP_MAX_NEW_TOKENS
    assert output_reserve(_req("d", 10, 100, produced=40), 0.3, from_start=True) == 100


def test_running_requests_give_back_what_they_hold_when_their_last_token_is_due() -> None:
    from sglang_ext.adapter.scheduler.kv_outlook import kv_outlook

    running = _req("run", 1000, 101, produced=1)
    waiting = _req("wait", 500, 300)
    outlook = kv_outlook(
        5000, 0.5,
        [(running, _view("run", 1000, 1, first_token_time=12.0))],
        [(waiting, _view("wait", 500, 0, first_token_time=None))],
    )
    # free: 5000 less the running request's 100 outputs still to come
    assert outlook.free_tokens == 4900
    # its last token (index 100) is due 100 TPOTs after its first: 12 + 5 s
    assert outlook.release_times == (pytest.approx(17.0),)
    assert outlook.released_through == (1001 + 100,)
    assert outlook.reserves == {"wait": 300}
    assert outlook.new_reserve == pytest.approx((101 + 300) / 2)  # median of two


def test_a_running_request_reserves_a_share_of_its_outputs_and_a_queued_prompt_all() -> None:
    """SGLang's adder scales a running request's remaining outputs by ``new_token_ratio``
    and charges a prompt it admits for all of its outputs."""
    from sglang_ext.adapter.scheduler.kv_outlook import kv_outlook

    running = _req("run", 1000, 101, produced=1, ignore_eos=False)
    waiting = _req("wait", 500, 300, ignore_eos=False)
    outlook = kv_outlook(
        5000, 0.5,
        [(running, _view("run", 1000, 1, first_token_time=12.0))],
        [(waiting, _view("wait", 500, 0, first_token_time=None))],
    )
    assert outlook.free_tokens == 5000 - 0.5 * 100
    assert outlook.released_through == (1001 + 0.5 * 100,)
    assert outlook.reserves == {"wait": 300}
    assert outlook.new_reserve == pytest.approx((101 + 300) / 2)


def test_a_cut_prompts_remainder_comes_out_of_free_memory_first() -> None:
    """SGLang continues its chunked request before any queued prefill, so what it still
    needs (prompt tokens not in KV, and its outputs) is not free for the queue."""
    from sglang_ext.adapter.scheduler.kv_outlook import kv_outlook

    cut = _req("cut", 3000, 8)
    cut_view = RequestView("cut", 10.0, SLO, 0, 2000, 1000, 3000, 0, None)  # 1,000 in KV
    waiting = _req("wait", 100, 300)
    outlook = kv_outlook(2500, 0.5, [], [(waiting, _view("wait", 100, 0, None))], (cut, cut_view))
    assert outlook.free_tokens == 2500 - 2000 - 8
    assert outlook.need_of(cut_view) == 0  # held already, not counted twice
    assert outlook.need_of(_view("wait", 100, 0, None)) == 100 + 300
