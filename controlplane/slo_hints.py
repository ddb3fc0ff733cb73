"""A request's SLO from the hints clients already send to say how urgent it is, for a
request that names no ``slo`` of its own (an explicit ``slo`` wins over every hint). Pure.

- OpenAI's ``service_tier`` (the ``openai`` client sends it natively): a class by
  :attr:`SloHints.service_tiers` (shipped: ``flex`` -> ``relaxed``, ``priority`` ->
  ``interactive``); a tier the table does not list leaves the default class;
- smg's ``x-smg-priority`` header: one of smg's classes (``system``, ``interactive``,
  ``default``, ``bulk``) mapped by :attr:`SloHints.smg_priorities`, or an SLO class's name;
- SGLang's ``priority`` (larger is more urgent, as SGLang orders it by default): a rank
  into :attr:`SloHints.priority_classes`, least urgent first, clamped to its ends;
- llm-d's ``x-llm-d-slo-ttft-ms`` and ``x-llm-d-slo-tpot-ms`` headers: explicit targets,
  overriding those of the class the other hints name (or of the default class).

Hints that name different classes conflict, and a malformed one is refused: either is a
:class:`HintError` naming the field, which the gateway answers with a 400. A class name
the ranks do not define is refused by them, as for an explicit ``slo``.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from controlplane.protocol import MAX_SLO_CLASS_NAME, SloSpec

SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")  # OpenAI's values
CLASS_HEADER = "x-smg-priority"
TTFT_HEADER = "x-llm-d-slo-ttft-ms"
TPOT_HEADER = "x-llm-d-slo-tpot-ms"


class HintError(ValueError):
    """A request's hints that cannot be honoured; the message names the field."""


class HintConfigError(ValueError):
    """A hint table that cannot be used; refused at start-up."""


@dataclass(frozen=True)
class SloHints:
    """How hints map to SLO classes (``--slo-hints``; the shipped ``configs/slo_hints.toml``)."""

    service_tiers: Mapping[str, str] = field(default_factory=lambda: {
        "flex": "relaxed", "priority": "interactive"})
    priority_classes: tuple[str, ...] = ("relaxed", "standard", "interactive")  # empty: ignored
    smg_priorities: Mapping[str, str] = field(default_factory=lambda: {
        "system": "interactive", "interactive": "interactive", "default": "standard", "bulk": "relaxed"})

    def __post_init__(self) -> None:
        unknown = sorted(set(self.service_tiers) - set(SERVICE_TIERS))
        if unknown:
            raise HintConfigError(f"service_tier: unknown tier(s) {unknown}; OpenAI's are "
                                  f"{', '.join(SERVICE_TIERS)}")
        for where, name in [*((f"service_tier.{t}", c) for t, c in self.service_tiers.items()),
                            *(("priority_classes", c) for c in self.priority_classes),
                            *((f"smg_priority.{k}", c) for k, c in self.smg_priorities.items())]:
            if not isinstance(name, str) or not 0 < len(name) <= MAX_SLO_CLASS_NAME:
                raise HintConfigError(f"{where}: expected an SLO class name, got {name!r}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "<mapping>",
                     defaults: SloHints | None = None) -> SloHints:
        """From the TOML layout: ``service_tier = {flex = "relaxed", ...}`` and
        ``priority_classes = ["relaxed", ...]`` (least urgent first); a missing key keeps
        ``defaults``'s (the shipped table unless given)."""
        unknown = sorted(set(data) - {"service_tier", "priority_classes", "smg_priority"})
        if unknown:
            raise HintConfigError(f"{source}: unknown key(s) {unknown}; expected service_tier, "
                                  "priority_classes, smg_priority")
        defaults = defaults or cls()
        tiers = data.get("service_tier", defaults.service_tiers)
        classes = data.get("priority_classes", defaults.priority_classes)
        smg = data.get("smg_priority", defaults.smg_priorities)
        for key, table in (("service_tier", tiers), ("smg_priority", smg)):
            if not isinstance(table, Mapping):
                raise HintConfigError(f"{source}: {key} must be a table of name = class")
        if not isinstance(classes, Sequence) or isinstance(classes, str):
            raise HintConfigError(f"{source}: priority_classes must be a list of classes (empty: "
                                  "priority is no hint)")
        try:
            return cls(dict(tiers), tuple(classes), dict(smg))
        except HintConfigError as error:
            raise HintConfigError(f"{source}: {error}") from None

    @classmethod
    def load(cls, path: Path) -> SloHints:
        try:
            with path.open("rb") as handle:
                data = tomllib.load(handle)
        except OSError as error:
            raise HintConfigError(f"{path}: {error.strerror or error}") from None
        except tomllib.TOMLDecodeError as error:
            raise HintConfigError(f"{path}: not TOML: {error}") from None
        return cls.from_mapping(data, str(path))

    @property
    def classes(self) -> frozenset[str]:
        """Every class the table names."""
        return frozenset((*self.service_tiers.values(), *self.priority_classes,
                          *self.smg_priorities.values()))

    def within(self, classes: frozenset[str] | set[str]) -> SloHints:
        """The table less every entry naming a class not in ``classes``."""
        return SloHints({t: c for t, c in self.service_tiers.items() if c in classes},
                        tuple(c for c in self.priority_classes if c in classes),
                        {k: c for k, c in self.smg_priorities.items() if c in classes})

    def slo(self, headers: Mapping[str, str], service_tier: str | None = None,
            priority: int | None = None) -> SloSpec | None:
        """The SLO the hints name; None when there are none (the default class)."""
        named: list[tuple[str, str]] = []  # (the field, the class it names)
        if service_tier is not None:
            if service_tier not in SERVICE_TIERS:
                raise HintError(f"service_tier: expected one of {', '.join(SERVICE_TIERS)}, "
                                f"got {service_tier!r}")
            if service_tier in self.service_tiers:
                named.append((f"service_tier {service_tier!r}", self.service_tiers[service_tier]))
        header_class = headers.get(CLASS_HEADER)
        if header_class is not None:
            header_class = header_class.strip()
            if not 0 < len(header_class) <= MAX_SLO_CLASS_NAME:
                raise HintError(f"{CLASS_HEADER}: expected an SLO class name of 1 to "
                                f"{MAX_SLO_CLASS_NAME} characters")
            named.append((CLASS_HEADER, self.smg_priorities.get(header_class, header_class)))
        if priority is not None and self.priority_classes:
            rank = min(max(priority, 0), len(self.priority_classes) - 1)
            named.append((f"priority {priority}", self.priority_classes[rank]))
        if len({name for _, name in named}) > 1:
            said = "; ".join(f"{where} means class {name!r}" for where, name in named)
            raise HintError(f"conflicting SLO hints: {said}; send one, or an explicit slo")
        ttft_ms = _milliseconds(headers, TTFT_HEADER)
        tpot_ms = _milliseconds(headers, TPOT_HEADER)
        if not named and ttft_ms is None and tpot_ms is None:
            return None
        spec = {"class": named[0][1]} if named else {}
        spec.update({k: v for k, v in (("ttft_ms", ttft_ms), ("tpot_ms", tpot_ms)) if v is not None})
        try:
            return msgspec.convert(spec, SloSpec)
        except (msgspec.ValidationError, ValueError) as error:
            raise HintError(f"SLO hints: {error}") from None


def _milliseconds(headers: Mapping[str, str], name: str) -> float | None:
    text = headers.get(name)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise HintError(f"{name}: expected milliseconds > 0, got {text!r}")
    return value
