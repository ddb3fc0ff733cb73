"""The SGLang extension's configuration: one TOML file named by ``FAIRBATCHING_CONFIG``.

::

    policy = "fb-anchor-margin"             # a FairBatching-family policy (sglang_ext.policy)
    slo_file = "slo.toml"                   # SLO classes; relative to this file
    step_model = "step_models/x.toml"       # initial step model (its form), recalibrated online
    learn_knee = true                       # a knee model learns its knee online too
    calibrate = true                        # fit the step model on the device at start-up
                                            # (default: true when no step_model is named)
    max_token_budget = 8192                 # new tokens per step, upper bound
    delivery_allowance_ms = 0               # tokens planned this much earlier (-margin variants)
    log_interval_s = 10.0                   # step-model log line period

    [gc]
    enabled = true
    min_decode_slack_ms = 500
    min_interval_s = 30

    [admission]                             # sglang_ext.policy.admission; all optional
    mode = "reject"                         # "off" (default), "reject" or "defer"
    rule = "edf"                            # "edf" (default) or "pab"
    max_defer_s = 2                         # defer: end one with no first token this long past its TTFT
    give_up = "longest"                     # defer: serve last the longest prefills (= 1); "fair" (= 0): drawn
                                            # blind to length; a number between: the weight of length; "latest"
    retry_after_s = 1                       # reject: the 429's Retry-After
    max_budget_age_s = 0.5                  # reject: an older published budget is not trusted
    headroom = 0.1                          # fraction of the prefill rate held back

    [trace]                                 # sglang_ext.adapter.scheduler.step_trace; off by default
    step_log = "steps.jsonl"                # one JSON line per step; relative to this file

    [slo_hints]                             # sglang_ext.adapter.slo_hints; all optional
    enabled = true                          # an SLO from service_tier, priority, smg's and llm-d's headers
    service_tier = { flex = "relaxed", priority = "interactive" }   # OpenAI tier -> class
    priority_classes = ["relaxed", "standard", "interactive"]       # SGLang priority, least urgent first
    smg_priority = { bulk = "relaxed", default = "standard" }       # x-smg-priority -> class
                                            # (default: configs/slo_hints.toml's, less the classes
                                            # slo_file does not define; a class named here must be)

Pure: importing it needs neither sglang nor torch, so a bad file is reported before
any SGLang process starts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controlplane.slo_hints import HintConfigError, SloHints
from sglang_ext.bundled import CONFIGS_DIR
from sglang_ext.policy import variants as _variants  # noqa: F401  (registers the variants)
from sglang_ext.policy.admission import AdmissionError, AdmissionSettings
from sglang_ext.policy.gc import GcConfig
from sglang_ext.policy.name_registry import UnknownNameError
from sglang_ext.policy.policies import POLICIES, BatchPolicy, PolicyContext
from sglang_ext.policy.slo import SloCatalog, SloError
from sglang_ext.policy.step_model import StepCoefficients, StepModelFile, StepPredictor
from sglang_ext.policy.tomlfile import read_toml

CONFIG_ENV = "FAIRBATCHING_CONFIG"
DEFAULT_POLICY = "fb"
TIME_BUDGET_POLICIES = ("fb", "fb-pab", "fb-anchor", "fb-margin", "fb-kairos",
                        "fb-anchor-margin", "fb-anchor-margin-pab", "fb-smooth", "fb-steady")

_TOP_KEYS = {"policy", "slo_file", "step_model", "learn_knee", "calibrate", "max_token_budget",
             "delivery_allowance_ms", "log_interval_s", "gc", "admission", "trace", "slo_hints"}
_TRACE_KEYS = {"step_log"}
_GC_KEYS = {"enabled", "min_decode_slack_ms", "min_interval_s"}
_ADMISSION_NUMBERS = ("max_defer_s", "retry_after_s", "max_budget_age_s", "headroom")
_ADMISSION_WORDS = {"mode": "off", "rule": "edf", "give_up": None}
_ADMISSION_KEYS = {*_ADMISSION_WORDS, *_ADMISSION_NUMBERS}


class ConfigError(ValueError):
    """A malformed extension config; the message names the file and the field."""


@dataclass(frozen=True)
class ExtensionConfig:
    policy: str
    catalog: SloCatalog
    initial_step_model: StepPredictor  # the step-model file's model, of its form
    max_token_budget: int = 8192
    log_interval_s: float = 10.0
    gc_enabled: bool = True
    gc: GcConfig = field(default_factory=GcConfig)
    source: str = "<defaults>"
    #: as configured; the policy's ``admission`` is what applies (``-pab`` names imply one)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    #: where each scheduler writes its per-step record (``[trace] step_log``); None: off
    step_log: Path | None = None
    #: ``delivery_allowance_ms`` in seconds (``PolicyContext.delivery_allowance_s``)
    delivery_allowance_s: float = 0.0
    #: the file's [linear] table (the model itself in a linear file), which fb keeps
    initial_linear_model: StepCoefficients | None = None
    #: ``learn_knee`` (``PolicyContext.learn_knee``)
    learn_knee: bool = True
    #: fit the step model on the device when each scheduler starts
    #: (``sglang_ext.policy.startup_calibration``)
    calibrate: bool = False
    #: how a request without an SLO gets one from its hints (``[slo_hints]``); None: off
    slo_hints: SloHints | None = None

    def build_policy(self) -> BatchPolicy:
        context = PolicyContext(
            global_slo=self.catalog.default,
            initial_step_model=self.initial_step_model,
            initial_linear_model=self.initial_linear_model,
            max_token_budget=self.max_token_budget,
            admission=self.admission,
            delivery_allowance_s=self.delivery_allowance_s,
            learn_knee=self.learn_knee,
        )
        return POLICIES.get(self.policy)(context)

    @property
    def effective_admission(self) -> AdmissionSettings:
        """The admission the policy applies: the configured one, or the one its name
        implies (``fb-anchor-margin-pab`` with mode ``off``: reject under rule ``pab``)."""
        return self.build_policy().admission

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ExtensionConfig:
        path = Path(path)
        data = read_toml(path, ConfigError, "FairBatching config")
        try:
            return cls.from_mapping(data, base_dir=path.parent, source=str(path))
        except (ConfigError, SloError) as exc:
            message = str(exc)
            raise ConfigError(message if message.startswith(str(path)) else f"{path}: {message}")

    @classmethod
    def from_mapping(
        cls, data: Mapping[str, Any], base_dir: Path, source: str = "<mapping>"
    ) -> ExtensionConfig:
        unknown = set(data) - _TOP_KEYS
        if unknown:
            raise ConfigError(f"unknown key(s) {sorted(unknown)}; expected {sorted(_TOP_KEYS)}")
        policy = data.get("policy", DEFAULT_POLICY)
        if not isinstance(policy, str):
            raise ConfigError(f"policy must be a string, got {policy!r}")
        if policy not in TIME_BUDGET_POLICIES:
            try:
                POLICIES.get(policy)
            except UnknownNameError as exc:
                raise ConfigError(str(exc)) from None
            raise ConfigError(
                f"policy {policy!r} is not supported inside SGLang; "
                f"choose one of {', '.join(TIME_BUDGET_POLICIES)}"
            )
        catalog = _load_catalog(data.get("slo_file"), base_dir)
        step_model = _load_step_model(data.get("step_model"), base_dir)
        max_token_budget = _positive_int(data, "max_token_budget", 8192)
        log_interval_s = _positive_float(data, "log_interval_s", 10.0)
        gc_table = data.get("gc", {})
        if not isinstance(gc_table, Mapping):
            raise ConfigError("[gc] must be a table")
        unknown = set(gc_table) - _GC_KEYS
        if unknown:
            raise ConfigError(f"[gc]: unknown key(s) {sorted(unknown)}; expected {sorted(_GC_KEYS)}")
        enabled = gc_table.get("enabled", True)
        if not isinstance(enabled, bool):
            raise ConfigError(f"[gc] enabled must be true or false, got {enabled!r}")
        try:
            gc = GcConfig(
                min_decode_slack_s=_positive_float(gc_table, "min_decode_slack_ms", 500.0, 0) / 1e3,
                min_interval_s=_positive_float(gc_table, "min_interval_s", 30.0, 0),
            )
        except ValueError as exc:
            raise ConfigError(f"[gc]: {exc}") from None
        admission = _load_admission(data.get("admission", {}))
        step_log = _load_trace(data.get("trace", {}), base_dir)
        delivery_allowance_ms = _positive_float(data, "delivery_allowance_ms", 0.0, 0)
        if delivery_allowance_ms and not POLICIES.get(policy).takes_delivery_allowance:
            raise ConfigError(
                f"delivery_allowance_ms: policy {policy!r} plans tokens at their deadlines and "
                "takes no delivery allowance; use fb-anchor-margin or fb-smooth, or drop the key"
            )
        learn_knee = data.get("learn_knee", True)
        calibrate = data.get("calibrate", "step_model" not in data)
        for key, value in (("learn_knee", learn_knee), ("calibrate", calibrate)):
            if not isinstance(value, bool):
                raise ConfigError(f"{key} must be true or false, got {value!r}")
        slo_hints = _load_slo_hints(data.get("slo_hints", {}), catalog)
        config = cls(policy, catalog, step_model.model, max_token_budget, log_interval_s, enabled,
                     gc, source, admission, step_log, delivery_allowance_ms / 1e3, step_model.linear,
                     learn_knee, calibrate, slo_hints)
        try:
            config.build_policy()  # refuses a policy name that contradicts [admission]
        except AdmissionError as exc:
            raise ConfigError(f"[admission]: {exc}") from None
        return config


def _load_slo_hints(table: Any, catalog: SloCatalog) -> SloHints | None:
    if not isinstance(table, Mapping):
        raise ConfigError("[slo_hints] must be a table")
    enabled = table.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError(f"[slo_hints] enabled must be true or false, got {enabled!r}")
    if not enabled:
        return None
    entries = {key: value for key, value in table.items() if key != "enabled"}
    defined = set(catalog.classes)
    try:
        hints = SloHints.from_mapping(entries, "[slo_hints]", SloHints().within(defined))
    except HintConfigError as exc:
        raise ConfigError(str(exc)) from None
    undefined = sorted(hints.classes - defined)
    if undefined:
        raise ConfigError(f"[slo_hints] names class(es) {undefined} the SLO file does not define "
                          f"(defined: {', '.join(sorted(defined))})")
    return hints


def load_from_environment() -> ExtensionConfig | None:
    """The config named by ``FAIRBATCHING_CONFIG``; ``None`` when the variable is unset
    or empty (FairBatching off: SGLang runs stock)."""
    value = os.environ.get(CONFIG_ENV, "").strip()
    if not value:
        return None
    try:
        return ExtensionConfig.load(value)
    except ConfigError as exc:
        raise ConfigError(f"{CONFIG_ENV}={value}: {exc}") from None


def _resolve(value: Any, base_dir: Path, key: str) -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key} must be a path string, got {value!r}")
    path = Path(value).expanduser()
    return path if path.is_absolute() else base_dir / path


def _load_catalog(value: Any, base_dir: Path) -> SloCatalog:
    if value is None:
        default = CONFIGS_DIR / "slo.toml"
        if not default.is_file():
            raise ConfigError("slo_file is required (the package has no bundled slo.toml)")
        return SloCatalog.from_toml(default)
    return SloCatalog.from_toml(_resolve(value, base_dir, "slo_file"))


def _load_step_model(value: Any, base_dir: Path) -> StepModelFile:
    if value is None:
        default = CONFIGS_DIR / "step_models" / "llama3.1-8b-h100.toml"
        if not default.is_file():
            raise ConfigError("step_model is required (the package has no bundled step models)")
        value = str(default)
    try:
        return StepModelFile.load(_resolve(value, base_dir, "step_model"))
    except ValueError as exc:
        raise ConfigError(f"step_model: {exc}") from None


def _load_admission(table: Any) -> AdmissionSettings:
    if not isinstance(table, Mapping):
        raise ConfigError("[admission] must be a table")
    unknown = set(table) - _ADMISSION_KEYS
    if unknown:
        raise ConfigError(
            f"[admission]: unknown key(s) {sorted(unknown)}; expected {sorted(_ADMISSION_KEYS)}"
        )
    words = {}
    for key, default in _ADMISSION_WORDS.items():
        value = table.get(key, default)
        if value is not default and not isinstance(value, str) and not (
            key == "give_up" and isinstance(value, (int, float)) and not isinstance(value, bool)
        ):
            kind = "a string or a number from 0 to 1" if key == "give_up" else "a string"
            raise ConfigError(f"[admission] {key} must be {kind}, got {value!r}")
        words[key] = value
    numbers = {}
    for key in _ADMISSION_NUMBERS:
        if key not in table:
            continue
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"[admission] {key} must be a number, got {value!r}")
        numbers[key] = float(value)
    try:
        return AdmissionSettings.parse(**words, **numbers)
    except AdmissionError as exc:
        raise ConfigError(f"[admission]: {exc}") from None


def _load_trace(table: Any, base_dir: Path) -> Path | None:
    if not isinstance(table, Mapping):
        raise ConfigError("[trace] must be a table")
    unknown = set(table) - _TRACE_KEYS
    if unknown:
        raise ConfigError(f"[trace]: unknown key(s) {sorted(unknown)}; expected {sorted(_TRACE_KEYS)}")
    if "step_log" not in table:
        return None
    path = _resolve(table["step_log"], base_dir, "[trace] step_log")
    if not path.parent.is_dir():
        raise ConfigError(f"[trace] step_log: directory {path.parent} does not exist")
    return path


def _positive_int(table: Mapping[str, Any], key: str, default: int) -> int:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")
    return value


def _positive_float(table: Mapping[str, Any], key: str, default: float, minimum: float = 1e-9) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise ConfigError(f"{key} must be a finite number >= {minimum:g}, got {value!r}")
    return float(value)
