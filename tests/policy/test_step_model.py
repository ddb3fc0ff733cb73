"""Step-time model (FairBatching §3.2): offline least squares, TOML files, online model.

Synthetic truth throughout: a = 8 ms, b = 60 us/token, c = 20 ns/context token
(an 8192-token prefill ~ 0.5 s, a 100-request decode over 200k context ~ 18 ms).
Noise is multiplicative lognormal with sigma 2%, whose mean |relative error| is
0.02 * sqrt(2/pi) ~ 1.6%.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from sglang_ext.policy.step_error import StepErrorLog
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.policy.step_model import (
    OnlineStepModel,
    StepCoefficients,
    StepModelError,
    StepSample,
    fit_least_squares,
)

TRUE = StepCoefficients(0.008, 6e-5, 2e-8)
PRIOR_30_OFF = StepCoefficients(0.008 * 1.3, 6e-5 * 0.7, 2e-8 * 1.3)
NOISE = 0.02


def chunk(new_tokens: int, context: int) -> StepShape:
    """A step of ``new_tokens`` after ``context`` cached tokens (all the linear model reads)."""
    return StepShape.from_requests([(new_tokens, context)])


def rel(x: float, y: float) -> float:
    return abs(x / y - 1)


def coefficient_errors(got: StepCoefficients, want: StepCoefficients) -> tuple[float, float, float]:
    return (
        rel(got.a_s, want.a_s),
        rel(got.b_s_per_token, want.b_s_per_token),
        rel(got.c_s_per_context_token, want.c_s_per_context_token),
    )


def serving_step(rng: np.random.Generator) -> tuple[int, int]:
    """A step shape from a serving mix: prefill-heavy, decode-only or mixed."""
    kind = rng.random()
    if kind < 0.3:  # prefill-heavy (chunk of up to 8192 on a large running batch)
        return int(rng.integers(512, 8193)), int(rng.integers(0, 400_000))
    batch = int(rng.integers(1, 256))
    context = batch * int(rng.integers(200, 4000))
    if kind < 0.7:  # decode-only
        return batch, context
    return batch + int(rng.integers(1, 2048)), context + int(rng.integers(0, 8000))  # mixed


def prefill_step(rng: np.random.Generator) -> tuple[int, int]:
    """A prefill-only step: a fresh prompt of 1k-8k tokens and nothing else running."""
    n = int(rng.integers(1024, 8193))
    return n, n


def mean_prediction_error(model, truth, shapes) -> float:
    return float(np.mean([rel(_predict(model, n, ctx), truth.predict(n, ctx)) for n, ctx in shapes]))


def _predict(model, n: int, ctx: int) -> float:
    return model.predict(chunk(n, ctx)) if isinstance(model, OnlineStepModel) else model.predict(n, ctx)


def observe_truth(model, truth, rng, steps: int, shape=serving_step) -> None:
    for _ in range(steps):
        n, ctx = shape(rng)
        model.observe(chunk(n, ctx), truth.predict(n, ctx) * rng.lognormal(0.0, NOISE))


# --------------------------------------------------------------------------- coefficients


def test_predict_is_linear() -> None:
    # 8 ms + 100 * 60 us + 50_000 * 20 ns = 8 + 6 + 1 = 15 ms
    assert TRUE.predict(100, 50_000) == pytest.approx(0.015)


def test_usable_clamps_to_divisible_values() -> None:
    usable = StepCoefficients(-0.001, -1e-5, -1e-9).usable()
    assert usable.a_s == 0.0
    assert usable.b_s_per_token > 0
    assert usable.c_s_per_context_token == 0.0
    assert TRUE.usable() == TRUE


@pytest.mark.parametrize("bad", [math.nan, math.inf, "1", None])
def test_coefficients_must_be_finite_numbers(bad) -> None:
    with pytest.raises(StepModelError, match="b_s_per_token"):
        StepCoefficients(0.001, bad, 0.0)


# --------------------------------------------------------------------------- least squares


def synthetic_samples(truth: StepCoefficients, n: int, seed: int, max_context=500_000):
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        new_tokens = int(rng.integers(1, 8193))
        context = int(rng.integers(0, max_context + 1)) if max_context else 0
        seconds = truth.predict(new_tokens, context) * rng.lognormal(0.0, NOISE)
        samples.append(StepSample(new_tokens, context, seconds))
    return samples


def test_fit_recovers_known_coefficients() -> None:
    fitted = fit_least_squares(synthetic_samples(TRUE, 500, seed=1))
    a_err, b_err, c_err = coefficient_errors(fitted, TRUE)
    assert a_err < 0.05 and b_err < 0.02 and c_err < 0.05, fitted


def test_fit_absolute_least_squares() -> None:
    # Unweighted LS is dominated by the large steps, so a and c (small shares of them)
    # come out looser than with relative weighting; b is still tight.
    fitted = fit_least_squares(synthetic_samples(TRUE, 500, seed=1), relative=False)
    a_err, b_err, c_err = coefficient_errors(fitted, TRUE)
    assert a_err < 0.10 and b_err < 0.02 and c_err < 0.10, fitted


def test_fit_tokens_only() -> None:
    truth = StepCoefficients(0.008, 6e-5, 0.0)
    fitted = fit_least_squares(synthetic_samples(truth, 300, seed=2, max_context=0), use_context=False)
    assert fitted.c_s_per_context_token == 0.0
    assert rel(fitted.a_s, 0.008) < 0.05 and rel(fitted.b_s_per_token, 6e-5) < 0.02


def test_fit_tokens_only_ignores_context() -> None:
    # context varies but the model is a + b*n: c must be exactly 0
    fitted = fit_least_squares(synthetic_samples(TRUE, 200, seed=3), use_context=False)
    assert fitted.c_s_per_context_token == 0.0


def test_fit_exact_on_noiseless_samples() -> None:
    samples = [StepSample(n, ctx, TRUE.predict(n, ctx)) for n, ctx in [(1, 0), (100, 5000), (4000, 10), (10, 90_000)]]
    fitted = fit_least_squares(samples)
    assert coefficient_errors(fitted, TRUE) == pytest.approx((0, 0, 0), abs=1e-9)


def test_fit_needs_enough_samples() -> None:
    two = [StepSample(1, 0, 0.01), StepSample(100, 10, 0.02)]
    with pytest.raises(StepModelError, match="at least 3 samples"):
        fit_least_squares(two)
    with pytest.raises(StepModelError, match="at least 2 samples"):
        fit_least_squares(two[:1], use_context=False)
    with pytest.raises(StepModelError):
        fit_least_squares([])


def test_fit_rejects_degenerate_samples() -> None:
    same = [StepSample(100, 1000, 0.01 + i * 1e-4) for i in range(10)]
    with pytest.raises(StepModelError, match="do not vary enough"):
        fit_least_squares(same)
    # context proportional to new tokens: b and c cannot be told apart
    collinear = [StepSample(n, 10 * n, TRUE.predict(n, 10 * n)) for n in range(1, 20)]
    for relative in (True, False):
        with pytest.raises(StepModelError, match="do not vary enough"):
            fit_least_squares(collinear, relative=relative)


@pytest.mark.parametrize("bad", [0.0, -0.01, math.nan, math.inf])
def test_fit_rejects_non_positive_or_non_finite_times(bad: float) -> None:
    samples = synthetic_samples(TRUE, 10, seed=4) + [StepSample(10, 10, bad)]
    with pytest.raises(StepModelError, match="finite, positive times"):
        fit_least_squares(samples)


# --------------------------------------------------------------------------- TOML files


def test_toml_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "coef.toml"
    coefficients = StepCoefficients(0.0081234567, 6.1e-05, 1.9e-08)
    coefficients.save(path, comment="fitted on H100\nsecond line", samples=500, gpu="h100", r2=0.999)
    text = path.read_text()
    assert text.startswith("# fitted on H100\n# second line\n")
    assert "[fit]" in text and 'gpu = "h100"' in text
    assert StepCoefficients.load(path) == coefficients  # repr round-trips floats exactly


def test_toml_round_trip_of_numpy_scalars(tmp_path: Path) -> None:
    # np.float64 passes validation (it subclasses float) but its repr under NumPy 2 is
    # "np.float64(0.008)", which is not TOML; save must write plain literals.
    path = tmp_path / "coef.toml"
    coefficients = StepCoefficients(np.float64(0.008), np.float64(6e-5), np.float64(2e-8))
    coefficients.save(path, samples=np.int64(500), mean_abs_rel_error=np.float64(0.0125))
    assert "np." not in path.read_text()
    assert StepCoefficients.load(path) == coefficients


def test_toml_round_trip_of_strings_needing_escapes(tmp_path: Path) -> None:
    import tomllib

    path = tmp_path / "coef.toml"
    awkward = 'H100 "SXM5" C:\\profiles\ttab'
    TRUE.save(path, gpu=awkward)
    assert StepCoefficients.load(path) == TRUE
    assert tomllib.loads(path.read_text())["fit"]["gpu"] == awkward


def test_toml_round_trip_without_extras(tmp_path: Path) -> None:
    path = tmp_path / "coef.toml"
    TRUE.save(path)
    assert "[fit]" not in path.read_text()
    assert StepCoefficients.load(path) == TRUE


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("a_s = 0.008\nb_s_per_token = 6e-5\n", "missing field(s) c_s_per_context_token"),
        ("b_s_per_token = 6e-5\n", "missing field(s) a_s, c_s_per_context_token"),
        (
            "a_s = 0.008\nb_s_per_token = 6e-5\nc_s_per_context_token = 2e-8\nd_s = 1.0\n",
            "unknown field(s) ['d_s']",
        ),
        ("a_s = 0.008\nb_s_per_token = \n", "invalid TOML"),
        ("a_s = 0.008\nb_s_per_token = 'fast'\nc_s_per_context_token = 2e-8\n", "b_s_per_token must be"),
        ("a_s = nan\nb_s_per_token = 6e-5\nc_s_per_context_token = 2e-8\n", "a_s must be a finite"),
    ],
    ids=["missing-one", "missing-two", "unknown", "invalid-toml", "string-value", "nan"],
)
def test_malformed_coefficient_files_name_the_file(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "broken-coef.toml"
    path.write_text(text)
    with pytest.raises(StepModelError) as info:
        StepCoefficients.load(path)
    message = str(info.value)
    assert message.startswith(str(path)), message
    assert fragment in message, message


def test_missing_coefficient_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(StepModelError, match="no such coefficient file") as info:
        StepCoefficients.load(path)
    assert str(path) in str(info.value)


# --------------------------------------------------------------------------- online model


def test_online_model_starts_at_the_offline_fit() -> None:
    model = OnlineStepModel(TRUE)
    assert model.coefficients == TRUE
    assert model.error.samples == 0 and model.error.mean_abs_relative == 0.0
    tokens_only = OnlineStepModel(TRUE, use_context=False)
    assert tokens_only.coefficients == StepCoefficients(0.008, 6e-5, 0.0)


def test_online_model_converges_from_a_prior_30_percent_off() -> None:
    rng = np.random.default_rng(0)
    model = OnlineStepModel(PRIOR_30_OFF)
    shapes = [serving_step(rng) for _ in range(300)]
    assert mean_prediction_error(model, TRUE, shapes) > 0.15  # the prior really is off
    observe_truth(model, TRUE, rng, 1000)
    a_err, b_err, c_err = coefficient_errors(model.coefficients, TRUE)
    # every coefficient much closer than the 30% it started at
    assert a_err < 0.05 and b_err < 0.05 and c_err < 0.15, model.coefficients
    # predictions on unseen shapes within ~1.5x the noise
    assert mean_prediction_error(model, TRUE, shapes) < 0.025
    error = model.error
    assert error.samples == 1000
    # EWMA of |relative error| approaches the noise floor (0.016)
    assert 0.01 < error.mean_abs_relative < 0.03
    assert error.p95_abs_relative < 0.06
    assert error.outliers == 0


def test_online_tokens_only_model_converges() -> None:
    truth = StepCoefficients(0.008, 6e-5, 0.0)
    rng = np.random.default_rng(1)
    model = OnlineStepModel(StepCoefficients(0.006, 8e-5, 0.0), use_context=False)
    observe_truth(model, truth, rng, 800)
    assert model.coefficients.c_s_per_context_token == 0.0
    assert rel(model.coefficients.a_s, 0.008) < 0.05
    assert rel(model.coefficients.b_s_per_token, 6e-5) < 0.05


def test_online_model_tracks_a_drift() -> None:
    """b rises by 50% mid-stream; forgetting 0.995 (~200-step memory) follows it."""
    rng = np.random.default_rng(2)
    model = OnlineStepModel(TRUE)
    observe_truth(model, TRUE, rng, 600)
    drifted = StepCoefficients(TRUE.a_s, TRUE.b_s_per_token * 1.5, TRUE.c_s_per_context_token)
    shapes = [serving_step(rng) for _ in range(300)]
    at_change = mean_prediction_error(model, drifted, shapes)
    assert rel(model.coefficients.b_s_per_token, drifted.b_s_per_token) > 0.3
    observe_truth(model, drifted, rng, 300)
    assert mean_prediction_error(model, drifted, shapes) < at_change / 2
    observe_truth(model, drifted, rng, 300)  # 600 steps after the change
    assert rel(model.coefficients.b_s_per_token, drifted.b_s_per_token) < 0.08
    assert mean_prediction_error(model, drifted, shapes) < 0.04


def test_a_rare_stall_barely_moves_predictions() -> None:
    rng = np.random.default_rng(3)
    model = OnlineStepModel(TRUE)
    observe_truth(model, TRUE, rng, 500)
    before = model.coefficients
    outliers = model.error.outliers
    n, ctx = serving_step(rng)
    relative = model.observe(chunk(n, ctx), 10 * TRUE.predict(n, ctx))
    assert relative == pytest.approx(0.9, abs=0.02)  # (10p - p) / 10p
    assert model.error.last_relative == relative
    assert model.error.outliers == outliers + 1
    shapes = [serving_step(rng) for _ in range(300)]
    assert mean_prediction_error(model, before, shapes) < 0.02
    assert max(rel(model.predict(chunk(*s)), before.predict(*s)) for s in shapes) < 0.03


def test_outliers_are_counted() -> None:
    model = OnlineStepModel(TRUE)
    p = TRUE.predict(100, 10_000)
    model.observe(chunk(100, 10_000), p * 1.5)  # slow but not an outlier
    model.observe(chunk(100, 10_000), p * 0.5)  # fast: never an outlier
    assert model.error.outliers == 0
    model.observe(chunk(100, 10_000), model.predict(chunk(100, 10_000)) * 2.5)
    model.observe(chunk(100, 10_000), model.predict(chunk(100, 10_000)) * 10)
    assert model.error.outliers == 2
    assert model.error.samples == 4


def test_long_decode_only_phase_does_not_wreck_prefill_predictions() -> None:
    """Anchoring: 3000 decode-only steps with context ~ 2000 x batch pin down only one
    combination of b and c; prefill-only predictions afterwards stay as good as before.
    Control: the same stream with a negligible anchor drifts along the unmeasured
    direction and mispredicts prefills badly."""

    def run(anchor_weight: float, seed: int) -> tuple[float, float]:
        rng = np.random.default_rng(seed)
        model = OnlineStepModel(TRUE, anchor_weight=anchor_weight)
        observe_truth(model, TRUE, rng, 300)
        probe = [prefill_step(rng) for _ in range(200)]
        before = mean_prediction_error(model, TRUE, probe)

        # decode-only: batch 8..255, context = batch x 2000 (+-2%), drawn vectorised
        batches = rng.integers(8, 256, size=3000)
        contexts = (batches * 2000 * rng.uniform(0.98, 1.02, size=3000)).astype(int)
        noise = rng.lognormal(0.0, NOISE, size=3000)
        for n, ctx, factor in zip(batches.tolist(), contexts.tolist(), noise.tolist()):
            model.observe(chunk(n, ctx), TRUE.predict(n, ctx) * factor)
        return before, mean_prediction_error(model, TRUE, probe)

    before, after = run(2.0, seed=0)
    assert before < 0.01
    assert after < 0.02, (before, after)
    control = [run(1e-6, seed)[1] for seed in range(3)]
    assert max(control) > 0.05, control


def test_unmeasured_direction_keeps_what_was_learned_online() -> None:
    """The anchor follows the online solution, so a direction the recent data leave
    unmeasured stays where online data last put it, not back at the offline fit.
    Starting 30% off, after a long decode-only phase prefill-only predictions stay good."""
    rng = np.random.default_rng(4)
    model = OnlineStepModel(PRIOR_30_OFF)
    observe_truth(model, TRUE, rng, 1000)
    probe = [prefill_step(rng) for _ in range(100)]
    assert mean_prediction_error(model, TRUE, probe) < 0.03

    def decode_only(rng):
        batch = int(rng.integers(8, 256))
        return batch, int(batch * 2000 * rng.uniform(0.98, 1.02))

    observe_truth(model, TRUE, rng, 3000, shape=decode_only)
    decode_probe = [decode_only(rng) for _ in range(100)]
    assert mean_prediction_error(model, TRUE, decode_probe) < 0.03  # measured direction: right
    prior_error = mean_prediction_error(PRIOR_30_OFF, TRUE, probe)
    assert prior_error > 0.2
    assert mean_prediction_error(model, TRUE, probe) < 0.05


@pytest.mark.parametrize("bad", [0.0, -0.001, math.nan, math.inf, -math.inf])
def test_invalid_measured_time_raises(bad: float) -> None:
    model = OnlineStepModel(TRUE)
    with pytest.raises(StepModelError, match="measured step time"):
        model.observe(chunk(10, 100), bad)
    assert model.error.samples == 0
    assert model.coefficients == TRUE


@pytest.mark.parametrize(
    "kwargs, fragment",
    [({"forgetting": 0.0}, "forgetting"), ({"forgetting": 1.5}, "forgetting"), ({"anchor_weight": 0}, "anchor_weight")],
)
def test_online_model_parameter_validation(kwargs, fragment) -> None:
    with pytest.raises(StepModelError, match=fragment):
        OnlineStepModel(TRUE, **kwargs)


def test_observe_returns_relative_error_and_records_it() -> None:
    model = OnlineStepModel(TRUE)
    p = TRUE.predict(1000, 100_000)
    relative = model.observe(chunk(1000, 100_000), p * 1.25)
    assert relative == pytest.approx(0.2)  # (1.25p - p) / 1.25p
    assert model.error.last_relative == pytest.approx(0.2)
    assert model.recent_abs_relative_errors == pytest.approx((0.2,))
    assert model.error.mean_abs_relative == pytest.approx(0.2)  # first sample: alpha = 1


def test_the_error_log_p95_follows_its_window_as_a_sort_would() -> None:
    log = StepErrorLog(window=16)
    shape = chunk(1, 400)
    rng = np.random.default_rng(7)
    for step in range(100):
        log.record(shape, 1.0, float(rng.choice((0.5, 0.8, 1.0, 1.25, 2.0, rng.uniform(0.4, 3.0)))))
        recent = sorted(log.recent)
        assert log.p95_abs_relative == recent[min(len(recent) - 1, int(0.95 * len(recent)))], step
        assert log.summary().median_abs_relative == statistics.median(recent)
