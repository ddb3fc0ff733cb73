"""Hardware profiles for the simulator: model shape, GPU specs and serving-runtime constants.

A profile is a TOML file with a top-level ``name`` and three tables, ``[model]``, ``[gpu]`` and
``[runtime]``, whose keys are exactly the fields of :class:`ModelSpec`, :class:`GpuSpec` and
:class:`RuntimeSpec`, and optionally a ``[service]`` table (:class:`ServiceSpec`): with it, step
times come from the batching study's service curve instead of the roofline
(``sglang_ext.sim.service_curve``), and the other tables still size the KV pool.  Every field
is documented (meaning, unit, where to find the number) in ``configs/profiles/README.md``.

Loading is strict, because a silently ignored typo in a profile silently changes every result:

* a missing table or field, a value of the wrong type, a value out of range, an unknown key and
  invalid TOML all raise :class:`ProfileError`, whose message starts with the file name and names
  the dotted field (``llama.toml: missing field model.num_layers``);
* a profile whose KV-cache pool would be empty (weights do not fit) is rejected at load time.

The dataclasses validate themselves too, so a profile built in code gets the same checks.

Some fields are optional (``ModelSpec.embedding_params``, ``GpuSpec.attention_*``,
``RuntimeSpec.prefill_overhead_ms``, ``RuntimeSpec.attention_kernels``...): a file may leave
them out, and their defaults give the plain roofline the bundled hand-written profiles use.

This module only needs the standard library (``tomllib``, Python >= 3.11).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from sglang_ext.bundled import CONFIGS_DIR
from sglang_ext.policy.tomlfile import read_toml

__all__ = [
    "ATTENTION_KERNELS",
    "PROFILES_DIR",
    "GpuSpec",
    "HardwareProfile",
    "ModelSpec",
    "ProfileError",
    "RuntimeSpec",
    "SERVICE_MARGINALS",
    "ServiceSpec",
    "available_profiles",
    "bundled_profile_path",
    "load_profile",
    "parse_profile",
]

#: ``<repo>/configs/profiles`` -- where the bundled profiles live.
PROFILES_DIR: Path = CONFIGS_DIR / "profiles"


class ProfileError(ValueError):
    """An invalid or missing hardware profile.  The message names the file and the field."""


# --------------------------------------------------------------------------------------------
# Field rules.  Each rule is (kind, limits) where kind is "int", "float", "str" or "choice".
# Numeric limits are (lower, lower_inclusive, upper): value > lower (or >= lower when
# lower_inclusive), value <= upper.  A "choice" lists the allowed strings.
# --------------------------------------------------------------------------------------------

_POS = (0.0, False, math.inf)  # strictly positive
_NONNEG = (0.0, True, math.inf)  # zero allowed
_FRACTION = (0.0, False, 1.0)  # (0, 1]
_PROBABILITY = (0.0, True, 1.0)  # [0, 1]

#: Values of ``runtime.attention_kernels``.
ATTENTION_KERNELS = ("batch", "split")

#: Values of ``service.marginal``.
SERVICE_MARGINALS = ("fixed", "exponential")

_RULES: dict[str, dict[str, tuple[str, Any]]] = {
    "model": {
        "name": ("str", None),
        "num_layers": ("int", _POS),
        "hidden_size": ("int", _POS),
        "num_attention_heads": ("int", _POS),
        "num_kv_heads": ("int", _POS),
        "head_dim": ("int", _POS),
        "num_params": ("float", _POS),
        "bytes_per_param": ("float", _POS),
        "kv_bytes_per_elem": ("float", _POS),
        "embedding_params": ("float", _NONNEG),
        "lm_head_params": ("float", _NONNEG),
    },
    "gpu": {
        "name": ("str", None),
        "memory_gb": ("float", _POS),
        "hbm_tb_s": ("float", _POS),
        "bf16_tflops": ("float", _POS),
        "compute_efficiency": ("float", _FRACTION),
        "bandwidth_efficiency": ("float", _FRACTION),
        "attention_compute_efficiency": ("float", _FRACTION),
        "attention_bandwidth_efficiency": ("float", _FRACTION),
        "attention_saturation_tiles": ("float", _NONNEG),
        "attention_tile_queries": ("int", _POS),
    },
    "runtime": {
        "step_overhead_ms": ("float", _NONNEG),
        "per_request_overhead_us": ("float", _NONNEG),
        "mem_fraction_static": ("float", _FRACTION),
        "activation_reserve_gb": ("float", _NONNEG),
        "noise_sigma": ("float", _NONNEG),
        "stall_probability": ("float", _PROBABILITY),
        "stall_ms_min": ("float", _NONNEG),
        "stall_ms_max": ("float", _NONNEG),
        "prefill_overhead_ms": ("float", _NONNEG),
        "attention_kernels": ("choice", ATTENTION_KERNELS),
    },
    "service": {
        "setup_ms": ("float", _POS),
        "per_token_us": ("float", _NONNEG),
        "threshold_tokens": ("int", _NONNEG),
        "marginal": ("choice", SERVICE_MARGINALS),
    },
}


def _describe_bounds(bounds: tuple[float, bool, float]) -> str:
    lo, lo_incl, hi = bounds
    if hi == math.inf:
        return ">= 0" if lo_incl else "> 0"
    return f"in {'[' if lo_incl else '('}{lo:g}, {hi:g}]"


def _coerce(section: str, key: str, value: Any, source: str) -> Any:
    """Type- and range-check one field; returns the value (ints widened to float for floats)."""
    kind, bounds = _RULES[section][key]
    dotted = f"{section}.{key}"
    if kind == "str":
        if not isinstance(value, str) or not value.strip():
            raise ProfileError(
                f"{source}: field {dotted} must be a non-empty string, got {value!r}"
            )
        return value
    if kind == "choice":
        if value not in bounds:
            allowed = ", ".join(repr(v) for v in bounds)
            raise ProfileError(f"{source}: field {dotted} must be one of {allowed}, got {value!r}")
        return value
    # bool is a subclass of int: reject it explicitly.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        want = "an integer" if kind == "int" else "a number"
        raise ProfileError(
            f"{source}: field {dotted} must be {want}, got {type(value).__name__} {value!r}"
        )
    if kind == "int":
        if isinstance(value, float):
            if not value.is_integer():
                raise ProfileError(f"{source}: field {dotted} must be an integer, got {value!r}")
            value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value):
            raise ProfileError(f"{source}: field {dotted} must be finite, got {value!r}")
    assert bounds is not None
    lo, lo_incl, hi = bounds
    ok = (value >= lo if lo_incl else value > lo) and value <= hi
    if not ok:
        raise ProfileError(
            f"{source}: field {dotted} must be {_describe_bounds(bounds)}, got {value!r}"
        )
    return value


def _check_instance(obj: Any, section: str) -> None:
    """Run the field rules on a constructed dataclass (used by ``__post_init__``)."""
    source = f"<{type(obj).__name__}>"
    for f in fields(obj):
        if getattr(obj, f.name) is None and f.default is None:  # optional, left unset
            continue
        value = _coerce(section, f.name, getattr(obj, f.name), source)
        if value is not getattr(obj, f.name):
            object.__setattr__(obj, f.name, value)


# --------------------------------------------------------------------------------------------
# Dataclasses
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of a dense decoder-only transformer (values from the model's ``config.json``)."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: float  # total parameters, embeddings included (e.g. 8.03e9)
    bytes_per_param: float = 2.0  # bf16 weights
    kv_bytes_per_elem: float = 2.0  # bf16 KV cache
    # Of num_params: the input embedding (looked up, never multiplied; 0 counts it as a layer)
    embedding_params: float = 0.0
    # Of num_params: the LM head, run on one token per sequence (0: on every new token)
    lm_head_params: float = 0.0

    def __post_init__(self) -> None:
        _check_instance(self, "model")
        if self.num_attention_heads % self.num_kv_heads != 0:
            raise ProfileError(
                f"<ModelSpec>: field model.num_kv_heads ({self.num_kv_heads}) must divide "
                f"model.num_attention_heads ({self.num_attention_heads})"
            )
        if self.embedding_params + self.lm_head_params >= self.num_params:
            raise ProfileError(
                f"<ModelSpec>: fields model.embedding_params ({self.embedding_params:g}) + "
                f"model.lm_head_params ({self.lm_head_params:g}) must be less than "
                f"model.num_params ({self.num_params:g})"
            )

    @property
    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes per token: 2 (K and V) * layers * kv_heads * head_dim * bytes/elem."""
        return 2.0 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_elem

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights held in GPU memory (all of ``num_params``)."""
        return self.num_params * self.bytes_per_param

    @property
    def per_token_params(self) -> float:
        """Parameters every new token is multiplied by (all but the embedding and LM head)."""
        return self.num_params - self.embedding_params - self.lm_head_params


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """Public spec-sheet numbers of one GPU plus the achieved fractions of peak."""

    name: str
    memory_gb: float  # HBM capacity, GB (1e9 bytes)
    hbm_tb_s: float  # peak memory bandwidth, TB/s (1e12 bytes/s)
    bf16_tflops: float  # dense (non-sparse) bf16 tensor-core peak, TFLOP/s
    compute_efficiency: float  # achieved fraction of bf16_tflops on the model's GEMMs, (0, 1]
    bandwidth_efficiency: float  # achieved fraction of hbm_tb_s when streaming, (0, 1]
    attention_compute_efficiency: float | None = None  # None: compute_efficiency
    attention_bandwidth_efficiency: float | None = None  # None: bandwidth_efficiency
    # Attention tiles (thread blocks) that fill the GPU; fewer reach tiles/this of the attention
    # roof.  0: attention always runs at its full roof.
    attention_saturation_tiles: float = 0.0
    attention_tile_queries: int = 128  # query rows per prefill attention tile

    def __post_init__(self) -> None:
        _check_instance(self, "gpu")

    @property
    def effective_flops(self) -> float:
        """Achieved FLOP/s: bf16_tflops * 1e12 * compute_efficiency."""
        return self.bf16_tflops * 1e12 * self.compute_efficiency

    @property
    def effective_bandwidth(self) -> float:
        """Achieved bytes/s: hbm_tb_s * 1e12 * bandwidth_efficiency."""
        return self.hbm_tb_s * 1e12 * self.bandwidth_efficiency

    @property
    def effective_attention_flops(self) -> float:
        """Achieved FLOP/s of attention kernels at full occupancy."""
        efficiency = self.attention_compute_efficiency
        return self.bf16_tflops * 1e12 * (
            self.compute_efficiency if efficiency is None else efficiency
        )

    @property
    def effective_attention_bandwidth(self) -> float:
        """Achieved bytes/s of attention kernels (KV reads and writes) at full occupancy."""
        efficiency = self.attention_bandwidth_efficiency
        return self.hbm_tb_s * 1e12 * (
            self.bandwidth_efficiency if efficiency is None else efficiency
        )


@dataclass(frozen=True, slots=True)
class RuntimeSpec:
    """Serving-runtime constants: overheads, memory split, noise and stalls."""

    step_overhead_ms: float  # fixed per-step CPU / kernel-launch overhead, ms
    per_request_overhead_us: float  # per request in the batch (metadata, sampling), us
    mem_fraction_static: float  # fraction of GPU memory for weights + KV pool (SGLang flag)
    activation_reserve_gb: float  # further GB kept out of the KV pool, GB
    noise_sigma: float  # lognormal sigma of multiplicative run-to-run noise
    stall_probability: float  # per-step probability of a stall
    stall_ms_min: float  # stall duration lower bound, ms
    stall_ms_max: float  # stall duration upper bound, ms
    prefill_overhead_ms: float = 0.0  # fixed cost of a step with any prefill chunk, ms
    # "batch": one attention kernel for the whole step; "split": prefill chunks and decodes in
    # separate kernels, each with its own roofline
    attention_kernels: str = "batch"

    def __post_init__(self) -> None:
        _check_instance(self, "runtime")
        if self.stall_ms_max < self.stall_ms_min:
            raise ProfileError(
                f"<RuntimeSpec>: field runtime.stall_ms_max ({self.stall_ms_max:g}) must be "
                f">= runtime.stall_ms_min ({self.stall_ms_min:g})"
            )


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """The batching study's service curve ``S(b) = c + a * max(0, b - b0)`` of a batch of ``b``
    tokens (``shared/seeds/des_batching_study.txt``), replacing the roofline's step time."""

    setup_ms: float  # c: fixed cost of every batch, ms (> 0)
    per_token_us: float  # a: cost of each token of the batch past threshold_tokens, us
    threshold_tokens: int  # b0: tokens a batch carries at no marginal cost
    # "fixed": a as given; "exponential": a is the mean of one exponential draw per batch
    marginal: str = "fixed"

    def __post_init__(self) -> None:
        _check_instance(self, "service")


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One model served on one GPU with one runtime configuration."""

    name: str
    model: ModelSpec
    gpu: GpuSpec
    runtime: RuntimeSpec
    # the study's service curve; None (the default): the roofline of model, gpu and runtime
    service: ServiceSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ProfileError("<HardwareProfile>: field name must be a non-empty string")
        pool = self.kv_pool_bytes
        if pool < self.model.kv_bytes_per_token:
            raise ProfileError(
                f"<HardwareProfile>: no room for a KV cache: memory_gb * mem_fraction_static "
                f"({self.gpu.memory_gb:g} GB * {self.runtime.mem_fraction_static:g}) - weights "
                f"({self.model.weight_bytes / 1e9:.2f} GB) - activation_reserve_gb "
                f"({self.runtime.activation_reserve_gb:g} GB) = {pool / 1e9:.2f} GB "
                f"(fields gpu.memory_gb, runtime.mem_fraction_static, model.num_params)"
            )

    @property
    def kv_pool_bytes(self) -> float:
        """Bytes left for the KV pool: memory * mem_fraction_static - weights - reserve."""
        return (
            self.gpu.memory_gb * 1e9 * self.runtime.mem_fraction_static
            - self.model.weight_bytes
            - self.runtime.activation_reserve_gb * 1e9
        )

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds (SGLang's ``max_total_num_tokens`` analogue)."""
        return math.floor(self.kv_pool_bytes / self.model.kv_bytes_per_token)

    @property
    def memory_gb(self) -> float:
        """GPU HBM capacity in GB (baselines pick SGLang-like defaults from it)."""
        return self.gpu.memory_gb


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

