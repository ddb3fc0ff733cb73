"""Fairness measured everywhere: the worst prompt bucket and SLO class of a load
point, token goodput, capacity from a sweep's grid and by bisection, the `capacity`
subcommand, the sweep's capacity summary and its fairness plot."""

from __future__ import annotations

import json

import pytest

from sglang_ext.policy.slo import Slo
from sglang_ext.sim import capacity
from sglang_ext.sim.capacity import (
    bisect_capacity,
    capacity_from_probes,
    capacity_text,
    grid_capacity,
    grid_capacity_table,
)
from sglang_ext.sim.commands import main
from sglang_ext.sim.metrics import (
    MIN_GROUP_REQUESTS,
    RequestRecord,
    summarize,
    token_goodput,
    worst_group,
)

SLO = Slo(ttft_s=1.0, tpot_s=0.25)


def _record(prompt: int, met: bool, *, slo_class: str | None = None, output: int = 2,
            req_id: int = 0) -> RequestRecord:
    rec = RequestRecord(req_id, 0.0, SLO, prompt_tokens=prompt, output_tokens=output,
                        slo_class=slo_class)
    first = 0.5 if met else 2.0  # TTFT 0.5 s meets 1 s; 2 s does not
    for index in range(output):
        rec.on_token(index, first + 0.125 * index)
    return rec


def _records(spec: list[tuple[int, int, int, str | None]]) -> list[RequestRecord]:
    """(prompt tokens, met, violated, class) groups as records."""
    out = []
    for prompt, met, violated, slo_class in spec:
        out += [_record(prompt, True, slo_class=slo_class, req_id=len(out) + i)
                for i in range(met)]
        out += [_record(prompt, False, slo_class=slo_class, req_id=len(out) + i)
                for i in range(violated)]
    return out


# ------------------------------------------------------------------ worst group, goodput
def test_worst_bucket_ignores_a_bucket_below_the_minimum_size():
    records = _records([
        (100, 18, 2, "a"),     # <512: 20 requests, 0.90
        (600, 27, 3, "a"),     # 512-1023: 30 requests, 0.90 (tie: the first bucket wins)
        (5000, 0, 19, "b"),    # >=4096: 19 requests, 0.0: too few to decide
    ])
    load = summarize(records, 4.0, 10.0)
    worst = load["worst_prompt_bucket"]
    assert worst == {"label": "<512", "attainment": 0.9, "requests": 20,
                     "min_requests": MIN_GROUP_REQUESTS,
                     "sizes": {"<512": 20, "512-1023": 30, ">=4096": 19}}
    # classes: a = 50 requests at 0.9, b = 19 requests: too small
    assert load["worst_slo_class"]["label"] == "a"
    assert load["worst_slo_class"]["attainment"] == 0.9
    assert load["worst_slo_class"]["sizes"] == {"a": 50, "b": 19}
    # at 19 the small bucket and class decide it
    assert worst_group(load["by_prompt_tokens"], 19)["label"] == ">=4096"
    assert worst_group(load["by_slo_class"], 19)["attainment"] == 0.0


def test_no_group_large_enough_leaves_the_worst_undecided():
    load = summarize(_records([(100, 5, 5, None)]), 4.0, 10.0)
    assert load["worst_prompt_bucket"]["label"] is None
    assert load["worst_prompt_bucket"]["attainment"] is None
    assert load["worst_prompt_bucket"]["sizes"] == {"<512": 10}
    assert load["worst_slo_class"]["label"] is None


def test_token_goodput_counts_prompt_and_output_tokens_of_met_requests():
    records = [_record(100, True, output=4), _record(300, True, output=2),
               _record(1000, False, output=8)]
    assert token_goodput(records, 2.0) == (104 + 302) / 2.0
    load = summarize(records, 4.0, 2.0)
    assert load["token_goodput"] == (104 + 302) / 2.0
    assert load["output_tokens_per_s"] == (4 + 2 + 8) / 2.0  # the same duration


# ------------------------------------------------------------------ grid capacity
def _load(rate: float, attainment: float, worst: float | None = None,
          label: str = ">=4096") -> dict:
    worst = attainment if worst is None else worst
    return {"rate": rate, "attainment": attainment,
            "worst_prompt_bucket": {"label": label, "attainment": worst},
            "worst_slo_class": {"label": "standard", "attainment": attainment}}


