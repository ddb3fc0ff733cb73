"""The simulator reserves KV for outputs as SGLang's prefill admission does."""

from __future__ import annotations

import pytest
from sim_helpers import SLO, make_policy, small_kv_profile

from sglang_ext.sim.engine import SimEngine
from sglang_ext.sim.output_reserve import (
    CLIP_MAX_NEW_TOKENS,
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO,
    NewTokenRatio,
    reserved_outputs,
)


def test_the_ratio_decays_to_its_floor_and_starts_over():
    ratio = NewTokenRatio()
    assert ratio.current == INIT_NEW_TOKEN_RATIO == 0.7
    for _ in range(300):
        ratio.decay_step()
    assert ratio.current == pytest.approx((0.7 + 0.098) / 2)
    for _ in range(400):
        ratio.decay_step()
    assert ratio.current == MIN_NEW_TOKEN_RATIO == pytest.approx(0.098)
    ratio.reset()
    assert ratio.current == 0.7


def test_a_retraction_estimates_the_ratio_from_the_decodes_kept():
    ratio = NewTokenRatio()
    ratio.after_retraction([(80, 100), (0, 100)])
    assert ratio.current == pytest.approx((80 + 2 * 20) / 201)
    ratio.after_retraction([(95, 100)])
    assert ratio.current == 1.0


def test_outputs_are_reserved_up_to_sglangs_clip():
    assert reserved_outputs(300, 0.5) == 150
    assert reserved_outputs(10_000) == CLIP_MAX_NEW_TOKENS
    assert reserved_outputs(-3) == 0


def _engine(kv: int) -> SimEngine:
    profile = small_kv_profile(kv)
    return SimEngine(profile, make_policy("sarathi", profile), seed=0, check_invariants=True)


def _started_beside_a_running_request(prompt: int, outputs: int) -> SimEngine:
    """A 2,000-token pool; a running request holds 1,001 tokens and has 399 outputs to
    come when a prompt arrives; one step later."""
    engine = _engine(2000)
    engine.submit("running", 0.0, 1000, 400, SLO)
    while engine.records["running"].first_token_s is None:
        engine.step()
    engine.submit("new", engine.now, prompt, outputs, SLO)
    engine.step()
    return engine


def test_a_prompt_starts_when_it_and_its_outputs_fit_beside_the_running_reserve():
    """999 tokens are free: 600 + 100 fit beside 0.7 x 399 = 279 reserved."""
    engine = _started_beside_a_running_request(600, 100)
    assert engine.records["new"].prefill_tokens_computed > 0


def test_a_prompt_waits_while_its_outputs_do_not_fit_beside_the_running_reserve():
    """600 + 300 do not fit beside the 279 reserved, though the prompt alone does: the
    prompt waits for the running request's memory instead of being retracted later."""
    engine = _started_beside_a_running_request(600, 300)
    assert engine.records["new"].prefill_tokens_computed == 0
    engine.run_until_idle(120.0)
    running, new = engine.records["running"], engine.records["new"]
    assert running.finished and new.finished
    assert running.preemptions == new.preemptions == 0
    assert new.first_token_s > running.finish_s


def test_a_step_that_prefills_leaves_the_ratio_as_it_is():
    """SGLang updates the ratio only on a decode-only step: a step that admits or
    continues a prompt (mixed with the decodes) leaves it."""
    engine = _engine(100_000)
    engine.submit("running", 0.0, 100, 50, SLO)
    while engine.records["running"].first_token_s is None:
        engine.step()
    engine.submit("long", engine.now, 20_000, 5, SLO)
    before = engine.new_token_ratio.current
    engine.step()
    assert engine.records["long"].prefill_tokens_computed > 0
    assert engine.records["running"].decode_steps == 1
    assert engine.new_token_ratio.current == before


def test_decode_steps_decay_the_ratio_and_an_idle_scheduler_resets_it():
    engine = _engine(100_000)
    engine.submit("a", 0.0, 100, 50, SLO)
    engine.run_until_idle(60.0)
    assert engine.new_token_ratio.current == pytest.approx(0.7 - 49 * (0.7 - 0.098) / 600)
    engine.advance_to(engine.now + 1.0)
    assert engine.new_token_ratio.current == 0.7
