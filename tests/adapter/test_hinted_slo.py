"""SLO hints at SGLang's front door (``sglang_ext.adapter.hinted_slo``), on SGLang's own
request objects and a Starlette request: each hint becomes ``custom_params["slo"]``, an
explicit SLO is left alone, a bad hint is refused; the front door's steps run in order;
the extension config's ``[slo_hints]`` table."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from sglang.srt.managers.io_struct import GenerateReqInput  # noqa: E402
from starlette.requests import Request  # noqa: E402

from controlplane.slo_hints import HintError, SloHints  # noqa: E402
from sglang_ext.adapter.extension_config import ConfigError, ExtensionConfig  # noqa: E402
from sglang_ext.adapter.front_door import chained  # noqa: E402
from sglang_ext.adapter.hinted_slo import hint_generate, hint_openai, with_hinted_slo  # noqa: E402

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parents[2]
HINTS = SloHints()
CHAT = [{"role": "user", "content": "hi"}]


def starlette_request(body: dict, headers: dict[str, str] | None = None) -> Request:
    raw = json.dumps(body).encode()
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    return Request(scope, receive)


def test_a_hint_is_written_where_the_extension_reads_the_slo_and_an_explicit_one_is_kept():
    hinted = with_hinted_slo({"max_new_tokens": 4, "custom_params": {"tag": 1}}, HINTS,
                             {"x-llm-d-slo-tpot-ms": "40"}, "flex", None)
    assert hinted == {"max_new_tokens": 4, "custom_params": {"tag": 1, "slo": {"class": "relaxed", "tpot_ms": 40.0}}}
    explicit = {"custom_params": {"slo": {"class": "standard"}}}
    assert with_hinted_slo(explicit, HINTS, {"x-smg-priority": "nonsense" * 20}, "flex", None) is None
    assert with_hinted_slo(None, HINTS, {}, None, None) is None


def test_generate_takes_priority_and_headers_for_each_prompt_of_a_batch():
    single = GenerateReqInput(text="hi", sampling_params={"max_new_tokens": 3}, priority=2)
    hint_generate(single, HINTS, {})
    assert single.sampling_params == {"max_new_tokens": 3, "custom_params": {"slo": {"class": "interactive"}}}
    batch = GenerateReqInput(text=["a", "b"], sampling_params=[{"custom_params": {"slo": {"class": "standard"}}}, {}])
    hint_generate(batch, HINTS, {"x-smg-priority": "relaxed"})
    assert batch.sampling_params == [{"custom_params": {"slo": {"class": "standard"}}},
                                     {"custom_params": {"slo": {"class": "relaxed"}}}]
    none = GenerateReqInput(text="hi")
    hint_generate(none, HINTS, {})
    assert none.sampling_params is None
    with pytest.raises(HintError, match="conflicting SLO hints"):
        hint_generate(GenerateReqInput(text="hi", priority=0), HINTS, {"x-smg-priority": "interactive"})


def test_the_openai_routes_read_service_tier_from_the_body_sglangs_models_drop():
    body = {"model": "m", "messages": CHAT, "service_tier": "flex", "custom_params": {"tag": 1}}
    request = ChatCompletionRequest(**body)
    assert not hasattr(request, "service_tier")
    asyncio.run(hint_openai(request, starlette_request(body, {"X-LLM-D-SLO-TTFT-MS": "900"}), HINTS))
    assert request.custom_params == {"tag": 1, "slo": {"class": "relaxed", "ttft_ms": 900.0}}
    completion = CompletionRequest(model="m", prompt="hi", priority=1)
    asyncio.run(hint_openai(completion, starlette_request({"prompt": "hi", "priority": 1}), HINTS))
    assert completion.custom_params == {"slo": {"class": "standard"}}
    explicit = ChatCompletionRequest(model="m", messages=CHAT, custom_params={"slo": "interactive"})
    asyncio.run(hint_openai(explicit, starlette_request({"service_tier": "flex"}), HINTS))
    assert explicit.custom_params == {"slo": "interactive"}
    for tier, message in (("turbo", "service_tier: expected one of"), (3, "service_tier: expected a string")):
        with pytest.raises(HintError, match=message):
            asyncio.run(hint_openai(ChatCompletionRequest(model="m", messages=CHAT),
                                    starlette_request({"service_tier": tier}), HINTS))


def test_the_front_doors_steps_run_in_order_and_one_may_answer_alone():
    calls: list[str] = []

    def step(name: str, answer: bool = False):
        async def around(original, *args):
            calls.append(name)
            return f"{name} answered" if answer else await original(*args)
        return around

    async def route(value: str) -> str:
        calls.append("route")
        return value

    assert asyncio.run(chained([step("hints"), step("gate")])(route, "served")) == "served"
    assert calls == ["hints", "gate", "route"]
    calls.clear()
    assert asyncio.run(chained([step("hints", answer=True), step("gate")])(route, "served")) == "hints answered"
    assert calls == ["hints"]


def test_the_configs_table_defaults_to_the_catalogs_classes_and_refuses_others(tmp_path):
    shipped = ExtensionConfig.load(REPO / "configs" / "fairbatching.toml")
    assert shipped.slo_hints == SloHints()
    (tmp_path / "slo.toml").write_text('default_class = "chat"\n[classes.chat]\nttft_ms = 900\ntpot_ms = 60\n'
                                       '[classes.relaxed]\nttft_ms = 5000\ntpot_ms = 200\n')
    config = tmp_path / "fb.toml"
    config.write_text('policy = "fb-smooth"\nslo_file = "slo.toml"\n')
    assert ExtensionConfig.load(config).slo_hints == SloHints({"flex": "relaxed"}, ("relaxed",), {"bulk": "relaxed"})
    config.write_text('policy = "fb-smooth"\nslo_file = "slo.toml"\n[slo_hints]\nenabled = false\n')
    assert ExtensionConfig.load(config).slo_hints is None
    config.write_text('policy = "fb-smooth"\nslo_file = "slo.toml"\n[slo_hints]\npriority_classes = ["relaxed", "chat"]\n')
    assert ExtensionConfig.load(config).slo_hints == SloHints({"flex": "relaxed"}, ("relaxed", "chat"),
                                                              {"bulk": "relaxed"})
    for table, message in (('service_tier = { priority = "interactive" }', r"class\(es\) \['interactive'\]"),
                           ('enabled = "yes"', "enabled must be true or false"),
                           ('service_tier = { turbo = "chat" }', "unknown tier")):
        config.write_text(f'policy = "fb-smooth"\nslo_file = "slo.toml"\n[slo_hints]\n{table}\n')
        with pytest.raises(ConfigError, match=message):
            ExtensionConfig.load(config)
