"""End to end on CPU: stock ``python -m sglang.launch_server`` + the FairBatching plugin +
the emulated GPU. Servers are shared per test session (see ``conftest.py``).

Assertions are about behaviour (which requests ran, deferrals, attainment trends, PAB
movement, token counts), never absolute latency: client-side timings are only compared
between the two servers of the same run, and a state a test needs (streams decoding,
prompts queued, a counter published) is waited for, not assumed after a sleep. They
must hold on a busy machine (``scripts/stress_tests.sh`` runs them beside busy loops).
"""

from __future__ import annotations

import importlib.util
import re
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

import requests
from servers import EMULATED_PROFILE as PROFILE
from servers import EMULATED_TIME_SCALE as TIME_SCALE

from benchmarks.support.sse import json_events

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
KV_TOKENS = "200000"
TIGHT = {"ttft_ms": 2000, "tpot_ms": 60}
# Token times are taken by a client sharing two cores with the server, the tokenizer and 25
# other streams (and, on a busy machine, whatever else runs), so they carry jitter the
# scheduler cannot see, and their absolute values say as much about the machine as about
# the scheduler. The tight class's max TPOT is therefore compared between the two servers
# on the same burst, not with the 60 ms target. The gap is structural: with the plugin off
# the burst's prompts run prefill-first while every decode waits, one stall per stream of
# the whole burst's device time (~1.37 s for 16 x 6000 tokens), diluted over the few
# tokens before it; FairBatching interleaves them and keeps to its 60 ms envelope plus
# whatever delay the machine adds to delivering tokens. Measured beside two busy loops:
# median max TPOT 239 ms plugin off vs 65 ms (ratio 3.6). A burst of 3000-token prompts
# (stall ~0.7 s) gave ratios 2.0-4.7, the lowest on the busiest machine (146 vs 72 ms),
# hence the 6000-token prompts. Client jitter of j ms on both sides keeps the ratio above
# MARGIN while j < 2 x stock - 3 x fairbatching, ~280 ms in the run above.
TPOT_RATIO_MARGIN = 1.5
BURST_PROMPT_TOKENS = 6000
BASE_ARGS = ("--max-total-tokens", KV_TOKENS, "--enable-metrics", "--max-prefill-tokens", "16384")


def emulated_env(fb_config: Path | None) -> dict[str, str]:
    env = {"FAIRBATCHING_EMULATED_GPU": PROFILE, "FAIRBATCHING_EMULATED_GPU_TIME_SCALE": TIME_SCALE}
    if fb_config is not None:
        env["FAIRBATCHING_CONFIG"] = str(fb_config)
    return env


@pytest.fixture(scope="module")
def fb_server(sglang_server, fb_config):
    return sglang_server(args=BASE_ARGS, env=emulated_env(fb_config))


@pytest.fixture(scope="module")
def stock_server(sglang_server):
    return sglang_server(args=BASE_ARGS, env=emulated_env(None))


@dataclass
class Stream:
    """One streamed /generate request, timed on the client."""

    rid: str
    arrival: float = 0.0
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    status: int | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def max_tpot(self) -> float:
        first = self.token_times[0]
        return max(((t - first) / j for j, t in enumerate(self.token_times) if j), default=0.0)


def stream_generate(url: str, rid: str, prompt_tokens: int, max_new_tokens: int,
                    slo: dict | None, on_token: Callable[[Stream], None] | None = None) -> Stream:
    params: dict = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    if slo is not None:
        params["custom_params"] = {"slo": slo}
    body = {"rid": rid, "input_ids": [5 + (i * 37 + len(rid)) % 900 for i in range(prompt_tokens)],
            "sampling_params": params, "stream": True}
    record = Stream(rid, arrival=time.perf_counter())
    with requests.post(f"{url}/generate", json=body, stream=True, timeout=300) as reply:
        record.status = reply.status_code
        if reply.status_code != 200:
            return record
        for chunk in json_events(reply.iter_lines(decode_unicode=True)):
            now = time.perf_counter()
            while len(record.token_times) < chunk["meta_info"]["completion_tokens"]:
                record.token_times.append(now)
            reason = chunk["meta_info"].get("finish_reason")
            if reason:
                record.finish_reason = reason["type"]
            if on_token is not None:
                on_token(record)
    return record


