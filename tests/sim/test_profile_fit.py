"""The roofline's optional refinements, the profile fit, and the bundled measured profile."""

from __future__ import annotations

import dataclasses
import filecmp
import json
import re
import tomllib
from pathlib import Path

import pytest

from sglang_ext.sim.gpu import RooflineGpu, StepShape
from sglang_ext.sim.profile import (
    HardwareProfile,
    ProfileError,
    bundled_profile_path,
    load_profile,
    parse_profile,
)
from sglang_ext.sim.fitting.profile_fit import (
    FIT_FIELDS,
    fit_profile,
    fitted_profile_toml,
    profile_toml,
    residuals,
    with_vocabulary,
)
from sglang_ext.sim.fitting.step_grid import GridRow, read_grid

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gpu"
GRID = FIXTURES / "llama3.1-8b-h100.csv"
SHARED_GRID = Path(__file__).resolve().parents[3] / "shared" / "data" / "gpu" / GRID.name
MEASURED = "llama3.1-8b-h100-measured"


@pytest.fixture(scope="module")
def rows() -> list[GridRow]:
    return read_grid(GRID)


@pytest.fixture(scope="module")
def llama() -> HardwareProfile:
    return load_profile(bundled_profile_path("llama3.1-8b-h100"))


@pytest.fixture(scope="module")
def fit_base(llama) -> HardwareProfile:
    config = json.loads(GRID.with_suffix(".json").read_text())["config"]
    return dataclasses.replace(
        llama, model=with_vocabulary(llama.model, config["vocab"], tied=config["tied"])
    )


def _set(profile: HardwareProfile, **dotted: object) -> HardwareProfile:
    sections: dict[str, dict[str, object]] = {}
    for name, value in dotted.items():
        section, key = name.split("__")
        sections.setdefault(section, {})[key] = value
    return dataclasses.replace(
        profile,
        **{s: dataclasses.replace(getattr(profile, s), **v) for s, v in sections.items()},
    )


# ------------------------------------------------ unchanged profiles: bit-identical step times

SHAPES = {
    "decode 1x1024": StepShape.from_requests((), [1024]),
    "decode 64x1024": StepShape.from_requests((), [1024] * 64),
    "decode 256x1024": StepShape.from_requests((), [1024] * 256),
    "prefill 2048": StepShape.from_requests([(2048, 0)]),
    "prefill 512 after 8192": StepShape.from_requests([(512, 8192)]),
    "prefill 2048 + 128x1024": StepShape.from_requests([(2048, 0)], [1024] * 128),
    "2x256 + 8x4096": StepShape.from_requests([(256, 0), (256, 1024)], [4096] * 8),
}

