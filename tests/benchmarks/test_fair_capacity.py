"""benchmarks.sim.fair_capacity: its scoring and its tables, on a real (small) bisection and
on a document built by hand."""

from __future__ import annotations

import pytest

from benchmarks.sim import fair_capacity as fc
from sglang_ext.sim.runner import Scenario
from sglang_ext.sim.workloads import bundled_sample


def _capacity(overall: float, bucket: float, klass: float) -> dict:
    def entry(value):
        return {"capacity": value}
    return {"capacity": {target: {"overall": entry(overall), "worst_prompt_bucket": entry(bucket),
                                  "worst_slo_class": entry(klass)} for target in ("0.9", "0.99")},
            "busy": {str(overall): 0.99}, "simulations": 7}


def _point(eff: float, worst: float) -> dict:
    return {"effective_rps": eff, "attainment": eff / 30, "worst_bucket": worst,
            "worst_bucket_label": "2048-4095", "worst_class": worst, "max_tpot_p99_ms": 40.0,
            "busy": 0.99}


def test_tuning_score_is_the_worse_group_then_overall():
    assert fc.tuning_score(_capacity(22.0, 20.0, 21.0)) == (20.0, 22.0)
    assert fc.tuning_score(_capacity(22.0, None, 21.0)) == (0.0, 22.0)  # a group never met


def test_render_divides_by_the_best_baseline_of_each_measure():
    shipped, other = fc.FAIRBATCHING[:2]
    baselines = ["sarathi@1024", "sarathi-queue-timeout@1024,timeout=1.75", *fc.UNTUNED_BASELINES]
    capacities = {shipped: _capacity(22.0, 21.0, 22.0), other: _capacity(21.0, 20.0, 21.0),
                  baselines[0]: _capacity(19.0, 18.0, 19.0), baselines[1]: _capacity(22.0, 20.0, 22.0),
                  baselines[2]: _capacity(10.0, 9.0, 10.0), baselines[3]: _capacity(12.0, 11.0, 12.0)}
    points = {load: {label: _point(25.0 if label == shipped else 20.0, 0.5) for label in capacities}
              for load in ("1.5x", "2x", "steady")}
    entry = {"scenario": fc.REFERENCE.__dict__, "requests": 1445,
             "labels": {"fairbatching": [shipped, other], "tuned here": baselines,
                        "tuned elsewhere": []},
             "capacity": capacities, "loads": {"1.5x": 33.0, "2x": 44.0, "steady": 8.0},
             "points": points}
    text = fc.render({"machine": "test", "scenarios": [entry]})
    summary = next(line for line in text.splitlines()
                   if line.startswith(f"| {fc.REFERENCE.label} | `{shipped}` |"))
    assert "| tuned here | 1.00x (22.00 / 22.00) | 1.05x (21.00 / 20.00) |" in summary
    assert "1.25x (25.00 / 20.00)" in summary
    assert "| tuned elsewhere |" not in text.split("## bundled")[0]  # no row without its settings
    assert f"| `{baselines[1]}` | tuned here | 22.00 / 20.00 / 22.00 |" in text


@pytest.mark.slow
def test_bisect_reports_capacity_for_every_measure():
    scenario = fc.build_scenario(fc.REFERENCE, fc.SHARED_AZURE_TRACE)
    small = Scenario(bundled_sample().head(30.0), scenario.profile, scenario.catalog)
    result = fc.bisect(small, "sarathi@1024", tolerance=0.2)
    overall = fc.capacity_of(result, "0.9", "overall")
    assert overall > 0
    assert fc.tuning_score(result)[1] == overall
    assert result["simulations"] >= 2
