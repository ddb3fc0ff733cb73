"""Calibrating a hardware profile against a measured step-time grid.

:func:`fit_profile` adjusts a profile's efficiencies and overheads (:data:`FIT_FIELDS`) until
the simulator's own :class:`~sglang_ext.sim.gpu.RooflineGpu` reproduces the grid's measured
device times, and reports what is left over by kind of step.  The model stays a roofline: the
fit only moves physical rates and overheads; it never learns a free-form predictor.

Method: minimise ``sum(soft_l1(log(model / measured) / 0.02))`` over the rows with
``scipy.optimize.least_squares`` -- quadratic for errors under about 2 %, the absolute log
error above, so a few shapes the roofline cannot express (a batch of long-tailed contexts,
whose slowest sequence sets the attention time) do not drag the rest.  Efficiencies are
searched in [0.05, 1], the attention saturation on a log scale, overheads from 0.  Every fitted
value is rounded to four significant digits, and the residuals are those of the rounded
profile, so the TOML written by :func:`fitted_profile_toml` reproduces them exactly.  The fit
is deterministic: no random starts, one fixed starting point (the base's values).

``gpu.bandwidth_efficiency`` is not fitted by default: the weight-read time of a small step
and ``runtime.step_overhead_ms`` only appear as their sum on a grid, so the base's value (a
copy benchmark) is kept and the overhead takes the rest.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from sglang_ext.sim.fitting.step_grid import GRID_KINDS, GridRow
from sglang_ext.sim.gpu import RooflineGpu
from sglang_ext.sim.profile import ATTENTION_KERNELS, HardwareProfile, ModelSpec

__all__ = [
    "FIT_FIELDS",
    "FitField",
    "ProfileFit",
    "Residuals",
    "fit_profile",
    "fitted_profile_toml",
    "profile_toml",
    "residuals",
    "step_errors",
    "with_vocabulary",
]

_LOSS_SCALE = 0.02  # log error where the loss turns from quadratic to absolute
_SIGNIFICANT_DIGITS = 4


@dataclass(frozen=True, slots=True)
class FitField:
    """A profile field the fit adjusts: dotted name, search bounds, and where the search
    starts when the base leaves the field unset or outside the bounds."""

    dotted: str
    lower: float
    upper: float
    start: float
    log_scale: bool = False  # search log(value): for a field spanning decades

    @property
    def section(self) -> str:
        return self.dotted.split(".", 1)[0]

    @property
    def key(self) -> str:
        return self.dotted.split(".", 1)[1]


#: What :func:`fit_profile` adjusts by default.
FIT_FIELDS: tuple[FitField, ...] = (
    FitField("gpu.compute_efficiency", 0.05, 1.0, 0.7),
    FitField("gpu.attention_compute_efficiency", 0.05, 1.0, 0.7),
    FitField("gpu.attention_bandwidth_efficiency", 0.05, 1.0, 0.9),
    FitField("gpu.attention_saturation_tiles", 1.0, 1e5, 128.0, log_scale=True),
    FitField("runtime.step_overhead_ms", 0.0, 100.0, 1.0),
    FitField("runtime.per_request_overhead_us", 0.0, 1000.0, 8.0),
    FitField("runtime.prefill_overhead_ms", 0.0, 100.0, 0.0),
)


@dataclass(frozen=True, slots=True)
class Residuals:
    """Relative errors ``(model - measured) / measured`` of one kind of step, in percent."""

    kind: str  # a grid kind, or "all"
    rows: int
    median_signed_pct: float
    median_abs_pct: float
    p90_abs_pct: float
    worst_pct: float  # the signed error of largest magnitude


@dataclass(frozen=True, slots=True)
class ProfileFit:
    """A fitted profile, the base it started from, and its residuals against the grid."""

    profile: HardwareProfile
    base: HardwareProfile
    fitted: tuple[str, ...]  # dotted names of the fitted fields
    residuals: tuple[Residuals, ...]  # one per kind present, then "all"
    rows: int
    mean_abs_log_error: float  # mean |log(model / measured)| over the rows

    def residual(self, kind: str) -> Residuals:
        for entry in self.residuals:
            if entry.kind == kind:
                return entry
        raise KeyError(f"no rows of kind {kind!r}")


# -------------------------------------------------------------------------------------- fit


def fit_profile(
    rows: Sequence[GridRow],
    base: HardwareProfile,
    name: str,
    *,
    fit_fields: Sequence[FitField] = FIT_FIELDS,
    attention_kernels: str = "split",
) -> ProfileFit:
    """Fit ``fit_fields`` of ``base`` to the measured ``rows``; everything else is kept.

    ``base`` supplies the model (split its embedding and LM head out of ``num_params`` with
    :func:`with_vocabulary` first), the GPU's peaks and the fields not fitted.  The noise,
    stall and memory fields stay the base's: a grid of medians says nothing about them.
    ``attention_kernels`` is the measured engine's attention layout (``"split"``: prefill
    chunks and decodes in separate kernels, as in the bundled H100 grid).
    """
    if not rows:
        raise ValueError("fit_profile needs at least one grid row")
    if attention_kernels not in ATTENTION_KERNELS:
        raise ValueError(
            f"attention_kernels must be one of {', '.join(ATTENTION_KERNELS)}, "
            f"got {attention_kernels!r}"
        )
    template = replace(
        base,
        name=name,
        runtime=replace(base.runtime, attention_kernels=attention_kernels),
    )
    shapes = [row.shape for row in rows]
    log_measured = np.log([row.seconds for row in rows])
    lower = np.array([_to_search(f, f.lower) for f in fit_fields])
    upper = np.array([_to_search(f, f.upper) for f in fit_fields])
    start = np.array([_to_search(f, _start_value(f, template)) for f in fit_fields])

    def log_errors(x: np.ndarray) -> np.ndarray:
        values = [_from_search(f, v) for f, v in zip(fit_fields, x)]
        profile = _with_values(template, fit_fields, values)
        gpu = RooflineGpu(profile)
        return np.log([gpu.ideal_step_s(shape) for shape in shapes]) - log_measured

    result = least_squares(
        log_errors, start, bounds=(lower, upper), loss="soft_l1", f_scale=_LOSS_SCALE,
        x_scale="jac",
    )
    values = [_round(_from_search(f, v)) for f, v in zip(fit_fields, result.x)]
    profile = _with_values(template, fit_fields, values)
    errors = step_errors(profile, rows)
    return ProfileFit(
        profile=profile,
        base=base,
        fitted=tuple(f.dotted for f in fit_fields),
        residuals=residuals(profile, rows),
        rows=len(rows),
        mean_abs_log_error=float(np.mean(np.abs(np.log1p(errors)))),
    )


def _start_value(field: FitField, profile: HardwareProfile) -> float:
    value = _effective(profile, field)
    if value is None or not field.lower <= value <= field.upper:
        return field.start
    return value


def _effective(profile: HardwareProfile, field: FitField) -> float | None:
    """The field's value as the model uses it (an unset attention efficiency is the
    corresponding linear-layer one)."""
    value = getattr(getattr(profile, field.section), field.key)
    if value is None and field.dotted == "gpu.attention_compute_efficiency":
        return profile.gpu.compute_efficiency
    if value is None and field.dotted == "gpu.attention_bandwidth_efficiency":
        return profile.gpu.bandwidth_efficiency
    return value


def _to_search(field: FitField, value: float) -> float:
    return math.log(value) if field.log_scale else value


def _from_search(field: FitField, value: float) -> float:
    return math.exp(value) if field.log_scale else float(value)


def _round(value: float) -> float:
    return float(f"{value:.{_SIGNIFICANT_DIGITS}g}")


def _with_values(
    profile: HardwareProfile, fit_fields: Sequence[FitField], values: Iterable[float]
) -> HardwareProfile:
    changes: dict[str, dict[str, float]] = {}
    for field, value in zip(fit_fields, values):
        changes.setdefault(field.section, {})[field.key] = value
    sections = {
        section: replace(getattr(profile, section), **values_)
        for section, values_ in changes.items()
    }
    return replace(profile, **sections)


# -------------------------------------------------------------------------------- residuals


def step_errors(profile: HardwareProfile, rows: Sequence[GridRow]) -> np.ndarray:
    """``(model - measured) / measured`` of every row (noise-free model time)."""
    gpu = RooflineGpu(profile)
    model = np.array([gpu.ideal_step_s(row.shape) for row in rows])
    measured = np.array([row.seconds for row in rows])
    return model / measured - 1.0


def residuals(profile: HardwareProfile, rows: Sequence[GridRow]) -> tuple[Residuals, ...]:
    """Error statistics of ``profile`` against ``rows``: per grid kind present, then "all"."""
    errors = step_errors(profile, rows) * 100.0
    kinds = np.array([row.kind for row in rows])
    table = [
        _summarise(kind, errors[kinds == kind]) for kind in GRID_KINDS if np.any(kinds == kind)
    ]
    return (*table, _summarise("all", errors))


def _summarise(kind: str, errors: np.ndarray) -> Residuals:
    magnitude = np.abs(errors)
    return Residuals(
        kind=kind,
        rows=len(errors),
        median_signed_pct=float(np.median(errors)),
        median_abs_pct=float(np.median(magnitude)),
        p90_abs_pct=float(np.percentile(magnitude, 90)),
        worst_pct=float(errors[int(np.argmax(magnitude))]),
    )


# ----------------------------------------------------------------------------- model facts


def with_vocabulary(model: ModelSpec, vocab_size: int, *, tied: bool) -> ModelSpec:
    """``model`` with its embedding and LM head split out of ``num_params``.

    Both are ``vocab_size * hidden_size``; a tied embedding is the LM head's matrix, streamed
    once by the head, so it adds no separate embedding parameters.
    """
    vocab_params = float(vocab_size * model.hidden_size)
    return replace(
        model, embedding_params=0.0 if tied else vocab_params, lm_head_params=vocab_params
    )


# ------------------------------------------------------------------------------------- TOML


def profile_toml(
    profile: HardwareProfile, *, header: str = "", fitted: Iterable[str] = ()
) -> str:
    """``profile`` as TOML that :func:`~sglang_ext.sim.profile.load_profile` reads back equal.

    ``header`` becomes leading ``#`` comment lines; fields named in ``fitted`` (dotted) get a
    ``# fitted`` note.  Unset optional fields are left out.
    """
    marked = set(fitted)
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines.append(f"name = {_toml_value(profile.name)}")
    sections = ("model", "gpu", "runtime") + (("service",) if profile.service else ())
    for section in sections:
        lines += ["", f"[{section}]"]
        spec = getattr(profile, section)
        for f in fields(spec):
            value = getattr(spec, f.name)
            if value is None:
                continue
            note = "  # fitted" if f"{section}.{f.name}" in marked else ""
            lines.append(f"{f.name} = {_toml_value(value)}{note}")
    return "\n".join(lines) + "\n"


def fitted_profile_toml(fit: ProfileFit, *, grid: str, command: str) -> str:
    """The fitted profile as TOML, with a header saying how it was made and how well it fits."""
    overall = fit.residual("all")
    header = "\n".join([
        f"{fit.profile.name}: {fit.profile.model.name} on {fit.profile.gpu.name}, fitted to a",
        f"measured step-time grid ({grid}, {fit.rows} rows) by",
        "sglang_ext.sim.fitting.profile_fit.fit_profile, starting from the profile "
        f"{fit.base.name!r}.",
        f"Regenerate with: {command}",
        "Error (model - measured) / measured over all rows: median "
        f"{overall.median_signed_pct:+.1f}%, median |error| {overall.median_abs_pct:.1f}%,",
        f"p90 |error| {overall.p90_abs_pct:.1f}%.  Noise, stall and memory fields are the base's.",
        "Every field is documented in configs/profiles/README.md.",
    ])
    return profile_toml(fit.profile, header=header, fitted=fit.fitted)


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        raise TypeError(f"no profile field is a bool, got {value!r}")
    if isinstance(value, int):
        return str(value)
    text = repr(float(value))
    if abs(value) >= 1e7 and "e" not in text:  # 8.03e9, not 8030000000.0
        text = next(
            t for t in (f"{value:.{d}e}" for d in range(16)) if float(t) == value
        )
        mantissa, exponent = text.split("e")
        text = f"{mantissa}e{int(exponent)}"
    return text