# Computed before the optional fields existed; the defaults must keep them to the last bit.
PINNED = {
    "llama3.1-8b-h100": {
        "decode 1x1024": 0.006379259966832505,
        "decode 64x1024": 0.00969054832504146,
        "decode 256x1024": 0.020394091060150162,
        "prefill 2048": 0.05010655337092012,
        "prefill 512 after 8192": 0.016161252852832587,
        "prefill 2048 + 128x1024": 0.058303655621889966,
        "2x256 + 8x4096": 0.014634634352828853,
    },
    "qwen3-14b-h20": {
        "decode 1x1024": 0.009963275294117646,
        "decode 64x1024": 0.021939814901960782,
        "decode 256x1024": 0.08415925960784314,
        "prefill 2048": 0.5628262502630631,
        "prefill 512 after 8192": 0.16966527688648647,
        "prefill 2048 + 128x1024": 0.5989509185729729,
        "2x256 + 8x4096": 0.14260872717837839,
    },
}
PINNED_NOISY = {  # measure_step_s, seed 7, on the first three shapes in order
    "llama3.1-8b-h100": [0.0063766252681178495, 0.009430821946936114, 0.020421729653775682],
    "qwen3-14b-h20": [0.009959160360920434, 0.02135178329944942, 0.08427331438818444],
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_unchanged_profiles_keep_their_step_times_bit_for_bit(name):
    profile = load_profile(bundled_profile_path(name))
    gpu = RooflineGpu(profile)
    assert {label: gpu.ideal_step_s(shape) for label, shape in SHAPES.items()} == PINNED[name]
    noisy = RooflineGpu(profile, seed=7)
    assert [noisy.measure_step_s(shape) for shape in list(SHAPES.values())[:3]] == (
        PINNED_NOISY[name]
    )


def test_optional_fields_at_their_defaults_are_the_plain_roofline(llama):
    spelled_out = _set(
        llama,
        model__embedding_params=0.0,
        model__lm_head_params=0,
        gpu__attention_compute_efficiency=llama.gpu.compute_efficiency,
        gpu__attention_bandwidth_efficiency=llama.gpu.bandwidth_efficiency,
        gpu__attention_saturation_tiles=0.0,
        gpu__attention_tile_queries=64,
        runtime__prefill_overhead_ms=0.0,
        runtime__attention_kernels="batch",
    )
    plain, explicit = RooflineGpu(llama), RooflineGpu(spelled_out)
    for shape in SHAPES.values():
        assert explicit.ideal_step_s(shape) == plain.ideal_step_s(shape)


# ------------------------------------------------------------- the refinements, one at a time


def test_occupancy_slows_a_small_decode_batch_to_its_blocks_share(llama):
    profile = _set(
        llama, gpu__attention_saturation_tiles=128.0, runtime__attention_kernels="split"
    )
    gpu = RooflineGpu(profile)
    kv_s = gpu.breakdown(StepShape.from_requests((), [16384])).attention_s
    full_s = RooflineGpu(llama).breakdown(StepShape.from_requests((), [16384])).attention_s
    assert kv_s == pytest.approx(full_s * 128 / llama.model.num_kv_heads)  # 8 of 128 blocks
    big = StepShape.from_requests((), [1024] * 64)  # 512 blocks: the full roof
    full = RooflineGpu(llama).breakdown(big).attention_s
    assert gpu.breakdown(big).attention_s == pytest.approx(full)


def test_split_attention_adds_the_prefill_and_decode_rooflines(llama):
    mixed = StepShape.from_requests([(2048, 0)], [1024] * 64)
    batch = RooflineGpu(llama).breakdown(mixed)
    split = RooflineGpu(_set(llama, runtime__attention_kernels="split")).breakdown(mixed)
    prefill = RooflineGpu(llama).breakdown(StepShape.from_requests([(2048, 0)]))
    decode = RooflineGpu(llama).breakdown(StepShape.from_requests((), [1024] * 64))
    # the prefill is compute-bound, the decodes memory-bound: one kernel overlaps them
    assert batch.attention_s < split.attention_s
    assert split.attention_s == pytest.approx(prefill.attention_s + decode.attention_s)


def test_lm_head_runs_once_per_sequence_and_prefill_overhead_once_per_step(llama):
    head = 5e8
    profile = _set(
        llama, model__embedding_params=head, model__lm_head_params=head,
        runtime__prefill_overhead_ms=0.5,
    )
    gpu = RooflineGpu(profile)
    one, four = StepShape.from_requests([(4096, 0)]), StepShape.from_requests([(1024, 0)] * 4)
    flops_s = 1.0 / profile.gpu.effective_flops
    extra = gpu.breakdown(four).linear_compute_s - gpu.breakdown(one).linear_compute_s
    assert extra == pytest.approx(3 * 2 * head * flops_s)
    assert gpu.breakdown(one).overhead_s == pytest.approx(1e-3 + 0.5e-3 + 8e-6)
    assert gpu.breakdown(four).overhead_s == pytest.approx(1e-3 + 0.5e-3 + 4 * 8e-6)
    decode = gpu.breakdown(StepShape.from_requests((), [100]))
    assert decode.overhead_s == pytest.approx(1e-3 + 8e-6)  # no prefill: no prefill overhead


# ------------------------------------------------------------------- validation of new fields


def _bundled_data() -> dict:
    return tomllib.loads(bundled_profile_path("llama3.1-8b-h100").read_text())


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("model", "embedding_params", -1.0, "model.embedding_params must be >= 0"),
        ("model", "lm_head_params", "big", "model.lm_head_params must be a number"),
        ("gpu", "attention_compute_efficiency", 0.0,
         "gpu.attention_compute_efficiency must be in (0, 1]"),
        ("gpu", "attention_bandwidth_efficiency", 1.5,
         "gpu.attention_bandwidth_efficiency must be in (0, 1]"),
        ("gpu", "attention_saturation_tiles", -4, "gpu.attention_saturation_tiles must be >= 0"),
        ("gpu", "attention_tile_queries", 0, "gpu.attention_tile_queries must be > 0"),
        ("gpu", "attention_tile_queries", 64.5, "gpu.attention_tile_queries must be an integer"),
        ("runtime", "prefill_overhead_ms", -0.1, "runtime.prefill_overhead_ms must be >= 0"),
        ("runtime", "prefill_overhead_ms", True, "runtime.prefill_overhead_ms must be a number"),
        ("runtime", "attention_kernels", "fused",
         "runtime.attention_kernels must be one of 'batch', 'split'"),
        ("runtime", "attention_kernels", 2, "runtime.attention_kernels must be one of"),
    ],
)
def test_new_fields_refuse_bad_values_naming_the_field(section, key, value, message):
    data = _bundled_data()
    data[section][key] = value
    with pytest.raises(ProfileError, match=re.escape(f"bad.toml: field {message}")):
        parse_profile(data, "bad.toml")


