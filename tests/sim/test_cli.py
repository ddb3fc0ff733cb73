"""``python -m sglang_ext.sim`` end to end: outputs, the results.json shape, user errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_ext.policy.policies import POLICIES
from sglang_ext.policy.step_model import StepCoefficients, StepModelFile
from sglang_ext.sim import commands
from sglang_ext.sim.commands import main
from sglang_ext.sim.fitting.calibration import offline_fit, offline_step_model
from sglang_ext.sim.profile import PROFILES_DIR, bundled_profile_path, load_profile

TOP_LEVEL = {"schema_version", "scenario", "rates", "cdf_rate", "requested", "policies"}
LOAD_KEYS = {
    "rate", "requests", "attainment", "effective_rps", "envelope_attainment", "ttft_attainment",
    "tpot_attainment", "rejected", "aborted", "unfinished", "preemptions", "recomputed_tokens",
    "output_tokens_per_s", "ttft_ms", "tpot_ms", "mean_tpot_ms", "max_tbt_ms", "e2e_ms",
    "steps", "gpu_busy_fraction", "by_slo_class",
}
PERCENTILES = {"p50", "p90", "p95", "p99", "mean"}
SCENARIO_KEYS = {
    "workload", "requests", "natural_rate", "profile", "arrivals", "seed", "step_model",
    "learn_knee", "calibrate", "drain_s", "max_token_budget", "slo",
}
FAST = ["--head-seconds", "30"]


def _check_policy_entry(entry: dict, rates: list[float]) -> None:
    assert {"peak_effective_rps", "peak_rate", "loads"} <= set(entry)
    loads = entry["loads"]
    assert [load["rate"] for load in loads] == rates
    for load in loads:
        assert LOAD_KEYS <= set(load)
        for name in ("ttft_ms", "tpot_ms", "mean_tpot_ms", "max_tbt_ms", "e2e_ms"):
            assert set(load[name]) == PERCENTILES
        assert 0.0 <= load["attainment"] <= 1.0
        assert load["effective_rps"] == pytest.approx(load["rate"] * load["attainment"])
        assert load["requests"] > 10 and load["unfinished"] == 0
    peak = max(loads, key=lambda load: load["effective_rps"])
    assert entry["peak_effective_rps"] == peak["effective_rps"]
    assert entry["peak_rate"] == peak["rate"]


# ------------------------------------------------------------------ help
@pytest.mark.slow
def test_module_help_in_a_subprocess():
    done = subprocess.run(
        [sys.executable, "-m", "sglang_ext.sim", "--help"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr
    for command in ("run", "sweep", "calibrate"):
        assert command in done.stdout
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("command", ["run", "sweep", "calibrate"])
def test_subcommand_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "--profile" in capsys.readouterr().out


# ------------------------------------------------------------------ run
def test_run_writes_results_json(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--policy", "fb", "--rate", "8", *FAST, "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "peak eff RPS" in stdout and "wrote" in stdout
    document = json.loads((out / "results.json").read_text())
    assert document["schema_version"] == 2
    assert TOP_LEVEL <= set(document)  # the same shape as a sweep's
    assert SCENARIO_KEYS <= set(document["scenario"])
    assert document["rates"] == [8.0] and document["cdf_rate"] == 8.0
    assert document["requested"] == ["fb"]
    assert set(document["policies"]) == {"fb"}
    _check_policy_entry(document["policies"]["fb"], [8.0])
    assert document["scenario"]["slo"]["ttft_ms"] == 2000.0


@pytest.mark.slow
def test_a_margin_policy_reports_its_mean_margin_on_the_form_asked_for(tmp_path):
    margins = {}
    for form in ("linear", "knee"):
        out = tmp_path / form
        argv = ["run", "--policy", "fb-anchor-margin", "--rate", "8", *FAST, "--step-form", form,
                "--out", str(out)]
        assert main(argv) == 0
        document = json.loads((out / "results.json").read_text())
        assert document["scenario"]["step_model"] == form
        load = document["policies"]["fb-anchor-margin"]["loads"][0]
        assert load["step_model"]["form"] == form
        margins[form] = load["mean_margin"]
    assert 0 < margins["knee"] < margins["linear"] <= 0.5  # the better fit needs less margin
    fb = tmp_path / "fb"
    assert main(["run", "--policy", "fb", "--rate", "8", *FAST, "--out", str(fb)]) == 0
    assert "mean_margin" not in json.loads((fb / "results.json").read_text())["policies"]["fb"]["loads"][0]


def test_run_with_budgeted_policy_and_slo_override(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["run", "--policy", "sarathi@1024", "--rate", "6", *FAST, "--ttft-ms", "500",
            "--tpot-ms", "40", "--arrivals", "poisson", "--out", str(out)]
    assert main(argv) == 0
    document = json.loads((out / "results.json").read_text())
    assert set(document["policies"]) == {"sarathi@1024"}
    slo = document["scenario"]["slo"]
    assert slo | {"classes": None} == {
        "default_class": "standard", "ttft_ms": 500.0, "tpot_ms": 40.0, "classes": None,
    }
    assert slo["classes"]["standard"] == {"ttft_ms": 500.0, "tpot_ms": 40.0}
    assert slo["classes"]["relaxed"] == {"ttft_ms": 5000.0, "tpot_ms": 200.0}



def _table_rows(stdout: str) -> list[str]:
    """The policy column of the printed table, row by row."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("policy "))
    rows = []
    for line in lines[start + 2:]:
        if not line.strip():
            break
        rows.append(line.split()[0])
    return rows


