"""A measured step-time grid turned into the two files that use it: a simulator hardware
profile fitted to it (:func:`~sglang_ext.sim.fitting.profile_fit.fit_profile`) and a step-model file
fitted to it (:func:`~sglang_ext.policy.step_model.fit_step_model`).

The grid's JSON sidecar (``<grid>.json``, written by ``benchmarks/gpu/step_profiler.py``) names the
model it ran (``config``: layers, hidden, heads, kv_heads, head_dim, inter, vocab, tied).  A
base profile supplies what a grid cannot know: the GPU's peak rates and memory, and the noise,
stall and memory fields.  When the grid's model is the base's, the base's model is kept with
its embedding and LM head split out; when it is another model, the model section is built
from the sidecar, so one GPU profile serves every model measured on that GPU.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sglang_ext.policy.step_model import StepModelFile, fit_step_model
from sglang_ext.sim.fitting.profile_fit import ProfileFit, fit_profile, with_vocabulary
from sglang_ext.sim.fitting.step_grid import GridError, GridRow
from sglang_ext.sim.profile import HardwareProfile, ModelSpec

__all__ = ["GridFit", "base_for_grid", "fit_grid", "model_from_config", "read_grid_meta"]

CONFIG_KEYS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "vocab", "tied")


@dataclass(frozen=True, slots=True)
class GridFit:
    """Both fits of one grid: the simulator's GPU and the scheduler's predictor."""

    profile: ProfileFit
    step_model: StepModelFile
    step_model_errors: tuple[float, ...]  # |predicted - measured| / measured per row


def read_grid_meta(grid: Path) -> dict[str, Any]:
    """The grid's JSON sidecar (``grid`` with suffix ``.json``), or ``{}`` without one."""
    sidecar = grid.with_suffix(".json")
    if not sidecar.is_file():
        return {}
    try:
        meta = json.loads(sidecar.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GridError(f"{sidecar}: not JSON: {exc}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config", {}), dict):
        raise GridError(f"{sidecar}: expected a JSON object with a `config` object")
    return meta


def model_from_config(config: Mapping[str, Any], name: str) -> ModelSpec:
    """A dense decoder's :class:`ModelSpec` from a grid's ``config``; the parameter count is
    the decoder's (attention, gated MLP, norms) plus the embedding and, untied, the LM head."""
    missing = [key for key in CONFIG_KEYS if key not in config]
    if missing:
        raise GridError(f"grid config lacks {', '.join(missing)}")
    values = {key: config[key] for key in CONFIG_KEYS if key != "tied"}
    bad = [key for key, v in values.items() if isinstance(v, bool) or not isinstance(v, int) or v <= 0]
    if bad or not isinstance(config["tied"], bool):
        raise GridError(f"grid config: {', '.join(bad) or 'tied'} must be "
                        + ("positive integers" if bad else "true or false"))
    hidden, heads, kv_heads, head_dim = (values[k] for k in ("hidden", "heads", "kv_heads", "head_dim"))
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    layer = attention + 3 * hidden * values["inter"] + 2 * hidden
    vocab_params = values["vocab"] * hidden
    params = values["layers"] * layer + hidden + vocab_params * (1 if config["tied"] else 2)
    model = ModelSpec(name=name, num_layers=values["layers"], hidden_size=hidden,
                      num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                      num_params=float(params))
    return with_vocabulary(model, values["vocab"], tied=config["tied"])


def base_for_grid(base: HardwareProfile, meta: Mapping[str, Any]) -> HardwareProfile:
    """``base`` with the grid's model: the base's own (vocabulary split out) when the shapes
    match, else one built from the sidecar's ``config``; ``base`` itself without a config."""
    config = meta.get("config")
    if not config:
        return base
    model = base.model
    same = (model.num_layers, model.hidden_size, model.num_attention_heads, model.num_kv_heads,
            model.head_dim) == tuple(config.get(k) for k in ("layers", "hidden", "heads",
                                                            "kv_heads", "head_dim"))
    if not same:
        return replace(base, model=model_from_config(config, str(meta.get("model", "measured"))))
    if model.lm_head_params or "vocab" not in config:
        return base
    return replace(base, model=with_vocabulary(model, int(config["vocab"]),
                                               tied=bool(config.get("tied"))))


def fit_grid(rows: Sequence[GridRow], base: HardwareProfile, name: str, meta: Mapping[str, Any],
             form: str = "knee") -> GridFit:
    """Fit a profile named ``name`` (from ``base``, see :func:`base_for_grid`) and a step model
    of ``form`` (a knee file carries the linear fit too) to the measured ``rows``."""
    profile = fit_profile(rows, base_for_grid(base, meta), name)
    shapes, seconds = [r.shape for r in rows], [r.seconds for r in rows]
    step_model = fit_step_model(form, shapes, seconds)
    errors = tuple(abs(step_model.model.predict_step(s) - t) / t
                   for s, t in zip(shapes, seconds, strict=True))
    return GridFit(profile=profile, step_model=step_model, step_model_errors=errors)
