"""``form_batch_with_budgets``: a rank that publishes its budgets at every decision takes
the decision and the budgets from one forecast; both must be exactly what the two calls
give, for every policy, admission and state (expired requests included)."""

from __future__ import annotations

import random

import pytest

import sglang_ext.policy.variants  # noqa: F401  (registers the variants)
import sglang_ext.sim.competitors  # noqa: F401  (registers the baselines)
from sglang_ext.policy.admission import AdmissionMode, AdmissionSettings, GiveUp, KvOutlook
from sglang_ext.policy.knee_step_model import KneeStepModel
from sglang_ext.policy.policies import POLICIES, PolicyContext
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_model import StepCoefficients
from sglang_ext.policy.view import RequestView

STANDARD = Slo(2.0, 0.05)
CLASSES = {"interactive": Slo(0.5, 0.05), "standard": STANDARD, "relaxed": Slo(5.0, 0.2)}
LINEAR = StepCoefficients(0.004, 6e-5, 3.1e-8)
KNEE = KneeStepModel(0.005, 5e-5, 1e-8, 3.3e-9, 1e-12, 256.0, 64.0)
NOW = 100.0
DEFER = [AdmissionSettings(AdmissionMode.DEFER, give_up=give_up)
         for give_up in (None, GiveUp.LATEST, GiveUp.FAIR)]
FAMILY = ["fb", "fb-fb", "fb-tb", "fb-anchor", "fb-margin", "fb-kairos", "fb-anchor-margin",
          "fb-smooth"]


def state(rng: random.Random, count: int) -> list[RequestView]:
    """Decodes and queued prompts around ``NOW``; some queued past ``max_defer_s`` after
    their TTFT deadline (the decision ends them)."""
    views = []
    for seq in range(count):
        slo = rng.choice(list(CLASSES.values()))
        if rng.random() < 0.3:
            prompt = rng.randint(1, 6000)
            views.append(RequestView(seq, NOW - rng.uniform(0.0, slo.ttft_s + 2.5), slo, 0,
                                     rng.choice([prompt, rng.randint(1, prompt)]), 0, prompt, seq))
        else:
            index = rng.randint(1, 300)
            arrival = NOW - slo.ttft_s - slo.tpot_s * index + rng.uniform(-0.1, 1.0)
            prompt = rng.randint(1, 6000)
            views.append(RequestView(seq, arrival, slo, index, 0, prompt + index - 1, prompt, seq,
                                     arrival + rng.uniform(0.05, slo.ttft_s)))
    return views


def kv_of(rng: random.Random, views: list[RequestView]) -> KvOutlook:
    releases = [(NOW + rng.uniform(0.0, 30.0), float(rng.randint(1, 5000))) for _ in range(20)]
    return KvOutlook.of(rng.choice([2000, 400_000]), releases,
                        {v.req_id: 64.0 for v in views if v.pending_prefill}, 128.0)


def policies():
    for name in FAMILY:
        for admission in [AdmissionSettings(), AdmissionSettings(AdmissionMode.REJECT), *DEFER]:
            yield name, admission
    yield "fb-pab", AdmissionSettings()
    yield "sarathi", AdmissionSettings()


@pytest.mark.parametrize(("name", "admission"), list(policies()),
                         ids=lambda value: value.label if isinstance(value, AdmissionSettings) else value)
@pytest.mark.parametrize("model", [LINEAR, KNEE], ids=["linear", "knee"])
def test_one_forecast_gives_what_the_two_calls_give(name, admission, model):
    rng = random.Random(f"{name}-{admission.label}-{type(model).__name__}")
    context = PolicyContext(STANDARD, model, admission=admission, token_budget=1024,
                            initial_linear_model=LINEAR)
    policy = POLICIES.get(name)(context)
    expired_seen = 0
    for trial in range(40):
        views = state(rng, rng.choice([0, 1, 20, 120]))
        policy.observe_kv(kv_of(rng, views) if trial % 2 else None)
        decision, budgets = policy.form_batch_with_budgets(views, NOW, CLASSES)
        assert budgets == policy.class_budgets(views, NOW, CLASSES)
        assert decision == policy.form_batch(views, NOW)
        expired_seen += bool(decision.abort_ids)
    if admission.mode is AdmissionMode.DEFER:
        assert expired_seen  # the states reach the path where a request expires
