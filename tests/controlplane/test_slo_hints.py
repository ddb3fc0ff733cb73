"""controlplane.slo_hints: each hint's SLO, conflicts and malformed hints refused naming the
field, an explicit slo winning over every hint (through the gateway's translation), and
the hint table's file."""

from __future__ import annotations

import pytest

from benchmarks.support.paths import REPO
from controlplane.gateway_translate import BadRequest, translate
from controlplane.openai_api import ChatCompletionRequest, CompletionRequest
from controlplane.protocol import SloSpec
from controlplane.slo_hints import HintConfigError, HintError, SloHints

HINTS = SloHints()


def test_no_hint_is_the_default_class():
    assert HINTS.slo({}) is None
    assert HINTS.slo({}, service_tier="auto") is None and HINTS.slo({}, service_tier="default") is None


@pytest.mark.parametrize(("tier", "slo_class"), [("flex", "relaxed"), ("priority", "interactive")])
def test_a_service_tier_names_its_class(tier, slo_class):
    assert HINTS.slo({}, service_tier=tier) == SloSpec(slo_class=slo_class)


def test_smgs_header_names_one_of_smgs_classes_or_an_slo_class_and_sglangs_priority_ranks_them():
    assert [HINTS.slo({"x-smg-priority": smg}).slo_class for smg in ("system", "interactive", "default", "bulk")] == \
        ["interactive", "interactive", "standard", "relaxed"]
    assert HINTS.slo({"x-smg-priority": " relaxed "}) == SloSpec(slo_class="relaxed")
    ranked = [HINTS.slo({}, priority=p).slo_class for p in (-5, 0, 1, 2, 3, 10**9)]
    assert ranked == ["relaxed", "relaxed", "standard", "interactive", "interactive", "interactive"]


def test_llm_ds_headers_set_targets_over_the_hinted_class_or_the_default():
    assert HINTS.slo({"x-llm-d-slo-ttft-ms": "800"}) == SloSpec(ttft_ms=800.0)
    assert HINTS.slo({"x-llm-d-slo-ttft-ms": "800", "x-llm-d-slo-tpot-ms": "40"}, service_tier="flex") == \
        SloSpec(slo_class="relaxed", ttft_ms=800.0, tpot_ms=40.0)


def test_hints_naming_one_class_agree_and_different_classes_conflict():
    assert HINTS.slo({"x-smg-priority": "interactive"}, service_tier="priority", priority=2) == \
        SloSpec(slo_class="interactive")
    with pytest.raises(HintError, match=r"conflicting SLO hints: service_tier 'flex' means class "
                                        r"'relaxed'; x-smg-priority means class 'interactive'"):
        HINTS.slo({"x-smg-priority": "interactive"}, service_tier="flex")


@pytest.mark.parametrize(("headers", "tier", "field"), [
    ({}, "fast", "service_tier"),
    ({"x-smg-priority": ""}, None, "x-smg-priority"),
    ({"x-smg-priority": "c" * 65}, None, "x-smg-priority"),
    ({"x-llm-d-slo-ttft-ms": "soon"}, None, "x-llm-d-slo-ttft-ms"),
    ({"x-llm-d-slo-ttft-ms": "0"}, None, "x-llm-d-slo-ttft-ms"),
    ({"x-llm-d-slo-tpot-ms": "inf"}, None, "x-llm-d-slo-tpot-ms"),
    ({"x-llm-d-slo-tpot-ms": "nan"}, None, "x-llm-d-slo-tpot-ms"),
])
def test_a_malformed_hint_is_refused_naming_its_field(headers, tier, field):
    with pytest.raises(HintError, match=f"^{field}: "):
        HINTS.slo(headers, service_tier=tier)


def test_the_gateway_takes_an_explicit_slo_over_every_hint_and_a_bad_hint_is_a_400():
    headers = {"x-smg-priority": "interactive", "x-llm-d-slo-ttft-ms": "100"}
    body = CompletionRequest(prompt="hi", slo="relaxed", service_tier="priority", priority=0)
    assert translate(body, 64, HINTS, headers)[1] == SloSpec(slo_class="relaxed")
    body = CompletionRequest(prompt="hi", custom_params={"slo": {"ttft_ms": 900}}, service_tier="flex")
    assert translate(body, 64, HINTS, headers)[1] == SloSpec(ttft_ms=900.0)
    chat = ChatCompletionRequest(messages=[], service_tier="flex")
    assert translate(chat, 64, HINTS, {"x-llm-d-slo-tpot-ms": "60"})[1] == SloSpec(slo_class="relaxed", tpot_ms=60.0)
    with pytest.raises(BadRequest, match="conflicting SLO hints"):
        translate(chat, 64, HINTS, {"x-smg-priority": "standard"})
    assert translate(CompletionRequest(prompt="hi", service_tier="flex"), 64)[1] is None  # no table: no hints


def test_the_shipped_table_is_the_built_in_one():
    assert SloHints.load(REPO / "configs" / "slo_hints.toml") == SloHints()


def test_a_table_is_read_and_a_bad_one_refused_naming_the_file_and_key(tmp_path):
    table = tmp_path / "hints.toml"
    table.write_text('service_tier = { scale = "interactive" }\npriority_classes = ["batch", "chat"]\n'
                     'smg_priority = { bulk = "batch" }\n')
    hints = SloHints.load(table)
    assert hints.slo({"x-smg-priority": "bulk"}) == SloSpec(slo_class="batch")
    assert hints.slo({"x-smg-priority": "system"}) == SloSpec(slo_class="system")  # not mapped: a class name
    assert hints.slo({}, service_tier="scale") == SloSpec(slo_class="interactive")
    assert hints.slo({}, service_tier="flex") is None and hints.slo({}, priority=7) == SloSpec(slo_class="chat")
    for text, message in [('service_tier = { turbo = "x" }', "unknown tier"),
                          ('service_tier = { flex = 3 }', "service_tier.flex: expected an SLO class name"),
                          ('priority_classes = "relaxed"', "must be a list"),
                          ('tiers = {}', "unknown key"),
                          ('smg_priority = ["bulk"]', "smg_priority must be a table"),
                          ("service_tier = [", "not TOML")]:
        table.write_text(text + "\n")
        with pytest.raises(HintConfigError, match=message) as refused:
            SloHints.load(table)
        assert str(table) in str(refused.value)
    table.write_text("priority_classes = []\n")
    assert SloHints.load(table).slo({}, priority=2) is None  # priority is no hint
    with pytest.raises(HintConfigError, match="No such file"):
        SloHints.load(tmp_path / "missing.toml")
