"""The front door's SLO checks (``sglang_ext.request_validation``), on SGLang's own
sampling-parameter shapes: a malformed SLO and one below the rank's TPOT floor are both
``ValueError`` (SGLang's 400), with the reason."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

from sglang_ext.policy.batch_former import min_serviceable_tpot_s
from sglang_ext.policy.slo import SloCatalog
from sglang_ext.policy.step_model import StepModelFile
from sglang_ext.request_validation import check_request_slo

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parents[2]
CATALOG = SloCatalog.from_toml(REPO / "configs" / "slo.toml")
MODEL = StepModelFile.load(REPO / "configs" / "step_models" / "llama3.1-8b-h100.toml").model


def params(slo: dict) -> dict:
    return {"max_new_tokens": 4, "custom_params": {"slo": slo}}


def test_a_tpot_below_the_floor_is_refused_with_the_reason() -> None:
    floor_ms = min_serviceable_tpot_s(MODEL) * 1e3
    with pytest.raises(ValueError, match=rf"tpot_ms 4 is below this server's minimum of {floor_ms:.1f} ms"):
        check_request_slo(CATALOG, params({"ttft_ms": 100, "tpot_ms": 4}), MODEL)
    check_request_slo(CATALOG, params({"ttft_ms": 100, "tpot_ms": floor_ms + 0.1}), MODEL)
    with pytest.raises(ValueError, match="below"):  # a batch: any one refused refuses it
        check_request_slo(CATALOG, [params({"class": "interactive"}), params({"tpot_ms": 2})], MODEL)


def test_without_a_step_model_only_malformed_slos_are_refused() -> None:
    check_request_slo(CATALOG, params({"ttft_ms": 100, "tpot_ms": 4}))
    with pytest.raises(ValueError, match="invalid SLO"):
        check_request_slo(CATALOG, params({"ttft_ms": -1}), MODEL)