@pytest.mark.slow
def test_run_takes_several_policies_at_one_rate(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["run", "--policy", "fb-anchor-margin", "--policy", "sarathi@1024", "--rate", "12",
            *FAST, "--out", str(out)]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert _table_rows(stdout) == ["fb-anchor-margin", "sarathi@1024"]
    assert "at 12 req/s:" in stdout
    document = json.loads((out / "results.json").read_text())
    assert TOP_LEVEL <= set(document)  # the shape of a sweep of two policies at one rate
    assert document["rates"] == [12.0] and document["cdf_rate"] == 12.0
    assert document["requested"] == ["fb-anchor-margin", "sarathi@1024"]
    assert list(document["policies"]) == ["fb-anchor-margin", "sarathi@1024"]
    for entry in document["policies"].values():
        _check_policy_entry(entry, [12.0])
    assert "mean_margin" in document["policies"]["fb-anchor-margin"]["loads"][0]
    # each policy's run is the one it gets alone: nothing carries over between them
    alone = tmp_path / "alone"
    assert main(["run", "--policy", "sarathi@1024", "--rate", "12", *FAST,
                 "--out", str(alone)]) == 0
    single = json.loads((alone / "results.json").read_text())
    assert single["policies"]["sarathi@1024"] == document["policies"]["sarathi@1024"]
    assert single["scenario"] == document["scenario"]
    assert _table_rows(capsys.readouterr().out) == ["sarathi@1024"]


def test_run_applies_admission_to_each_policy_and_runs_a_label_once(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["run", "--policy", "fb", "--policy", "sarathi@512", "--policy", "fb+reject",
            "--admission", "reject", "--rate", "8", *FAST, "--out", str(out)]
    assert main(argv) == 0
    assert _table_rows(capsys.readouterr().out) == ["fb+reject", "sarathi@512"]
    document = json.loads((out / "results.json").read_text())
    assert document["requested"] == ["fb+reject", "sarathi@512"]
    assert list(document["policies"]) == ["fb+reject", "sarathi@512"]


@pytest.mark.parametrize("bad, fragment", [
    ("nope", "'nope'"),
    ("fb-pab+defer", "fb-pab"),  # refused when the policy is built, still before any run
])
def test_run_refuses_a_bad_policy_among_several_before_running_any(bad, fragment, tmp_path,
                                                                    capsys, monkeypatch):
    ran = []
    monkeypatch.setattr(commands, "simulate", lambda *args, **kwargs: ran.append(args))
    out = tmp_path / "o"
    line = _user_error(["run", "--policy", "sarathi@512", "--policy", bad, "--rate", "8",
                        *FAST, "--out", str(out)], capsys)
    assert fragment in line
    assert not ran and not out.exists()


def test_run_with_a_disaggregated_policy_among_colocated_ones(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["run", "--policy", "kairos-fcfs", "--policy", "sarathi@512", "--split", "1:1",
            "--rate", "4", "--head-seconds", "20", "--out", str(out)]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert _table_rows(stdout) == ["kairos-fcfs", "sarathi@512"]
    assert "kairos-fcfs: 2 GPUs (1 prefill + 1 decode" in stdout
    assert "sarathi@512:" not in stdout
    document = json.loads((out / "results.json").read_text())
    assert document["disaggregated"]["gpus"] == 2
    assert document["policies"]["kairos-fcfs"]["loads"][0]["gpus"] == 2
    assert "gpus" not in document["policies"]["sarathi@512"]["loads"][0]


@pytest.mark.parametrize("argv, option, hint", [
    (["run", "--rate", "4", "--rate", "8"], "--rate", "sweep --rates"),
    (["cluster", "--policy", "fb", "--policy", "sarathi@512"], "--policy", "once per policy"),
    (["cluster", "--rate", "4", "--rate=8"], "--rate", "sweep --rates"),
    (["sweep", "--rates", "4,8", "--rates", "12"], "--rates", "one comma-separated list"),
    (["sweep", "--budgets", "256", "--budgets", "512"], "--budgets", "one comma-separated"),
    (["run", "--trace", "a.csv", "--trace", "b.csv"], "--trace", ""),
    (["run", "--profile", "qwen3-14b-h20", "--prof", "llama3.1-8b-h100"], "--profile", ""),
    (["run", "--seed", "1", "--seed", "2"], "--seed", ""),
    (["calibrate", "--form", "knee", "--form", "linear"], "--form", ""),
])
def test_a_repeated_single_valued_option_is_refused(argv, option, hint, capsys):
    last = _argparse_error(argv, capsys)
    assert f"argument {option}: given more than once; it takes one value" in last
    assert hint in last


# ------------------------------------------------------------------ sweep
@pytest.mark.slow
def test_sweep_writes_results_plots_and_table(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", "--policy", "fb", "--policy", "sarathi", "--budgets", "256,1024",
            "--rates", "4,8", *FAST, "--jobs", "1", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    document = json.loads((out / "results.json").read_text())
    assert document["schema_version"] == 2
    assert TOP_LEVEL <= set(document)
    assert document["rates"] == [4.0, 8.0]
    assert document["requested"] == ["fb", "sarathi"]
    policies = document["policies"]
    assert set(policies) == {"fb", "sarathi", "sarathi@256", "sarathi@1024"}
    for entry in policies.values():
        _check_policy_entry(entry, [4.0, 8.0])
    best = policies["sarathi"]["best_of"]
    assert best in ("sarathi@256", "sarathi@1024")
    assert policies["sarathi"]["peak_effective_rps"] == max(
        policies[m]["peak_effective_rps"] for m in ("sarathi@256", "sarathi@1024")
    )
    assert policies["sarathi"]["loads"] == policies[best]["loads"]
    assert "best_of" not in policies["fb"]
    for name in ("effective_rps.png", "latency_cdf.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000
    table = captured.out
    assert "peak eff RPS" in table
    assert any(line.startswith("fb ") for line in table.splitlines())
    assert f"sarathi ({best.split('@')[1]})" in table
    assert "4 requests" not in captured.err and "tuned (sarathi)" in captured.err


# ------------------------------------------------------------------ calibrate
def test_calibrate_writes_loadable_coefficients(tmp_path, capsys):
    path = tmp_path / "sub" / "coeffs.toml"
    assert main(["calibrate", "--profile", "llama3.1-8b-h100", "--out", str(path)]) == 0
    loaded = StepModelFile.load(path)
    profile = load_profile(bundled_profile_path("llama3.1-8b-h100"))
    assert loaded == offline_step_model(profile, "knee")
    assert loaded.model.form == "knee" and loaded.linear == offline_fit(profile)
    assert loaded.model.knee_tokens > 0 and loaded.model.e_s_per_pair > 0
    assert "knee_tokens" in capsys.readouterr().out
    linear_path = tmp_path / "linear.toml"
    assert main(["calibrate", "--form", "linear", "--out", str(linear_path)]) == 0
    assert StepCoefficients.load(linear_path) == offline_fit(profile)
    # and the file feeds back into a run as its initial step model
    out = tmp_path / "run"
    assert main(["run", "--policy", "fb-pab", "--rate", "4", *FAST, "--step-model", str(path),
                 "--out", str(out)]) == 0
    assert (out / "results.json").is_file()


# ------------------------------------------------------------------ user errors
def _user_error(argv, capsys) -> str:
    """Exit status 2, one ``error: ...`` line on stderr, no traceback, no output files."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("error: ")
    assert "Traceback" not in captured.err
    return lines[0]


def _argparse_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "error:" in last
    return last


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_unknown_policy_lists_the_valid_ones(command, tmp_path, capsys):
    line = _user_error([command, "--policy", "nope", *FAST, "--out", str(tmp_path / "o")], capsys)
    assert "'nope'" in line
    for name in POLICIES.names():
        assert name in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "policy, message",
    [
        ("fb@256", "takes no token budget"),
        ("sarathi@abc", "must be an integer"),
        ("sarathi@0", "must be >= 1"),
        ("sarathi@-5", "must be >= 1"),
    ],
)
def test_bad_policy_budget(policy, message, tmp_path, capsys):
    line = _user_error(["run", "--policy", policy, *FAST, "--out", str(tmp_path)], capsys)
    assert message in line


def test_unknown_format_is_an_argparse_error(tmp_path, capsys):
    last = _argparse_error(["run", "--format", "xml", "--out", str(tmp_path)], capsys)
    assert "invalid choice" in last and "azure" in last


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["run", "--ttft-ms", "0"], "--ttft-ms"),
        (["run", "--tpot-ms", "-5"], "--tpot-ms"),
        (["run", "--rate", "nan"], "--rate"),
        (["sweep", "--rates", "4,x"], "--rates"),
        (["sweep", "--budgets", "0,256"], "--budgets"),
        (["sweep", "--budgets", "a"], "--budgets"),
        (["run", "--arrivals", "gamma:-1"], "--arrivals"),
    ],
)
def test_bad_numbers_are_argparse_errors(argv, fragment, capsys):
    assert fragment in _argparse_error(argv, capsys)


def _azure(tmp_path: Path, rows: list[str]) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text("\n".join(["TIMESTAMP,ContextTokens,GeneratedTokens", *rows]) + "\n")
    return path


def test_malformed_trace_names_file_and_line(tmp_path, capsys):
    trace = _azure(tmp_path, [
        "2023-11-16 18:15:46.6805900,374,44",
        "2023-11-16 18:15:50.9951690,abc,109",
    ])
    line = _user_error(["run", "--trace", str(trace), "--out", str(tmp_path / "o")], capsys)
    assert f"{trace}:3:" in line and "ContextTokens" in line


def test_empty_trace_file(tmp_path, capsys):
    trace = tmp_path / "empty.csv"
    trace.write_text("")
    line = _user_error(["run", "--trace", str(trace), "--out", str(tmp_path / "o")], capsys)
    assert str(trace) in line and "empty" in line


def test_missing_trace_file(tmp_path, capsys):
    trace = tmp_path / "absent.csv"
    line = _user_error(["sweep", "--trace", str(trace), "--out", str(tmp_path / "o")], capsys)
    assert str(trace) in line


def test_profile_missing_a_field(tmp_path, capsys):
    source = (PROFILES_DIR / "llama3.1-8b-h100.toml").read_text().splitlines()
    kept = [line for line in source if not line.startswith("hbm_tb_s")]
    assert len(kept) == len(source) - 1
    profile = tmp_path / "broken.toml"
    profile.write_text("\n".join(kept) + "\n")
    line = _user_error(["run", "--profile", str(profile), *FAST, "--out", str(tmp_path / "o")],
                       capsys)
    assert str(profile) in line and "gpu.hbm_tb_s" in line


def test_unknown_bundled_profile(tmp_path, capsys):
    line = _user_error(["calibrate", "--profile", "no-such-gpu"], capsys)
    assert "no-such-gpu" in line and "llama3.1-8b-h100" in line


def test_slo_config_with_non_positive_target(tmp_path, capsys):
    slo = tmp_path / "slo.toml"
    slo.write_text('default_class = "a"\n[classes.a]\nttft_ms = 0\ntpot_ms = 50\n')
    line = _user_error(["run", "--slo-config", str(slo), *FAST, "--out", str(tmp_path / "o")],
                       capsys)
    assert str(slo) in line and "ttft_ms" in line


def test_missing_step_model_file(tmp_path, capsys):
    line = _user_error(["run", *FAST, "--step-model", str(tmp_path / "nope.toml"),
                        "--out", str(tmp_path / "o")], capsys)
    assert "nope.toml" in line


def test_trace_naming_an_unknown_slo_class(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 5, "slo_class": "vip"}\n'
        '{"arrival_s": 1, "prompt_tokens": 10, "output_tokens": 5}\n'
    )
    line = _user_error(["run", "--trace", str(trace), "--format", "jsonl",
                        "--out", str(tmp_path / "o")], capsys)
    assert "vip" in line


def test_non_positive_max_token_budget(tmp_path, capsys):
    line = _user_error(["run", "--max-token-budget", "0", *FAST, "--out", str(tmp_path)], capsys)
    assert "--max-token-budget" in line


def test_skip_seconds_runs_a_later_window(tmp_path):
    out = tmp_path / "run"
    assert main(["run", "--policy", "fb", "--rate", "8", "--skip-seconds", "200",
                 "--head-seconds", "20", "--out", str(out)]) == 0
    scenario = json.loads((out / "results.json").read_text())["scenario"]
    assert scenario["workload"].endswith("[200s:][:20s]")


def test_skip_seconds_past_the_trace_is_a_clean_error(tmp_path, capsys):
    line = _user_error(["run", "--skip-seconds", "100000", "--out", str(tmp_path)], capsys)
    assert "no request arrives 100000 s or later" in line


def test_unwritable_out_is_a_clean_error(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code = main(["run", "--policy", "fb", "--rate", "8", "--head-seconds", "20",
                 "--out", str(blocker / "sub")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error:") and "Traceback" not in err


# ------------------------------------------------------------------ admission and classes
@pytest.mark.slow
def test_admission_applies_to_the_fairbatching_family_only(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", "--policy", "fb-anchor-margin", "--policy", "sarathi@512",
            "--policy", "fb+reject:pab", "--admission", "defer", "--rates", "8", *FAST,
            "--jobs", "1", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    document = json.loads((out / "results.json").read_text())
    assert set(document["policies"]) == {"fb-anchor-margin+defer", "sarathi@512", "fb+reject:pab"}


def test_admission_without_a_fairbatching_policy_is_a_user_error(tmp_path, capsys):
    line = _user_error(["run", "--policy", "sarathi@512", "--admission", "reject", *FAST,
                        "--out", str(tmp_path / "x")], capsys)
    assert "FairBatching-family" in line


def test_plus_admission_on_a_baseline_is_a_user_error(tmp_path, capsys):
    line = _user_error(["run", "--policy", "sarathi@512+reject", *FAST,
                        "--out", str(tmp_path / "x")], capsys)
    assert "takes no +admission" in line


def test_contradicting_pab_name_is_a_user_error(tmp_path, capsys):
    line = _user_error(["run", "--policy", "fb-pab+defer", *FAST, "--out", str(tmp_path / "x")],
                       capsys)
    assert "only rejects" in line or "fb-pab" in line


@pytest.mark.parametrize("argv, fragment", [
    (["--admission", "drop"], "unknown admission mode"),
    (["--class-mix", "standard:0.5"], "sum to 1"),
    (["--class-mix", "standard"], "NAME:FRACTION"),
])
def test_bad_admission_and_class_mix_are_argparse_errors(argv, fragment, capsys):
    assert fragment in _argparse_error(["run", "--policy", "fb", *argv], capsys)


def test_class_mix_names_must_be_defined(tmp_path, capsys):
    line = _user_error(["run", "--policy", "fb", "--class-mix", "gold:1", *FAST,
                        "--out", str(tmp_path / "x")], capsys)
    assert "gold" in line and "interactive" in line


def test_class_mix_runs_and_reaches_the_requests(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["run", "--policy", "fb", "--admission", "reject", "--rate", "8",
            "--class-mix", "interactive:0.5,relaxed:0.5", *FAST, "--out", str(out)]
    assert main(argv) == 0
    document = json.loads((out / "results.json").read_text())
    assert "interactive:0.5,relaxed:0.5" in document["scenario"]["workload"]
