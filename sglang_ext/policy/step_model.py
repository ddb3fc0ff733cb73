"""Step-time model ``seconds = a + b * new_tokens + c * context`` (FairBatching §3.2).

Fitted offline by least squares from profiled steps and recalibrated online from
every measured step.

Online method: exponentially forgetting least squares anchored at the offline fit.
Each step adds its sample to decayed normal equations (forgetting factor 0.995, an
effective memory of ~200 steps, a few seconds of serving); the coefficients solve
them with a constant ridge term pulling toward the offline fit. Why not textbook RLS
with forgetting or a plain sliding window: during decode-only phases new tokens and
context grow together (context ~ batch x mean length), so the recent data pins down
only one combination of b and c. RLS forgets its prior and a window has none, so
both drift freely along the unmeasured direction and mispredict badly when prefills
return (we saw 30x errors). The constant anchor keeps every unmeasured direction at
the offline fit while measured directions follow the data. Samples are weighted by
1/measured (relative error): a few-millisecond decode step counts as much as a
multi-second prefill, and a stall's influence is bounded (its relative residual is
at most 1). Both cost O(1) per step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from sglang_ext.policy.knee_step_model import KNEE_FLOORS, KneeFitError, KneeStepModel, fit_knee
from sglang_ext.policy.online_knee import RESCALE_BAND, OnlineKneeModel
from sglang_ext.policy.step_error import LearnedModel, StepErrorLog, check_learning_rates
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.policy.tomlfile import read_toml

# Internal feature scales keep the RLS covariance well conditioned.
_TOKEN_SCALE = 1_000.0
_CONTEXT_SCALE = 100_000.0
_MIN_B = 1e-9


class StepModelError(ValueError):
    """Bad coefficients, samples or coefficient file."""


@dataclass(frozen=True, slots=True)
class StepCoefficients:
    """The paper's linear model ``a + b * new_tokens + c * context``."""

    a_s: float  # fixed cost per step, seconds
    b_s_per_token: float  # seconds per new token (prefill or decode)
    c_s_per_context_token: float  # seconds per token of KV context read

    form: ClassVar[str] = "linear"

    def __post_init__(self) -> None:
        for name in ("a_s", "b_s_per_token", "c_s_per_context_token"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise StepModelError(f"{name} must be a finite number, got {value!r}")

    def predict(self, new_tokens: float, context: float) -> float:
        return self.a_s + self.b_s_per_token * new_tokens + self.c_s_per_context_token * context

    def step_s(self, new_tokens: float, prefill_context: float, decode_requests: int,
               decode_context: float, prefill_pairs: float) -> float:
        return self.a_s + self.b_s_per_token * new_tokens + self.c_s_per_context_token * (
            prefill_context + decode_context)

    def predict_step(self, shape: StepShape) -> float:
        return self.predict(shape.new_tokens, shape.prefill_context + shape.decode_context)

    @property
    def smallest_step_s(self) -> float:
        """One decode token with no context."""
        return self.a_s + self.b_s_per_token

    def prefill_cost_s(self, chunk: int, prefix: int, base_tokens: float) -> float:
        """What a chunk of ``chunk`` tokens after ``prefix`` cached ones adds to a step."""
        return self.b_s_per_token * chunk + self.c_s_per_context_token * prefix

    def max_chunk(self, time_left_s: float, prefix: int, base_tokens: float, limit: int) -> int:
        """The longest chunk (at most ``limit``) whose :meth:`prefill_cost_s` fits in
        ``time_left_s``; 0 when not even one token does."""
        spare = time_left_s - self.c_s_per_context_token * prefix
        if spare < self.b_s_per_token or limit < 1:
            return 0
        return min(limit, math.floor(spare / self.b_s_per_token))

    def decode_cost_s(self, kv_tokens: float, decodes: int) -> float:
        """What one decode over ``kv_tokens`` adds to a step of ``decodes`` decodes."""
        return self.b_s_per_token + self.c_s_per_context_token * kv_tokens

    def decode_increment(self, new_tokens: float, decodes: int) -> tuple[float, float] | None:
        """``(fixed, per KV token)``: exactly what each further decode adds to a step, from
        any step on."""
        return self.b_s_per_token, self.c_s_per_context_token

    def prefill_work(self, pending: int, prefix: int) -> float:
        """A queued prefill in prompt-token equivalents (seconds over ``b``): the linear
        model's admission counts prompt tokens."""
        return float(pending)

    def prompt_for_work(self, work: float) -> float:
        """The prompt of :meth:`prefill_work` ``work`` when it starts with no prefix."""
        return work

    def features(self, shape: StepShape) -> tuple[float, ...]:
        return (1.0, float(shape.new_tokens), float(shape.prefill_context + shape.decode_context))

    @property
    def weights(self) -> tuple[float, ...]:
        return (self.a_s, self.b_s_per_token, self.c_s_per_context_token)

    def with_weights(self, weights: Sequence[float]) -> StepCoefficients:
        return StepCoefficients(*(list(weights) + [0.0] * (3 - len(weights)))).usable()

    def fields(self) -> dict[str, float]:
        return {"a_s": self.a_s, "b_s_per_token": self.b_s_per_token,
                "c_s_per_context_token": self.c_s_per_context_token}

    def usable(self) -> StepCoefficients:
        """Coefficients a policy can divide by: a >= 0, b > 0, c >= 0 (``self`` when they
        already are, as the online model's always are)."""
        if self.b_s_per_token >= _MIN_B and self.a_s >= 0.0 and self.c_s_per_context_token >= 0.0:
            return self
        return StepCoefficients(
            max(self.a_s, 0.0), max(self.b_s_per_token, _MIN_B), max(self.c_s_per_context_token, 0.0)
        )

    def to_toml(self, comment: str = "", **fit_info: float | str) -> str:
        return _toml_document(comment, [
            "# step seconds = a_s + b_s_per_token * new_tokens + c_s_per_context_token * context",
            *_toml_fields(self.fields()),
        ], fit_info)

    def save(self, path: str | Path, comment: str = "", **fit_info: float | str) -> None:
        Path(path).write_text(self.to_toml(comment, **fit_info))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "<mapping>") -> StepCoefficients:
        names = ("a_s", "b_s_per_token", "c_s_per_context_token")
        if data.get("form", "linear") != "linear":
            raise StepModelError(f"{source}: a {data.get('form')!r} step model, not the linear one")
        missing = [n for n in names if n not in data]
        if missing:
            raise StepModelError(f"{source}: missing field(s) {', '.join(missing)}")
        unknown = set(data) - set(names) - {"fit", "form"}
        if unknown:
            raise StepModelError(f"{source}: unknown field(s) {sorted(unknown)}")
        try:
            return cls(*(data[n] for n in names))
        except StepModelError as exc:
            raise StepModelError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> StepCoefficients:
        return cls.from_mapping(read_toml(path, StepModelError, "coefficient"), str(path))