def metric(url: str, name: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=30).text
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)]
    return sum(values)


def loads(url: str) -> list[dict]:
    return requests.get(f"{url}/v1/loads", timeout=30).json()["loads"]


def pab_tokens(url: str) -> list[int | None]:
    return [rank.get("fairbatching_pab_tokens") for rank in loads(url)]


def wait_for_metric_above(url: str, name: str, floor: float, timeout: float = 60.0) -> float:
    """The metric once it exceeds ``floor`` (FairBatching publishes its counters every
    0.5 s of steps), or its value at the timeout."""
    deadline = time.monotonic() + timeout
    while (value := metric(url, name)) <= floor and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


@dataclass
class BurstResult:
    tight: list[Stream]
    burst: list[Stream]
    #: (PAB tokens, waiting requests) from each /v1/loads sample taken during the run
    pab_samples: list[tuple[int, int]]


def run_burst(url: str, tag: str) -> BurstResult:
    """Eight tight-TPOT streams start decoding; then sixteen BURST_PROMPT_TOKENS-token
    prompts of the relaxed class arrive at once."""
    started = threading.Event()
    first_tokens: set[str] = set()

    def note(stream: Stream) -> None:
        if stream.token_times:
            first_tokens.add(stream.rid)
            if len(first_tokens) >= 8:
                started.set()

    pab_samples: list[tuple[int, int]] = []
    stop_sampling = threading.Event()

    def sample_pab() -> None:
        # Each sample pairs the PAB with the queue it was computed for (one /v1/loads
        # snapshot), so the test can look at the samples taken while the burst waited.
        while not stop_sampling.is_set():
            pab_samples.extend((rank["fairbatching_pab_tokens"], rank.get("num_waiting_reqs", 0))
                               for rank in loads(url) if rank.get("fairbatching_pab_tokens") is not None)
            time.sleep(0.02)

    with ThreadPoolExecutor(26) as pool:
        sampler = pool.submit(sample_pab)
        tight = [pool.submit(stream_generate, url, f"{tag}-tight-{i}", 200, 120, TIGHT, note) for i in range(8)]
        assert started.wait(120), "tight streams never started"
        burst = [pool.submit(stream_generate, url, f"{tag}-burst-{i}", BURST_PROMPT_TOKENS, 24,
                             {"class": "relaxed"})
                 for i in range(16)]
        tight_results = [f.result() for f in tight]
        burst_results = [f.result() for f in burst]
        stop_sampling.set()
        sampler.result()
    return BurstResult(tight_results, burst_results, pab_samples)


@pytest.fixture(scope="module")
def fb_burst(fb_server) -> tuple[BurstResult, float]:
    name = "fairbatching:deferred_decodes_total"
    deferred_before = metric(fb_server.url, name)
    result = run_burst(fb_server.url, "fb")
    return result, wait_for_metric_above(fb_server.url, name, deferred_before) - deferred_before


@pytest.fixture(scope="module")
def stock_burst(stock_server) -> BurstResult:
    return run_burst(stock_server.url, "stock")


def median_max_tpot(streams: list[Stream]) -> float:
    return statistics.median(s.max_tpot for s in streams)


def test_burst_completes_with_exact_token_counts(fb_burst) -> None:
    result, _ = fb_burst
    for stream in result.tight:
        assert (stream.status, len(stream.token_times), stream.finish_reason) == (200, 120, "length")
    for stream in result.burst:
        assert (stream.status, len(stream.token_times), stream.finish_reason) == (200, 24, "length")


def test_decodes_are_deferred_while_prefills_queue(fb_burst) -> None:
    _, deferred = fb_burst
    assert deferred > 0