def test_embedding_and_lm_head_must_leave_some_parameters(llama):
    with pytest.raises(ProfileError, match=r"model\.embedding_params .* model\.lm_head_params"):
        dataclasses.replace(llama.model, embedding_params=4e9, lm_head_params=4.03e9)
    data = _bundled_data()
    data["model"]["lm_head_params"] = 9e9
    with pytest.raises(ProfileError, match=r"^bad\.toml: fields model\.embedding_params"):
        parse_profile(data, "bad.toml")


# ----------------------------------------------------------------------------------- the fit


TRUTH = {
    "gpu__compute_efficiency": 0.6,
    "gpu__attention_compute_efficiency": 0.4,
    "gpu__attention_bandwidth_efficiency": 0.7,
    "gpu__attention_saturation_tiles": 150.0,
    "runtime__step_overhead_ms": 2.0,
    "runtime__per_request_overhead_us": 5.0,
    "runtime__prefill_overhead_ms": 0.5,
}


def test_fit_recovers_the_parameters_of_a_synthetic_gpu(rows, fit_base):
    truth = _set(fit_base, runtime__attention_kernels="split", **TRUTH)
    gpu = RooflineGpu(truth)
    synthetic = [dataclasses.replace(r, graph_ms=gpu.ideal_step_s(r.shape) * 1e3) for r in rows]
    fit = fit_profile(synthetic, fit_base, "synthetic")
    assert fit.fitted == tuple(f.dotted for f in FIT_FIELDS)
    for name, value in TRUTH.items():
        section, key = name.split("__")
        assert getattr(getattr(fit.profile, section), key) == pytest.approx(value, rel=1e-3), name
    assert fit.profile.runtime.attention_kernels == "split"
    assert fit.residual("all").p90_abs_pct < 0.1
    assert fit.mean_abs_log_error < 1e-3


def test_fit_is_deterministic_and_keeps_the_base_runtime(rows, fit_base):
    first, second = fit_profile(rows, fit_base, "x"), fit_profile(rows, fit_base, "x")
    assert first == second
    r, b = first.profile.runtime, fit_base.runtime
    assert (r.noise_sigma, r.stall_probability, r.stall_ms_min, r.stall_ms_max) == (
        b.noise_sigma, b.stall_probability, b.stall_ms_min, b.stall_ms_max
    )
    assert (r.mem_fraction_static, r.activation_reserve_gb) == (
        b.mem_fraction_static, b.activation_reserve_gb
    )
    assert first.profile.gpu.bandwidth_efficiency == fit_base.gpu.bandwidth_efficiency
    assert first.profile.model == fit_base.model


