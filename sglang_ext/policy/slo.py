"""Per-request SLO targets and the token-deadline envelope (FairBatching §3.1).

``token_deadline(arrival, j) = arrival + ttft + tpot * j`` with ``j = 0`` the first
output token; a request's slack is the deadline of its next token minus now.
One SLO *spec* shape is shared by the simulator, the SGLang adapter and the SDK:
``{"ttft_ms": 500, "tpot_ms": 50}`` or ``{"class": "interactive"}``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from sglang_ext.policy.tomlfile import read_toml


class SloError(ValueError):
    """A malformed SLO spec or SLO catalog; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float  # time to first token target, seconds
    tpot_s: float  # time per output token target, seconds

    def __post_init__(self) -> None:
        for field_name in ("ttft_s", "tpot_s"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SloError(f"{field_name} must be a number, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise SloError(f"{field_name} must be a finite number > 0, got {value!r}")

    @classmethod
    def from_ms(cls, ttft_ms: float, tpot_ms: float) -> Slo:
        _check_ms("ttft_ms", ttft_ms)
        _check_ms("tpot_ms", tpot_ms)
        return cls(ttft_ms / 1e3, tpot_ms / 1e3)

    def token_deadline(self, arrival: float, index: int) -> float:
        """Deadline of output token ``index`` (0 = first token) of a request arriving at ``arrival``."""
        return arrival + self.ttft_s + self.tpot_s * index


def slack(arrival: float, slo: Slo, next_output_index: int, now: float) -> float:
    """Seconds until the deadline of the request's next output token (negative when late)."""
    return arrival + slo.ttft_s + slo.tpot_s * next_output_index - now


SLO_PARAM_KEY = "slo"


def slo_spec_of(custom_params: Any) -> Mapping[str, Any] | None:
    """The SLO spec inside a request's ``custom_params``, or ``None`` when it has none."""
    if custom_params is None:
        return None
    if not isinstance(custom_params, Mapping):
        raise SloError(f"custom_params must be an object, got {type(custom_params).__name__}")
    spec = custom_params.get(SLO_PARAM_KEY)
    if spec is not None and not isinstance(spec, Mapping):
        raise SloError(
            f"custom_params.{SLO_PARAM_KEY} must be an object such as "
            f'{{"ttft_ms": 500, "tpot_ms": 50}} or {{"class": "interactive"}}, got {spec!r}'
        )
    return spec


def _check_ms(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SloError(f"{name} must be a number of milliseconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise SloError(f"{name} must be > 0 milliseconds, got {value!r}")


@dataclass(frozen=True)
class SloCatalog:
    """Named SLO classes and the default class (the global SLO used for PAB)."""

    default_class: str
    classes: Mapping[str, Slo]

    def __post_init__(self) -> None:
        if not self.classes:
            raise SloError("an SLO catalog needs at least one class")
        if self.default_class not in self.classes:
            raise SloError(
                f"default_class {self.default_class!r} is not a defined class; "
                f"defined: {', '.join(sorted(self.classes))}"
            )
        object.__setattr__(self, "classes", MappingProxyType(dict(self.classes)))

    @property
    def default(self) -> Slo:
        return self.classes[self.default_class]

    def resolve(self, spec: Mapping[str, Any] | None) -> Slo:
        """Turn a request's SLO spec into targets; ``None`` or ``{}`` means the default class.

        Accepted: ``{"class": name}``, ``{"ttft_ms": x, "tpot_ms": y}``, or a class with
        one or both targets overridden.
        """
        if spec is None:
            return self.default
        if not isinstance(spec, Mapping):
            raise SloError(f"an SLO spec must be an object, got {type(spec).__name__}")
        unknown = set(spec) - {"class", "ttft_ms", "tpot_ms"}
        if unknown:
            raise SloError(
                f"unknown SLO key(s) {sorted(unknown)}; expected 'class', 'ttft_ms', 'tpot_ms'"
            )
        base = self.default
        if "class" in spec:
            name = spec["class"]
            if not isinstance(name, str) or name not in self.classes:
                raise SloError(
                    f"unknown SLO class {name!r}; defined: {', '.join(sorted(self.classes))}"
                )
            base = self.classes[name]
        ttft_ms = spec.get("ttft_ms", base.ttft_s * 1e3)
        tpot_ms = spec.get("tpot_ms", base.tpot_s * 1e3)
        return Slo.from_ms(ttft_ms, tpot_ms)

    def resolve_custom_params(self, custom_params: Any) -> Slo:
        """The SLO of a request from its ``custom_params`` (the shape shared by the SGLang
        routes and the SDK): ``{"slo": <spec>, ...other keys}``; no ``"slo"`` key means
        the default class."""
        return self.resolve(slo_spec_of(custom_params))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "<mapping>") -> SloCatalog:
        """Build from the TOML layout: ``default_class = "x"`` and ``[classes.x] ttft_ms/tpot_ms``."""
        try:
            unknown = set(data) - {"default_class", "classes"}
            if unknown:
                raise SloError(f"unknown top-level key(s) {sorted(unknown)}")
            default_class = data.get("default_class")
            if not isinstance(default_class, str):
                raise SloError("missing string field 'default_class'")
            raw_classes = data.get("classes")
            if not isinstance(raw_classes, Mapping) or not raw_classes:
                raise SloError("missing table 'classes' with at least one [classes.NAME]")
            classes = {}
            for name, table in raw_classes.items():
                if not isinstance(table, Mapping) or set(table) != {"ttft_ms", "tpot_ms"}:
                    raise SloError(f"[classes.{name}] must have exactly 'ttft_ms' and 'tpot_ms'")
                try:
                    classes[name] = Slo.from_ms(table["ttft_ms"], table["tpot_ms"])
                except SloError as exc:
                    raise SloError(f"[classes.{name}]: {exc}") from None
            return cls(default_class, classes)
        except SloError as exc:
            raise SloError(f"{source}: {exc}") from None

    @classmethod
    def from_toml(cls, path: str | Path) -> SloCatalog:
        return cls.from_mapping(read_toml(path, SloError, "SLO"), str(path))

    @classmethod
    def single(cls, slo: Slo, name: str = "default") -> SloCatalog:
        return cls(name, {name: slo})