def _toml_document(comment: str, body: list[str], fit_info: Mapping[str, float | str]) -> str:
    """``comment`` as comment lines, then ``body``, then a ``[fit]`` table of ``fit_info``."""
    lines = [f"# {line}" for line in comment.splitlines()] if comment else []
    lines += body
    if fit_info:
        lines += ["\n[fit]", *_toml_fields(fit_info)]
    return "\n".join(lines) + "\n"


def _toml_fields(fields: Mapping[str, float | str]) -> list[str]:
    return [f"{name} = {_toml_value(value)}" for name, value in fields.items()]


def _toml_value(value: float | str) -> str:
    """A TOML literal: ``repr`` of a NumPy scalar (``np.float64(0.1)``) is not TOML, and a
    string needs its quotes, backslashes and control characters escaped."""
    if isinstance(value, str):
        out = []
        for ch in value:
            if ch in '"\\':
                out.append("\\" + ch)
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    if isinstance(value, numbers.Integral):
        return str(int(value))
    return repr(float(value))


#: A step-time predictor: the paper's linear model or the knee model. Both offer
#: ``predict_step``, ``step_s``, ``smallest_step_s``, ``prefill_cost_s``, ``max_chunk``
#: (the decision path) and ``features`` / ``weights`` / ``with_weights`` (recalibration).
StepPredictor = StepCoefficients | KneeStepModel
STEP_FORMS = ("linear", "knee")


