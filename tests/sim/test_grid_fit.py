"""``python -m sglang_ext.sim fit-grid``: a measured grid becomes a simulator profile and a
step-model file; the grid's model comes from its sidecar, the GPU from the base profile."""

from __future__ import annotations

import json
import shutil
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from sglang_ext.policy.step_model import StepModelFile
from sglang_ext.sim.commands import main
from sglang_ext.sim.fitting.grid_fit import base_for_grid, model_from_config, read_grid_meta
from sglang_ext.sim.profile import bundled_profile_path, load_profile
from sglang_ext.sim.fitting.step_grid import GridError, read_grid

GRID = Path(__file__).resolve().parents[1] / "fixtures" / "gpu" / "llama3.1-8b-h100.csv"
LLAMA = json.loads(GRID.with_suffix(".json").read_text())["config"]
# mistralai/Mistral-Nemo-Base-2407 config.json (12.2B parameters on its model card)
NEMO = {"layers": 40, "hidden": 5120, "heads": 32, "kv_heads": 8, "head_dim": 128,
        "inter": 14336, "vocab": 131072, "tied": False}


@pytest.mark.slow
def test_the_bundled_measured_profile_is_what_fit_grid_writes(tmp_path, capsys) -> None:
    profile_path, step_path = tmp_path / "p.toml", tmp_path / "s.toml"
    argv = ["fit-grid", "--grid", str(GRID), "--base", "llama3.1-8b-h100",
            "--name", "llama3.1-8b-h100-measured",
            "--out-profile", str(profile_path), "--out-step-model", str(step_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "median error +0.2%" in out and "knee step model" in out
    assert load_profile(profile_path) == load_profile(
        bundled_profile_path("llama3.1-8b-h100-measured"))

    fitted = StepModelFile.load(step_path)
    assert fitted.model.form == "knee" and fitted.linear.form == "linear"
    rows = read_grid(GRID)
    errors = [abs(fitted.model.predict_step(r.shape) - r.seconds) / r.seconds for r in rows]
    linear = [abs(fitted.linear.predict_step(r.shape) - r.seconds) / r.seconds for r in rows]
    assert sum(errors) / len(errors) < 0.08 < sum(linear) / len(linear)
    recorded = tomllib.loads(step_path.read_text())["fit"]
    assert recorded["mean_abs_rel_error"] == pytest.approx(sum(errors) / len(errors))
    assert recorded["max_abs_rel_error"] == pytest.approx(max(errors))

    assert main([*argv[:-4], "--form", "linear", "--out-profile", str(profile_path),
                 "--out-step-model", str(step_path)]) == 0
    assert StepModelFile.load(step_path).model.form == "linear"


def test_a_model_from_the_sidecar_counts_its_parameters() -> None:
    llama = model_from_config(LLAMA, "llama")
    assert llama.num_params == pytest.approx(8.03e9, rel=0.001)  # the model card's count
    assert llama.lm_head_params == llama.embedding_params == 128256 * 4096
    nemo = model_from_config(NEMO, "nemo")
    assert nemo.num_params == pytest.approx(12.2e9, rel=0.01)
    tied = model_from_config(dict(NEMO, tied=True), "nemo-tied")
    assert tied.embedding_params == 0 and tied.lm_head_params == 131072 * 5120
    assert nemo.num_params - tied.num_params == 131072 * 5120


def test_the_grid_model_replaces_the_base_model_only_when_it_differs() -> None:
    base = load_profile(bundled_profile_path("llama3.1-8b-h100"))
    same = base_for_grid(base, {"config": LLAMA})
    assert same.model == replace(base.model, embedding_params=128256 * 4096,
                                 lm_head_params=128256 * 4096)
    other = base_for_grid(base, {"model": "mistral-nemo-12b", "config": NEMO})
    assert other.model.name == "mistral-nemo-12b" and other.model.num_layers == 40
    assert other.gpu == base.gpu and other.runtime == base.runtime
    assert base_for_grid(base, {}) is base


def _error(argv, capsys) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""
    return captured.err


def test_a_sidecar_it_cannot_use_is_refused_and_nothing_is_written(tmp_path, capsys) -> None:
    grid = tmp_path / "grid.csv"
    shutil.copy(GRID, grid)
    outputs = ["--out-profile", str(tmp_path / "p.toml"), "--out-step-model", str(tmp_path / "s.toml")]
    argv = ["fit-grid", "--grid", str(grid), "--base", "llama3.1-8b-h100", *outputs]
    grid.with_suffix(".json").write_text("{not json")
    assert "grid.json: not JSON" in _error(argv, capsys)
    grid.with_suffix(".json").write_text(json.dumps({"config": dict(NEMO, inter=None)}))
    assert "grid config: inter must be positive integers" in _error(argv, capsys)
    grid.with_suffix(".json").write_text(json.dumps({"config": {"layers": 40}}))
    assert "grid config lacks hidden" in _error(argv, capsys)
    assert "no bundled profile named 'no-such-gpu'" in _error(
        [*argv[:3], "--base", "no-such-gpu", *outputs], capsys)
    assert not (tmp_path / "p.toml").exists() and not (tmp_path / "s.toml").exists()
    grid.with_suffix(".json").write_text("[]")
    with pytest.raises(GridError, match="expected a JSON object"):
        read_grid_meta(grid)