_SECTIONS: dict[str, type] = {
    "model": ModelSpec, "gpu": GpuSpec, "runtime": RuntimeSpec, "service": ServiceSpec,
}


def _build_section(data: Mapping[str, Any], section: str, source: str) -> Any:
    if section not in data:
        raise ProfileError(f"{source}: missing table [{section}]")
    table = data[section]
    if not isinstance(table, Mapping):
        raise ProfileError(
            f"{source}: field {section} must be a table ([{section}]), got {type(table).__name__}"
        )
    cls = _SECTIONS[section]
    rules = _RULES[section]
    unknown = sorted(set(table) - set(rules))
    if unknown:
        raise ProfileError(
            f"{source}: unknown field(s) {', '.join(f'{section}.{k}' for k in unknown)} "
            f"(allowed: {', '.join(rules)})"
        )
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in table:
            if f.default is not MISSING:  # optional field: keep the dataclass default
                continue
            raise ProfileError(f"{source}: missing field {section}.{f.name}")
        kwargs[f.name] = _coerce(section, f.name, table[f.name], source)
    try:
        return cls(**kwargs)
    except ProfileError as exc:  # cross-field checks: re-label with the file name
        raise ProfileError(_relabel(str(exc), source)) from None


def _relabel(message: str, source: str) -> str:
    if message.startswith("<") and ">: " in message:
        return f"{source}: {message.split('>: ', 1)[1]}"
    return f"{source}: {message}"


