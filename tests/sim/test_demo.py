"""The demo (scripts/demo.sh): the shipped configuration against the three strongest
baselines of each case's tuned sweep, one SLO class and three, on one screen."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_ext.bundled import CONFIGS_DIR
from sglang_ext.sim import commands, demo, tuned
from sglang_ext.sim.commands import build_parser, main
from sglang_ext.sim.sweep import BASELINES

TINY_RATES = (4.0, 8.0)


def _settings(peaks: dict[str, tuple[float, float]]) -> tuned.TunedSettings:
    families = {name: tuned.TunedFamily(f"{name}@512", (), 1, peak, rate)
                for name, (peak, rate) in peaks.items()}
    return tuned.TunedSettings(Path("t.toml"), {}, {}, families)


def test_the_strongest_baselines_are_ranked_by_peak_and_a_tie_counts_once():
    settings = _settings({
        "sarathi": (19.0, 19.0),
        "sarathi-sjf": (26.5, 36.0),
        "sarathi-sjf-queue-cap": (26.5, 36.0),  # the cap never bound: ran as sarathi-sjf
        "sarathi-sjf-queue-timeout": (27.9, 36.0),
        "sarathi-queue-cap": (22.6, 36.0),
        "fb-fb": (40.0, 36.0),  # FairBatching's own family is no baseline
    })
    assert demo.strongest_baselines(settings) == (
        "sarathi-sjf-queue-timeout", "sarathi-sjf", "sarathi-queue-cap")
    assert demo.strongest_baselines(settings, 1) == ("sarathi-sjf-queue-timeout",)
    every_one_on_time = _settings({"sarathi": (8.0, 8.0), "sarathi-sjf": (8.0, 8.0)})
    assert demo.strongest_baselines(every_one_on_time) == ("sarathi", "sarathi-sjf")


def test_the_shipped_policy_is_the_server_configs(tmp_path):
    assert demo.shipped_policy() == "fb-smooth+defer"
    config = tmp_path / "fb.toml"
    config.write_text('policy = "fb-steady"\n[admission]\nmode = "off"\n')
    assert demo.shipped_policy(config) == "fb-steady"


@pytest.mark.parametrize("case", demo.CASES, ids=lambda case: case.slug)
def test_each_case_ships_baselines_tuned_on_its_own_scenario(case):
    assert case.tuned_file.parent == CONFIGS_DIR and case.tuned_file.is_file()
    settings = tuned.load(case.tuned_file)
    scenario = commands._scenario(build_parser().parse_args(["sweep", *case.sweep_argv]))
    assert settings.differences(tuned.scenario_fingerprint(scenario)) == []
    assert case.table_rate in commands.QUICK_RATES
    chosen = demo.strongest_baselines(settings)
    assert len(chosen) == demo.BASELINE_COUNT and set(chosen) <= set(BASELINES)
    assert "+dirty" not in str(settings.provenance.get("commit"))
    assert "/tmp" not in str(settings.provenance.get("command"))


def _tiny_cases(tmp_path: Path) -> tuple[demo.DemoCase, ...]:
    """The demo's two cases on a 20 s head of the sample, each with a tuned file written by
    a real (small) sweep."""
    cases = []
    for slug, mix, group in (("one-class", None, "worst_prompt_bucket"),
                             ("three-classes", demo.THREE_CLASSES, "worst_slo_class")):
        argv = ("--head-seconds", "20", *(("--class-mix", mix) if mix else ()))  # a case's sweep_argv
        path = tmp_path / f"{slug}.toml"
        assert main(["sweep", "--retune", "--policy", "sarathi", "--policy", "sarathi-sjf",
                     "--budgets", "512,1024", "--rates", ",".join(map(str, TINY_RATES)),
                     "--jobs", "1", "--no-progress", "--out", str(tmp_path / f"tune-{slug}"),
                     "--save-tuned", str(path), *argv]) == 0
        cases.append(demo.DemoCase(slug.replace("-", " "), slug, mix, path, TINY_RATES[-1],
                                   group, ("--head-seconds", "20")))
    return tuple(cases)


@pytest.mark.slow
def test_the_demo_prints_each_case_in_100_columns_and_draws_one_figure(
        tmp_path, monkeypatch, capsys):
    cases = _tiny_cases(tmp_path)
    capsys.readouterr()
    monkeypatch.setattr(demo, "CASES", cases)
    monkeypatch.setattr(commands, "QUICK_RATES", TINY_RATES)
    out = tmp_path / "demo"
    assert main(["demo", "--jobs", "1", "--no-progress", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    tables = printed.split("results, ")[0]
    assert max(map(len, tables.splitlines())) <= demo.WIDTH
    assert printed.count("fb-smooth+defer (shipped)") == 5  # 2 tables + 3 with classes
    assert "per SLO class" in printed and "interactive" in printed
    for case in cases:
        document = json.loads((out / case.slug / "results.json").read_text())
        assert set(document["policies"]) >= {"fb-smooth+defer", "sarathi", "sarathi-sjf"}
        assert document["policies"]["sarathi"]["tuning"]["from"] == tuned.display_path(
            case.tuned_file)
    assert (out / "demo.png").stat().st_size > 10_000
    assert "/tmp" not in printed.split("results, ")[0]


def test_a_missing_tuned_file_says_how_to_write_it(tmp_path, monkeypatch, capsys):
    case = demo.CASES[0]
    monkeypatch.setattr(demo, "CASES", (demo.DemoCase(
        case.title, case.slug, case.class_mix, tmp_path / "none.toml", case.table_rate,
        case.worst_group),))
    assert main(["demo", "--no-progress", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "are missing; write them with `python -m sglang_ext.sim sweep --full" in err
    assert not (tmp_path / "o").exists()
