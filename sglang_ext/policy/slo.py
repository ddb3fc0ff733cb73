"""Per-request SLO targets and the token-deadline envelope (FairBatching §3.1).

``token_deadline(arrival, j) = arrival + ttft + tpot * j`` with ``j = 0`` the first
output token; a request's slack is the deadline of its next token minus now.
One SLO *spec* shape is shared by the simulator, the SGLang adapter and the SDK:
``{"ttft_ms": 500, "tpot_ms": 50}``, ``{"e2e_ms": 20000}`` or ``{"class": "interactive"}``.

Two SLO kinds (the multi-SLO setting of ``slo_aware_annealing.txt``):

- **TTFT+TPOT** (chat): met when TTFT <= ``ttft`` and the worst average rate after the
  first token <= ``tpot``.
- **end-to-end** (code, where output is useful only when complete): met when the last
  token arrives within ``e2e`` of arrival. The scheduler still needs a token envelope,
  so an e2e SLO carries a derived one: the first token is due at ``ttft`` (the class's
  ``ttft_ms`` if stated, else ``E2E_TTFT_SHARE`` of ``e2e``) and the remaining
  ``n - 1`` expected output tokens are paced evenly over what is left, so token
  ``n - 1`` is due exactly at ``arrival + e2e``. ``n`` is the expected output length
  (``with_expected_output``): the simulator's online per-class Gaussian mean, the
  server's ``max_new_tokens``; until one is known, ``NOMINAL_OUTPUT_TOKENS``.
  Every FairBatching rule then works on the envelope unchanged.
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


E2E_TTFT_SHARE = 0.25  # an e2e SLO's first-token budget when its class states none
NOMINAL_OUTPUT_TOKENS = 256  # an e2e envelope's output length before any is known


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float  # time to first token target (an e2e SLO's: its envelope's), seconds
    tpot_s: float  # time per output token target (an e2e SLO's: its envelope's), seconds
    e2e_s: float | None = None  # end-to-end target; set for the e2e kind only

    def __post_init__(self) -> None:
        for field_name in ("ttft_s", "tpot_s", "e2e_s"):
            value = getattr(self, field_name)
            if value is None and field_name == "e2e_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SloError(f"{field_name} must be a number, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise SloError(f"{field_name} must be a finite number > 0, got {value!r}")
        if self.e2e_s is not None and self.ttft_s >= self.e2e_s:
            raise SloError(
                f"an e2e SLO's first-token budget ({self.ttft_s * 1e3:g} ms) must be below "
                f"its e2e target ({self.e2e_s * 1e3:g} ms)"
            )

    @classmethod
    def from_ms(cls, ttft_ms: float, tpot_ms: float) -> Slo:
        _check_ms("ttft_ms", ttft_ms)
        _check_ms("tpot_ms", tpot_ms)
        return cls(ttft_ms / 1e3, tpot_ms / 1e3)

    @classmethod
    def end_to_end_ms(
        cls, e2e_ms: float, ttft_ms: float | None = None,
        expected_output_tokens: int = NOMINAL_OUTPUT_TOKENS,
    ) -> Slo:
        """An e2e SLO whose envelope expects ``expected_output_tokens`` output tokens."""
        _check_ms("e2e_ms", e2e_ms)
        if ttft_ms is not None:
            _check_ms("ttft_ms", ttft_ms)
        e2e_s = e2e_ms / 1e3
        ttft_s = E2E_TTFT_SHARE * e2e_s if ttft_ms is None else ttft_ms / 1e3
        if ttft_s >= e2e_s:
            raise SloError(f"ttft_ms {ttft_ms:g} must be below e2e_ms {e2e_ms:g}")
        return cls(ttft_s, ttft_s, e2e_s).with_expected_output(expected_output_tokens)

    @property
    def is_end_to_end(self) -> bool:
        return self.e2e_s is not None

    def with_expected_output(self, output_tokens: float) -> Slo:
        """This SLO with its envelope paced for ``output_tokens`` outputs (TTFT+TPOT: itself)."""
        if self.e2e_s is None:
            return self
        remaining = max(1.0, float(output_tokens) - 1.0)
        return Slo(self.ttft_s, (self.e2e_s - self.ttft_s) / remaining, self.e2e_s)

    def as_spec(self) -> dict[str, float]:
        """The explicit-target spec (``custom_params.slo``) that resolves to this SLO."""
        if self.e2e_s is None:
            return {"ttft_ms": self.ttft_s * 1e3, "tpot_ms": self.tpot_s * 1e3}
        return {"e2e_ms": self.e2e_s * 1e3, "ttft_ms": self.ttft_s * 1e3}

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

        Accepted: ``{"class": name}``, ``{"ttft_ms": x, "tpot_ms": y}``,
        ``{"e2e_ms": z}`` (optionally with ``ttft_ms``, its first-token budget), or a class
        with targets overridden. ``e2e_ms`` and ``tpot_ms`` exclude each other: naming
        ``e2e_ms`` makes the SLO end-to-end, naming ``tpot_ms`` makes it TTFT+TPOT.
        """
        if spec is None:
            return self.default
        if not isinstance(spec, Mapping):
            raise SloError(f"an SLO spec must be an object, got {type(spec).__name__}")
        unknown = set(spec) - {"class", "ttft_ms", "tpot_ms", "e2e_ms"}
        if unknown:
            raise SloError(
                f"unknown SLO key(s) {sorted(unknown)}; expected 'class', 'ttft_ms', "
                "'tpot_ms', 'e2e_ms'"
            )
        if "e2e_ms" in spec and "tpot_ms" in spec:
            raise SloError("give 'e2e_ms' (an end-to-end target) or 'tpot_ms', not both")
        base = self.default
        if "class" in spec:
            name = spec["class"]
            if not isinstance(name, str) or name not in self.classes:
                raise SloError(
                    f"unknown SLO class {name!r}; defined: {', '.join(sorted(self.classes))}"
                )
            base = self.classes[name]
        if "e2e_ms" in spec or (base.is_end_to_end and "tpot_ms" not in spec):
            e2e_ms = spec.get("e2e_ms", base.e2e_s * 1e3 if base.e2e_s else None)
            keeps_ttft = base.is_end_to_end and "e2e_ms" not in spec
            ttft_ms = spec.get("ttft_ms", base.ttft_s * 1e3 if keeps_ttft else None)
            return Slo.end_to_end_ms(e2e_ms, ttft_ms)
        ttft_ms = spec.get("ttft_ms", base.ttft_s * 1e3)
        tpot_ms = spec.get("tpot_ms", None if base.is_end_to_end else base.tpot_s * 1e3)
        return Slo.from_ms(ttft_ms, tpot_ms)

    def resolve_custom_params(self, custom_params: Any) -> Slo:
        """The SLO of a request from its ``custom_params`` (the shape shared by the SGLang
        routes and the SDK): ``{"slo": <spec>, ...other keys}``; no ``"slo"`` key means
        the default class."""
        return self.resolve(slo_spec_of(custom_params))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "<mapping>") -> SloCatalog:
        """Build from the TOML layout: ``default_class = "x"`` and ``[classes.x]`` with
        ``ttft_ms`` + ``tpot_ms`` (TTFT+TPOT) or ``e2e_ms`` (+ optional ``ttft_ms``)."""
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
                keys = set(table) if isinstance(table, Mapping) else None
                if keys not in ({"ttft_ms", "tpot_ms"}, {"e2e_ms"}, {"e2e_ms", "ttft_ms"}):
                    raise SloError(
                        f"[classes.{name}] must have exactly 'ttft_ms' and 'tpot_ms' "
                        "(TTFT+TPOT), or 'e2e_ms' with an optional 'ttft_ms' (end-to-end)"
                    )
                try:
                    if "e2e_ms" in keys:
                        classes[name] = Slo.end_to_end_ms(table["e2e_ms"], table.get("ttft_ms"))
                    else:
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
