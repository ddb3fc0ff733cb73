"""The emulated GPU the real-server benchmarks (and the end-to-end tests) run SGLang on:
its profile and time scale, the tiny model's context, and FairBatching's shipped config
made for it."""

from __future__ import annotations

from pathlib import Path

from benchmarks.support.paths import REPO

PROFILE = "llama3.1-8b-h100"
TIME_SCALE = 2.0  # emulated step times are the profile's, doubled
TINY_MODEL_CONTEXT = 8192  # prompt + output tokens
MAX_PROMPT_TOKENS = 6144  # trace prompts are capped here, leaving room for the output


def write_fb_config(directory: Path) -> Path:
    """``DIRECTORY/fairbatching.toml``: the shipped config with its initial step model
    scaled by :data:`TIME_SCALE` (as a deployment starts from coefficients fitted on its
    own GPU) and the SLO classes of ``configs/slo.toml``."""
    from sglang_ext.policy.step_model import StepModelFile

    shipped_path = REPO / "configs" / "fairbatching.toml"
    shipped_model = StepModelFile.load(REPO / "configs" / "step_models" / "llama3.1-8b-h100.toml")
    shipped_model.scaled(TIME_SCALE).save(directory / "step_model.toml")
    text = shipped_path.read_text()
    for old, new in (
        ('slo_file = "slo.toml"', f'slo_file = "{REPO / "configs" / "slo.toml"}"'),
        ('step_model = "step_models/llama3.1-8b-h100.toml"', 'step_model = "step_model.toml"'),
    ):
        if old not in text:
            raise SystemExit(f"configs/fairbatching.toml no longer contains {old!r}; "
                             "update benchmarks/server/emulated.py")
        text = text.replace(old, new)
    config = directory / "fairbatching.toml"
    config.write_text(text)
    return config