def test_grid_capacity_is_the_last_load_before_the_first_failure():
    loads = [_load(4, 1.0, 0.995), _load(8, 0.97, 0.93), _load(12, 0.91, 0.6),
             _load(16, 0.5, 0.1)]
    overall = capacity_from_probes(loads, 0.9, "overall")
    assert overall["capacity"] == 12 and overall["next_fail"] == 16
    assert not overall["at_top"] and overall["resolution"] == pytest.approx(16 / 12 - 1)
    assert capacity_text(overall) == "12"
    strict = capacity_from_probes(loads, 0.99, "overall")
    assert (strict["capacity"], strict["next_fail"]) == (4, 8)
    bucket = capacity_from_probes(loads, 0.9, "worst_prompt_bucket")
    assert (bucket["capacity"], bucket["next_fail"]) == (8, 12)
    assert bucket["worst_at_next_fail"] == ">=4096"
    fails_first = capacity_from_probes(loads, 0.999, "worst_prompt_bucket")
    assert fails_first["capacity"] is None and fails_first["next_fail"] == 4
    assert capacity_text(fails_first) == "<4"


def test_grid_capacity_at_the_top_load_is_a_lower_bound():
    loads = [_load(4, 1.0), _load(8, 0.99), _load(12, 0.95)]
    entry = capacity_from_probes(loads, 0.9, "overall")
    assert entry["capacity"] == 12 and entry["next_fail"] is None and entry["at_top"]
    assert capacity_text(entry) == ">=12"


def test_grid_capacity_is_not_lifted_by_a_load_that_meets_again_above_a_failure():
    # 12 fails (noise), 16 meets again: capacity stays 8, 16 is listed
    loads = [_load(16, 0.92), _load(4, 1.0), _load(12, 0.85), _load(8, 0.95), _load(20, 0.5)]
    entry = capacity_from_probes(loads, 0.9, "overall")
    assert (entry["capacity"], entry["next_fail"]) == (8, 12)
    assert entry["met_above_failure"] == [16]


def test_grid_capacity_of_an_undefined_worst_group_is_undefined():
    loads = [_load(4, 1.0, None), _load(8, 0.5)]
    loads[0]["worst_prompt_bucket"]["attainment"] = None
    entry = capacity_from_probes(loads, 0.9, "worst_prompt_bucket")
    assert entry["undefined"] and entry["capacity"] is None
    assert capacity_text(entry) == "n/a"


def test_grid_capacity_per_target_and_measure_and_its_table():
    loads = [_load(4, 1.0, 0.99), _load(8, 0.95, 0.8)]
    table = grid_capacity(loads)
    assert set(table) == {"0.9", "0.99"}
    assert set(table["0.9"]) == {"overall", "worst_prompt_bucket", "worst_slo_class"}
    assert table["0.9"]["overall"]["method"] == "grid"
    document = {"policies": {"p": {"loads": loads, "capacity": table}}}
    text = grid_capacity_table(document, ["p"])
    assert ">=8 / 4 / >=8" in text and "4 / 4 / 4" in text


# ------------------------------------------------------------------ bisection
def _curve(knee: float, bucket_knee: float):
    """Attainment 1 below the knee, then falling 5% per req/s; the worst bucket's earlier."""
    calls = []

    def evaluate(rate: float) -> dict:
        calls.append(rate)
        return _load(rate, min(1.0, max(0.0, 1 - (rate - knee) * 0.05)),
                     min(1.0, max(0.0, 1 - (rate - bucket_knee) * 0.05)))

    return evaluate, calls


def test_bisection_brackets_each_target_and_measure_within_the_tolerance():
    evaluate, calls = _curve(17.3, 12.1)
    search = bisect_capacity(evaluate, start=4.8)
    expected = {("0.9", "overall"): 19.3, ("0.99", "overall"): 17.5,
                ("0.9", "worst_prompt_bucket"): 14.1, ("0.99", "worst_prompt_bucket"): 12.3}
    for (target, measure), true in expected.items():
        entry = search.capacity[target][measure]
        assert entry["capacity"] <= true < entry["next_fail"], (target, measure)
        assert entry["next_fail"] / entry["capacity"] - 1 <= 0.05
        assert entry["resolved"] and entry["method"] == "bisection"
    assert search.simulations == len(calls) == len(set(calls))  # each load probed once
    assert search.simulations <= 25


def test_bisection_never_counts_a_load_above_a_failure():
    # non-monotone: 10 fails (a noisy dip), everything else up to 20 meets
    def evaluate(rate: float) -> dict:
        ok = rate < 20 and not 9.9 <= rate <= 10.1
        return _load(rate, 1.0 if ok else 0.5)

    search = bisect_capacity(evaluate, start=10.0, targets=(0.9,), measures=("overall",))
    entry = search.capacity["0.9"]["overall"]
    assert entry["next_fail"] == 10.0 and entry["capacity"] < 10.0
    assert entry["resolved"] and 10.0 / entry["capacity"] - 1 <= 0.05


