"""The per-task online Gaussian of output lengths (SLO-aware annealing §5.1)."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_ext.policy.output_length import (
    MIN_SAMPLES, PRIOR, OutputEstimate, OutputLengthModel,
)
from sglang_ext.policy.slo import NOMINAL_OUTPUT_TOKENS, Slo


def test_the_prior_until_two_requests_finished() -> None:
    model = OutputLengthModel()
    assert MIN_SAMPLES == 2
    assert model.estimate("code") == PRIOR == OutputEstimate(NOMINAL_OUTPUT_TOKENS, 0.0, 0)
    model.observe("code", 40)
    assert model.estimate("code") == PRIOR  # one sample has no spread: still the prior
    model.observe("code", 60)
    assert model.estimate("code") == OutputEstimate(50.0, pytest.approx(14.142135623730951), 2)


def test_mean_and_sample_std_of_a_hand_example() -> None:
    model = OutputLengthModel()
    for tokens in (100, 200, 300):
        model.observe("t", tokens)
    estimate = model.estimate("t")
    assert (estimate.mean, estimate.std, estimate.samples) == (200.0, 100.0, 3)
    assert estimate.expected_tokens == 200


def test_welford_matches_numpy_on_many_samples() -> None:
    lengths = np.random.default_rng(7).integers(1, 4000, 5000)
    model = OutputLengthModel()
    for tokens in lengths:
        model.observe("t", int(tokens))
    estimate = model.estimate("t")
    assert estimate.samples == len(lengths)
    assert estimate.mean == pytest.approx(lengths.mean(), rel=1e-12)
    assert estimate.std == pytest.approx(lengths.std(ddof=1), rel=1e-9)


def test_equal_lengths_have_no_spread() -> None:
    model = OutputLengthModel()
    for _ in range(5):
        model.observe("t", 128)
    assert model.estimate("t") == OutputEstimate(128.0, 0.0, 5)


def test_tasks_are_learnt_apart() -> None:
    model = OutputLengthModel()
    chat, code = Slo(2.0, 0.05), Slo(3.0, 0.05, 12.0)  # an SLO is a task when unclassed
    for tokens in (10, 30):
        model.observe("chat", tokens)
        model.observe(code, tokens * 100)
    assert model.estimate("chat").mean == 20.0
    assert model.estimate(code).mean == 2000.0
    assert model.estimate(chat) == PRIOR and model.estimate("code") == PRIOR


def test_a_given_prior() -> None:
    prior = OutputEstimate(64.0, 8.0, 0)
    model = OutputLengthModel(prior)
    model.observe("t", 1000)
    assert model.estimate("t") is prior and model.estimate("other") is prior


@pytest.mark.parametrize("tokens", [0, -3])
def test_an_output_length_is_at_least_one_token(tokens: int) -> None:
    model = OutputLengthModel()
    with pytest.raises(ValueError, match=f"an output length is >= 1 token, got {tokens}"):
        model.observe("t", tokens)
    model.observe("t", 5)
    model.observe("t", 7)
    assert model.estimate("t").mean == 6.0  # the refused value left no trace


@pytest.mark.parametrize("mean, expected", [(0.2, 1), (1.4, 1), (199.6, 200), (2048.0, 2048)])
def test_expected_tokens_is_the_rounded_mean_at_least_one(mean: float, expected: int) -> None:
    assert OutputEstimate(mean, 1.0, 5).expected_tokens == expected
