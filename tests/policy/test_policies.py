"""The named FairBatching policies and the policy registry."""

from __future__ import annotations

import pytest

from policy_helpers import COEF, NOW, SLO, measured_step, request
from sglang_ext.policy.batch_former import form_batch
from sglang_ext.policy.policies import POLICIES, BatchPolicy, PolicyContext
from sglang_ext.policy.name_registry import Registry, UnknownNameError
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_model import StepCoefficients

import sglang_ext.sim.competitors.baselines  # noqa: F401  (registers the baselines)

FAIRBATCHING = ["fb", "fb-fb", "fb-pab", "fb-tb"]
BASELINES = ["sarathi", "sglang-default", "vllm-default"]


def make(name: str, **kwargs) -> BatchPolicy:
    kwargs.setdefault("global_slo", SLO)
    kwargs.setdefault("initial_step_model", COEF)
    return POLICIES.get(name)(PolicyContext(**kwargs))


# --------------------------------------------------------------------------- registry


def test_registry_lists_the_fairbatching_family_and_baselines() -> None:
    names = POLICIES.names()
    for name in FAIRBATCHING + BASELINES:
        assert name in names
        assert name in POLICIES
    assert names == sorted(names)
    assert list(POLICIES) == names


def test_policies_carry_their_names() -> None:
    for name in FAIRBATCHING + BASELINES:
        policy = make(name)
        assert isinstance(policy, BatchPolicy)
        assert policy.name == name


def test_token_budget_flags() -> None:
    assert POLICIES.get("fb-fb").takes_token_budget
    assert POLICIES.get("sarathi").takes_token_budget
    assert not POLICIES.get("fb").takes_token_budget
    assert not POLICIES.get("fb-tb").takes_token_budget


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(UnknownNameError) as info:
        POLICIES.get("fairbatch")
    message = str(info.value)
    assert message.startswith("unknown policy 'fairbatch'; valid: ")
    for name in FAIRBATCHING + BASELINES:
        assert name in message
    assert isinstance(info.value, KeyError)


def test_duplicate_registration_raises() -> None:
    before = POLICIES.get("fb")
    with pytest.raises(KeyError, match="policy 'fb' is already registered"):
        POLICIES.register("fb")(BatchPolicy)
    assert POLICIES.get("fb") is before  # the original entry survives


def test_fresh_registry() -> None:
    registry: Registry[int] = Registry("thing")
    registry.add("b", 2)
    assert registry.register("a")(1) == 1
    assert registry.names() == ["a", "b"] and registry.get("a") == 1
    with pytest.raises(KeyError, match="thing 'a' is already registered"):
        registry.add("a", 3)
    with pytest.raises(UnknownNameError, match="unknown thing 'c'; valid: a, b"):
        registry.get("c")


def test_context_validation() -> None:
    with pytest.raises(ValueError, match="max_token_budget"):
        PolicyContext(SLO, COEF, max_token_budget=0)
    with pytest.raises(ValueError, match="token budget"):
        PolicyContext(SLO, COEF, token_budget=0)


# --------------------------------------------------------------------------- fb


def test_fb_is_algorithm_1_with_its_step_model() -> None:
    requests = [request("u", 0.02, context=1234), request("p", 0.3, prefill=1000)]
    policy = make("fb", max_token_budget=300)
    assert policy.form_batch(requests, NOW) == form_batch(requests, NOW, COEF, max_token_budget=300)
    assert policy.form_batch([], NOW).is_empty
    assert policy.admit(requests, NOW, 10**9, SLO)  # fb admits everything


# --------------------------------------------------------------------------- fb-pab


def test_fb_pab_admits_up_to_the_budget_on_an_empty_rank() -> None:
    policy = make("fb-pab")
    # (TTFT - a) / (b + c) = 0.995 / 1.01e-4 = 9851.49
    assert policy.prefill_admission_budget([], NOW) == pytest.approx(9851.485, abs=1e-3)
    assert policy.admit([], NOW, 9851, SLO)
    assert not policy.admit([], NOW, 9852, SLO)


def test_fb_pab_on_a_loaded_rank() -> None:
    policy = make("fb-pab")
    requests = [
        request("d1", 0.2, context=1000),
        request("d2", 0.6, context=3000),
        request("p", 0.9, prefill=500),
    ]
    # hand-computed in test_pab: (1 - 0.1286) / 1.01e-4 - 500 = 8127.72
    assert policy.admit(requests, NOW, 8127, SLO)
    assert not policy.admit(requests, NOW, 8128, SLO)


def test_fb_pab_uses_the_slo_of_the_request_at_hand() -> None:
    # TTFT 2 s: (2 - 0.005) / 1.01e-4 = 19752.48, whatever the global SLO
    policy = make("fb-pab")
    assert policy.admit([], NOW, 19752, Slo(2.0, 0.05))
    assert not policy.admit([], NOW, 19753, Slo(2.0, 0.05))
    assert not policy.admit([], NOW, 9852, SLO)


# --------------------------------------------------------------------------- fb-tb


TB_COEF = StepCoefficients(0.005, 1.6e-4, 1e-6)


