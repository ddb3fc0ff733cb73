"""The router gauges (``docs/metrics.md``) scraped from a live stock SGLang server with
``--enable-metrics`` and the FairBatching plugin on the emulated GPU, parsed with
prometheus_client's text parser: one series per rank and SLO class (per DP rank on a DP
server), fresh, and a budget that falls while a burst of long prompts is queued and
recovers once it has run. The servers are the session's shared ones
(``test_fairbatching_e2e.py`` asks for the same arguments); states are waited for, never
assumed after a sleep.
"""

from __future__ import annotations

import importlib.util
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

import requests
from prometheus_client.parser import text_string_to_metric_families
from servers import EMULATED_PROFILE as PROFILE
from servers import EMULATED_TIME_SCALE as TIME_SCALE

from sglang_ext.adapter.extension_config import ExtensionConfig

pytestmark = [pytest.mark.e2e, pytest.mark.sglang]

BASE_ARGS = ("--max-total-tokens", "200000", "--enable-metrics", "--max-prefill-tokens", "16384")
BUDGET = "fairbatching:prefill_admission_budget_tokens"
TTFT = "fairbatching:predicted_ttft_seconds"
RATE = "fairbatching:prefill_rate_tokens_per_second"
UPDATED = "fairbatching:budget_updated_timestamp_seconds"
SERVER_BUDGET = "fairbatching:server_prefill_admission_budget_tokens"
SERVER_TTFT = "fairbatching:server_predicted_ttft_seconds"
RANK_LABELS = {"model_name", "dp_rank", "tp_rank", "pp_rank"}
BURST_PROMPTS = 16
BURST_PROMPT_TOKENS = 6000
METRICS_DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def emulated_env(fb_config: Path) -> dict[str, str]:
    return {"FAIRBATCHING_EMULATED_GPU": PROFILE, "FAIRBATCHING_EMULATED_GPU_TIME_SCALE": TIME_SCALE,
            "FAIRBATCHING_CONFIG": str(fb_config)}


@pytest.fixture(scope="module")
def fb_server(sglang_server, fb_config):
    return sglang_server(args=BASE_ARGS, env=emulated_env(fb_config))


@pytest.fixture(scope="module")
def dp_server(sglang_server, fb_config):
    env = {**emulated_env(fb_config), "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
    return sglang_server(args=(*BASE_ARGS, "--dp-size", "2", "--load-balance-method", "pab"), env=env)


@pytest.fixture(scope="module")
def slo_classes(fb_config) -> set[str]:
    return set(ExtensionConfig.load(fb_config).catalog.classes)


Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(url: str) -> Samples:
    text = requests.get(f"{url}/metrics", timeout=30).text
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    matching = [v for series, v in samples.get(name, []) if labels.items() <= series.items()]
    assert len(matching) == 1, f"{name}{labels}: {matching}"
    return matching[0]


def wait_for(url: str, condition: Callable[[Samples], bool], what: str,
             timeout: float = 120.0) -> Samples:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        if condition(samples):
            return samples
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def settled(url: str, names: tuple[str, ...], timeout: float = 120.0, **labels: str) -> Samples:
    """A scrape no refresh ran through: each gauge is written on its own, so a scrape
    taken while the rank refreshes can read one gauge new and the next one old. Two
    scrapes in a row that agree on the rank's refresh stamp and on ``names`` bracket
    no refresh; the second is returned."""
    def key(samples: Samples) -> tuple[float, ...]:
        return (value(samples, UPDATED), *(value(samples, name, **labels) for name in names))

    deadline = time.monotonic() + timeout
    before = scrape(url)
    while True:
        after = scrape(url)
        if key(after) == key(before):
            return after
        assert time.monotonic() < deadline, f"no two scrapes in a row agreed on {names}"
        before = after


def fresh(samples: Samples, ranks: int = 1, max_age_s: float = 5.0) -> bool:
    stamps = [v for _, v in samples.get(UPDATED, [])]
    return len(stamps) == ranks and all(time.time() - stamp < max_age_s for stamp in stamps)


def queue_empty(samples: Samples) -> bool:
    return sum(v for _, v in samples.get("sglang:num_queue_reqs", [])) == 0 and \
        sum(v for _, v in samples.get("sglang:num_running_reqs", [])) == 0


def test_one_series_per_slo_class_with_sglang_rank_labels(fb_server, slo_classes) -> None:
    samples = wait_for(fb_server.url, fresh, "fresh router gauges")
    for name in (BUDGET, TTFT):
        series = samples[name]
        assert {labels["slo_class"] for labels, _ in series} == slo_classes
        assert all(set(labels) == RANK_LABELS | {"slo_class"} for labels, _ in series)
        assert all(labels["dp_rank"] == "0" for labels, _ in series)
    for name in (SERVER_BUDGET, SERVER_TTFT):
        assert {labels["slo_class"] for labels, _ in samples[name]} == slo_classes
    assert value(samples, RATE) > 0
    assert all(0 <= v < 3600 for _, v in samples[TTFT])
    # the rank's labels are SGLang's own: its gauges and ours join on them
    sglang_rank = samples["sglang:num_queue_reqs"][0][0]
    ours = samples[RATE][0][0]
    assert {k: sglang_rank[k] for k in ("model_name", "tp_rank", "pp_rank")} == \
        {k: ours[k] for k in ("model_name", "tp_rank", "pp_rank")}


def generate(url: str, rid: str, prompt_tokens: int) -> int:
    body = {"rid": rid, "input_ids": [5 + (i * 37 + len(rid)) % 900 for i in range(prompt_tokens)],
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True,
                                "custom_params": {"slo": {"class": "relaxed"}}}}
    return requests.post(f"{url}/generate", json=body, timeout=300).status_code