def test_fit_refuses_bad_input(fit_base):
    with pytest.raises(ValueError, match="at least one grid row"):
        fit_profile([], fit_base, "x")
    with pytest.raises(ValueError, match="attention_kernels"):
        fit_profile(read_grid(GRID)[:3], fit_base, "x", attention_kernels="fused")


def test_residuals_report_each_kind_then_all(rows, llama):
    table = residuals(llama, rows)
    assert [r.kind for r in table] == ["decode", "prefill", "mixed", "random", "all"]
    assert [r.rows for r in table] == [38, 30, 51, 90, 209]
    overall = table[-1]
    assert overall.median_signed_pct < -20  # the hand-written profile is ~23% fast
    assert overall.median_abs_pct <= overall.p90_abs_pct <= abs(overall.worst_pct)


def test_profile_toml_round_trips_with_header_and_notes(rows, fit_base):
    fit = fit_profile(rows, fit_base, "round-trip")
    text = fitted_profile_toml(fit, grid="grid.csv", command="python fit.py --grid grid.csv")
    assert text.startswith("# round-trip: ")
    assert "grid.csv, 209 rows" in text and "python fit.py --grid grid.csv" in text
    for field in FIT_FIELDS:
        assert re.search(rf"^{field.key} = \S+  # fitted$", text, re.MULTILINE), field.dotted
    assert parse_profile(tomllib.loads(text), "round-trip.toml") == fit.profile
    plain = profile_toml(fit_base)
    assert "attention_compute_efficiency" not in plain  # unset optional fields are left out
    assert parse_profile(tomllib.loads(plain)) == fit_base


# ---------------------------------------------------------------- the bundled measured profile


def test_measured_profile_meets_the_grid_within_five_percent_median(rows, llama):
    measured = load_profile(bundled_profile_path(MEASURED))
    assert measured.name == MEASURED
    table = {r.kind: r for r in residuals(measured, rows)}
    assert abs(table["all"].median_signed_pct) <= 5.0
    for kind in ("decode", "prefill", "mixed", "random"):
        assert abs(table[kind].median_signed_pct) <= 5.0, kind
    assert table["all"].median_abs_pct < 5.0
    r, b = measured.runtime, llama.runtime
    assert (r.noise_sigma, r.stall_probability, r.stall_ms_min, r.stall_ms_max,
            r.mem_fraction_static, r.activation_reserve_gb) == (
        b.noise_sigma, b.stall_probability, b.stall_ms_min, b.stall_ms_max,
        b.mem_fraction_static, b.activation_reserve_gb)
    assert measured.kv_capacity_tokens == llama.kv_capacity_tokens


def test_measured_profile_is_what_the_fit_gives(rows, fit_base):
    bundled = load_profile(bundled_profile_path(MEASURED))
    fit = fit_profile(rows, fit_base, MEASURED)
    for field in FIT_FIELDS:
        section, key = field.section, field.key
        got = getattr(getattr(fit.profile, section), key)
        want = getattr(getattr(bundled, section), key)
        assert got == pytest.approx(want, rel=2e-3), field.dotted
    assert dataclasses.replace(fit.profile, gpu=bundled.gpu, runtime=bundled.runtime) == bundled


@pytest.mark.skipif(not SHARED_GRID.is_file(), reason="../shared/data/gpu is not checked out")
def test_fixture_grid_is_the_shared_one():
    assert filecmp.cmp(GRID, SHARED_GRID, shallow=False)
    assert filecmp.cmp(GRID.with_suffix(".json"), SHARED_GRID.with_suffix(".json"), shallow=False)
