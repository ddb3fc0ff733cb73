"""Policy specs as the CLI and the sweep name them: ``NAME[@BUDGET][,key=value...][+MODE[:RULE]]``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import sglang_ext.policy.variants  # noqa: F401  registers the FairBatching variants
import sglang_ext.sim.competitors  # noqa: F401  registers the competitor policies
from sglang_ext.policy.admission import AdmissionError, AdmissionSettings, GiveUp
from sglang_ext.policy.name_registry import UnknownNameError
from sglang_ext.policy.policies import POLICIES

#: Sarathi's and fb-fb's budgets swept by default: 32 to 8192, doubling; a sweep then
#: refines around the best (``sglang_ext.sim.fitting.tuning``).
DEFAULT_TOKEN_BUDGETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
#: ``[admission]`` numbers a policy label may set, by the label's name for them: the
#: ``AdmissionSettings`` field and what the value is
ADMISSION_NUMBERS = {"max_defer": ("max_defer_s", "SECONDS"), "headroom": ("headroom", "FRACTION")}


class PolicySpecError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class PolicySpec:
    base: str  # registered policy name
    token_budget: int | None = None
    settings: tuple[tuple[str, float], ...] = ()  # the policy's other tunables, by name
    admission: AdmissionSettings | None = None  # NAME+MODE[:RULE]; None: the policy's own

    @property
    def label(self) -> str:
        parts = [] if self.token_budget is None else [str(self.token_budget)]
        parts += [f"{name}={_number(value)}" for name, value in self.settings]
        label = f"{self.base}@{','.join(parts)}" if parts else self.base
        return label if self.admission is None else f"{label}+{self.admission.label}"

    @property
    def is_tunable(self) -> bool:
        """Named without any of its tunables: a sweep tunes them."""
        factory = POLICIES.get(self.base)
        return (factory.takes_token_budget or bool(factory.setting_names)) and (
            self.token_budget is None and not self.settings
        )


def _number(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:.6g}"


def parse_admission(text: str) -> AdmissionSettings:
    """``MODE[:RULE][:GIVE_UP][:max_defer=S][:headroom=H]`` (``reject``, ``defer``,
    ``reject:pab``, ``defer:latest``, ``defer:0.5``: a length weight;
    ``defer:max_defer=0.5`` and ``defer:headroom=0.2``: the ``[admission]`` ``max_defer_s``
    and ``headroom``)."""
    mode, *options = text.split(":")
    words: dict[str, str] = {}
    numbers: dict[str, float] = {}
    for option in options:
        name, equals, value = option.partition("=")
        if equals:
            if name not in ADMISSION_NUMBERS or not _is_number(value):
                raise PolicySpecError(
                    f"admission {text!r}: expected "
                    f"{' or '.join(f'{n}={unit}' for n, (_, unit) in ADMISSION_NUMBERS.items())}, "
                    f"got {option!r}")
            key = ADMISSION_NUMBERS[name][0]
            if key in numbers:
                raise PolicySpecError(f"admission {text!r}: two values for its {name}")
            numbers[key] = float(value)
            continue
        key = "give_up" if option in {g.value for g in GiveUp} or _is_number(option) else "rule"
        if key in words:
            raise PolicySpecError(f"admission {text!r}: two values for its {key}")
        words[key] = option
    if "max_defer_s" in numbers and mode != "defer":
        raise PolicySpecError(f"admission {text!r}: max_defer is how long mode 'defer' keeps "
                              f"a late prefill; mode {mode!r} keeps none")
    try:
        return AdmissionSettings.parse(mode, **words, **numbers)
    except AdmissionError as exc:
        raise PolicySpecError(str(exc)) from None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_policy(text: str) -> PolicySpec:
    """``NAME``, ``NAME@BUDGET`` (policies that take a token budget), and either followed
    by ``,key=value`` for the policy's other tunables: ``sarathi-queue-cap@1024,cap=32768``;
    then optionally ``+MODE[:RULE]``, the admission control of a FairBatching-family
    policy (``fb-anchor-margin+reject``, ``+defer``, ``+reject:pab``)."""
    text, plus, admission_text = text.partition("+")
    admission = parse_admission(admission_text) if plus else None
    spec = _parse_policy_settings(text)
    if admission is None:
        return spec
    if not POLICIES.get(spec.base).takes_admission:
        raise PolicySpecError(
            f"policy {spec.base!r} takes no +admission: it is not of the FairBatching family "
            "(the baselines' admission controls are their own policies, e.g. sarathi-queue-cap)"
        )
    return dataclasses.replace(spec, admission=admission)


def _parse_policy_settings(text: str) -> PolicySpec:
    base, _, params_text = text.partition("@")
    try:
        factory = POLICIES.get(base)
    except UnknownNameError as exc:
        raise PolicySpecError(str(exc)) from None
    if not params_text:
        return PolicySpec(base)
    budget: int | None = None
    settings: dict[str, float] = {}
    for position, part in enumerate(params_text.split(",")):
        key, sep, value_text = part.partition("=")
        if not sep:
            if position or not factory.takes_token_budget:
                raise PolicySpecError(
                    f"policy {base!r} takes no token budget (got {text!r})" if not
                    factory.takes_token_budget else f"expected key=value after the budget in {text!r}"
                )
            try:
                budget = int(part)
            except ValueError:
                raise PolicySpecError(f"token budget in {text!r} must be an integer") from None
            if budget < 1:
                raise PolicySpecError(f"token budget in {text!r} must be >= 1")
            continue
        if key not in factory.setting_names:
            valid = ", ".join(factory.setting_names) or "none"
            raise PolicySpecError(f"policy {base!r} has no setting {key!r} (settings: {valid})")
        try:
            value = float(value_text)
        except ValueError:
            raise PolicySpecError(f"setting {key} in {text!r} must be a number") from None
        if not math.isfinite(value) or value <= 0:
            raise PolicySpecError(f"setting {key} in {text!r} must be a finite number > 0")
        settings[key] = value
    return PolicySpec(base, budget, tuple(sorted(settings.items())))