def test_bisection_stops_at_the_rate_bounds_unresolved():
    always = bisect_capacity(lambda r: _load(r, 1.0), start=1.0, max_rate=8.0,
                             targets=(0.9,), measures=("overall",))
    entry = always.capacity["0.9"]["overall"]
    assert entry["capacity"] == 8.0 and entry["at_top"] and not entry["resolved"]
    assert sorted(always.loads) == [1.0, 2.0, 4.0, 8.0]
    never = bisect_capacity(lambda r: _load(r, 0.0), start=1.0, min_rate=0.25,
                            targets=(0.9,), measures=("overall",))
    entry = never.capacity["0.9"]["overall"]
    assert entry["capacity"] is None and entry["next_fail"] == 0.25
    assert capacity_text(entry) == "<0.25" and not entry["resolved"]


# ------------------------------------------------------------------ CLI, sweep, plot
@pytest.mark.slow
def test_capacity_subcommand_end_to_end(tmp_path, capsys):
    out = tmp_path / "cap"
    code = main(["capacity", "--policy", "fb-anchor-margin", "--policy", "sarathi@1024",
                 "--head-seconds", "20", "--target", "0.9", "--tolerance", "0.25",
                 "--max-rate", "40", "--min-group-requests", "5", "--jobs", "1",
                 "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "worst bucket" in printed and "simulations in" in printed
    document = json.loads((out / "results.json").read_text())
    assert document["capacity"]["targets"] == [0.9]
    assert document["capacity"]["min_group_requests"] == 5
    total = 0
    for name in ("fb-anchor-margin", "sarathi@1024"):
        entry = document["policies"][name]
        sims = entry["capacity_search"]["simulations"]
        assert sims == len(entry["loads"])
        total += sims
        assert set(entry["capacity"]) == {"0.9"}
        for measure in capacity.MEASURES:
            result = entry["capacity"]["0.9"][measure]
            assert result["method"] == "bisection"
            assert result["capacity"] is not None
            if result["next_fail"] is not None:
                assert result["next_fail"] / result["capacity"] - 1 <= 0.25
        for load in entry["loads"]:
            assert load["worst_prompt_bucket"]["min_requests"] == 5
    assert document["capacity"]["simulations"] == total


def test_capacity_subcommand_refuses_a_target_over_one(capsys):
    with pytest.raises(SystemExit):
        main(["capacity", "--policy", "fb", "--target", "1.5"])
    assert "(0, 1]" in capsys.readouterr().err


def test_a_sweep_document_carries_grid_capacity_and_the_worst_bucket_column(tmp_path):
    from sglang_ext.sim.commands import _scenario, build_parser
    from sglang_ext.sim.sweep import plan_sweep, run_sweep, summary_table

    args = build_parser().parse_args(["sweep", "--head-seconds", "20"])
    plan = plan_sweep(["fb-anchor-margin"])
    document, _ = run_sweep(_scenario(args), plan, (4.0, 8.0), cdf_rate=4.0, jobs=1)
    entry = document["policies"]["fb-anchor-margin"]
    assert entry["capacity"] == grid_capacity(entry["loads"])
    assert "worst bucket" in summary_table(document)


def _fairness_document(names: list[str]) -> dict:
    rates = [4.0, 8.0, 12.0]
    policies = {}
    for i, name in enumerate(names):
        loads = [dict(_load(r, 1 - r / 40, 1 - r / 20 - i / 50), effective_rps=r * (1 - r / 40),
                      ) for r in rates]
        for load in loads:
            load["worst_prompt_bucket"]["min_requests"] = 20
        policies[name] = {"loads": loads}
    return {"scenario": {"profile": "p", "slo": {"default_class": "standard", "ttft_ms": 2000.0,
                                                 "tpot_ms": 50.0, "classes": {}}},
            "rates": rates, "requested": names, "policies": policies}


def test_fairness_plot_one_colour_per_policy_points_in_load_order_legend_outside():
    import matplotlib.pyplot as plt

    from sglang_ext.sim.plots import fairness_figure, policy_styles

    names = ["sarathi", "fb-anchor-margin", "sarathi-queue-timeout"]
    document = _fairness_document(names)
    fig = fairness_figure(document, names)
    try:
        ax = fig.axes[0]
        lines = {line.get_label(): line for line in ax.get_lines()}
        styles = policy_styles(names)
        for name in names:
            line = lines[name]
            assert line.get_color() == styles[name]["color"]
            loads = document["policies"][name]["loads"]
            assert list(line.get_xdata()) == [l["worst_prompt_bucket"]["attainment"] for l in loads]
            assert list(line.get_ydata()) == [l["effective_rps"] for l in loads]
        assert len({lines[name].get_color() for name in names}) == len(names)
        legend = ax.get_legend()
        fig.canvas.draw()
        box, data = legend.get_window_extent(), ax.get_window_extent()
        assert box.x0 >= data.x1
        assert "worst prompt-length bucket" in ax.get_xlabel()
    finally:
        plt.close(fig)
