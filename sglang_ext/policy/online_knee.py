"""Online recalibration of the knee model that learns its knee as well as its weights.

A device the starting file was not fitted to has its own floor (the weights' read) and its
own slope past the knee, so with the knee frozen at the file's value the slope has to
compromise between the two, and the floor it implies drifts with the mix of steps. Here
every knee on a log grid (plus the file's own) keeps its own exponentially forgetting,
anchored normal equations, exactly those of :class:`~sglang_ext.policy.step_model.OnlineStepModel`
for that knee; only the new-token regressor ``max(new_tokens, knee)`` differs between
them. The model in use is the candidate with the smallest forgetting-weighted squared
relative residual, and it changes only when another's is lower by ``switch_margin``
(hysteresis: noise does not flip the knee back and forth).

Each candidate's anchor starts at the file's model moved to its knee with the same
floor and slope (``a' = a + b * (knee - knee')``), so before any evidence every candidate
predicts what the file predicts for steps past both knees. The decode saturation (below which a
step's decode attention is not yet parallel) is learned the same way, over a small grid.
Each step updates every candidate's normal equations (in one compiled call where
``sglang_ext.policy.compiled`` is built, batched NumPy otherwise, the same floats) and
solves the one in use; every :data:`SELECT_INTERVAL` steps all are solved and the best is
chosen, so a step costs tens of microseconds, once per forward step.
"""

from __future__ import annotations

import math

import numpy as np

from sglang_ext.policy import compiled
from sglang_ext.policy.knee_step_model import KNEE_FLOORS, KneeStepModel
from sglang_ext.policy.step_error import LearnedModel, StepErrorLog, check_learning_rates
from sglang_ext.policy.step_shape import StepShape

#: the knees every learner considers beside its file's own: 8 to 4,096 tokens, ~26% apart
KNEE_GRID = tuple(float(k) for k in np.geomspace(8.0, 4096.0, 28))
#: the decode saturations (decodes below which attention is not yet parallel) considered
SATURATION_GRID = (0.0, 8.0, 16.0, 32.0)
MIN_SWITCH_SAMPLES = 16
SWITCH_MARGIN = 0.1
#: every candidate is solved (and the best one chosen) once per this many steps; the one
#: in use, every step
SELECT_INTERVAL = 8
RESCALE_BAND = 1.25


