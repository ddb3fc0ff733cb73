"""The knee step model: where the paper's linear model goes wrong on a real GPU, one term each::

    seconds = a + b * max(new_tokens, knee)                      # weights read once: a floor
            + c * prefill_context                                # cached prefix of the chunks
            + d * decode_context * max(1, saturation / decodes)  # decode attention
            + e * prefill_pairs                                  # causal query-key pairs

- **The floor and its knee.** Every step reads all weights once, so a step of a few
  tokens costs as much as one of ``knee`` tokens; past the knee the linear layers are
  compute-bound and each token costs ``b``.
- **Prefill attention** grows with causal pairs ``n * (prefix + (n + 1) / 2)``, not with
  the context: a 4k-token chunk does 16x the attention of a 1k one.
- **Decode attention** reads each decode's KV. A kernel without split-KV runs one block per
  (sequence, KV head): below ``saturation`` decodes the GPU is not full and the longest
  sequence sets the time, so the cost is that of ``saturation`` sequences of the mean
  context (the grid has only the sum, hence the mean).

Fitted to the measured H100 grid (``../shared/data/gpu/``), held out on a third of the rows:
mean |error| 5.9% against the linear model's 14.8% (``python -m sglang_ext.sim
predictor-check``). ``knee`` and ``saturation`` are fitted by a search over a grid of
candidates (each one's linear coefficients by least squares), then refined; online, they
stay at their offline values and the five linear coefficients follow the measured steps
(:class:`sglang_ext.policy.step_model.OnlineStepModel`).

The prediction is monotone in a prefill chunk's length, which :meth:`max_chunk` inverts in
closed form: a quadratic in the chunk length below the knee and another above it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from sglang_ext.policy.step_shape import StepShape

_MIN_B = 1e-9
_ROUNDING = 1e-6  # tokens: a root closer than this to an integer is checked exactly
#: the coefficients online recalibration adjusts, in :meth:`KneeStepModel.features` order
KNEE_WEIGHTS = ("a_s", "b_s_per_token", "c_s_per_prefill_context_token",
                "d_s_per_decode_context_token", "e_s_per_pair")
KNEE_SHAPE = ("knee_tokens", "decode_saturation")
#: smallest per-term scales for online recalibration (s, s/token, s/token, s/token, s/pair)
KNEE_FLOORS = (1e-3, 1e-7, 1e-10, 1e-10, 1e-13)
#: the fewest measured steps a knee fit accepts (five coefficients, two shape parameters)
MIN_KNEE_SAMPLES = 8


class KneeFitError(ValueError):
    """Samples a knee model cannot be fitted to."""


@dataclass(frozen=True, slots=True)
class KneeStepModel:
    a_s: float
    b_s_per_token: float
    c_s_per_prefill_context_token: float
    d_s_per_decode_context_token: float
    e_s_per_pair: float
    knee_tokens: float
    decode_saturation: float

    form: ClassVar[str] = "knee"

    def __post_init__(self) -> None:
        for name in (*KNEE_WEIGHTS, *KNEE_SHAPE):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in KNEE_SHAPE:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    # ------------------------------------------------------------------ prediction
    def step_s(self, new_tokens: float, prefill_context: float, decode_requests: int,
               decode_context: float, prefill_pairs: float) -> float:
        tokens = new_tokens if new_tokens > self.knee_tokens else self.knee_tokens
        decode = decode_context
        if decode_requests and decode_requests < self.decode_saturation:
            decode *= self.decode_saturation / decode_requests
        return (self.a_s + self.b_s_per_token * tokens
                + self.c_s_per_prefill_context_token * prefill_context
                + self.d_s_per_decode_context_token * decode + self.e_s_per_pair * prefill_pairs)

    def predict_step(self, shape: StepShape) -> float:
        return self.step_s(shape.new_tokens, shape.prefill_context, shape.decode_requests,
                           shape.decode_context, shape.prefill_attention_pairs)

    @property
    def smallest_step_s(self) -> float:
        """One decode token with no context (``step_s(1, 0, 1, 0, 0.0)``)."""
        return self.a_s + self.b_s_per_token * (1 if 1 > self.knee_tokens else self.knee_tokens)

    def prefill_cost_s(self, chunk: int, prefix: int, base_tokens: float) -> float:
        """What a chunk of ``chunk`` tokens after ``prefix`` cached ones adds to a step that
        already computes ``base_tokens``."""
        knee = self.knee_tokens
        before = base_tokens if base_tokens > knee else knee
        after = base_tokens + chunk
        if after < knee:
            after = knee
        return (self.b_s_per_token * (after - before) + self.c_s_per_prefill_context_token * prefix
                + self.e_s_per_pair * chunk * (prefix + (chunk + 1) / 2.0))

    def max_chunk(self, time_left_s: float, prefix: int, base_tokens: float, limit: int) -> int:
        """The longest chunk (at most ``limit``) whose :meth:`prefill_cost_s` fits in
        ``time_left_s``; 0 when not even one token does.

        Closed form: the cost is a quadratic in the chunk below the knee (the floor pays
        for the tokens) and another past it; the root is checked against
        :meth:`prefill_cost_s` only when it lies within rounding of an integer."""
        if limit < 1:
            return 0
        b, e, knee = self.b_s_per_token, self.e_s_per_pair, self.knee_tokens
        fixed = self.c_s_per_prefill_context_token * prefix
        # prefill_cost_s(limit, prefix, base_tokens), inline (this is the packing hot path)
        before = base_tokens if base_tokens > knee else knee
        after = base_tokens + limit
        if after < knee:
            after = knee
        if b * (after - before) + fixed + e * limit * (prefix + (limit + 1) / 2.0) <= time_left_s:
            return limit  # the cost grows with the chunk: the whole limit fits
        # the largest root of (e / 2) x^2 + beta x + gamma, in the form without cancellation
        free = knee - base_tokens  # tokens the floor already pays for
        if free > 0 and fixed + e * free * (prefix + (free + 1) / 2.0) > time_left_s:
            beta, gamma = e * (prefix + 0.5), fixed - time_left_s
        else:
            shift = b * (base_tokens - knee) if base_tokens < knee else 0.0
            beta, gamma = b + e * (prefix + 0.5), fixed + shift - time_left_s
        if gamma >= 0.0:
            root = 0.0
        else:
            denominator = beta + math.sqrt(beta * beta - 2.0 * e * gamma)
            root = -2.0 * gamma / denominator if denominator > 0.0 else math.inf
        chunk = int(root) if root < limit - 1 else limit - 1
        if (chunk + 1 - root < _ROUNDING and chunk + 1 < limit
                and self.prefill_cost_s(chunk + 1, prefix, base_tokens) <= time_left_s):
            chunk += 1
        elif (root - chunk < _ROUNDING and chunk >= 1
              and self.prefill_cost_s(chunk, prefix, base_tokens) > time_left_s):
            chunk -= 1
        return chunk

    def decode_cost_s(self, kv_tokens: float, decodes: int) -> float:
        """What one decode over ``kv_tokens`` adds to a step of ``decodes`` decodes, past
        the knee."""
        return self.b_s_per_token + self.d_s_per_decode_context_token * kv_tokens * self._scale(decodes)

    def decode_increment(self, new_tokens: float, decodes: int) -> tuple[float, float] | None:
        """``(fixed, per KV token)``: exactly what each further decode adds to a step of
        ``new_tokens`` tokens and ``decodes`` decodes, once past the knee and the
        saturation (adding decodes keeps it there); ``None`` below either, where a decode
        can be free (the floor pays for it) or even lower the mean-context estimate."""
        if new_tokens >= self.knee_tokens and decodes >= self.decode_saturation:
            return self.b_s_per_token, self.d_s_per_decode_context_token
        return None

    def prefill_work(self, pending: int, prefix: int) -> float:
        """A queued prefill in prompt-token equivalents: its time past the knee over ``b``
        (a long prompt's attention makes it worth more than its length)."""
        return self.prefill_cost_s(pending, prefix, self.knee_tokens) / self.b_s_per_token

    def prompt_for_work(self, work: float) -> float:
        """The prompt with no prefix whose :meth:`prefill_work` is ``work`` (negative
        work maps one to one)."""
        if work <= 0.0 or self.e_s_per_pair <= 0.0:
            return work
        half = self.e_s_per_pair / (2.0 * self.b_s_per_token)
        linear = 1.0 + half
        return (-linear + math.sqrt(linear * linear + 4.0 * half * work)) / (2.0 * half)

    # ------------------------------------------------------------------ recalibration
    def features(self, shape: StepShape) -> tuple[float, ...]:
        """The regressors of the five weights, at this model's knee and saturation."""
        decode = shape.decode_context * self._scale(shape.decode_requests)
        return (1.0, float(max(shape.new_tokens, self.knee_tokens)), float(shape.prefill_context),
                decode, float(shape.prefill_attention_pairs))

    def _scale(self, decodes: int) -> float:
        """How many sequences' worth of the mean context a step of ``decodes`` decodes
        reads in the time of: ``saturation`` below it, else each its own."""
        return self.decode_saturation / decodes if 0 < decodes < self.decode_saturation else 1.0

    @property
    def weights(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in KNEE_WEIGHTS)

    def with_weights(self, weights: Sequence[float]) -> KneeStepModel:
        return KneeStepModel(*weights, self.knee_tokens, self.decode_saturation).usable()

    def usable(self) -> KneeStepModel:
        """Coefficients a policy can divide by: every weight >= 0, ``b`` > 0 (``self`` when
        they already are, as the online model's always are)."""
        a, b, c, d, e = (self.a_s, self.b_s_per_token, self.c_s_per_prefill_context_token,
                         self.d_s_per_decode_context_token, self.e_s_per_pair)
        if b >= _MIN_B and a >= 0.0 and c >= 0.0 and d >= 0.0 and e >= 0.0:
            return self
        return KneeStepModel(max(a, 0.0), max(b, _MIN_B), max(c, 0.0), max(d, 0.0), max(e, 0.0),
                             self.knee_tokens, self.decode_saturation)

    # ------------------------------------------------------------------ files
    def fields(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in (*KNEE_WEIGHTS, *KNEE_SHAPE)}

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str) -> KneeStepModel:
        names = (*KNEE_WEIGHTS, *KNEE_SHAPE)
        missing = [name for name in names if name not in data]
        if missing:
            raise ValueError(f"{source}: missing field(s) {', '.join(missing)}")
        try:
            return cls(*(data[name] for name in names))
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None


