"""benchmarks.sim.crosswise_capacity: which files each device starts from, and its table's
ratios to the best baseline of each measure, on results built by hand."""

from __future__ import annotations

from benchmarks.sim import crosswise_capacity as cw
from benchmarks.sim import fair_capacity as fc


def _capacity(overall: float, bucket: float | None, klass: float) -> dict:
    return {"0.9": {"overall": {"capacity": overall}, "worst_prompt_bucket": {"capacity": bucket},
                    "worst_slo_class": {"capacity": klass}}}


def test_each_device_starts_from_its_own_file_and_the_other_ones():
    for profile, other in (("llama3.1-8b-h100-measured", "qwen3-14b-h20"),
                           ("qwen3-14b-h20", "llama3.1-8b-h100-measured")):
        starts = cw.starts(profile)
        assert [s.file for s in starts] == [profile, other, other, None]
        assert [s.calibrate for s in starts] == [False, False, True, False]
        assert all((cw.STEP_MODELS / f"{s.file}.toml").is_file() for s in starts if s.file)


def test_ratios_are_to_the_best_baseline_of_each_measure():
    baselines = ["sarathi@1024", "sarathi-queue-timeout@1024,timeout=1.75"]
    entry = {"scenario": fc.REFERENCE.__dict__, "requests": 1445,
             "labels": {"tuned here": baselines},
             "capacity": {baselines[0]: {"capacity": _capacity(20.0, 10.0, 20.0)},
                          baselines[1]: {"capacity": _capacity(16.0, 16.0, 18.0)}}}
    own, crosswise = cw.starts(fc.REFERENCE.profile)[:2]
    results = {(fc.REFERENCE.label, own.label): {"capacity": _capacity(22.0, 12.0, 22.0), "simulations": 9},
               (fc.REFERENCE.label, crosswise.label): {"capacity": _capacity(18.0, None, 18.0),
                                                       "simulations": 9}}
    doc = cw.collect([entry], results)
    (scenario,) = doc["scenarios"]
    assert scenario["best_baseline"]["overall"] == {"policy": baselines[0], "capacity": 20.0}
    assert scenario["best_baseline"]["worst_prompt_bucket"] == {"policy": baselines[1], "capacity": 16.0}
    rows = {row["start"]: row["cap90"] for row in scenario["rows"]}
    assert rows[own.label]["overall"]["ratio"] == 22.0 / 20.0
    assert rows[crosswise.label]["worst_prompt_bucket"] == {"capacity": 0.0, "ratio": 0.0}
    text = cw.render(doc)
    assert f"| {fc.REFERENCE.label} | {own.label} | 22.00 (1.10x) | 12.00 (0.75x) | 22.00 (1.10x) |" in text
    assert f"| {fc.REFERENCE.label} | {crosswise.label} | 18.00 (0.90x) | < min | 18.00 (0.90x) |" in text
    assert "the lowest ratio: overall 0.90x" in text


def test_a_measure_no_baseline_reaches_has_no_ratio_and_the_table_still_renders():
    baseline = "sarathi@1024"
    entry = {"scenario": fc.REFERENCE.__dict__, "requests": 1445, "labels": {"tuned here": [baseline]},
             "capacity": {baseline: {"capacity": _capacity(20.0, 10.0, None)}}}
    crosswise = cw.starts(fc.REFERENCE.profile)[1]
    results = {(fc.REFERENCE.label, crosswise.label): {"capacity": _capacity(21.0, 11.0, 2.0),
                                                       "simulations": 9}}
    text = cw.render(cw.collect([entry], results))
    assert f"| {fc.REFERENCE.label} | {crosswise.label} | 21.00 (1.05x) | 11.00 (1.10x) | 2.00 |" in text
    assert "worst class" not in text.split("the lowest ratio:")[1]


def test_a_bisection_saved_by_a_stopped_run_is_read_back(tmp_path):
    start = cw.starts(fc.REFERENCE.profile)[0]
    saved = cw.saved_path(tmp_path, fc.REFERENCE.__dict__, start)
    saved.write_text('{"capacity": {}, "simulations": 0, "wall_s": 0}')
    assert cw.bisect_start((fc.REFERENCE.__dict__, start, tmp_path / "no-trace", tmp_path)) == {
        "capacity": {}, "simulations": 0, "wall_s": 0}
