"""The report's seed-systems section (:mod:`benchmarks.sim.seed_systems`): per-GPU rows, ratios to
the best baseline, the per-class table at the best baseline's peak load, from synthetic
sweeps; and one tiny real run of the whole section."""

from __future__ import annotations

import pytest

import benchmarks.sim.seed_systems as ss
from sglang_ext.sim.sweep import BASELINES

RATES = (8.0, 16.0, 24.0)


def _pcts(p50: float) -> dict:
    return {"p50": p50, "p90": p50, "p95": p50, "p99": 2 * p50, "mean": p50}


def _load(rate: float, attainment: float) -> dict:
    classes = {
        "chat": {"attainment": attainment, "ttft_ms": _pcts(100), "tpot_ms": _pcts(20)},
        "code": {"attainment": 1.0, "e2e_ms": _pcts(5000)},
    }
    return {"rate": rate, "attainment": attainment, "effective_rps": rate * attainment,
            "by_slo_class": classes}


def _entry(attainments: tuple[float, ...], rates=RATES, best_of: str | None = None) -> dict:
    loads = [_load(r, a) for r, a in zip(rates, attainments, strict=True)]
    peak = max(loads, key=lambda load: load["effective_rps"])
    entry = {"peak_effective_rps": peak["effective_rps"], "peak_rate": peak["rate"],
             "peak_at_highest_load": peak["rate"] == max(rates), "loads": loads}
    if best_of:
        entry["best_of"] = best_of
    return entry


def _runs() -> ss.ProfileRuns:
    colocated = {name: _entry((1.0, 0.5, 0.2)) for name in ss.COLOCATED}
    colocated["sarathi"] = _entry((1.0, 0.75, 0.3), best_of="sarathi@512")  # best: 12 at 16
    colocated["slo-anneal-short"] = _entry((1.0, 1.0, 0.5), best_of="slo-anneal-short@512,batch=4")
    doubled = tuple(2 * r for r in RATES)
    disaggregated = {name: _entry((1.0, 0.6, 0.1), doubled) for name in ss.SEED_DISAGGREGATED}
    check = {"slo-anneal@512,batch=4": _entry((1.0, 0.8, 0.7))}
    return ss.ProfileRuns(
        "llama3.1-8b-h100",
        {"policies": colocated, "rates": list(RATES), "scenario": {"requests": 100}},
        {"policies": disaggregated, "rates": list(doubled)},
        {"policies": check, "rates": list(RATES)},
    )


def test_the_paper_schedule_row_is_the_short_schedules_tuned_setting():
    assert ss.paper_schedule_of("slo-anneal-short@512,batch=4") == "slo-anneal@512,batch=4"
    assert _runs().paper_annealing == "slo-anneal@512,batch=4"


def test_every_row_reads_per_gpu_and_divides_by_the_best_baseline():
    table = "\n".join(ss.peak_table(_runs()))
    assert "Best baseline: **sarathi (512)** (12.00 req/s on one GPU)" in table
    assert "without admission control: **sarathi (512)** (12.00)" in table
    kairos = next(line for line in table.splitlines() if line.startswith("| kairos (") or
                  line.startswith("| kairos |"))
    # 2 GPUs at 32 req/s with 0.6 attained: 19.2 effective, 9.6 per GPU at 16 per GPU
    assert "| 2 | 9.60 | 16 | 0.80x | 0.80x | 2.40 | 0.33x |" in kairos
    short = next(line for line in table.splitlines() if line.startswith("| slo-anneal-short"))
    assert "| 1 | 16.00 | 16 | 1.33x | 1.33x | 12.00 | 1.67x |" in short
    paper = next(line for line in table.splitlines() if line.startswith("| slo-anneal@512"))
    assert ">=16.80" in paper and "n/a (>=)" in paper  # peak at the highest load: no ratio


def test_per_class_table_is_at_the_knee():
    rate, lines = ss.class_table(_runs())
    assert rate == 16.0
    rows = {line.split(" | ")[0]: line for line in lines[2:]}
    assert len(rows) == len(ss.COLOCATED) + 1 + len(ss.SEED_DISAGGREGATED)
    assert rows["| fb-anchor-margin"].startswith("| fb-anchor-margin | 0.500 | 0.500 | 1.000 | 100 | 200 | 20 | 40 | 5000 | 10000 |")
    assert "| 0.600 | 0.600 | 1.000 |" in rows["| kairos"]  # read at 32 req/s on 2 GPUs


def test_the_section_reads_back_from_its_results(tmp_path):
    text = "\n".join(ss.section([_runs()], 125.0, "scripts/report.sh --seed-systems"))
    assert "in 2.1 min" in text and "## llama3.1-8b-h100" in text
    assert ss._elapsed_from(text) == pytest.approx(126.0)
    assert all(f"`{name}`" in text for name in BASELINES)


@pytest.mark.slow
def test_a_tiny_section_runs_end_to_end(tmp_path, monkeypatch):
    from tqdm import tqdm

    from sglang_ext.sim.workloads import bundled_sample

    monkeypatch.setattr(ss, "SETTINGS", {"llama3.1-8b-h100": ss.SeedSetting(10, (8, 24))})
    (tmp_path / "results").mkdir()
    with tqdm(total=0, disable=True) as bar:
        path = ss.run_section(bundled_sample(), ["llama3.1-8b-h100"], seed=0, step_form="knee",
                              jobs=1, out=tmp_path, command="test", bar=bar, from_results=False)
    text = path.read_text()
    assert "slo-anneal-short (" in text and "kairos-fcfs" in text and "| code e2e p50 |" in text
    again = ss.run_section(bundled_sample(), ["llama3.1-8b-h100"], seed=0, step_form="knee",
                           jobs=1, out=tmp_path, command="test", bar=None, from_results=True)
    assert again.read_text().splitlines()[4:] == text.splitlines()[4:]