# ---------------------------------------------------------------------- offline fit


def fit_knee(shapes: Sequence[StepShape], seconds: Sequence[float]) -> KneeStepModel:
    """Least relative squares over measured steps, ``knee`` and ``saturation`` included.

    For each candidate (knee, saturation) on a log grid spanning the data, the five
    weights are a linear least-squares problem (weighted by 1 / measured, as the linear
    fit); weights that come out negative are dropped one at a time and the rest refitted.
    The best pair is refined on a finer grid around it."""
    if len(shapes) != len(seconds):
        raise KneeFitError("one measured time per step shape")
    if len(shapes) < MIN_KNEE_SAMPLES:
        raise KneeFitError(f"need at least {MIN_KNEE_SAMPLES} measured steps to fit the knee "
                           f"model, got {len(shapes)}")
    times = np.asarray(seconds, dtype=float)
    if not np.all(np.isfinite(times)) or np.any(times <= 0):
        raise KneeFitError("step samples need finite, positive times")
    raw = np.array([(s.new_tokens, s.prefill_context, s.decode_requests, s.decode_context,
                     s.prefill_attention_pairs) for s in shapes], dtype=float)
    tokens, prefix, decodes, decode_ctx, pairs = raw.T
    if np.unique(tokens).size < 3:
        raise KneeFitError("steps do not vary enough in new tokens to fit a knee")
    if not np.any(pairs > 0):
        raise KneeFitError("no prefill steps: the causal-pairs term cannot be fitted")
    if not np.any(decode_ctx > 0):
        raise KneeFitError("no decode steps with context: decode attention cannot be fitted")

    def solve(knee: float, saturation: float) -> tuple[float, np.ndarray]:
        factor = np.where((decodes > 0) & (decodes < saturation), saturation / np.maximum(decodes, 1), 1.0)
        design = np.column_stack([np.ones_like(tokens), np.maximum(tokens, knee), prefix,
                                  decode_ctx * factor, pairs]) / times[:, None]
        active = [0, 1] + [i for i in (2, 3, 4) if np.any(design[:, i] > 0)]
        while True:
            solution, *_ = np.linalg.lstsq(design[:, active], np.ones_like(times), rcond=None)
            negative = [(value, index) for value, index in zip(solution[1:], active[1:]) if value < 0]
            if not negative or len(active) <= 2:
                break
            active.remove(min(negative)[1])
        weights = np.zeros(5)
        weights[active] = solution
        residual = design @ weights - 1.0
        return float(residual @ residual), weights

    knees = np.unique(np.r_[0.0, np.geomspace(1.0, max(tokens.max(), 2.0), 48)])
    saturations = np.unique(np.r_[0.0, np.geomspace(1.0, max(decodes.max(), 2.0), 24)])
    best = min(((solve(k, s)[0], k, s) for k in knees for s in saturations))
    _, knee, saturation = best
    for _ in range(2):
        fine_knees = knee * np.geomspace(0.8, 1.25, 9) if knee > 0 else [0.0]
        fine_saturations = saturation * np.geomspace(0.8, 1.25, 9) if saturation > 0 else [0.0]
        best = min(best, *((solve(k, s)[0], k, s) for k in fine_knees for s in fine_saturations))
        _, knee, saturation = best
    _, weights = solve(knee, saturation)
    return KneeStepModel(*(float(w) for w in weights), float(knee), float(saturation))