def test_tight_class_tpot_attainment_beats_the_plugin_off(fb_burst, stock_burst) -> None:
    """The same burst against both servers, compared with each other (see
    TPOT_RATIO_MARGIN): the tight class's median max TPOT is at most 1/MARGIN of the
    plugin-off server's, and at a target set by the run itself, the fastest plugin-off
    tight stream's max TPOT, FairBatching's attainment is at least 6/8 (plugin off: 0/8
    by construction)."""
    fb, _ = fb_burst
    for name, streams in (("fb", fb.tight), ("stock", stock_burst.tight)):
        for s in streams:
            gaps = [b - a for a, b in zip(s.token_times, s.token_times[1:])]
            worst_j = max(range(1, len(s.token_times)), key=lambda j: (s.token_times[j] - s.token_times[0]) / j)
            print(name, s.rid, f"max_tpot={s.max_tpot*1e3:.0f}ms at j={worst_j} max_gap={max(gaps)*1e3:.0f}ms ttft={s.ttft*1e3:.0f}ms")
    fb_median, stock_median = median_max_tpot(fb.tight), median_max_tpot(stock_burst.tight)
    target = min(s.max_tpot for s in stock_burst.tight)
    fb_attainment = sum(s.max_tpot < target for s in fb.tight) / len(fb.tight)
    print(f"tight class median max TPOT: fairbatching {fb_median * 1e3:.0f} ms, plugin off "
          f"{stock_median * 1e3:.0f} ms (ratio {stock_median / fb_median:.2f}); fairbatching's "
          f"attainment at the plugin-off server's best ({target * 1e3:.0f} ms): {fb_attainment:.2f}")
    assert fb_median * TPOT_RATIO_MARGIN <= stock_median
    assert fb_attainment >= 0.75


def test_pab_falls_as_prefills_queue(fb_server, fb_burst) -> None:
    """While the burst's prompts wait (seen in the same /v1/loads snapshot as the PAB),
    the PAB is down by at least half of their tokens from the idle PAB."""
    result, _ = fb_burst
    idle = max(v for v in pab_tokens(fb_server.url) if v is not None)
    assert result.pab_samples, "no PAB in /v1/loads"
    queued = [pab for pab, waiting in result.pab_samples if waiting >= 8]
    assert queued, f"no sample while 8 or more prompts waited: {sorted(set(w for _, w in result.pab_samples))}"
    assert min(queued) < idle - 16 * BURST_PROMPT_TOKENS // 2


def test_the_start_up_line_names_the_decision_path(fb_server) -> None:
    from sglang_ext.policy import compiled

    (line,) = [line for line in fb_server.log_text().splitlines() if "FairBatching on:" in line]
    expected = "compiled (_compiled." if compiled.built() else "pure Python"
    assert f"decision path {expected}" in line, line
    assert "request tables (columns) from " in line, line


def test_plugin_off_reports_no_fairbatching_state(stock_server) -> None:
    assert pab_tokens(stock_server.url) == [None]
    assert "fairbatching:" not in requests.get(f"{stock_server.url}/metrics", timeout=30).text


