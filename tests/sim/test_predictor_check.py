"""``python -m sglang_ext.sim predictor-check``: held-out and online errors of the step-time
predictors on a measured grid, and clear errors for a grid it cannot use."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_ext.sim.commands import main
from sglang_ext.sim.fitting.predictor_check import check_predictors, serving_order
from sglang_ext.sim.fitting.step_grid import GridError, read_grid

GRID = Path(__file__).resolve().parents[1] / "fixtures" / "gpu" / "llama3.1-8b-h100.csv"


def test_knee_beats_linear_on_the_measured_grid(capsys, tmp_path) -> None:
    figures = tmp_path / "check.json"
    assert main(["predictor-check", "--grid", str(GRID), "--json", str(figures)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("best: knee MAPE ")
    check = check_predictors(read_grid(GRID))
    knee, linear = (next(f for f in check.forms if f.form == name) for name in ("knee", "linear"))
    assert knee.held_out["all"].mape < 0.08 < linear.held_out["all"].mape
    assert knee.online.mape < 0.10
    assert knee.online.rows == 209 - 50 and knee.held_out["all"].rows == 209 - 139
    assert out[-1] == f"best: knee MAPE {knee.held_out['all'].mape * 100:.1f}%"
    assert '"best": "knee"' in figures.read_text()


def test_the_serving_order_streams_every_row_once_in_decode_stretches() -> None:
    rows = read_grid(GRID)
    stream = serving_order(rows, seed=3)
    assert sorted(r.line for r in stream) == sorted(r.line for r in rows)
    assert stream == serving_order(rows, seed=3)
    assert stream != serving_order(rows, seed=4)
    assert [r.kind for r in stream[:4]] == ["decode"] * 4


def _error(argv, capsys) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""
    return captured.err


def test_a_malformed_grid_is_refused_naming_the_line(tmp_path, capsys) -> None:
    lines = GRID.read_text().splitlines()
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join([lines[0], lines[1], lines[2].replace(",1,", ",x,", 1), *lines[3:20]]))
    err = _error(["predictor-check", "--grid", str(bad)], capsys)
    assert "line 3" in err and "is not an integer" in err
    bad.write_text("\n".join([lines[0], lines[1].replace("decode", "verify")]))
    assert "line 2: column kind" in _error(["predictor-check", "--grid", str(bad)], capsys)
    bad.write_text(lines[0].replace("graph_ms,", "") + "\n")
    assert "missing column(s) graph_ms" in _error(["predictor-check", "--grid", str(bad)], capsys)
    missing = tmp_path / "missing.csv"
    assert "cannot read" in _error(["predictor-check", "--grid", str(missing)], capsys)


def test_too_few_rows_are_refused_with_the_reason(tmp_path, capsys) -> None:
    lines = GRID.read_text().splitlines()
    few = tmp_path / "few.csv"
    few.write_text("\n".join(lines[:8]))
    assert "too few rows" in _error(["predictor-check", "--grid", str(few)], capsys)
    only_decodes = tmp_path / "decodes.csv"
    only_decodes.write_text("\n".join(lines[:39]))  # the grid's 38 decode rows
    err = _error(["predictor-check", "--grid", str(only_decodes), "--warmup", "5"], capsys)
    assert "causal-pairs term" in err or "no prefill steps" in err


def test_read_grid_checks_the_derived_columns(tmp_path) -> None:
    lines = GRID.read_text().splitlines()
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join([lines[0], lines[1].replace(",1,128,1,", ",1,128,7,")]))
    with pytest.raises(GridError, match="new_tokens: must equal"):
        read_grid(bad)
