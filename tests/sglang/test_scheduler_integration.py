"""FairBatching inside a real SGLang ``Scheduler`` (CPU, emulated GPU), one step at a time.

Each scenario runs ``scheduler_harness.py`` in a fresh interpreter: the plugin's hooks
patch SGLang's classes process-wide, and the stock scenario must not see them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("scheduler_harness.py")

REQUESTS = [
    {"rid": "relaxed-0", "prompt_tokens": 64, "max_new_tokens": 60, "slo": {"class": "relaxed"}},
    {"rid": "relaxed-1", "prompt_tokens": 80, "max_new_tokens": 60, "slo": {"class": "relaxed"}},
    {"rid": "relaxed-abort", "prompt_tokens": 72, "max_new_tokens": 400, "slo": {"class": "relaxed"}},
    {"rid": "tight", "prompt_tokens": 96, "max_new_tokens": 60, "slo": {"ttft_ms": 100, "tpot_ms": 15}},
    {"rid": "long-prompt", "prompt_tokens": 7000, "max_new_tokens": 5, "slo": {"class": "interactive"},
     "at_step": 6},
    {"rid": "second-prompt", "prompt_tokens": 3000, "max_new_tokens": 5, "slo": {"class": "standard"},
     "at_step": 7},
]


def run_scenario(tmp_path: Path, name: str, *, overlap: bool, fairbatching: bool) -> dict[str, Any]:
    scenario: dict[str, Any] = {"requests": REQUESTS, "overlap": overlap,
                                "abort_when_parked": ["relaxed-abort"], "timeout_s": 150}
    if fairbatching:
        config = tmp_path / f"{name}.toml"
        config.write_text(
            f'policy = "fb"\nslo_file = "{REPO / "configs" / "slo.toml"}"\n'
            f'step_model = "{REPO / "configs" / "step_models" / "llama3.1-8b-h100.toml"}"\n'
        )
        scenario["config"] = str(config)
    return run_harness(tmp_path, name, scenario)


def run_harness(tmp_path: Path, name: str, scenario: dict[str, Any]) -> dict[str, Any]:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(scenario))
    env = {**os.environ, "FAIRBATCHING_EMULATED_GPU": "llama3.1-8b-h100"}
    env.pop("FAIRBATCHING_CONFIG", None)
    done = subprocess.run([sys.executable, str(HARNESS), str(path)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("HARNESS-RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("HARNESS-RESULT "))


@pytest.fixture(scope="module", params=[False, True], ids=["normal-loop", "overlap-loop"])
def fairbatching_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_scenario(tmp_path_factory.mktemp("fb"), "fb", overlap=request.param, fairbatching=True)


@pytest.fixture(scope="module")
def stock_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_scenario(tmp_path_factory.mktemp("stock"), "stock", overlap=False, fairbatching=False)


def test_every_request_gets_exactly_its_tokens_and_the_aborted_one_aborts(fairbatching_run: dict) -> None:
    outputs = fairbatching_run["outputs"]
    for spec in REQUESTS:
        if spec["rid"] == "relaxed-abort":
            continue
        assert outputs[spec["rid"]] == {**outputs[spec["rid"]], "tokens": spec["max_new_tokens"], "finished": "length"}
    assert "relaxed-abort" in fairbatching_run["aborted_at_step"], "the abort target was never parked"
    assert outputs["relaxed-abort"]["finished"] == "abort"
    assert outputs["relaxed-abort"]["tokens"] < 400


def test_parked_decodes_keep_their_kv_and_next_input_token(fairbatching_run: dict) -> None:
    checks = fairbatching_run["checks"]
    assert checks["parked_kv_changed"] == 0 and checks["relay_token_wrong"] == 0
    assert checks["parked_kv_kept"] > 0 and checks["parked_relay_token_ok"] > 0


def test_no_kv_leak_and_idle_at_the_end(fairbatching_run: dict) -> None:
    assert fairbatching_run["idle"]
    assert fairbatching_run["kv_free_plus_evictable"] == fairbatching_run["kv_total"]
    assert fairbatching_run["fairbatching"]["parked"] == 0


def test_decodes_are_deferred_while_a_prefill_runs(fairbatching_run: dict) -> None:
    mixed = [s for s in fairbatching_run["steps"] if s["prefill_tokens"] > 0 and s["parked"]]
    assert mixed, "no step deferred a decode while prefilling"
    for step in mixed:
        assert "tight" in step["decodes"], "the tight-TPOT request was deferred"
        assert "tight" not in step["parked"]
    assert any({"relaxed-0", "relaxed-1"} <= set(step["parked"]) for step in mixed)


def test_the_long_prompt_is_chunked_to_the_time_budget(fairbatching_run: dict) -> None:
    chunks = [s for s in fairbatching_run["steps"] if "long-prompt" in s["prefills"]]
    assert len(chunks) >= 2, chunks
    first = chunks[0]
    assert first["prefills"]["long-prompt"] < 7000
    assert first["prefills"]["long-prompt"] <= first["planned_prefill"]["long-prompt"]
    assert first["predicted_s"] <= first["time_budget_s"] * (1 + 1e-9)
    assert sum(s["prefills"]["long-prompt"] for s in chunks) == 7000


def test_step_model_is_recalibrated_from_measured_steps(fairbatching_run: dict) -> None:
    snapshot = fairbatching_run["fairbatching"]
    assert snapshot["counters"]["steps"] > 50
    assert snapshot["step_model"]["mean_abs_relative_error"] < 0.5
    assert snapshot["pab_tokens"] > 0


def test_stock_scheduler_is_untouched_and_prefills_alone(stock_run: dict) -> None:
    assert stock_run["fairbatching"] is None
    outputs = stock_run["outputs"]
    assert all(outputs[s["rid"]]["tokens"] == s["max_new_tokens"] for s in REQUESTS if s["rid"] != "relaxed-abort")
    assert stock_run["kv_free_plus_evictable"] == stock_run["kv_total"]
    prefill_steps = [s for s in stock_run["steps"] if "long-prompt" in s["prefills"]]
    assert prefill_steps and all(not s["decodes"] for s in prefill_steps)


MEMORY_BOUND = [
    # Without ignore_eos SGLang reserves only a fraction of max_new_tokens (new_token_ratio),
    # over-admits, and must retract later; the emulated GPU never emits EOS.
    *({"rid": f"relaxed-{i}", "prompt_tokens": 200, "max_new_tokens": 300, "slo": {"class": "relaxed"},
       "ignore_eos": False} for i in range(6)),
    {"rid": "tight", "prompt_tokens": 100, "max_new_tokens": 300, "slo": {"ttft_ms": 100, "tpot_ms": 15}},
    {"rid": "prompt", "prompt_tokens": 1200, "max_new_tokens": 20, "slo": {"class": "interactive"}, "at_step": 30},
]


@pytest.fixture(scope="module")
def memory_bound_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp_path = tmp_path_factory.mktemp("kv")
    config = tmp_path / "fb.toml"
    config.write_text(
        f'policy = "fb"\nslo_file = "{REPO / "configs" / "slo.toml"}"\n'
        f'step_model = "{REPO / "configs" / "step_models" / "llama3.1-8b-h100.toml"}"\n'
    )
    scenario = {"requests": MEMORY_BOUND, "overlap": False, "max_total_tokens": 3000,
                "disable_radix_cache": True, "timeout_s": 200, "config": str(config)}
    return run_harness(tmp_path, "kv", scenario)


def test_retraction_under_kv_pressure_sees_parked_requests(memory_bound_run: dict) -> None:
    """KV for 3,000 tokens, 4,300 wanted: SGLang must retract, parked requests included,
    and every request still ends with exactly its tokens and no KV leaked."""
    outputs = memory_bound_run["outputs"]
    assert {rid: o["tokens"] for rid, o in outputs.items()} == {
        s["rid"]: s["max_new_tokens"] for s in MEMORY_BOUND}
    assert memory_bound_run["idle"]
    assert memory_bound_run["kv_free_plus_evictable"] == memory_bound_run["kv_total"]
    assert memory_bound_run["fairbatching"]["counters"]["deferred_decodes"] > 0
    assert memory_bound_run["retracted"] > 0
