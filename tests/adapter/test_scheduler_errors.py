"""Errors FairBatching's scheduler hooks handle instead of raising are never silent: each
is counted by site (the state's ``errors``, its snapshot, the Prometheus counter) and
logged, the first time at once and then rate-limited per site."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parents[2]
LOGGER = "sglang_ext.fairbatching"


@pytest.fixture
def state():
    from sglang_ext.adapter.extension_config import ExtensionConfig
    from sglang_ext.adapter.scheduler.state import FairBatchingState

    return FairBatchingState(ExtensionConfig.load(REPO / "configs" / "fairbatching.toml"))


def decode_batch(context_lens: list[int]) -> SimpleNamespace:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return SimpleNamespace(forward_mode=ForwardMode.DECODE, reqs=[object() for _ in context_lens],
                           seq_lens_cpu=[n + 1 for n in context_lens], seq_lens=None)


class SlotsResult:
    __slots__ = ("next_token_ids",)


@dataclasses.dataclass(frozen=True)
class FrozenResult:
    next_token_ids: tuple = ()


@pytest.mark.parametrize("result_type", [SlotsResult, FrozenResult])
def test_a_step_result_that_takes_no_attributes_is_counted_and_logged(state, caplog, result_type):
    from sglang_ext.adapter.scheduler import hooks

    sites: list[str] = []
    state.errors.on_error = sites.append  # what FairBatchingMetrics.observe_error gets
    scheduler = SimpleNamespace(fairbatching=state)
    device_free_at = state.device_free_at
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            result = result_type()
            assert hooks._run_batch(lambda self, batch: result, scheduler, decode_batch([100, 200])) is result
    site = hooks.UNTIMED_STEP_SITE
    assert state.errors.counts == {site: 3}
    assert state.snapshot()["errors"] == {site: 3}
    assert sites == [site] * 3
    lines = [r for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1, "the first occurrence is logged, the next ones in this minute are not"
    assert lines[0].levelno == logging.WARNING
    assert result_type.__qualname__ in lines[0].getMessage()
    assert f"site='{site}'" in lines[0].getMessage()
    assert state.device_free_at == device_free_at  # an untimed step is not counted as in flight
    assert not hasattr(result, "_fairbatching_launch")


def test_sglangs_result_carries_the_launch_and_nothing_is_counted(state):
    from sglang.srt.managers.utils import GenerationBatchResult

    from sglang_ext.adapter.scheduler import hooks
    from sglang_ext.adapter.scheduler.state import LAUNCH_ATTR

    scheduler = SimpleNamespace(fairbatching=state)
    result = GenerationBatchResult()
    hooks._run_batch(lambda self, batch: result, scheduler, decode_batch([100, 200]))
    launch = getattr(result, LAUNCH_ATTR)
    assert (launch.features.new_tokens, launch.features.total_context) == (2, 300)
    assert state.device_free_at > 0 and not state.errors.counts
    idle = GenerationBatchResult()
    hooks._run_batch(lambda self, batch: idle, scheduler, decode_batch([]))  # no tokens: not timed
    assert not hasattr(idle, LAUNCH_ATTR) and not state.errors.counts


def test_handled_errors_log_again_after_the_interval_with_the_count_left_out(caplog):
    from sglang_ext.adapter.scheduler.state import HandledErrors

    clock = SimpleNamespace(now=0.0)
    errors = HandledErrors(interval_s=60.0, clock=lambda: clock.now)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for message in ("first", "second", "third"):
            errors.record("site.a", message, exc_info=False)
            clock.now += 1.0
        errors.record("site.b", "other site", exc_info=False)
        clock.now = 61.0
        errors.record("site.a", "fourth", exc_info=False)
    assert errors.counts == {"site.a": 4, "site.b": 1}
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        "FairBatching: first site='site.a' total=1",
        "FairBatching: other site site='site.b' total=1",
        "FairBatching: fourth site='site.a' total=4 suppressed=2",
    ]


@pytest.fixture(scope="module")
def metrics():
    """One per process: the metrics register in prometheus_client's global registry."""
    from sglang_ext.adapter.scheduler.prometheus_metrics import FairBatchingMetrics

    return FairBatchingMetrics(dp_rank=None)


def test_the_prometheus_counter_counts_by_site(metrics):
    from prometheus_client import REGISTRY

    labels = {"dp_rank": "0", "site": "run_batch.untimed_step"}
    before = REGISTRY.get_sample_value("fairbatching:handled_errors_total", labels) or 0.0
    metrics.observe_error("run_batch.untimed_step")
    metrics.observe_error("run_batch.untimed_step")
    assert REGISTRY.get_sample_value("fairbatching:handled_errors_total", labels) == before + 2


def test_the_old_admission_budget_gauge_is_deprecated_and_still_published(metrics, state):
    """``fairbatching:admission_budget_tokens`` duplicates the router gauge
    ``fairbatching:prefill_admission_budget_tokens`` (docs/metrics.md): its HELP names the
    replacement, and it keeps its values until it is removed."""
    from prometheus_client import REGISTRY

    old = "fairbatching:admission_budget_tokens"
    (family,) = [f for f in REGISTRY.collect() if f.name == old]
    assert family.documentation.startswith(
        "DEPRECATED, use fairbatching:prefill_admission_budget_tokens")
    assert "removed in a later release" in family.documentation
    state.class_budgets = {"standard": 1234}
    metrics.publish(state)
    assert REGISTRY.get_sample_value(old, {"dp_rank": "0", "slo_class": "standard"}) == 1234
    doc = (REPO / "docs" / "metrics.md").read_text()
    assert f"**Deprecated:** `{old}{{slo_class}}`" in doc and "will be removed in a later release" in doc