def test_budget_falls_while_a_burst_is_queued_and_recovers(fb_server) -> None:
    url = fb_server.url
    idle = wait_for(url, lambda s: fresh(s, max_age_s=1.0) and queue_empty(s), "an idle rank")
    idle_stamp = value(idle, UPDATED)
    idle = wait_for(url, lambda s: value(s, UPDATED) > idle_stamp + 0.1 and queue_empty(s),
                    "a refresh of the idle rank")
    idle_budget = value(idle, BUDGET, slo_class="relaxed")
    idle_ttft = value(idle, TTFT, slo_class="relaxed")

    with ThreadPoolExecutor(BURST_PROMPTS) as pool:
        replies = [pool.submit(generate, url, f"router-burst-{i}", BURST_PROMPT_TOKENS)
                   for i in range(BURST_PROMPTS)]
        busy = wait_for(url, lambda s: value(s, BUDGET, slo_class="relaxed") < idle_budget
                        and value(s, TTFT, slo_class="relaxed") > idle_ttft,
                        "the budget to fall below idle while the burst is queued")
        # the server-wide gauge of a one-rank server is that rank's, refresh by refresh
        steady = settled(url, (BUDGET, SERVER_BUDGET), slo_class="relaxed")
        assert value(steady, SERVER_BUDGET, slo_class="relaxed") == value(steady, BUDGET, slo_class="relaxed")
        statuses = [reply.result() for reply in replies]
    assert statuses == [200] * BURST_PROMPTS
    busy_budget = value(busy, BUDGET, slo_class="relaxed")
    wait_for(url, lambda s: queue_empty(s) and value(s, BUDGET, slo_class="relaxed") > busy_budget,
             "the budget to recover once the burst has run")


def test_a_dp_server_exports_each_rank(dp_server, slo_classes) -> None:
    samples = wait_for(dp_server.url, lambda s: fresh(s, ranks=2), "fresh gauges from both ranks")
    for name in (BUDGET, TTFT):
        assert {(labels["dp_rank"], labels["slo_class"]) for labels, _ in samples[name]} == \
            {(rank, name) for rank in ("0", "1") for name in slo_classes}
    for slo_class in slo_classes:
        budgets = [value(samples, BUDGET, dp_rank=rank, slo_class=slo_class) for rank in ("0", "1")]
        # one series per class, merged over the ranks (multiprocess mode max)
        assert value(samples, SERVER_BUDGET, slo_class=slo_class) >= min(budgets)


def recipe_selectors() -> list[str]:
    """The ``metricSpec`` selectors of docs/metrics.md's llm-d recipe."""
    return re.findall(r'metricSpec: "([^"]+)"', METRICS_DOC.read_text())


def epp_matches(samples: Samples, selector: str) -> list[float]:
    """The series an llm-d EPP selector ``name{label=value,...}`` matches: every series of
    that name whose labels include the given ones (the EPP takes the first)."""
    name, _, block = selector.partition("{")
    wanted = dict(pair.split("=", 1) for pair in block.rstrip("}").split(",") if pair)
    return [v for labels, v in samples.get(name, []) if wanted.items() <= labels.items()]


@pytest.mark.parametrize("server", ["fb_server", "dp_server"])
def test_the_llm_d_recipe_selectors_each_name_one_series(server, request) -> None:
    url = request.getfixturevalue(server).url
    ranks = 2 if server == "dp_server" else 1
    samples = wait_for(url, lambda s: fresh(s, ranks=ranks), "fresh router gauges")
    selectors = recipe_selectors()
    assert len(selectors) >= 3
    if server == "fb_server":  # without DP the per-rank gauge names one series too
        selectors.append(f"{BUDGET}{{slo_class=standard}}")
    for selector in selectors:
        assert len(epp_matches(samples, selector)) == 1, selector