class OnlineKneeModel(LearnedModel):
    """:class:`~sglang_ext.policy.step_model.OnlineStepModel`'s contract (``observe``,
    ``coefficients``, ``error``) for a knee model whose knee is learned too."""

    def __init__(
        self,
        initial: KneeStepModel,
        *,
        forgetting: float = 0.995,
        anchor_weight: float = 2.0,
        anchor_follow: float = 0.002,
        error_window: int = 256,
        knees: tuple[float, ...] = KNEE_GRID,
        saturations: tuple[float, ...] = SATURATION_GRID,
        switch_margin: float = SWITCH_MARGIN,
    ) -> None:
        check_learning_rates(forgetting, anchor_weight, anchor_follow)
        if not 0.0 <= switch_margin < 1.0:
            raise ValueError(f"switch_margin must be in [0, 1), got {switch_margin}")
        knee_grid = sorted({float(k) for k in knees if k >= 0} | {float(initial.knee_tokens)})
        saturation_grid = sorted({float(v) for v in saturations if v >= 0}
                                 | {float(initial.decode_saturation)})
        grid = [(k, v) for k in knee_grid for v in saturation_grid]
        self._knees = np.asarray([k for k, _ in grid])
        self._saturations = np.asarray([v for _, v in grid])
        self._current = grid.index((float(initial.knee_tokens), float(initial.decode_saturation)))
        weights = np.asarray(initial.weights, dtype=float)
        self._floors = np.asarray(KNEE_FLOORS)
        priors = np.tile(weights, (len(grid), 1))
        priors[:, 0] = np.maximum(weights[0] + weights[1] * (initial.knee_tokens - self._knees), 0.0)
        self._scale = np.maximum(priors, self._floors)
        self._prior = priors / self._scale
        dim = weights.size
        self._identity = np.eye(dim)
        self._system = (np.empty((dim, dim)), np.empty(dim))  # the compiled path's matrix, rhs
        self._gram = np.zeros((len(grid), dim, dim))
        self._moment = np.zeros((len(grid), dim))
        self._count = 0.0
        self._forgetting = forgetting
        self._anchor = anchor_weight
        self._follow = anchor_follow
        self._switch_margin = switch_margin
        self._theta = self._prior.copy()
        self._errors = StepErrorLog(error_window)
        self._coefficients = initial.usable()

    @property
    def knee_tokens(self) -> float:
        return float(self._knees[self._current])

    def observe(self, shape: StepShape, measured_s: float) -> float:
        """Learn from one measured step; returns its relative error (measured - predicted) / measured."""
        if not measured_s > 0 or not math.isfinite(measured_s):
            raise ValueError(f"measured step time must be > 0, got {measured_s!r}")
        predicted = self._coefficients.predict_step(shape)
        relative = self._errors.record(shape, predicted, measured_s)
        lam = self._forgetting
        features = self._coefficients.features(shape)
        if compiled.knee_update is not None:
            compiled.knee_update(features, float(shape.new_tokens), shape.decode_requests,
                                 shape.decode_context, measured_s, lam, self._knees,
                                 self._saturations, self._scale, self._gram, self._moment)
        else:
            self._update(features, shape, measured_s)
        self._count = lam * self._count + 1.0
        if self._errors.samples % SELECT_INTERVAL == 0:
            self._solve_all()
            self._current = self._choose()
        else:
            self._solve_current()
        self._coefficients = self._model(self._current)
        return relative

    def _update(self, features: tuple[float, ...], shape: StepShape, measured_s: float) -> None:
        """Every candidate's normal equations forgotten and the step added (the reference
        of ``compiled.knee_update``)."""
        rows = np.empty((self._knees.size, len(features)))
        rows[:] = features
        rows[:, 1] = np.maximum(float(shape.new_tokens), self._knees)
        decodes = shape.decode_requests
        if decodes:
            saturations = self._saturations
            rows[:, 3] = shape.decode_context * np.where(
                saturations > decodes, saturations / decodes, 1.0)
        rows *= self._scale / measured_s
        lam = self._forgetting
        self._gram *= lam
        self._gram += rows[:, :, None] * rows[:, None, :]
        self._moment *= lam
        self._moment += rows

    def _solve_all(self) -> None:
        """Every candidate's solution; its anchor follows it (at the rate of
        ``SELECT_INTERVAL`` steps), and grown weights are rescaled."""
        matrix = self._gram + self._anchor * self._identity
        rhs = self._moment + self._anchor * self._prior
        theta = np.linalg.solve(matrix, rhs[:, :, None])[:, :, 0]
        self._prior += min(1.0, self._follow * SELECT_INTERVAL) * (theta - self._prior)
        self._theta = theta
        self._rescale()

    def _solve_current(self) -> None:
        index = self._current
        if compiled.knee_system is not None:
            matrix, rhs = self._system
            compiled.knee_system(index, self._anchor, self._gram, self._moment, self._prior,
                                 matrix, rhs)
        else:
            matrix = self._gram[index] + self._anchor * self._identity
            rhs = self._moment[index] + self._anchor * self._prior[index]
        self._theta[index] = np.linalg.solve(matrix, rhs)

    def _rescale(self) -> None:
        """Re-express every weight that grew past a factor of :data:`RESCALE_BAND` in units
        of its new value. The data terms are unchanged; the anchor then counts
        ``anchor_weight`` steps of evidence at the new value, so a device slower than the
        file is followed in a few rescalings rather than held back by an anchor that grows
        with the square of the move. A weight that must shrink needs no rescaling: in the
        file's units its regressor is large, and the data outweigh the anchor at once."""
        theta = self._theta
        moved = theta > RESCALE_BAND
        if not moved.any():
            return
        ratio = np.where(moved, theta, 1.0)
        self._scale *= ratio
        self._theta = theta / ratio
        self._prior /= ratio
        self._moment *= ratio
        self._gram *= ratio[:, :, None] * ratio[:, None, :]

    def residuals(self) -> np.ndarray:
        """Each candidate's forgetting-weighted mean squared relative residual."""
        theta = self._theta
        fit = np.einsum("ki,kij,kj->k", theta, self._gram, theta)
        total = self._count - 2.0 * np.einsum("ki,ki->k", theta, self._moment) + fit
        return np.maximum(total, 0.0) / max(self._count, 1e-12)

    def _choose(self) -> int:
        if self._errors.samples < MIN_SWITCH_SAMPLES:
            return self._current
        residuals = self.residuals()
        best = int(np.argmin(residuals))
        if residuals[best] < (1.0 - self._switch_margin) * residuals[self._current]:
            return best
        return self._current

    def _model(self, index: int) -> KneeStepModel:
        weights = (self._theta[index] * self._scale[index]).tolist()
        return KneeStepModel(*weights, float(self._knees[index]),
                             float(self._saturations[index])).usable()
