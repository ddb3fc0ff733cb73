"""Tests for the hardware profiles and the roofline GPU model (fast, numpy only)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from sglang_ext.sim.gpu import RooflineGpu, StepShape
from sglang_ext.sim.profile import (
    GpuSpec,
    HardwareProfile,
    ModelSpec,
    ProfileError,
    RuntimeSpec,
    available_profiles,
    bundled_profile_path,
    load_profile,
)

BUNDLED = ["llama3.1-8b-h100", "qwen3-14b-h20"]


@pytest.fixture(scope="module")
def llama() -> HardwareProfile:
    return load_profile(bundled_profile_path("llama3.1-8b-h100"))


@pytest.fixture(scope="module")
def qwen() -> HardwareProfile:
    return load_profile(bundled_profile_path("qwen3-14b-h20"))


def decode(batch: int, ctx: int) -> StepShape:
    return StepShape.from_requests((), [ctx] * batch)


def prefill(n: int, prefix: int = 0) -> StepShape:
    return StepShape.from_requests([(n, prefix)])


# ------------------------------------------------------------------------------ profiles


def test_bundled_profiles_listed_and_load():
    names = available_profiles()
    for name in BUNDLED:
        assert name in names
        prof = load_profile(bundled_profile_path(name))
        assert prof.name == name
        assert prof.memory_gb == prof.gpu.memory_gb
    assert bundled_profile_path("llama3.1-8b-h100.toml") == bundled_profile_path("llama3.1-8b-h100")


def test_unknown_bundled_profile_lists_available():
    with pytest.raises(ProfileError) as exc:
        bundled_profile_path("no-such-profile")
    assert "llama3.1-8b-h100" in str(exc.value)


def test_llama_kv_bytes_and_capacity(llama):
    m = llama.model
    assert m.kv_bytes_per_token == 131072  # 2 * 32 * 8 * 128 * 2 B = 128 KiB
    assert m.weight_bytes == pytest.approx(16.06e9)
    expected = math.floor((80e9 * 0.88 - 16.06e9 - 1.0e9) / 131072)
    assert llama.kv_capacity_tokens == expected
    assert 300_000 < llama.kv_capacity_tokens < 600_000


def test_qwen_kv_bytes_and_capacity(qwen):
    assert qwen.model.kv_bytes_per_token == 163840  # 2 * 40 * 8 * 128 * 2
    assert 200_000 < qwen.kv_capacity_tokens < 500_000


def test_dataclass_validation_in_code():
    with pytest.raises(ProfileError, match="model.num_layers"):
        ModelSpec("m", 0, 4096, 32, 8, 128, 8e9)
    with pytest.raises(ProfileError, match="model.num_kv_heads"):
        ModelSpec("m", 32, 4096, 32, 5, 128, 8e9)
    with pytest.raises(ProfileError, match="gpu.compute_efficiency"):
        GpuSpec("g", 80, 3.35, 989, 1.5, 0.9)
    with pytest.raises(ProfileError, match="runtime.stall_ms_max"):
        RuntimeSpec(1.0, 8.0, 0.88, 1.0, 0.03, 0.001, 50.0, 10.0)


def test_weights_do_not_fit_rejected():
    model = ModelSpec("big", 80, 8192, 64, 8, 128, 70e9)
    gpu = GpuSpec("small", 80, 3.35, 989, 0.7, 0.9)
    rt = RuntimeSpec(1.0, 8.0, 0.88, 1.0, 0.03, 0.0005, 10, 50)
    with pytest.raises(ProfileError, match="KV"):
        HardwareProfile("x", model, gpu, rt)


# ------------------------------------------------------------------------------ loader errors


def _write_variant(tmp_path: Path, edit) -> Path:
    text = bundled_profile_path("llama3.1-8b-h100").read_text()
    path = tmp_path / "profile.toml"
    path.write_text(edit(text))
    return path


def _drop_line(text: str, key: str) -> str:
    lines = [ln for ln in text.splitlines() if not ln.startswith(f"{key} =")]
    return "\n".join(lines) + "\n"


def test_missing_field(tmp_path):
    path = _write_variant(tmp_path, lambda t: _drop_line(t, "num_layers"))
    with pytest.raises(ProfileError) as exc:
        load_profile(path)
    msg = str(exc.value)
    assert "profile.toml" in msg and "missing field model.num_layers" in msg


def test_missing_table(tmp_path):
    def drop_runtime(t: str) -> str:
        return t.split("[runtime]")[0]

    path = _write_variant(tmp_path, drop_runtime)
    with pytest.raises(ProfileError, match=r"profile\.toml: missing table \[runtime\]"):
        load_profile(path)


def test_optional_field_defaults(tmp_path):
    path = _write_variant(tmp_path, lambda t: _drop_line(t, "kv_bytes_per_elem"))
    assert load_profile(path).model.kv_bytes_per_elem == 2.0


@pytest.mark.parametrize(
    "old,new,field",
    [
        ("num_layers = 32", 'num_layers = "32"', "model.num_layers"),
        ("num_layers = 32", "num_layers = 32.5", "model.num_layers"),
        ("num_layers = 32", "num_layers = true", "model.num_layers"),
        ("hbm_tb_s = 3.35", "hbm_tb_s = -3.35", "gpu.hbm_tb_s"),
        ("bf16_tflops = 989.0", "bf16_tflops = 0", "gpu.bf16_tflops"),
        ("mem_fraction_static = 0.88", "mem_fraction_static = 1.2", "runtime.mem_fraction_static"),
        ("noise_sigma = 0.03", "noise_sigma = -0.1", "runtime.noise_sigma"),
        ('name = "H100-SXM-80GB"', "name = 5", "gpu.name"),
    ],
)
def test_bad_type_or_value(tmp_path, old, new, field):
    path = _write_variant(tmp_path, lambda t: t.replace(old, new, 1))
    with pytest.raises(ProfileError) as exc:
        load_profile(path)
    msg = str(exc.value)
    assert "profile.toml" in msg and field in msg


def test_unknown_field(tmp_path):
    path = _write_variant(
        tmp_path, lambda t: t.replace("hbm_tb_s = 3.35", "hbm_tb_s = 3.35\nhbm_tbs = 3.35")
    )
    with pytest.raises(ProfileError, match=r"profile\.toml: unknown field.*gpu\.hbm_tbs"):
        load_profile(path)


def test_unknown_top_level_field(tmp_path):
    path = _write_variant(tmp_path, lambda t: 'descripton = "typo"\n' + t)
    with pytest.raises(ProfileError, match="unknown field.*descripton"):
        load_profile(path)


def test_invalid_toml(tmp_path):
    path = _write_variant(tmp_path, lambda t: t + "\n[gpu\nbroken = \n")
    with pytest.raises(ProfileError) as exc:
        load_profile(path)
    msg = str(exc.value)
    assert "profile.toml" in msg and "invalid TOML" in msg and "line" in msg


def test_missing_file(tmp_path):
    with pytest.raises(ProfileError, match="nope.toml: no such profile file"):
        load_profile(tmp_path / "nope.toml")


def test_profile_error_is_value_error():
    assert issubclass(ProfileError, ValueError)


# ------------------------------------------------------------------------------ roofline


def test_empty_and_negative_shapes_rejected(llama):
    gpu = RooflineGpu(llama)
    with pytest.raises(ValueError):
        gpu.ideal_step_s(StepShape(0, 0.0, 0, 0, 0))
    with pytest.raises(ValueError):
        gpu.ideal_step_s(StepShape(10, 55.0, -1, 0, 0, 1))
    with pytest.raises(ValueError):
        gpu.measure_step_s(StepShape(0, 0.0, 100, 0, 0))


def test_step_shape_from_requests():
    s = StepShape.from_requests([(100, 50), (10, 0)], [300, 700, 1000])
    assert s.prefill_tokens == 110
    assert s.prefill_attention_pairs == pytest.approx(100 * (50 + 50.5) + 10 * 5.5)
    assert s.prefill_context == 50
    assert s.decode_requests == 3 and s.decode_context == 2000
    assert s.prefill_requests == 2
    assert s.new_tokens == 113 and s.num_requests == 5 and s.total_context == 2050


@pytest.mark.parametrize("name", BUNDLED)
def test_monotone_in_prefill_tokens_and_decode_context(name):
    gpu = RooflineGpu(load_profile(bundled_profile_path(name)))
    times = [gpu.ideal_step_s(prefill(n)) for n in (1, 16, 64, 256, 512, 1024, 2048, 4096, 8192)]
    assert all(b >= a for a, b in itertools.pairwise(times))
    assert times[-1] > times[0]
    times = [gpu.ideal_step_s(decode(32, c)) for c in (0, 128, 512, 2048, 8192, 32768)]
    assert all(b > a for a, b in itertools.pairwise(times))
    # mixed batches: adding a prefill chunk to decodes never makes the step cheaper
    base = StepShape.from_requests((), [1024] * 16)
    mixed = StepShape.from_requests([(512, 0)], [1024] * 16)
    assert gpu.ideal_step_s(mixed) > gpu.ideal_step_s(base)


def test_small_decode_is_memory_bound(llama):
    gpu = RooflineGpu(llama)
    shape = decode(1, 1024)
    bd = gpu.breakdown(shape)
    assert bd.linear_bound == "memory" and bd.attention_bound == "memory"
    weight_read = llama.model.weight_bytes / llama.gpu.effective_bandwidth
    overhead = llama.runtime.step_overhead_ms / 1e3
    t = gpu.ideal_step_s(shape)
    assert t == pytest.approx(weight_read + overhead, rel=0.02)
    assert 5.5e-3 <= t <= 7.0e-3  # calibration target for Llama-3.1-8B on H100
    # decode steps barely grow with batch size while memory-bound (the roofline's flat part)
    assert gpu.ideal_step_s(decode(8, 128)) < 1.05 * gpu.ideal_step_s(decode(1, 128))


def test_large_prefill_is_compute_bound(llama, qwen):
    gpu = RooflineGpu(llama)
    bd = gpu.breakdown(prefill(2048))
    assert bd.linear_bound == "compute" and bd.attention_bound == "compute"
    t = bd.total_s
    assert 40e-3 <= t <= 60e-3  # calibration target
    # ~linear in tokens once compute-bound: 2x tokens -> roughly 2x linear time
    assert gpu.breakdown(prefill(4096)).linear_s == pytest.approx(2 * bd.linear_s, rel=1e-9)
    # the compute-poor H20 is compute-bound on linear layers already at 64 tokens
    assert RooflineGpu(qwen).breakdown(prefill(64)).linear_bound == "compute"
    assert gpu.breakdown(prefill(64)).linear_bound == "memory"


def test_prefill_attention_is_superlinear(llama):
    gpu = RooflineGpu(llama)
    a1 = gpu.breakdown(prefill(4096)).attention_compute_s
    a2 = gpu.breakdown(prefill(8192)).attention_compute_s
    assert a2 / a1 == pytest.approx(4.0, rel=0.01)


@pytest.mark.parametrize("name", BUNDLED)
def test_not_the_linear_predictor(name):
    """A 3-coefficient least-squares fit a + b*new_tokens + c*context leaves real residuals."""
    gpu = RooflineGpu(load_profile(bundled_profile_path(name)))
    shapes = [decode(bs, c) for bs in (1, 4, 16, 64, 256) for c in (256, 1024, 4096)]
    shapes += [prefill(n, pre) for n in (64, 256, 1024, 4096) for pre in (0, 4096)]
    shapes += [StepShape.from_requests([(512, 0)], [2048] * bs) for bs in (8, 32, 128)]
    x = np.array([[1.0, s.new_tokens, s.total_context] for s in shapes])
    y = np.array([gpu.ideal_step_s(s) for s in shapes])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    rel = np.abs(x @ coef - y) / y
    assert rel.max() > 0.10
    assert float(np.sqrt(np.mean(rel**2))) > 0.05


# ------------------------------------------------------------------------------ noise & stalls


def test_noise_reproducible_and_seed_dependent(llama):
    shape = decode(16, 2048)
    first = RooflineGpu(llama, seed=7).measure_step_s(shape)
    g1, g2, g3 = RooflineGpu(llama, seed=7), RooflineGpu(llama, seed=7), RooflineGpu(llama, seed=8)
    s1 = [g1.measure_step_s(shape) for _ in range(200)]
    s2 = [g2.measure_step_s(shape) for _ in range(200)]
    s3 = [g3.measure_step_s(shape) for _ in range(200)]
    assert s1 == s2
    assert s1[0] == first
    assert s1 != s3
    assert all(t > 0 for t in s1 + s3)
    assert len(set(s1)) > 190  # it is noisy


def test_noise_mean_and_spread(llama):
    gpu = RooflineGpu(llama, seed=1)
    shape = StepShape.from_requests([(256, 1024)], [1500] * 40)
    ideal = gpu.ideal_step_s(shape)
    n = 20_000
    ratios = np.array([gpu.measure_step_s(shape) for _ in range(n)]) / ideal
    stalled = ratios > 1.0 + 8 * llama.runtime.noise_sigma  # stalls are >= 10 ms on ~10 ms steps
    clean = ratios[~stalled]
    assert clean.mean() == pytest.approx(1.0, abs=0.002)
    assert np.log(clean).std() == pytest.approx(llama.runtime.noise_sigma, rel=0.05)
    assert ratios.min() > 0


def test_stall_rate(llama):
    gpu = RooflineGpu(llama, seed=3)
    shape = decode(4, 512)
    ideal = gpu.ideal_step_s(shape)
    n = 100_000
    times = np.array([gpu.measure_step_s(shape) for _ in range(n)])
    p = llama.runtime.stall_probability
    expected = n * p
    assert abs(gpu.stalls - expected) < 5 * math.sqrt(expected)  # 50 +- 35
    assert gpu.steps == n
    extra = times - ideal * 1.5  # noise never reaches +50%; stalls add >= 10 ms
    stalled = extra > 0
    assert stalled.sum() == gpu.stalls
    durations = times[stalled] - ideal
    rt = llama.runtime
    assert durations.min() > rt.stall_ms_min / 1e3 * 0.9
    assert durations.max() < rt.stall_ms_max / 1e3 + 2 * ideal


def test_zero_noise_profile_is_deterministic(llama):
    from dataclasses import replace

    rt = replace(llama.runtime, noise_sigma=0.0, stall_probability=0.0)
    prof = replace(llama, runtime=rt)
    gpu = RooflineGpu(prof, seed=0)
    shape = decode(8, 1000)
    assert gpu.measure_step_s(shape) == gpu.ideal_step_s(shape)


def test_measured_time_is_a_python_float_even_with_stalls():
    """A numpy scalar here would leak into the engine clock and every step model."""
    profile = load_profile(bundled_profile_path("llama3.1-8b-h100"))
    stalling = dataclasses.replace(
        profile, runtime=dataclasses.replace(profile.runtime, stall_probability=1.0)
    )
    gpu = RooflineGpu(stalling, seed=3)
    shape = StepShape(512, 512 * 256.5, 0, 8, 8000, 1)
    assert all(type(gpu.measure_step_s(shape)) is float for _ in range(20))
    assert gpu.stalls == 20
