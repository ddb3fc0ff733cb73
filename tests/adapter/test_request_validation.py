"""The front door's SLO checks (``sglang_ext.adapter.admission.slo_validation``), on SGLang's own
sampling-parameter shapes: a malformed SLO and one below the rank's TPOT floor are both
``ValueError`` (SGLang's 400), with the reason; an end-to-end SLO's TPOT is its envelope's,
paced for the output bound SGLang will apply."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from sglang_ext.policy.batch_former import min_serviceable_tpot_s  # noqa: E402
from sglang_ext.policy.slo import SloCatalog  # noqa: E402
from sglang_ext.policy.step_model import StepModelFile  # noqa: E402
from sglang_ext.adapter.admission.slo_validation import (  # noqa: E402
    SGLANG_DEFAULT_MAX_NEW_TOKENS, OutputBound, check_request_slo, output_bound,
)

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


E2E_CATALOG = SloCatalog.from_mapping({"default_class": "chat", "classes": {
    "chat": {"ttft_ms": 500, "tpot_ms": 50}, "code": {"e2e_ms": 20_000, "ttft_ms": 1_000}}})


def e2e_params(slo: dict, **sampling) -> dict:
    return {**sampling, "custom_params": {"slo": slo}}


def test_an_e2e_slo_that_cannot_cover_max_new_tokens_is_refused_in_the_requests_terms() -> None:
    floor_ms = min_serviceable_tpot_s(MODEL) * 1e3
    needs = math.ceil(4095 * floor_ms / 0.75)  # its first-token budget is a quarter of e2e_ms
    covered = math.floor(1500 / floor_ms) + 1
    with pytest.raises(ValueError) as refused:
        check_request_slo(CATALOG, e2e_params({"e2e_ms": 2000}, max_new_tokens=4096), MODEL)
    assert str(refused.value) == (
        "unserviceable SLO in custom_params: e2e_ms 2000 cannot cover max_new_tokens 4096 at "
        f"this server's minimum of {floor_ms:.1f} ms per output token (2 x its smallest step) "
        f"after a first-token budget of 500 ms: it needs e2e_ms >= {needs}, "
        f"or max_new_tokens <= {covered}"
    )
    # either way out is served
    check_request_slo(CATALOG, e2e_params({"e2e_ms": needs}, max_new_tokens=4096), MODEL)
    check_request_slo(CATALOG, e2e_params({"e2e_ms": 2000}, max_new_tokens=covered), MODEL)
    with pytest.raises(ValueError, match="e2e_ms 2000 cannot cover"):
        check_request_slo(CATALOG, e2e_params({"e2e_ms": 2000}, max_new_tokens=covered + 1), MODEL)


def test_an_e2e_slo_with_its_own_first_token_budget_needs_e2e_ms_with_that_ttft() -> None:
    floor_ms = min_serviceable_tpot_s(MODEL) * 1e3
    needs = math.ceil(1000 + 2047 * floor_ms)
    with pytest.raises(ValueError, match=rf"e2e_ms 20000 cannot cover max_new_tokens 2048 .* "
                                         rf"it needs e2e_ms >= {needs} with ttft_ms 1000, or"):
        check_request_slo(E2E_CATALOG, e2e_params({"class": "code"}, max_new_tokens=2048), MODEL)
    check_request_slo(E2E_CATALOG, e2e_params({"e2e_ms": needs, "ttft_ms": 1000},
                                              max_new_tokens=2048), MODEL)
    check_request_slo(E2E_CATALOG, e2e_params({"class": "code"}, max_new_tokens=1024), MODEL)
    one_token = rf"needs e2e_ms >= {math.ceil(1 + floor_ms)} with ttft_ms 1$"  # nothing fewer helps
    with pytest.raises(ValueError, match=one_token):
        check_request_slo(CATALOG, e2e_params({"e2e_ms": 2, "ttft_ms": 1}, max_new_tokens=1), MODEL)


def test_an_e2e_slo_is_paced_for_the_output_bound_sglang_will_apply() -> None:
    slo = {"e2e_ms": 500}  # covers 29 tokens on the reference model
    # no max_new_tokens: SamplingParams' default
    assert SGLANG_DEFAULT_MAX_NEW_TOKENS == SamplingParams().max_new_tokens == 128
    with pytest.raises(ValueError, match="cannot cover max_new_tokens 128 \\(the default\\)"):
        check_request_slo(CATALOG, e2e_params(slo), MODEL)
    check_request_slo(CATALOG, e2e_params(slo), MODEL, OutputBound(default=16))  # preferred params
    # max_new_tokens None (OpenAI chat without max_tokens): up to the context's room
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 custom_params={"slo": slo})
    chat_params = chat.to_sampling_params(stop=[], model_generation_config={})
    assert chat_params["max_new_tokens"] is None
    room = "cannot cover the context's room of 4000 tokens \\(no max_new_tokens\\)"
    with pytest.raises(ValueError, match=room):
        check_request_slo(CATALOG, chat_params, MODEL, OutputBound(room=4000))
    check_request_slo(CATALOG, chat_params, MODEL, OutputBound(room=20))
    check_request_slo(CATALOG, chat_params, MODEL)  # no room known: no bound to judge
    # a bound past the context's room is cut to it, as SGLang cuts it
    check_request_slo(CATALOG, e2e_params(slo, max_new_tokens=4096), MODEL, OutputBound(room=20))
    # a TTFT+TPOT SLO is judged on its TPOT alone, whatever the bound
    check_request_slo(CATALOG, params({"class": "interactive"}) | {"max_new_tokens": 10**6}, MODEL)


def test_the_output_bound_of_a_tokenizer_manager() -> None:
    manager = SimpleNamespace(preferred_sampling_params={"max_new_tokens": 64}, context_len=8192,
                              num_reserved_tokens=2)
    assert output_bound(manager, [1] * 100) == OutputBound(64, 8090)
    embeds = SimpleNamespace(preferred_sampling_params=None, context_len=8192)
    assert output_bound(embeds, None) == OutputBound()
    # the attributes it reads are TokenizerManager's own
    module = importlib.util.find_spec("sglang.srt.managers.tokenizer_manager")
    source = Path(module.origin).read_text()
    for name in ("preferred_sampling_params", "context_len", "num_reserved_tokens"):
        assert f"self.{name} =" in source, name


@pytest.mark.parametrize(("slo", "reason"), [
    ({"e2e_ms": 20_000, "tpot_ms": 50}, "give 'e2e_ms' .* or 'tpot_ms', not both"),
    ({"class": "code", "tpot_ms": 50, "e2e_ms": 9_000}, "not both"),
    ({"e2e_ms": 0}, "e2e_ms must be > 0"),
    ({"e2e_ms": -5}, "e2e_ms must be > 0"),
    ({"e2e_ms": "20s"}, "e2e_ms must be a number"),
    ({"e2e_ms": True}, "e2e_ms must be a number"),
    ({"e2e_ms": float("inf")}, "e2e_ms must be > 0"),
    ({"e2e_ms": 2_000, "ttft_ms": 2_000}, "ttft_ms 2000 must be below e2e_ms 2000"),
    ({"class": "code", "ttft_ms": 25_000}, "must be below"),
])
def test_malformed_e2e_slos_are_invalid(slo: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=f"invalid SLO in custom_params: .*{reason}"):
        check_request_slo(E2E_CATALOG, e2e_params(slo, max_new_tokens=4), MODEL)
