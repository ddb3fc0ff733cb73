"""The knee step model: prediction, its inversion for chunk sizing, the offline fit,
files, online recalibration, and its use in pack and PAB."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from policy_helpers import NOW, SLO, request

from sglang_ext.policy.batch_former import Triage, pack
from sglang_ext.policy.knee_step_model import KneeFitError, KneeStepModel, fit_knee
from sglang_ext.policy.pab import prefill_admission_budget
from sglang_ext.policy.step_model import (
    OnlineStepModel, StepCoefficients, StepModelError, StepModelFile, fit_step_model,
)
from sglang_ext.policy.step_shape import StepShape

# shaped like the fit on the measured H100 grid
TRUTH = KneeStepModel(0.004, 2.7e-5, 5e-7, 6.6e-8, 1.4e-9, 140.0, 13.5)
LINEAR = StepCoefficients(0.005, 2.1e-5, 4.3e-8)


def serving_shape(rng: np.random.Generator, kind: str | None = None) -> StepShape:
    kind = kind or rng.choice(["decode", "prefill", "mixed"])
    decodes = [] if kind == "prefill" else [int(c) for c in rng.integers(64, 8192, int(rng.integers(1, 200)))]
    chunks = [] if kind == "decode" else [(int(rng.integers(16, 4096)), int(rng.choice([0, 0, 2048, 8192])))]
    return StepShape.from_requests(chunks, decodes)


def test_prediction_terms() -> None:
    one_decode = StepShape.from_requests((), [1000])
    # below the knee and the saturation: the floor, and the decode costed as 13.5 sequences
    assert TRUTH.predict_step(one_decode) == pytest.approx(0.004 + 2.7e-5 * 140 + 6.6e-8 * 1000 * 13.5)
    prefill = StepShape.from_requests([(1000, 2048)])
    assert TRUTH.predict_step(prefill) == pytest.approx(
        0.004 + 2.7e-5 * 1000 + 5e-7 * 2048 + 1.4e-9 * 1000 * (2048 + 1001 / 2))
    assert TRUTH.smallest_step_s == pytest.approx(0.004 + 2.7e-5 * 140)


@pytest.mark.parametrize("model", [TRUTH, LINEAR], ids=["knee", "linear"])
def test_max_chunk_is_the_longest_chunk_that_fits(model) -> None:
    rng = np.random.default_rng(0)
    for _ in range(2000):
        base = int(rng.choice([0, 5, 60, 139, 140, 500]))
        prefix = int(rng.choice([0, 100, 2048, 30_000]))
        time_left = float(rng.uniform(0.0, 0.2))
        limit = int(rng.integers(1, 9000))
        chunk = model.max_chunk(time_left, prefix, base, limit)
        assert 0 <= chunk <= limit
        if chunk:
            assert model.prefill_cost_s(chunk, prefix, base) <= time_left
        if chunk < limit:
            assert model.prefill_cost_s(chunk + 1, prefix, base) > time_left


def test_prefill_cost_adds_up_to_the_prediction() -> None:
    decodes = StepShape.from_requests((), [500] * 20)
    both = StepShape.from_requests([(700, 300)], [500] * 20)
    cost = TRUTH.prefill_cost_s(700, 300, decodes.new_tokens)
    assert TRUTH.predict_step(decodes) + cost == pytest.approx(TRUTH.predict_step(both))


def test_fit_recovers_a_known_model() -> None:
    rng = np.random.default_rng(1)
    shapes = [serving_shape(rng) for _ in range(300)] + [
        StepShape.from_requests((), [1024] * n) for n in (1, 2, 4, 8, 16, 32, 64)]
    fitted = fit_knee(shapes, [TRUTH.predict_step(s) for s in shapes])
    assert fitted.knee_tokens == pytest.approx(TRUTH.knee_tokens, rel=0.1)
    assert fitted.decode_saturation == pytest.approx(TRUTH.decode_saturation, rel=0.1)
    errors = [abs(fitted.predict_step(s) / TRUTH.predict_step(s) - 1) for s in shapes]
    assert max(errors) < 0.02


def test_fit_refuses_what_it_cannot_fit() -> None:
    rng = np.random.default_rng(2)
    shapes = [serving_shape(rng) for _ in range(20)]
    times = [TRUTH.predict_step(s) for s in shapes]
    with pytest.raises(KneeFitError, match="at least 8"):
        fit_knee(shapes[:5], times[:5])
    decodes_only = [serving_shape(rng, "decode") for _ in range(20)]
    with pytest.raises(KneeFitError, match="no prefill steps"):
        fit_knee(decodes_only, [TRUTH.predict_step(s) for s in decodes_only])
    prefills_only = [serving_shape(rng, "prefill") for _ in range(20)]
    with pytest.raises(KneeFitError, match="no decode steps"):
        fit_knee(prefills_only, [TRUTH.predict_step(s) for s in prefills_only])
    with pytest.raises(KneeFitError, match="positive times"):
        fit_knee(shapes, [0.0] * len(shapes))
    with pytest.raises(StepModelError, match="form 'cubic'"):
        fit_step_model("cubic", shapes, times)


def test_knee_file_round_trip_and_refusals(tmp_path: Path) -> None:
    path = tmp_path / "knee.toml"
    StepModelFile(TRUTH, LINEAR).save(path, comment="test", samples=3)
    assert StepModelFile.load(path) == StepModelFile(TRUTH, LINEAR)
    with pytest.raises(StepModelError, match="not the linear one"):
        StepCoefficients.load(path)
    text = path.read_text()
    path.write_text(text.split("[linear]")[0])
    with pytest.raises(StepModelError, match=r"needs a \[linear\] table"):
        StepModelFile.load(path)
    path.write_text(text.replace('form = "knee"', 'form = "cubic"'))
    with pytest.raises(StepModelError, match="form 'cubic'"):
        StepModelFile.load(path)
    path.write_text(text.replace("knee_tokens = ", "knee_tokens = -"))
    with pytest.raises(StepModelError, match="knee_tokens must be >= 0"):
        StepModelFile.load(path)
    path.write_text("a_s = 0.005\nb_s_per_token = 2.1e-5\nc_s_per_context_token = 4.3e-8\n")
    legacy = StepModelFile.load(path)  # no form: today's linear model
    assert legacy.model == legacy.linear == LINEAR


def test_scaled_file_scales_every_weight_and_keeps_the_shape() -> None:
    scaled = StepModelFile(TRUTH, LINEAR).scaled(3.0)
    assert scaled.model.knee_tokens == TRUTH.knee_tokens
    shape = StepShape.from_requests([(900, 0)], [800] * 30)
    assert scaled.model.predict_step(shape) == pytest.approx(3 * TRUTH.predict_step(shape))
    assert scaled.linear.predict_step(shape) == pytest.approx(3 * LINEAR.predict_step(shape))


def test_online_knee_model_holds_through_a_decode_only_stretch() -> None:
    """Starts 30% off; learns from serving steps; a long decode-only phase then must not
    spoil its prefill predictions (the anchored recalibration's point)."""
    rng = np.random.default_rng(3)
    prior = KneeStepModel(0.004 * 1.3, 2.7e-5 * 0.7, 5e-7, 6.6e-8 * 1.3, 1.4e-9 * 0.7, 140.0, 13.5)
    model = OnlineStepModel(prior)
    prefills = [serving_shape(rng, "prefill") for _ in range(100)]

    def prefill_error() -> float:
        return float(np.mean([abs(model.predict(s) / TRUTH.predict_step(s) - 1) for s in prefills]))

    assert prefill_error() > 0.15
    for _ in range(600):
        shape = serving_shape(rng)
        model.observe(shape, TRUTH.predict_step(shape) * rng.lognormal(0.0, 0.02))
    learned = prefill_error()
    assert learned < 0.05
    for _ in range(2000):
        shape = serving_shape(rng, "decode")
        model.observe(shape, TRUTH.predict_step(shape) * rng.lognormal(0.0, 0.02))
    assert prefill_error() < max(0.05, 1.5 * learned)
    assert model.coefficients.knee_tokens == prior.knee_tokens  # the shape stays offline


def test_pack_sizes_the_chunk_by_inverting_the_knee_model() -> None:
    decodes = [(0.5, request(f"d{i}", 0.5, context=2000)) for i in range(10)]
    prompt = request("p", 1.0, prefill=20_000, context=4096)
    groups = Triage(0.05, 0.05, decodes, [(1.0, prompt)], [])
    decision = pack(groups, TRUTH, token_budget=8192, time_budget_s=0.05)
    (_, chunk), = decision.prefill_chunks
    decode_step = TRUTH.predict_step(StepShape.from_requests((), [2000] * 10))
    assert decision.predicted_step_s <= 0.05 + 1e-12
    assert decode_step + TRUTH.prefill_cost_s(chunk, 4096, 10) == pytest.approx(decision.predicted_step_s)
    assert decode_step + TRUTH.prefill_cost_s(chunk + 1, 4096, 10) > 0.05
    shape = StepShape.from_requests([(chunk, 4096)], [2000] * 10)
    assert TRUTH.predict_step(shape) == pytest.approx(decision.predicted_step_s)


def test_pack_with_the_linear_model_is_unchanged() -> None:
    decodes = [(0.5, request(f"d{i}", 0.5, context=2000)) for i in range(10)]
    prompt = request("p", 1.0, prefill=20_000, context=4096)
    decision = pack(Triage(0.05, 0.05, decodes, [(1.0, prompt)], []), LINEAR, token_budget=8192,
                    time_budget_s=0.05)
    a, b, c = LINEAR.weights
    expected = math.floor((0.05 - a - 10 * b - c * 20_000 - c * 4096) / b)
    assert decision.prefill_chunks == (("p", expected),)


def test_knee_pab_charges_long_queued_prompts_their_attention() -> None:
    empty = prefill_admission_budget([], NOW, TRUTH, SLO)
    assert empty > 0
    one_long = [request("q", SLO.ttft_s, prefill=8000)]
    two_short = [request(f"q{i}", SLO.ttft_s, prefill=4000) for i in range(2)]
    long_budget = prefill_admission_budget(one_long, NOW, TRUTH, SLO)
    short_budget = prefill_admission_budget(two_short, NOW, TRUTH, SLO)
    assert long_budget < short_budget < empty  # same tokens; the long prompt's pairs cost more
    # the budget is the longest fresh prompt that fits the time left: a prompt of that
    # length costs exactly that time
    left = TRUTH.prefill_cost_s(int(empty), 0, TRUTH.knee_tokens)
    assert left == pytest.approx(TRUTH.b_s_per_token * TRUTH.prompt_for_work(
        left / TRUTH.b_s_per_token) + TRUTH.e_s_per_pair * empty * (empty + 1) / 2, rel=1e-3)


def test_only_the_last_chunk_of_a_step_is_partial() -> None:
    """A chunk cut short by time ends the prefills: with the knee model a prompt with no
    prefix may still fit a token after one with a long prefix was cut (SGLang runs one
    partial chunk per step)."""
    long_prefix = request("long", 0.9, prefill=20_000, context=30_000)
    fresh = request("fresh", 1.0, prefill=500)
    for budget in np.linspace(0.05, 0.1, 41):  # whatever time the cut chunk leaves
        groups = Triage(budget, 0.05, [], [(0.9, long_prefix), (1.0, fresh)], [])
        decision = pack(groups, TRUTH, token_budget=8192, time_budget_s=budget)
        assert [req_id for req_id, _ in decision.prefill_chunks] == ["long"]
        assert decision.prefill_chunks[0][1] < 20_000
