"""How well each step-time predictor fits a measured grid (``sim predictor-check``).

Held out: each form is fitted on a seeded random 2/3 of the rows and its relative error
``|predicted - measured| / measured`` read on the other 1/3, overall and per kind of step.

Online: each form starts from its held-out fit (the offline calibration a deployment
starts from) and the whole grid is streamed to :class:`OnlineStepModel` in a seeded
serving-like order — stretches of 4-12 decode-only steps, each followed by a burst of
1-4 prefill, mixed or random steps — so the model has to stay right through decode-only
phases and the prefills that follow them. Each step is predicted before it is observed;
the error counts after ``warmup`` steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sglang_ext.policy.step_model import (
    STEP_FORMS,
    OnlineStepModel,
    StepModelError,
    StepPredictor,
    fit_step_model,
)
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.sim.fitting.step_grid import GRID_KINDS, GridRow

#: fewest grid rows a check accepts: the knee fit needs 8 on its 2/3 split
MIN_CHECK_ROWS = 12
DEFAULT_WARMUP = 50


@dataclass(frozen=True, slots=True)
class ErrorStats:
    rows: int
    mape: float  # mean |relative error|
    p90: float
    worst: float

    @classmethod
    def of(cls, errors: Sequence[float]) -> ErrorStats:
        values = np.abs(np.asarray(errors, dtype=float))
        if values.size == 0:
            return cls(0, float("nan"), float("nan"), float("nan"))
        return cls(int(values.size), float(values.mean()), float(np.percentile(values, 90)),
                   float(values.max()))


@dataclass(frozen=True, slots=True)
class FormCheck:
    form: str
    fitted: StepPredictor  # on the 2/3 split
    held_out: dict[str, ErrorStats]  # "all" and each kind present
    online: ErrorStats


@dataclass(frozen=True, slots=True)
class PredictorCheck:
    rows: int
    train_rows: int
    seed: int
    warmup: int
    forms: tuple[FormCheck, ...]

    @property
    def best(self) -> FormCheck:
        return min(self.forms, key=lambda check: check.held_out["all"].mape)


def split(rows: Sequence[GridRow], seed: int) -> tuple[list[GridRow], list[GridRow]]:
    """A seeded random 2/3 to fit on, the rest to hold out."""
    order = np.random.default_rng(seed).permutation(len(rows))
    cut = len(rows) * 2 // 3
    return [rows[i] for i in order[:cut]], [rows[i] for i in order[cut:]]


def serving_order(rows: Sequence[GridRow], seed: int) -> list[GridRow]:
    """The whole grid as a serving-like stream (module docstring)."""
    rng = np.random.default_rng(seed)
    decodes = [rows[i] for i in rng.permutation(len(rows)) if rows[i].kind == "decode"]
    others = [rows[i] for i in rng.permutation(len(rows)) if rows[i].kind != "decode"]
    stream: list[GridRow] = []
    while decodes or others:
        for _ in range(int(rng.integers(4, 13))):
            if decodes:
                stream.append(decodes.pop())
        for _ in range(int(rng.integers(1, 5))):
            if others:
                stream.append(others.pop())
    return stream


def synthetic_serving_stream(seed: int, steps: int) -> list[StepShape]:
    """Step shapes as a server meets them, for a device without a grid (a simulated GPU):
    decode-only stretches of 4-12 steps over 1-128 requests at 256-4,096 tokens of
    context each, each followed by 1-4 prefill or mixed steps (chunks of 16-4,096 tokens,
    log-uniform; three in ten after a cached prefix of up to 8,192 tokens; six in ten
    beside the decodes)."""
    rng = np.random.default_rng(seed)
    out: list[StepShape] = []
    while len(out) < steps:
        batch, context = int(rng.integers(1, 129)), int(rng.integers(256, 4097))
        out += [StepShape(0, 0.0, 0, batch, batch * context, 0)] * int(rng.integers(4, 13))
        for _ in range(int(rng.integers(1, 5))):
            chunk = int(math.exp(rng.uniform(math.log(16), math.log(4096))))
            prefix = int(rng.integers(0, 8192)) if rng.random() < 0.3 else 0
            decodes = batch if rng.random() < 0.6 else 0
            out.append(StepShape(chunk, chunk * (prefix + (chunk + 1) / 2), prefix, decodes,
                                 decodes * context, 1))
    return out[:steps]


def check_predictors(
    rows: Sequence[GridRow], *, seed: int = 0, warmup: int = DEFAULT_WARMUP,
    forms: Sequence[str] = STEP_FORMS,
) -> PredictorCheck:
    """Held-out and online errors of each form on ``rows``; StepModelError when the rows
    cannot be fitted (too few, or not varied enough)."""
    if len(rows) < MIN_CHECK_ROWS:
        raise StepModelError(f"too few rows to fit and hold out: {len(rows)}, need at least "
                             f"{MIN_CHECK_ROWS}")
    if warmup < 0 or warmup >= len(rows):
        raise StepModelError(f"warm-up of {warmup} steps leaves nothing of {len(rows)} rows to score")
    train, test = split(rows, seed)
    stream = serving_order(rows, seed)
    checks = []
    for form in forms:
        fitted = fit_step_model(form, [r.shape for r in train], [r.seconds for r in train]).model
        by_kind: dict[str, list[float]] = {"all": []}
        for row in test:
            error = fitted.predict_step(row.shape) / row.seconds - 1.0
            by_kind["all"].append(error)
            by_kind.setdefault(row.kind, []).append(error)
        online = OnlineStepModel(fitted)
        errors = [online.observe(row.shape, row.seconds) for row in stream]
        held_out = {kind: ErrorStats.of(by_kind[kind]) for kind in ("all", *GRID_KINDS)
                    if kind in by_kind}
        checks.append(FormCheck(form, fitted, held_out, ErrorStats.of(errors[warmup:])))
    return PredictorCheck(len(rows), len(train), seed, warmup, tuple(checks))


def render(check: PredictorCheck, source: str) -> str:
    kinds = ", ".join(f"{kind} {n}" for kind, n in _kind_counts(check).items())
    lines = [
        f"grid: {source} ({check.rows} rows)",
        f"held out (seed {check.seed}): fit on {check.train_rows} rows, error on the other "
        f"{check.rows - check.train_rows} ({kinds})",
        f"{'predictor':<10} {'kind':<8} {'rows':>5} {'MAPE':>7} {'p90':>7} {'worst':>7}",
    ]
    for form in check.forms:
        for kind, stats in form.held_out.items():
            lines.append(_stats_row(form.form, kind, stats))
    lines += [
        "",
        f"online: starts from the held-out fit, the whole grid streamed in serving order "
        f"(seed {check.seed}: decode-only stretches, prefill bursts), error after "
        f"{check.warmup} warm-up steps",
        f"{'predictor':<10} {'kind':<8} {'steps':>5} {'MAPE':>7} {'p90':>7} {'worst':>7}",
    ]
    lines += [_stats_row(form.form, "all", form.online) for form in check.forms]
    best = check.best
    lines += ["", f"best: {best.form} MAPE {best.held_out['all'].mape * 100:.1f}%"]
    return "\n".join(lines)


def _kind_counts(check: PredictorCheck) -> dict[str, int]:
    first = check.forms[0].held_out
    return {kind: stats.rows for kind, stats in first.items() if kind != "all"}


def _stats_row(form: str, kind: str, stats: ErrorStats) -> str:
    return (f"{form:<10} {kind:<8} {stats.rows:>5} {stats.mape * 100:>6.1f}% "
            f"{stats.p90 * 100:>6.1f}% {stats.worst * 100:>6.1f}%")


def as_json(check: PredictorCheck, source: str) -> dict:
    def stats(s: ErrorStats) -> dict:
        return {"rows": s.rows, "mape": s.mape, "p90": s.p90, "worst": s.worst}

    return {
        "grid": source, "rows": check.rows, "train_rows": check.train_rows, "seed": check.seed,
        "warmup": check.warmup, "best": check.best.form,
        "forms": {
            form.form: {
                "fitted": {"form": form.fitted.form, **form.fitted.fields()},
                "held_out": {kind: stats(s) for kind, s in form.held_out.items()},
                "online": stats(form.online),
            }
            for form in check.forms
        },
    }
