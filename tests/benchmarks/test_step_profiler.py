""":mod:`benchmarks.gpu.step_profiler` on the CPU with the built-in tiny model: the grid it writes reads
back with :func:`read_grid`, a stop (``--max-seconds``, SIGTERM) leaves a valid grid and says
so, out-of-memory shapes are skipped, user mistakes get one-line errors; and the varlen
packing agrees with per-sequence SDPA (checked against a reference ``varlen_attn``)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import benchmarks.gpu.step_profiler as pg  # noqa: E402
from sglang_ext.sim.fitting.step_grid import GRID_KINDS, read_grid  # noqa: E402

SMALL = ["--model", "tiny", "--device", "cpu", "--max-tokens", "64", "--max-context", "256",
         "--random", "4"]
LLAMA = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}


def write_config(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "model" / "config.json"
    path.parent.mkdir(exist_ok=True)
    config = {key: value for key, value in {**LLAMA, **changes}.items() if value is not None}
    path.write_text(json.dumps(config))
    return path


@pytest.mark.slow
def test_the_tiny_cpu_grid_reads_back_with_every_kind(tmp_path: Path, capsys) -> None:
    out = tmp_path / "grid.csv"
    assert pg.main([*SMALL, "--out", str(out)]) == 0
    rows = read_grid(out)
    assert {row.kind for row in rows} == set(GRID_KINDS)
    for row in rows:
        assert row.new_tokens == row.prefill_tokens + row.n_decode
        assert (row.n_prefill == 0) == (row.prefill_tokens == 0)
        if row.n_prefill == 1:
            n, prefix = row.prefill_tokens, row.prefill_prefix
            assert row.prefill_pairs == pytest.approx(n * (prefix + (n + 1) / 2))
        assert row.new_tokens <= 64 and row.graph_p10 <= row.graph_ms <= row.graph_p90
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["status"] == "complete" and meta["stopped"] is None
    assert meta["shapes"] == meta["planned"] == len(rows)
    assert meta["graph"] == pg.CPU_GRAPH_NOTE
    assert meta["config"] == {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2,
                              "head_dim": 16, "inter": 128, "vocab": 256, "tied": False}
    assert meta["limits"]["max_tokens"] == 64 and meta["seed"] == 0
    assert "complete" in capsys.readouterr().out


def test_max_seconds_stops_after_the_shape_in_progress(tmp_path: Path) -> None:
    out = tmp_path / "grid.csv"
    assert pg.main([*SMALL, "--out", str(out), "--max-seconds", "0.001"]) == 0
    rows = read_grid(out)
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["status"] == "stopped early" and meta["stopped"].startswith("max-seconds")
    assert meta["shapes"] == len(rows) == 1 < meta["planned"]


def test_a_signal_stops_the_run_after_the_shape_in_progress(tmp_path: Path) -> None:
    grid = pg.build_grid(pg.Limits(64, 256, 2048, 0, 0))
    timing = pg.Timing(1.0, 0.9, 1.1, 2.0, 2.2)
    calls = []

    def measure(batch: pg.Batch) -> pg.Timing:
        calls.append(batch)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return timing

    stop, before = pg.Stop(), signal.getsignal(signal.SIGTERM)
    restore = pg.stop_on_signals(stop)
    try:
        meta = pg.profile(grid, measure, tmp_path / "grid.csv", {}, stop, 0.0, None)
    finally:
        restore()
    assert len(read_grid(tmp_path / "grid.csv")) == meta["shapes"] == len(calls) == 2
    assert meta["stopped"] == "SIGTERM" and meta["status"] == "stopped early"
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_shape_out_of_memory_is_skipped_and_noted(tmp_path: Path) -> None:
    grid = pg.build_grid(pg.Limits(64, 256, 2048, 0, 0))[:3]

    def measure(batch: pg.Batch) -> pg.Timing:
        if batch is grid[1]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return pg.Timing(1.0, 0.9, 1.1, 2.0, 2.2)

    meta = pg.profile(grid, measure, tmp_path / "grid.csv", {}, pg.Stop(), 0.0, None)
    assert len(read_grid(tmp_path / "grid.csv")) == meta["shapes"] == 2
    assert meta["skipped"] == [{**grid[1].columns(), "error": "out of memory"}]
    assert meta["status"] == "complete"


def test_the_grid_keeps_to_its_limits_and_its_seed() -> None:
    limits = pg.Limits(max_tokens=16384, max_context=32768, max_kv=393216, random=90, seed=3)
    grid = pg.build_grid(limits)
    assert {b.kind for b in grid} == set(GRID_KINDS)
    assert sum(b.kind == "random" for b in grid) == 90
    assert all(limits.admit(b) for b in grid)
    assert grid == pg.build_grid(limits)
    assert grid != pg.build_grid(pg.Limits(16384, 32768, 393216, 90, seed=4))


def test_the_derived_columns_of_several_chunks() -> None:
    batch = pg.Batch("random", (pg.Chunk(4, 10), pg.Chunk(3)), (7, 9))
    columns = batch.columns()
    assert columns["prefill_pairs"] == f"{4 * (10 + 5 / 2) + 3 * (0 + 4 / 2):.4f}"
    assert (columns["prefill_tokens"], columns["prefill_prefix"], columns["decode_ctx"],
            columns["new_tokens"]) == (7, 10, 16, 9)
    assert batch.kv_tokens == 10 + 7 + 16


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
                          window_size=(-1, -1), enable_gqa=False, num_splits=None):
    """``varlen_attn`` written out: explicit bottom-right causal masks, repeated KV heads."""
    group = query.shape[1] // key.shape[1]
    out = []
    for i in range(len(cu_seq_q) - 1):
        q = query[cu_seq_q[i]:cu_seq_q[i + 1]].transpose(0, 1)
        k, v = (t[cu_seq_k[i]:cu_seq_k[i + 1]].repeat_interleave(group, 1).transpose(0, 1)
                for t in (key, value))
        rows, keys = q.shape[1], k.shape[1]
        mask = torch.ones(rows, keys, dtype=torch.bool)
        if window_size == (-1, 0):
            mask = mask.tril(keys - rows)
        scores = (q @ k.transpose(1, 2)) / q.shape[-1] ** 0.5
        out.append((scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(0, 1))
    return torch.cat(out)


def test_varlen_packing_agrees_with_per_sequence_sdpa() -> None:
    shape = pg.ModelShape(layers=1, hidden=64, heads=8, kv_heads=2, head_dim=8, inter=16,
                          vocab=8, tied=False)
    lay = pg.layout(pg.Batch("random", (pg.Chunk(5, 3), pg.Chunk(7)), (9, 4, 1)))
    q = torch.randn(len(lay.positions), shape.heads, shape.head_dim)
    keys, values = (torch.randn(lay.slots, shape.kv_heads, shape.head_dim) for _ in range(2))
    varlen = pg.varlen_attention(reference_varlen_attn)
    assert varlen.name == ("torch.nn.attention.varlen.varlen_attn(('window_size', 'enable_gqa', "
                           "'num_splits')), decode GQA-packed")
    expected = pg.sdpa_attention(lay, shape, q.device)(q, keys, values)
    got = varlen.bind(lay, shape, q.device)(q, keys, values)
    assert torch.allclose(got, expected, atol=1e-5)


def test_the_step_runs_and_writes_each_layers_window() -> None:
    model = pg.build_model(pg.TINY, torch.device("cpu"))
    batch = pg.Batch("mixed", (pg.Chunk(6, 2),), (5, 3))
    pool = pg.build_pool(model, batch.kv_tokens)
    before = pool.keys.clone()
    with torch.inference_mode():
        tokens = pg.make_step(model, pool, pg.SDPA, batch)()
    assert tokens.shape == (3,) and int(tokens.max()) < pg.TINY.vocab
    written = (pool.keys != before).any(-1).any(-1).nonzero().flatten().tolist()
    assert written == list(pg.layout(batch).write_slots)


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_local_experts": 8}, "num_local_experts = 8: a mixture-of-experts model"),
    ({"moe_intermediate_size": 1408}, "moe_intermediate_size = 1408"),
    ({"intermediate_size": None}, "intermediate_size is missing"),
    ({"num_attention_heads": "32"}, "num_attention_heads '32' is not a positive integer"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
])
def test_a_config_it_cannot_profile_is_refused_in_one_line(tmp_path: Path, capsys, changes,
                                                            message) -> None:
    config = write_config(tmp_path, **changes)
    argv = ["--config", str(config), "--device", "cpu", "--out", str(tmp_path / "g.csv")]
    assert pg.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and str(config) in err
    assert not (tmp_path / "g.csv").exists()


def test_a_dense_config_takes_defaults_for_optional_keys() -> None:
    shape = pg.model_shape({**LLAMA, "num_key_value_heads": None, "num_experts": 0})
    assert (shape.kv_heads, shape.head_dim, shape.tied) == (4, 16, False)
    assert pg.model_shape({**LLAMA, "head_dim": 32, "tie_word_embeddings": True}).head_dim == 32


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_device_cuda_without_cuda_is_refused(tmp_path: Path, capsys) -> None:
    assert pg.main(["--model", "tiny", "--device", "cuda", "--out", str(tmp_path / "g.csv")]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: CUDA is not available" in err and len(err.strip().splitlines()) == 1