def parse_profile(data: Mapping[str, Any], source: str = "<profile>") -> HardwareProfile:
    """Build a validated :class:`HardwareProfile` from a parsed TOML mapping.

    ``source`` prefixes every error message (``load_profile`` passes the file name).
    """
    if not isinstance(data, Mapping):
        raise ProfileError(f"{source}: a profile must be a table, got {type(data).__name__}")
    allowed = {"name", *_SECTIONS}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ProfileError(
            f"{source}: unknown field(s) {', '.join(unknown)} "
            f"(allowed at top level: name, [model], [gpu], [runtime], [service])"
        )
    if "name" not in data:
        raise ProfileError(f"{source}: missing field name")
    name = data["name"]
    if not isinstance(name, str) or not name.strip():
        raise ProfileError(f"{source}: field name must be a non-empty string, got {name!r}")
    model = _build_section(data, "model", source)
    gpu = _build_section(data, "gpu", source)
    runtime = _build_section(data, "runtime", source)
    service = _build_section(data, "service", source) if "service" in data else None
    try:
        return HardwareProfile(name=name, model=model, gpu=gpu, runtime=runtime, service=service)
    except ProfileError as exc:
        raise ProfileError(_relabel(str(exc), source)) from None


def load_profile(path: str | Path) -> HardwareProfile:
    """Load and validate a profile TOML file.  Raises :class:`ProfileError` on any problem."""
    source = str(path)
    data = read_toml(path, ProfileError, "profile")
    return parse_profile(data, source)


def available_profiles() -> list[str]:
    """Names of the bundled profiles (``configs/profiles/*.toml``), sorted."""
    if not PROFILES_DIR.is_dir():
        return []
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))


def bundled_profile_path(name: str) -> Path:
    """Path of the bundled profile ``name`` (e.g. ``"llama3.1-8b-h100"``; ``.toml`` optional)."""
    stem = name.removesuffix(".toml")
    path = PROFILES_DIR / f"{stem}.toml"
    if not path.is_file():
        names = ", ".join(available_profiles()) or "(none)"
        raise ProfileError(f"{path}: no bundled profile named {name!r}; available: {names}")
    return path
