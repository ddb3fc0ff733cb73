"""What the emulated GPU is told by its environment variables, validated once.

``FAIRBATCHING_EMULATED_GPU`` names a bundled profile (``llama3.1-8b-h100``, resolved in
``configs/profiles/``) or a path to a profile TOML file.  The optional variables:

* ``FAIRBATCHING_EMULATED_GPU_TIME_SCALE`` -- positive float multiplying every step time
  (default 1.0);
* ``FAIRBATCHING_EMULATED_GPU_SEED`` -- integer seed of the step-time noise (default 0; each
  data-parallel rank adds its rank);
* ``FAIRBATCHING_EMULATED_GPU_LOG`` -- file to which every emulated step is appended as one
  JSON line.

Any bad value raises :class:`EmulatedGpuConfigError`, whose message names the variable.
This module needs only the standard library and the project's profile loader.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sglang_ext.sim.profile import (
    HardwareProfile,
    ProfileError,
    available_profiles,
    bundled_profile_path,
    load_profile,
)

__all__ = [
    "ENV_LOG",
    "ENV_PROFILE",
    "ENV_SEED",
    "ENV_TIME_SCALE",
    "EmulatedGpuConfigError",
    "EmulationSettings",
    "resolve_profile",
]

ENV_PROFILE = "FAIRBATCHING_EMULATED_GPU"
ENV_TIME_SCALE = "FAIRBATCHING_EMULATED_GPU_TIME_SCALE"
ENV_SEED = "FAIRBATCHING_EMULATED_GPU_SEED"
ENV_LOG = "FAIRBATCHING_EMULATED_GPU_LOG"


class EmulatedGpuConfigError(ValueError):
    """A bad emulated-GPU setting; the message starts with the variable and its value."""


@dataclass(frozen=True, slots=True)
class EmulationSettings:
    """The emulated GPU's profile, time scale, noise seed and optional step-log path."""

    profile: HardwareProfile
    profile_source: str
    time_scale: float = 1.0
    seed: int = 0
    log_path: Path | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise EmulatedGpuConfigError(
                f"{ENV_TIME_SCALE}={self.time_scale!r}: must be a finite number > 0"
            )

    @classmethod
    def from_environment(cls, spec: str, environ: Mapping[str, str]) -> EmulationSettings:
        """Settings for profile ``spec`` with the optional variables read from ``environ``."""
        profile, source = resolve_profile(spec)
        return cls(
            profile=profile,
            profile_source=source,
            time_scale=_parse_time_scale(environ.get(ENV_TIME_SCALE)),
            seed=_parse_seed(environ.get(ENV_SEED)),
            log_path=_parse_log_path(environ.get(ENV_LOG)),
        )


def resolve_profile(spec: str) -> tuple[HardwareProfile, str]:
    """The profile named by ``spec`` (bundled name or TOML path) and the file it came from."""
    text = (spec or "").strip()
    if not text:
        raise EmulatedGpuConfigError(
            f"{ENV_PROFILE}={spec!r}: empty; give a bundled profile name "
            f"({', '.join(available_profiles()) or 'none bundled'}) or a path to a profile TOML"
        )
    looks_like_path = text.endswith(".toml") or "/" in text or Path(text).expanduser().is_file()
    try:
        path = Path(text).expanduser() if looks_like_path else bundled_profile_path(text)
        return load_profile(path), str(path)
    except ProfileError as exc:
        raise EmulatedGpuConfigError(f"{ENV_PROFILE}={spec!r}: {exc}") from None


def _parse_time_scale(raw: str | None) -> float:
    if raw is None or not raw.strip():
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        raise EmulatedGpuConfigError(
            f"{ENV_TIME_SCALE}={raw!r}: not a number (expected a float > 0, e.g. 2.0)"
        ) from None
    if not (math.isfinite(value) and value > 0):
        raise EmulatedGpuConfigError(f"{ENV_TIME_SCALE}={raw!r}: must be a finite number > 0")
    return value


def _parse_seed(raw: str | None) -> int:
    if raw is None or not raw.strip():
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise EmulatedGpuConfigError(f"{ENV_SEED}={raw!r}: not an integer") from None
    if value < 0:
        raise EmulatedGpuConfigError(f"{ENV_SEED}={raw!r}: must be >= 0")
    return value


def _parse_log_path(raw: str | None) -> Path | None:
    if raw is None or not raw.strip():
        return None
    path = Path(raw).expanduser()
    if path.is_dir():
        raise EmulatedGpuConfigError(f"{ENV_LOG}={raw!r}: is a directory, expected a file path")
    if not path.parent.is_dir():
        raise EmulatedGpuConfigError(
            f"{ENV_LOG}={raw!r}: directory {str(path.parent)!r} does not exist"
        )
    return path
