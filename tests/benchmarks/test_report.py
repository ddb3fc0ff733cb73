""":mod:`benchmarks.sim.report` end to end on tiny settings (the committed report is its real run)."""

from __future__ import annotations

import json

import pytest

import benchmarks.sim.report as report


@pytest.fixture(scope="module")
def report_module():
    """The report module with tiny settings (restored after the module's tests)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(report, "REDUCED", {
            "llama3.1-8b-h100": report.Setting(15, (8.0, 16.0)),
            "qwen3-14b-h20": report.Setting(15, (0.5, 1.0)),
        })
        patch.setattr(report, "GRID_REDUCED", report.Setting(15, (8.0, 16.0)))
        patch.setattr(report, "GRID_TTFT_MS", (500, 2000))
        patch.setattr(report, "GRID_TPOT_MS", (50, 200))
        yield report


@pytest.mark.slow
def test_report_writes_every_table_and_figure(report_module, tmp_path):
    out = tmp_path / "report"
    code = report_module.main(
        ["--trace", str(tmp_path / "absent.csv"), "--out", str(out), "--jobs", "1"]
    )
    assert code == 0
    text = (out / "report.md").read_text()
    for heading in ("Table 3", "Table 4", "Table 5", "Figure 7"):
        assert heading in text
    assert "bundled 600 s sample" in text  # the missing trace fell back, and says so
    for policy in ("sglang-default", "vllm-default", "sarathi (", "fb-pab", "fb-anchor-margin-pab"):
        assert policy in text
    for png in ("breakdown.png", "effective_rps_llama3.1-8b-h100.png",
                "latency_cdf_qwen3-14b-h20.png"):
        assert (out / png).stat().st_size > 1000
    llama = json.loads((out / "results" / "llama3.1-8b-h100" / "results.json").read_text())
    assert llama["schema_version"] == 2 and llama["rates"] == [8.0, 16.0]
    grid = json.loads((out / "results" / "slo_grid.json").read_text())
    assert set(grid) == {"500/50", "500/200", "2000/50", "2000/200"}
    assert grid["500/50"]["scenario"]["slo"] == {
        "default_class": "report", "ttft_ms": 500.0, "tpot_ms": 50.0,
        "classes": {"report": {"ttft_ms": 500.0, "tpot_ms": 50.0}},
    }


def test_a_peak_at_the_highest_load_gives_no_ratio(report_module):
    def entry(peak, rate):
        loads = [{"rate": r, "effective_rps": peak if r == rate else peak / 2} for r in (8.0, 16.0)]
        return {"peak_effective_rps": peak, "peak_rate": rate, "loads": loads,
                "peak_at_highest_load": rate == 16.0}

    policies = {name: entry(10.0, 8.0) for name in report_module.GRID_POLICIES}
    policies["sarathi"] = entry(11.0, 16.0)  # the best baseline peaked at the top load
    policies["fb"] = entry(12.0, 8.0)
    grid = {
        (t, p): {"rates": [8.0, 16.0], "policies": policies}
        for t in report_module.GRID_TTFT_MS for p in report_module.GRID_TPOT_MS
    }
    fb_rows = report_module.table5(grid)[:8]
    # no peak ratio; the cell compares at the highest load instead: fb 6 vs sarathi 11
    assert any("† -45.5% at 16" in line for line in fb_rows)
    policies["sarathi"] = entry(11.0, 8.0)
    assert any("+9.1%" in line for line in report_module.table5(grid))  # 12 / 11 - 1