@pytest.mark.parametrize(
    ("custom_params", "message"),
    [({"slo": {"class": "gold"}}, "unknown SLO class"), ({"slo": {"ttft_ms": -1}}, "ttft_ms"),
     ({"slo": "fast"}, "custom_params.slo must be an object")],
)
def test_malformed_slo_is_a_400_with_the_reason(fb_server, custom_params, message) -> None:
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 4, "custom_params": custom_params}}
    reply = requests.post(f"{fb_server.url}/generate", json=body, timeout=60)
    assert reply.status_code == 400
    assert message in reply.text
    model = requests.get(f"{fb_server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": "hello", "max_tokens": 4, "custom_params": custom_params}
    reply = requests.post(f"{fb_server.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400
    assert message in reply.text
    ok = requests.post(f"{fb_server.url}/generate", json={"text": "hello", "sampling_params": {
        "max_new_tokens": 4, "custom_params": {"slo": {"class": "interactive"}}}}, timeout=60)
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 4


def test_abort_mid_stream(fb_server) -> None:
    aborted = threading.Event()

    def abort_after_some_tokens(stream: Stream) -> None:
        if len(stream.token_times) >= 5 and not aborted.is_set():
            aborted.set()
            requests.post(f"{fb_server.url}/abort_request", json={"rid": stream.rid}, timeout=30)

    stream = stream_generate(fb_server.url, "abort-me", 100, 2000, {"class": "relaxed"}, abort_after_some_tokens)
    assert aborted.is_set()
    assert stream.finish_reason == "abort"
    assert len(stream.token_times) < 2000
    after = stream_generate(fb_server.url, "after-abort", 50, 10, None)
    assert len(after.token_times) == 10


@pytest.fixture(scope="module")
def fb_no_overlap_server(sglang_server, fb_config):
    return sglang_server(args=(*BASE_ARGS, "--disable-overlap-schedule"), env=emulated_env(fb_config))


def test_without_overlap_scheduling(fb_no_overlap_server) -> None:
    url = fb_no_overlap_server.url
    name = "fairbatching:deferred_decodes_total"
    deferred_before = metric(url, name)
    decoding: set[str] = set()
    all_decoding = threading.Event()

    def note(stream: Stream) -> None:
        if len(stream.token_times) >= 2:  # past its first token: decoding
            decoding.add(stream.rid)
            if len(decoding) == 4:
                all_decoding.set()

    with ThreadPoolExecutor(12) as pool:
        tight = [pool.submit(stream_generate, url, f"no-overlap-tight-{i}", 200, 60, TIGHT, note)
                 for i in range(4)]
        assert all_decoding.wait(120), "the tight streams never started decoding"
        # interactive (TTFT 500 ms): at a pace that keeps every decode in every step these
        # prompts would miss their deadlines, so the policy defers decodes for them
        burst = [pool.submit(stream_generate, url, f"no-overlap-burst-{i}", 3000, 16, {"class": "interactive"})
                 for i in range(8)]
        results = [f.result() for f in tight + burst]
    assert [len(r.token_times) for r in results] == [60] * 4 + [16] * 8
    assert wait_for_metric_above(url, name, deferred_before) > deferred_before


@pytest.fixture(scope="module")
def dp_server(sglang_server, fb_config):
    env = {**emulated_env(fb_config), "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
    return sglang_server(args=(*BASE_ARGS, "--dp-size", "2", "--load-balance-method", "pab"), env=env)


def test_dp2_with_the_pab_method(dp_server) -> None:
    url = dp_server.url
    assert len([v for v in pab_tokens(url) if v is not None]) == 2
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(
            lambda i: stream_generate(url, f"dp-{i}", 1500 if i % 3 == 0 else 100, 12, TIGHT), range(12)))
    assert all(len(r.token_times) == 12 and r.finish_reason == "length" for r in results)
    log = dp_server.log_text()
    assert "Traceback" not in log


@pytest.fixture(scope="module")
def slow_device_calibrated_server(sglang_server, tmp_path_factory):
    """The shipped config (admission defer) with ``calibrate = true`` on an emulated device
    whose decode-only step is about 20 ms (the Qwen3-32B on an H100 NVL), its step-model
    file the H100's: the plan's prompts take seconds to prefill here."""
    text = (REPO / "configs" / "fairbatching.toml").read_text()
    for old, new in (('slo_file = "slo.toml"', f'slo_file = "{REPO / "configs" / "slo.toml"}"'),
                     ('step_model = "step_models/', f'step_model = "{REPO / "configs" / "step_models"}/'),
                     ("calibrate = false", "calibrate = true")):
        assert old in text
        text = text.replace(old, new)
    config = tmp_path_factory.mktemp("calibrated") / "fairbatching.toml"
    config.write_text(text)
    env = {"FAIRBATCHING_EMULATED_GPU": "qwen3-32b-h100nvl", "FAIRBATCHING_EMULATED_GPU_TIME_SCALE": "1",
           "FAIRBATCHING_CONFIG": str(config)}
    return sglang_server(args=BASE_ARGS, env=env)


def test_a_calibrated_server_on_a_slow_device_becomes_ready_and_serves(slow_device_calibrated_server) -> None:
    """SGLang's readiness warm-up waits for the calibration and is not ended by admission
    defer for that wait; the calibration ends when its requests do, not at its timeout."""
    log = slow_device_calibrated_server.log_text()
    assert "start-up calibration fitted the knee step model" in log
    assert "start-up calibration timed out" not in log
    stream = stream_generate(slow_device_calibrated_server.url, "after-calibration", 200, 16,
                             {"class": "standard"})
    assert stream.status == 200 and len(stream.token_times) == 16