def test_fb_tb_derives_its_token_budget_from_the_time_budget() -> None:
    policy = make("fb-tb", initial_step_model=TB_COEF)
    # init_time_budget = max(0.0, 0.05) = 0.05 s; tokens-only model a' = 5 ms, b' = 0.16 ms
    # budget = floor((0.05 - 0.005) / 1.6e-4) = floor(281.25) = 281: 1 decode + 280 prefill
    requests = [request("u", 0.0, context=50_000), request("p", 0.3, prefill=10_000)]
    decision = policy.form_batch(requests, NOW)
    assert decision.decode_ids == ("u",)
    assert decision.prefill_chunks == (("p", 280),)
    assert decision.time_budget_s is None
    # predicted with the tokens-only model (context ignored): 5 + 281 * 0.16 = 49.96 ms
    assert decision.predicted_step_s == pytest.approx(0.04996)


def test_fb_tb_budget_never_below_the_serviceable_floor() -> None:
    # a' = 100 ms exceeds the 50 ms TPOT: unserviceable, so the request does not set the
    # budget (the paper's fb-tb derived 1 token per step from it); the fallback budget is
    # the floor 2 x (a + b) = 200.3 ms -> (0.20032 - 0.1) / 1.6e-4 = 627 tokens >= 500
    policy = make("fb-tb", initial_step_model=StepCoefficients(0.1, 1.6e-4, 0.0))
    decision = policy.form_batch([request("p", 0.01, prefill=500)], NOW)
    assert decision.prefill_chunks == (("p", 500),)


def test_fb_tb_budget_clamped_to_max() -> None:
    # init = 2 s: (2 - 0.005) / 1.6e-4 = 12468 tokens, clamped to the maximum
    policy = make("fb-tb", initial_step_model=TB_COEF)
    assert policy.form_batch([request("p", 2.0, prefill=20_000)], NOW).prefill_chunks == (
        ("p", 8192),
    )
    small = make("fb-tb", initial_step_model=TB_COEF, max_token_budget=1000)
    assert small.form_batch([request("p", 2.0, prefill=20_000)], NOW).prefill_chunks == (
        ("p", 1000),
    )


def test_fb_tb_learns_its_tokens_only_model() -> None:
    policy = make("fb-tb", initial_step_model=TB_COEF)
    for _ in range(50):
        policy.observe_step(measured_step(1000, 0), 2 * TB_COEF.predict(1000, 0))  # steps twice as slow
    assert policy.tokens_only_model.error.samples == 50
    assert policy.tokens_only_model.coefficients.c_s_per_context_token == 0.0
    slower = policy.tokens_only_model.coefficients
    assert slower.predict(1000, 0) > 1.5 * TB_COEF.predict(1000, 0)
    # a slower model means a smaller derived budget
    requests = [request("p", 0.3, prefill=10_000), request("u", 0.0)]
    assert policy.form_batch(requests, NOW).new_tokens < 281


# --------------------------------------------------------------------------- fb-fb


def test_fb_fb_packs_under_its_fixed_budget_ignoring_time() -> None:
    # The time budget (50 ms) would allow ~449 prefill tokens; fb-fb ignores it.
    requests = [request("u", 0.0), request("p", 0.3, prefill=5000), request("n", 0.9)]
    policy = make("fb-fb", token_budget=1500)
    decision = policy.form_batch(requests, NOW)
    assert decision.decode_ids == ("u",)
    assert decision.prefill_chunks == (("p", 1499),)
    assert decision.time_budget_s is None
    # prediction still from the step model: 5 + 0.1 + 149.9 = 155 ms
    assert decision.predicted_step_s == pytest.approx(0.155)
    assert policy.form_batch([], NOW).is_empty


def test_fb_fb_keeps_fairbatching_order() -> None:
    # budget 10: urgent decode, then prefills by slack, then the calm decode if room
    requests = [
        request("calm", 0.9),
        request("p2", 0.5, prefill=4),
        request("p1", 0.2, prefill=3),
        request("u", 0.0),
    ]
    decision = make("fb-fb", token_budget=10).form_batch(requests, NOW)
    assert decision.prefill_chunks == (("p1", 3), ("p2", 4))
    assert decision.decode_ids == ("u", "calm")  # 1 + 3 + 4 + 1 = 9 <= 10
    tight = make("fb-fb", token_budget=6).form_batch(requests, NOW)
    assert tight.prefill_chunks == (("p1", 3), ("p2", 2))
    assert tight.decode_ids == ("u",)


def test_fb_fb_default_budget() -> None:
    assert make("fb-fb").token_budget == 2048
    assert make("fb-fb", token_budget=64).token_budget == 64


# --------------------------------------------------------------------------- observe_step


@pytest.mark.parametrize("name", FAIRBATCHING + BASELINES)
def test_every_policy_observe_step_updates_its_step_model(name: str) -> None:
    policy = make(name)
    assert policy.step_model.coefficients == COEF
    pab_before = policy.prefill_admission_budget([], NOW)
    for _ in range(30):
        policy.observe_step(measured_step(2000, 100_000), 2 * COEF.predict(2000, 100_000))
    assert policy.step_model.error.samples == 30
    learned = policy.step_model.coefficients
    assert learned != COEF
    assert learned.predict(2000, 100_000) > 1.5 * COEF.predict(2000, 100_000)
    # the PAB follows the learned (slower) model
    assert policy.prefill_admission_budget([], NOW) < pab_before
