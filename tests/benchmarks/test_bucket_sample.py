"""benchmarks.sim.bucket_sample: its bucket counts, and its table from saved scenarios."""

from __future__ import annotations

import json

from benchmarks.sim import bucket_sample as bs
from benchmarks.sim.fair_capacity import scenario_file
from sglang_ext.sim.workloads import bundled_sample

BUNDLED = bs.KEYS[0]


def test_bucket_sizes_count_every_request_once_by_prompt_length():
    workload = bundled_sample().head(150.0)
    sizes = bs.bucket_sizes(workload)
    assert sum(sizes.values()) == len(workload.requests)
    longest = sum(r.prompt_tokens >= 4096 for r in workload.requests)
    assert sizes[">=4096"] == longest


def test_the_long_window_is_four_times_the_short_one():
    short = bs.build_scenario(BUNDLED, bs.SHARED_AZURE_TRACE).workload
    long = bs.long_workload(BUNDLED, bs.SHARED_AZURE_TRACE)
    assert long.requests[: len(short.requests)] == short.requests
    assert long.duration_s > 3.5 * short.duration_s


def _entry(value: float | None, bucket: str = "2048-4095") -> dict:
    return {"capacity": value, "next_fail": (value or 0.5) * 1.03, "at_top": False,
            "worst_at_next_fail": bucket}


def test_ratios_divide_by_the_best_baseline_of_each_window(tmp_path):
    tuned = ["sarathi@160", "sarathi-queue-timeout@160,timeout=0.875", *bs.UNTUNED]
    short = {"fb-smooth+defer": 1.3, "fb-smooth+defer:fair": 2.0, tuned[0]: 1.5, tuned[1]: 1.9}
    saved = {"labels": {"tuned here": tuned},
             "capacity": {label: {"capacity": {"0.9": {bs.MEASURE: _entry(value)}}}
                          for label, value in short.items()}}
    path = scenario_file(tmp_path, BUNDLED)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(saved))
    labels, _ = bs.short_results(BUNDLED, tmp_path)
    assert labels == ["fb-smooth+defer", "fb-smooth+defer:fair", *tuned[:2]]  # untuned left out
    long = {"fb-smooth+defer": 1.8, "fb-smooth+defer:fair": 1.6, tuned[0]: 1.2, tuned[1]: None}
    results = [{"scenario": BUNDLED.label, "label": label, "long": _entry(value, ">=4096"),
                "simulations": 6, "wall_s": 1.0} for label, value in long.items()]
    [scenario] = bs.assemble([BUNDLED], bs.SHARED_AZURE_TRACE, tmp_path, results)
    rows = {row["label"]: row for row in scenario["rows"]}
    assert rows["fb-smooth+defer"]["short_ratio"] == 1.3 / 1.9
    assert rows["fb-smooth+defer"]["long_ratio"] == 1.8 / 1.2  # a baseline that never met it
    assert rows[tuned[1]]["long_ratio"] is None
    text = bs.render({"commit": "test", "date": "today", "wall_s": 1.0,
                      "scenarios": [scenario]})
    assert "| `fb-smooth+defer` | 1.3 (2048-4095) | 0.68x | 1.8 (>=4096) | 1.50x | 6 |" in text
    assert f"| `{tuned[1]}` | 1.9 (2048-4095) | 1.00x | <0.515 (>=4096) | n/a | 6 |" in text