@dataclass(frozen=True, slots=True)
class StepModelFile:
    """A step-model file: its model, of the file's ``form`` (``linear`` when absent), and
    the paper's linear model fitted to the same data (its ``[linear]`` table; the model
    itself in a linear file), which the ``fb`` policy keeps."""

    model: StepPredictor
    linear: StepCoefficients

    @classmethod
    def of(cls, model: StepPredictor, linear: StepCoefficients | None = None) -> StepModelFile:
        if linear is None:
            if not isinstance(model, StepCoefficients):
                raise StepModelError("a knee model needs the linear model fitted beside it")
            linear = model
        return cls(model, linear)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "<mapping>") -> StepModelFile:
        form = data.get("form", "linear")
        if form == "linear":
            return cls.of(StepCoefficients.from_mapping(data, source))
        if form != "knee":
            raise StepModelError(f"{source}: form {form!r} is not one of {', '.join(STEP_FORMS)}")
        known = {"form", "fit", "linear", *KneeStepModel.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise StepModelError(f"{source}: unknown field(s) {sorted(unknown)}")
        linear = data.get("linear")
        if not isinstance(linear, Mapping):
            raise StepModelError(f"{source}: a knee model needs a [linear] table (the paper's "
                                 "model fitted to the same data, which fb keeps)")
        try:
            model = KneeStepModel.from_mapping(data, source)
        except ValueError as exc:
            raise StepModelError(str(exc)) from None
        return cls(model, StepCoefficients.from_mapping(linear, f"{source} [linear]"))

    @classmethod
    def load(cls, path: str | Path) -> StepModelFile:
        return cls.from_mapping(read_toml(path, StepModelError, "step model"), str(path))

    def to_toml(self, comment: str = "", **fit_info: float | str) -> str:
        if isinstance(self.model, StepCoefficients):
            return self.model.to_toml(comment, **fit_info)
        return _toml_document(comment, [
            "# step seconds = a_s + b_s_per_token * max(new_tokens, knee_tokens)",
            "#   + c_s_per_prefill_context_token * prefill_context",
            "#   + d_s_per_decode_context_token * decode_context * max(1, decode_saturation / decodes)",
            "#   + e_s_per_pair * prefill_pairs",
            'form = "knee"',
            *_toml_fields(self.model.fields()),
            "\n# the paper's linear model fitted to the same steps (the fb policy keeps it)",
            "[linear]",
            *_toml_fields(self.linear.fields()),
        ], fit_info)

    def save(self, path: str | Path, comment: str = "", **fit_info: float | str) -> None:
        Path(path).write_text(self.to_toml(comment, **fit_info))

    def scaled(self, factor: float) -> StepModelFile:
        """Both models on a GPU ``factor`` times slower (every weight times ``factor``)."""
        if not (math.isfinite(factor) and factor > 0):
            raise StepModelError(f"scale factor must be a finite number > 0, got {factor!r}")
        model = self.model.with_weights([w * factor for w in self.model.weights])
        linear = self.linear.with_weights([w * factor for w in self.linear.weights])
        return StepModelFile(model, linear)


def fit_step_model(form: str, shapes: Sequence[StepShape], seconds: Sequence[float]) -> StepModelFile:
    """Fit a model of ``form`` (and the linear model beside it) to measured steps."""
    samples = [StepSample(s.new_tokens, s.prefill_context + s.decode_context, t)
               for s, t in zip(shapes, seconds, strict=True)]
    linear = fit_least_squares(samples)
    if form == "linear":
        return StepModelFile.of(linear)
    if form != "knee":
        raise StepModelError(f"form {form!r} is not one of {', '.join(STEP_FORMS)}")
    try:
        return StepModelFile(fit_knee(shapes, seconds), linear)
    except KneeFitError as exc:
        raise StepModelError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class StepSample:
    new_tokens: int
    context: int
    seconds: float


def fit_least_squares(
    samples: Iterable[StepSample], *, use_context: bool = True, relative: bool = True
) -> StepCoefficients:
    """Least squares over measured steps; ``use_context=False`` fits ``a + b*n`` only.

    ``relative=True`` minimises relative rather than absolute error (each row weighted
    by 1/seconds), so multi-second prefills do not drown out few-millisecond decode
    steps, where a scheduler's budget errors matter just as much.
    """
    rows = [(1.0, s.new_tokens, s.context, s.seconds) for s in samples]
    width = 3 if use_context else 2
    if len(rows) < width:
        raise StepModelError(f"need at least {width} samples to fit, got {len(rows)}")
    data = np.asarray(rows, dtype=float)
    design, target = data[:, :width], data[:, 3]
    if np.any(target <= 0) or not np.all(np.isfinite(data)):
        raise StepModelError("step samples need finite, positive times")
    if relative:
        design, target = design / target[:, None], np.ones_like(target)
    if np.linalg.matrix_rank(design) < width:
        raise StepModelError("samples do not vary enough in new tokens / context to fit")
    solution, *_ = np.linalg.lstsq(design, target, rcond=None)
    c = float(solution[2]) if use_context else 0.0
    return StepCoefficients(float(solution[0]), float(solution[1]), c)


_LINEAR_FLOORS = (1e-3, 1e-7, 1e-10)  # smallest per-term scales (s, s/token, s/context token)


class OnlineStepModel(LearnedModel):
    """Online-recalibrated step model: ``observe`` after every step, read ``coefficients``.

    Works on either form: the model's ``features`` are the regressors of its
    ``weights`` (the knee model's knee and saturation stay at their offline values).
    Internally each weight is a multiple of its offline value (or of a small floor), so
    the features are "fraction of the step explained by this term" and
    ``anchor_weight`` is how many steps' worth of evidence the anchor counts as. The
    anchor starts at the offline fit and follows the online solution slowly
    (``anchor_follow`` per step, a ~500-step time constant): what was learned online
    survives a phase that stops measuring it, and since the solution equals the anchor
    along unmeasured directions, following it does not reintroduce drift there.
    ``use_context=False`` (linear only) learns ``a + b * new_tokens``.
    """

    def __init__(
        self,
        initial: StepPredictor,
        *,
        use_context: bool = True,
        forgetting: float = 0.995,
        anchor_weight: float = 2.0,
        anchor_follow: float = 0.002,
        error_window: int = 256,
    ) -> None:
        check_learning_rates(forgetting, anchor_weight, anchor_follow, StepModelError)
        if not use_context and not isinstance(initial, StepCoefficients):
            raise StepModelError("use_context=False learns the linear model a + b * new_tokens only")
        values = initial.weights
        floors = _LINEAR_FLOORS if isinstance(initial, StepCoefficients) else KNEE_FLOORS
        self._dim = len(values) if use_context else 2
        self._scale = [max(v, floor) for v, floor in zip(values, floors)][: self._dim]
        self._prior = [v / s for v, s in zip(values, self._scale)]
        self._forgetting = forgetting
        self._anchor = anchor_weight
        self._anchor_follow = anchor_follow
        self._gram = [[0.0] * self._dim for _ in range(self._dim)]
        self._moment = [0.0] * self._dim
        self._errors = StepErrorLog(error_window)
        self._coefficients: StepPredictor = initial.with_weights(values[: self._dim])

    def observe(self, shape: StepShape, measured_s: float) -> float:
        """Learn from one measured step; returns its relative error (measured - predicted) / measured."""
        if not measured_s > 0 or not math.isfinite(measured_s):
            raise StepModelError(f"measured step time must be > 0, got {measured_s!r}")
        predicted = self._coefficients.predict_step(shape)
        relative = self._errors.record(shape, predicted, measured_s)
        raw = self._coefficients.features(shape)
        x = [raw[i] * self._scale[i] / measured_s for i in range(self._dim)]
        lam, gram, moment = self._forgetting, self._gram, self._moment
        for i in range(self._dim):
            moment[i] = lam * moment[i] + x[i]
            row = gram[i]
            for j in range(self._dim):
                row[j] = lam * row[j] + x[i] * x[j]
        self._coefficients = self._solve()
        return relative

    def _solve(self) -> StepPredictor:
        dim, anchor = self._dim, self._anchor
        matrix = [
            [self._gram[i][j] + (anchor if i == j else 0.0) for j in range(dim)] for i in range(dim)
        ]
        rhs = [self._moment[i] + anchor * self._prior[i] for i in range(dim)]
        theta = _solve_small(matrix, rhs)
        follow = self._anchor_follow
        for i in range(dim):
            self._prior[i] += follow * (theta[i] - self._prior[i])
        weights = self._coefficients.with_weights([t * s for t, s in zip(theta, self._scale)])
        self._rescale(theta)
        return weights

    def _rescale(self, theta: list[float]) -> None:
        """Re-express each weight that grew past :data:`RESCALE_BAND` times its unit in
        units of its new value (as :class:`OnlineKneeModel` does, and why): the data
        terms are unchanged, and the anchor counts ``anchor_weight`` steps of evidence at
        the new value instead of holding back a device slower than the file."""
        ratios = [t if t > RESCALE_BAND else 1.0 for t in theta]
        if all(r == 1.0 for r in ratios):
            return
        for i, r in enumerate(ratios):
            self._scale[i] *= r
            self._prior[i] /= r
            self._moment[i] *= r
            row = self._gram[i]
            for j, q in enumerate(ratios):
                row[j] *= r * q


def online_step_model(initial: StepPredictor, *, learn_knee: bool = True) -> OnlineStepModel | OnlineKneeModel:
    """The online model a policy recalibrates from ``initial``: a knee model's knee is
    learned too unless ``learn_knee`` is False."""
    if learn_knee and isinstance(initial, KneeStepModel):
        return OnlineKneeModel(initial)
    return OnlineStepModel(initial)


def _solve_small(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for the small normal equations."""
    n = len(rhs)
    rows = [matrix[i][:] + [rhs[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        head = rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / head[col]
            if factor:
                target = rows[r]
                for k in range(col, n + 1):
                    target[k] -= factor * head[k]
    solution = [0.0] * n
    for r in range(n - 1, -1, -1):
        acc = rows[r][n] - sum(rows[r][k] * solution[k] for k in range(r + 1, n))
        solution[r] = acc / rows[r][r]
    return solution
