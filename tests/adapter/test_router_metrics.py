"""The router gauges (``sglang_ext.adapter.scheduler.router_metrics``) from a policy state:
each SLO class's budget and predicted TTFT, what the rank already publishes taken as it is,
the refresh interval, and the Prometheus series a scrape shows."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sglang_ext.adapter.extension_config import ExtensionConfig
from sglang_ext.adapter.scheduler.router_metrics import (
    MAX_PREDICTED_TTFT_S,
    RouterMetrics,
    router_signals,
)
from sglang_ext.adapter.scheduler.state import FairBatchingState, whole_budget_tokens
from sglang_ext.policy.admission import forecast
from sglang_ext.policy.view import RequestView

REPO = Path(__file__).resolve().parents[2]
LABELS = {"model_name": "tiny", "dp_rank": "1", "tp_rank": "2", "pp_rank": "0"}
NOW = 100.0


@pytest.fixture
def state() -> FairBatchingState:
    return FairBatchingState(ExtensionConfig.load(REPO / "configs" / "fairbatching.toml"))


def queued(state: FairBatchingState, count: int, prompt: int, slo_class: str = "relaxed") -> list:
    slo = state.config.catalog.classes[slo_class]
    return [RequestView(f"q{i}", NOW - 0.01 * i, slo, 0, prompt, 0, prompt, arrival_seq=i)
            for i in range(count)]


def decoding(state: FairBatchingState, count: int, context: int = 1000) -> list:
    slo = state.config.catalog.classes["standard"]
    return [RequestView(f"d{i}", NOW - 1.0, slo, 5, 0, context, context, arrival_seq=100 + i,
                        first_token_time=NOW - 0.5) for i in range(count)]


def signals_of(state: FairBatchingState, views: list, now: float = NOW):
    return router_signals(state.policy, views, NOW, now, state.config.catalog.classes)


def test_every_class_has_a_budget_and_a_ttft(state):
    classes = set(state.config.catalog.classes)
    signals = signals_of(state, [])
    assert set(signals.budget_tokens) == classes == set(signals.predicted_ttft_s)
    assert signals.prefill_rate_tokens_per_s > 0
    policy = state.policy
    idle = forecast([], NOW, policy.step_model.coefficients, policy.context.global_slo.tpot_s,
                    policy.admission.headroom)
    for name, slo in state.config.catalog.classes.items():
        # idle: the prompt the whole TTFT buys at the prefill rate, and nothing to wait for
        # but one token's prefill
        assert signals.budget_tokens[name] == math.floor(idle.budget(slo.ttft_s)) > 0
        assert signals.predicted_ttft_s[name] == pytest.approx(1 / signals.prefill_rate_tokens_per_s)


def test_queued_prompts_lower_the_budget_and_raise_the_ttft(state):
    idle = signals_of(state, [])
    busy = signals_of(state, decoding(state, 8) + queued(state, 6, 3000))
    for name in state.config.catalog.classes:
        assert busy.budget_tokens[name] < idle.budget_tokens[name]
        assert busy.predicted_ttft_s[name] >= idle.predicted_ttft_s[name]
    # EDF: the relaxed class waits behind the relaxed prompts due before it, the
    # interactive class (due sooner) behind none of them
    assert busy.predicted_ttft_s["relaxed"] > busy.predicted_ttft_s["interactive"]


def test_predicted_ttft_is_the_work_ahead_at_the_forecast_rate(state):
    views = decoding(state, 4) + queued(state, 3, 2000)
    policy = state.policy
    queue = forecast(views, NOW, policy.step_model.coefficients, policy.context.global_slo.tpot_s,
                     policy.admission.headroom, None, policy.admission.length_weight)
    in_time = len(queue.deadlines)
    assert in_time >= 1
    later = NOW + 0.25
    expected = max(0.0, queue.work_through[-1] / queue.rate - 0.25) + 1 / queue.rate
    assert signals_of(state, views, later).predicted_ttft_s["relaxed"] == pytest.approx(expected)


def test_no_prefill_rate_left_caps_the_ttft(state):
    signals = signals_of(state, decoding(state, 2000, context=60000))
    assert signals.prefill_rate_tokens_per_s == 0
    assert set(signals.predicted_ttft_s.values()) == {MAX_PREDICTED_TTFT_S}


def test_published_budgets_are_taken_as_they_are(state):
    views = decoding(state, 8) + queued(state, 4, 2500)
    state.publishes_budgets = True  # as under mode reject, the DP pab method, a control plane
    state.update_budgets(views, NOW)
    assert state.class_budgets
    published = router_signals(state.policy, views, NOW, NOW, state.config.catalog.classes,
                               state.class_budgets)
    assert published.budget_tokens == state.class_budgets
    computed = signals_of(state, views)
    expected = {name: whole_budget_tokens(tokens) for name, tokens in state.policy.class_budgets(
        views, NOW, state.config.catalog.classes).items()}
    assert computed.budget_tokens == expected


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_gauges_per_class_with_rank_labels_refreshed_at_most_every_interval(state):
    registry = CollectorRegistry()
    clock, wall = FakeClock(NOW), FakeClock(1.7e9)
    metrics = RouterMetrics(LABELS, registry, interval_s=0.1, clock=clock, wall_clock=wall)
    metrics.maybe_publish(state)
    assert scrape(registry) == {}  # no decision yet: nothing to say

    views = decoding(state, 8) + queued(state, 4, 2500)
    state.update_budgets(views, NOW)
    metrics.maybe_publish(state)
    expected = router_signals(state.policy, views, NOW, NOW, state.config.catalog.classes)
    samples = scrape(registry)
    rank = tuple(sorted(LABELS.items()))
    for name in state.config.catalog.classes:
        per_class = tuple(sorted({**LABELS, "slo_class": name}.items()))
        server = (("model_name", "tiny"), ("slo_class", name))
        assert samples[("fairbatching:prefill_admission_budget_tokens", per_class)] == \
            expected.budget_tokens[name]
        assert samples[("fairbatching:predicted_ttft_seconds", per_class)] == \
            pytest.approx(expected.predicted_ttft_s[name])
        assert samples[("fairbatching:server_prefill_admission_budget_tokens", server)] == \
            expected.budget_tokens[name]
        assert samples[("fairbatching:server_predicted_ttft_seconds", server)] == \
            pytest.approx(expected.predicted_ttft_s[name])
    assert samples[("fairbatching:prefill_rate_tokens_per_second", rank)] == \
        pytest.approx(expected.prefill_rate_tokens_per_s)
    assert samples[("fairbatching:budget_updated_timestamp_seconds", rank)] == 1.7e9

    state.update_budgets([], NOW)  # the queue drained
    clock.now, wall.now = NOW + 0.05, 1.7e9 + 0.05
    metrics.maybe_publish(state)  # within the interval: nothing recomputed
    assert scrape(registry) == samples
    clock.now, wall.now = NOW + 0.15, 1.7e9 + 0.15
    metrics.maybe_publish(state)
    refreshed = scrape(registry)
    assert refreshed[("fairbatching:budget_updated_timestamp_seconds", rank)] == 1.7e9 + 0.15
    relaxed = tuple(sorted({**LABELS, "slo_class": "relaxed"}.items()))
    assert refreshed[("fairbatching:prefill_admission_budget_tokens", relaxed)] > \
        samples[("fairbatching:prefill_admission_budget_tokens", relaxed)]
