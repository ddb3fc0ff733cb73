"""The sweep's quick default (scripts/demo.sh): the shipped tuned baseline settings, refused
on another scenario; ``--full`` is the sweep as it was; the tuned-settings file; the
closing summary; the plots tell every policy apart."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from sglang_ext.bundled import CONFIGS_DIR
from sglang_ext.sim import commands, sweep_modes, tuned
from sglang_ext.sim.commands import DEFAULT_RATES, QUICK_RATES, build_parser, main
from sglang_ext.sim.fitting import tuning
from sglang_ext.sim.metrics import LatencySamples
from sglang_ext.sim.plots import PALETTE, effective_rps_figure, latency_cdf_figure
from sglang_ext.sim.runner import DEFAULT_TOKEN_BUDGETS
from sglang_ext.sim.sweep import DEFAULT_POLICIES, PRIORITY_BASELINES, headline_table, plan_sweep

ROOT = Path(__file__).resolve().parents[2]
#: the sweep's default policies, the shortest-first baselines and fb-smooth among them;
#: --full runs them at the full grid
FULL_POLICIES = (
    "sglang-default", "vllm-default", "sarathi", "sarathi-queue-cap", "sarathi-queue-timeout",
    "sarathi-sjf", "sarathi-sjf-queue-cap", "sarathi-sjf-queue-timeout",
    "sarathi-hrrn", "sarathi-hrrn-queue-timeout", "sarathi-spf", "sarathi-spf-queue-timeout",
    "fb-fb", "fb-tb", "fb", "fb-pab", "fb-anchor-margin", "fb-anchor-margin-pab",
    "fb-anchor-margin+reject", "fb-anchor-margin+defer", "fb-smooth", "fb-smooth+defer",
)
FULL_RATES = (4.0, 8.0, 12.0, 14.0, 16.0, 17.0, 18.0, 19.0, 20.0, 22.0, 24.0, 28.0, 32.0, 36.0)
FULL_BUDGETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
TUNED_FAMILIES = ("sarathi", "sarathi-queue-cap", "sarathi-queue-timeout", "sarathi-sjf",
                  "sarathi-sjf-queue-cap", "sarathi-sjf-queue-timeout", "sarathi-hrrn",
                  "sarathi-hrrn-queue-timeout", "sarathi-spf", "sarathi-spf-queue-timeout",
                  "fb-fb")


class _Planned(Exception):
    pass


def _planned(monkeypatch, argv: list[str]) -> dict:
    """What ``sweep argv`` would run (its plan, loads, CDF load), without running it."""
    seen = {}

    def capture(scenario, plan, rates, *, cdf_rate, **kwargs):
        seen.update(scenario=scenario, plan=plan, rates=tuple(rates), cdf_rate=cdf_rate)
        raise _Planned

    monkeypatch.setattr(commands, "run_sweep", capture)
    with pytest.raises(_Planned):
        commands._cmd_sweep(build_parser().parse_args(["sweep", *argv]))
    return seen


def _default_scenario(*argv: str):
    return commands._scenario(build_parser().parse_args(["sweep", *argv]))


# ------------------------------------------------------------------ the plans
def test_full_keeps_the_sweep_it_replaced(monkeypatch):
    seen = _planned(monkeypatch, ["--full"])
    plan = seen["plan"]
    assert plan.requested == FULL_POLICIES
    assert plan.tuned == TUNED_FAMILIES and plan.presets == () and plan.budgets is None
    assert [spec.label for spec in plan.runs] == [n for n in FULL_POLICIES if n not in TUNED_FAMILIES]
    assert seen["rates"] == FULL_RATES and seen["cdf_rate"] == 19.0
    # the search the tuned families get, unchanged
    assert DEFAULT_TOKEN_BUDGETS == FULL_BUDGETS
    assert tuning.BUDGET_BOUNDS == (32, 8192) and tuning.START_BUDGET == 512
    assert tuning.SETTING_GRID == (0.25, 0.5, 1.0, 2.0, 4.0) and tuning.REFINE_STEP == 0.25
    assert DEFAULT_POLICIES == FULL_POLICIES and DEFAULT_RATES == FULL_RATES


def test_the_quick_default_runs_the_shipped_settings(monkeypatch):
    shipped = tuned.load()
    seen = _planned(monkeypatch, [])
    plan = seen["plan"]
    assert plan.requested == FULL_POLICIES and plan.tuned == ()
    assert {p.name: p.label for p in plan.presets} == {
        name: shipped.families[name].best for name in TUNED_FAMILIES
    }
    labels = [spec.label for spec in plan.runs]
    for preset in plan.presets:
        assert preset.label in labels
        assert preset.tuning["from"] == "configs/tuned_baselines.toml"
        assert preset.tuning["shipped"] is True
    assert seen["rates"] == QUICK_RATES and seen["cdf_rate"] == 19.0
    assert set(QUICK_RATES) < set(FULL_RATES)


def test_several_classes_add_the_class_priority_baselines(monkeypatch):
    mixed = _planned(monkeypatch, ["--class-mix", "interactive:0.3,standard:0.7"])["plan"]
    assert mixed.requested == FULL_POLICIES + PRIORITY_BASELINES
    assert set(PRIORITY_BASELINES) <= set(mixed.tuned)
    one = _planned(monkeypatch, ["--class-mix", "standard:1"])["plan"]
    assert one.requested == FULL_POLICIES


def test_retune_tunes_over_the_quick_grid(monkeypatch):
    seen = _planned(monkeypatch, ["--retune"])
    assert seen["plan"].tuned == TUNED_FAMILIES and seen["plan"].presets == ()
    assert seen["rates"] == QUICK_RATES


@pytest.mark.parametrize("argv, field", [
    (["--seed", "1"], "seed"),
    (["--profile", "qwen3-14b-h20"], "GPU profile"),
    (["--head-seconds", "120"], "workload"),
    (["--ttft-ms", "1000"], "SLO targets"),
    (["--arrivals", "poisson"], "arrivals"),
    (["--step-form", "linear"], "initial step model"),
])
def test_another_scenario_is_tuned_here_not_run_at_the_shipped_settings(monkeypatch, argv, field):
    seen = _planned(monkeypatch, argv)
    assert seen["plan"].tuned == TUNED_FAMILIES and seen["plan"].presets == ()
    mode = sweep_modes.choose_mode(plan_sweep(FULL_POLICIES), seen["scenario"], full=False,
                            retune=False, settings_path=None, save_tuned=None)
    assert mode.presets == () and any(text.startswith(field) for text in mode.refused)
    # a file named explicitly for another scenario is an error, not a silent re-tune
    with pytest.raises(tuned.TunedSettingsError, match="--retune"):
        sweep_modes.choose_mode(plan_sweep(FULL_POLICIES), seen["scenario"], full=False,
                         retune=False, settings_path=tuned.SHIPPED, save_tuned=None)


def test_another_trace_with_the_same_contents_matches():
    one = tuned.scenario_fingerprint(_default_scenario())
    other = tuned.scenario_fingerprint(_default_scenario(
        "--trace", str(ROOT / "sglang_ext" / "data" / "azure_conv_sample.csv"),
        "--head-seconds", "300"))
    assert tuned.load().differences(one) == [] and one["workload_sha256"] == other["workload_sha256"]


@pytest.mark.parametrize("argv, message", [
    (["--full", "--tuned-settings", "x.toml"], "--full tunes"),
    (["--retune", "--tuned-settings", "x.toml"], "--retune tunes"),
    (["--save-tuned", "x.toml"], "add --full"),
    (["--tuned-settings", "missing.toml"], "no such file"),
])
def test_flag_mistakes_are_user_errors(tmp_path, capsys, argv, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ the shipped file
def test_the_shipped_file_ships_with_the_package_and_says_where_it_came_from():
    assert tuned.SHIPPED == CONFIGS_DIR / "tuned_baselines.toml" and tuned.SHIPPED.is_file()
    assert (ROOT / "configs" / "tuned_baselines.toml").read_text() == tuned.SHIPPED.read_text()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["sglang_ext"]
    assert "data/configs/*.toml" in package_data
    settings = tuned.load()
    assert set(settings.families) == set(TUNED_FAMILIES)
    for key in ("command", "commit", "date", "rates", "simulations"):
        assert settings.provenance[key]
    assert tuple(settings.provenance["rates"]) == FULL_RATES
    scenario = settings.scenario
    assert (scenario["profile"], scenario["seed"], scenario["requests"]) == ("llama3.1-8b-h100", 0, 1445)
    assert scenario["workload"] == "azure_conv_sample.csv[:300s]"
    assert scenario["slo"]["standard"] == {"ttft_ms": 2000.0, "tpot_ms": 50.0}


def test_settings_file_round_trip(tmp_path):
    document = {
        "rates": [4.0, 8.0],
        "policies": {
            "sarathi@256": {"peak_effective_rps": 7.0, "peak_rate": 8.0, "loads": [{}, {}]},
            "sarathi@512": {"peak_effective_rps": 8.0, "peak_rate": 8.0, "loads": [{}, {}]},
            "sarathi": {"peak_effective_rps": 8.0, "peak_rate": 8.0, "loads": [{}, {}],
                        "best_of": "sarathi@512",
                        "tuning": {"tried": ["sarathi@256", "sarathi@512"], "edge_axes": []}},
            "fb": {"peak_effective_rps": 8.0, "peak_rate": 8.0, "loads": [{}, {}]},
        },
    }
    fingerprint = tuned.scenario_fingerprint(_default_scenario("--head-seconds", "30"))
    path = tmp_path / "t.toml"
    path.write_text(tuned.settings_toml(document, fingerprint, "python -m x", commit="abc",
                                        date="2026-01-01"))
    settings = tuned.load(path)
    assert settings.families["sarathi"] == tuned.TunedFamily("sarathi@512", (), 2, 8.0, 8.0)
    assert settings.provenance["simulations"] == 6 and settings.provenance["commit"] == "abc"
    assert settings.differences(fingerprint) == []
    assert settings.tuning_entry("sarathi")["shipped"] is False
    bad = tmp_path / "bad.toml"
    bad.write_text(path.read_text().replace('best = "sarathi@512"', 'best = "vllm-default"'))
    with pytest.raises(tuned.TunedSettingsError, match="not a setting of sarathi"):
        tuned.load(bad)


# ------------------------------------------------------------------ end to end, cheap
@pytest.mark.slow
def test_quick_sweep_labels_the_shipped_setting(tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["sweep", "--policy", "sarathi", "--rates", "36",
                 "--jobs", "1", "--no-progress", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    best = tuned.load().families["sarathi"].best
    assert "not searched (re-tune: --retune" in captured.err
    summary = captured.out.split("Summary (quick demo)")[1]
    assert f"sarathi ({best.split('@', 1)[1]}, shipped)" in summary
    assert "tuned settings from configs/tuned_baselines.toml" in " ".join(summary.split())
    assert "re-tune with --retune" in summary and "--full" in summary
    assert f"results: {out / 'results.json'}" in summary
    assert str(out / "effective_rps.png") in summary
    entry = json.loads((out / "results.json").read_text())["policies"]["sarathi"]
    assert entry["best_of"] == best and entry["tuning"]["shipped"] is True
    assert "tried" not in entry["tuning"]


@pytest.mark.slow
def test_another_scenario_tunes_here_and_says_so(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["sweep", "--policy", "sarathi", "--rates", "8", "--head-seconds", "20",
                 "--jobs", "1", "--no-progress", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "not using the tuned settings in configs/tuned_baselines.toml" in captured.err
    assert "workload: tuned on azure_conv_sample.csv[:300s]" in captured.err
    assert "sarathi tuned here" in captured.out
    entry = json.loads((out / "results.json").read_text())["policies"]["sarathi"]
    assert entry["tuning"]["tried"] and "from" not in entry["tuning"]


# ------------------------------------------------------------------ the summary
def _load(rate: float, effective: float) -> dict:
    return {"rate": rate, "effective_rps": effective}


def _entry(loads: list[tuple[float, float]], **extra) -> dict:
    peak = max(loads, key=lambda load: load[1])
    return {"peak_effective_rps": peak[1], "peak_rate": peak[0],
            "peak_at_highest_load": peak[0] == max(r for r, _ in loads),
            "loads": [_load(*load) for load in loads], **extra}


def test_headline_ratios_use_an_interior_peak_and_the_top_load():
    document = {
        "rates": [10.0, 20.0, 30.0], "requested": ["sarathi", "sarathi-queue-cap", "fb-x"],
        "policies": {
            "sarathi": _entry([(10, 10.0), (20, 16.0), (30, 8.0)], best_of="sarathi@1024",
                              tuning={"from": "configs/tuned_baselines.toml", "shipped": True}),
            "sarathi-queue-cap": _entry([(10, 10.0), (20, 15.0), (30, 20.0)]),
            "fb-x": _entry([(10, 10.0), (20, 20.0), (30, 25.0)]),
        },
    }
    lines = headline_table(document).splitlines()
    rows = {line.split("  ")[0]: line.split() for line in lines[2:5]}
    assert rows["sarathi (1024, shipped)"][-3:] == ["1.00x", "8.00", "0.40x"]
    assert rows["sarathi-queue-cap"][-3:] == ["-", "20.00", "1.00x"]  # admission control
    assert rows["fb-x"][-4:] == ["n/a", "(>=)", "25.00", "1.25x"]
    text = " ".join(headline_table(document).split())
    assert "the peak of sarathi (1024, shipped), 16.00 at 20 req/s" in text
    assert "that of sarathi-queue-cap, 20.00: the best baseline there" in text
    assert all(len(line) <= 100 for line in lines)


# ------------------------------------------------------------------ the plots
def _document(names: list[str]) -> dict:
    rates = [4.0, 8.0, 12.0]
    return {
        "scenario": {"profile": "p", "slo": {"default_class": "standard", "ttft_ms": 2000.0,
                                             "tpot_ms": 50.0, "classes": {}}},
        "rates": rates, "cdf_rate": 8.0, "requested": names,
        "policies": {name: _entry([(r, r * (1 - i / 50)) for r in rates])
                     for i, name in enumerate(names)},
    }


def _outside(fig, ax, legend) -> bool:
    fig.canvas.draw()
    box, data = legend.get_window_extent(), ax.get_window_extent()
    return box.x0 >= data.x1 or box.x1 <= data.x0 or box.y0 >= data.y1 or box.y1 <= data.y0


def test_effective_rps_plot_gives_each_policy_its_colour_and_keeps_the_legend_outside():
    import matplotlib.pyplot as plt

    names = list(FULL_POLICIES)
    fig = effective_rps_figure(_document(names), names)
    try:
        ax = fig.axes[0]
        lines = {line.get_label(): line for line in ax.get_lines()}
        curves = [lines[label] for label in names]
        colours = [line.get_color() for line in curves]
        assert len(set(colours)) == len(names)
        for name, line in zip(names, curves):
            fairbatching = name.startswith("fb")
            assert line.get_linestyle() == ("-" if fairbatching else "--"), name
            admission = ("+" in name or name.endswith("-pab") or "queue" in name)
            assert (line.get_marker() not in ("None", None, "")) == admission, name
        legend = ax.get_legend()
        assert [t.get_text() for t in legend.get_texts()][:len(names)] == names
        assert _outside(fig, ax, legend)
    finally:
        plt.close(fig)


def test_the_palette_has_no_repeat_for_a_large_sweep():
    assert len(set(PALETTE)) == len(PALETTE) >= 20


def test_latency_cdf_plot_shares_the_colours_and_keeps_the_legend_outside():
    import matplotlib.pyplot as plt

    names = list(FULL_POLICIES)
    document = _document(names)
    samples = {name: LatencySamples((100.0 + i, 200.0, 300.0), (20.0, 30.0 + i, 40.0))
               for i, name in enumerate(names)}
    fig = latency_cdf_figure(document, samples, names)
    reference = effective_rps_figure(document, names)
    try:
        expected = {l.get_label(): l.get_color() for l in reference.axes[0].get_lines()}
        for ax in fig.axes:
            colours = {line.get_label(): line.get_color() for line in ax.get_lines()
                       if line.get_label() in expected}
            assert colours == {name: expected[name] for name in names}
        legend = fig.legends[0]
        assert all(_outside(fig, ax, legend) for ax in fig.axes)
    finally:
        plt.close(fig)
        plt.close(reference)
