"""Shared builders for the simulator tests (imported as a plain module: pytest puts this
directory on ``sys.path`` because ``tests/sim`` is not a package)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

import sglang_ext.sim.runner  # noqa: F401  (registers the baseline policies)
from sglang_ext.policy.policies import POLICIES, BatchPolicy, PolicyContext
from sglang_ext.policy.slo import Slo, SloCatalog
from sglang_ext.sim.fitting.calibration import offline_fit
from sglang_ext.sim.profile import HardwareProfile, bundled_profile_path, load_profile
from sglang_ext.sim.workloads import TraceRequest, Workload, poisson_arrivals

SLO = Slo.from_ms(2000, 50)
CATALOG = SloCatalog.single(SLO, "standard")
ALL_POLICIES = ("fb", "fb-pab", "fb-fb", "fb-tb", "sglang-default", "vllm-default", "sarathi")


@functools.cache
def llama() -> HardwareProfile:
    return load_profile(bundled_profile_path("llama3.1-8b-h100"))


@functools.cache
def small_kv_profile(tokens: int) -> HardwareProfile:
    """The llama/H100 profile with a KV pool of exactly ``tokens`` tokens.

    Only ``runtime.activation_reserve_gb`` changes, so the GPU (80 GB: the baselines'
    defaults) and the step times are those of the bundled profile.
    """
    base = llama()
    pool = base.gpu.memory_gb * 1e9 * base.runtime.mem_fraction_static - base.model.weight_bytes
    # half a token of slack so floor() lands exactly on ``tokens``
    reserve_gb = (pool - (tokens + 0.5) * base.model.kv_bytes_per_token) / 1e9
    runtime = dataclasses.replace(base.runtime, activation_reserve_gb=reserve_gb)
    profile = dataclasses.replace(base, name=f"{base.name}-kv{tokens}", runtime=runtime)
    assert profile.kv_capacity_tokens == tokens, profile.kv_capacity_tokens
    return profile


def context_for(profile: HardwareProfile, **overrides) -> PolicyContext:
    fields = {
        "global_slo": SLO,
        "initial_step_model": offline_fit(profile),
        "gpu_memory_gb": profile.memory_gb,
    }
    fields.update(overrides)
    return PolicyContext(**fields)


def make_policy(name: str, profile: HardwareProfile, **overrides) -> BatchPolicy:
    return POLICIES.get(name)(context_for(profile, **overrides))


@dataclass(frozen=True, slots=True)
class Req:
    req_id: Hashable
    arrival: float
    prompt: int
    output: int
    slo: Slo = SLO


def synthetic_requests(
    n: int = 150,
    rate: float = 16.0,
    *,
    seed: int = 1,
    prompt: tuple[int, int] = (10, 3000),
    output: tuple[int, int] = (1, 300),
) -> list[Req]:
    """Poisson arrivals at ``rate``; prompts and outputs uniform in the closed ranges."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(prompt[0], prompt[1] + 1, n)
    outputs = rng.integers(output[0], output[1] + 1, n)
    times = poisson_arrivals(rate, n, seed)
    return [
        Req(i, float(t), int(p), int(o)) for i, (t, p, o) in enumerate(zip(times, prompts, outputs))
    ]


def synthetic_workload(n: int = 40, *, seed: int = 3) -> Workload:
    reqs = synthetic_requests(n, 4.0, seed=seed, prompt=(10, 2000), output=(1, 120))
    return Workload(
        tuple(TraceRequest(r.arrival, r.prompt, r.output) for r in reqs), "synthetic"
    )


def drive_search(search, score_of) -> object:
    """Run a tuning search (``sglang_ext.sim.fitting.tuning``) against a score function of each
    label's parsed spec; returns its result."""
    from sglang_ext.sim.runner import parse_policy

    labels = next(search)
    while True:
        try:
            labels = search.send({label: score_of(parse_policy(label)) for label in labels})
        except StopIteration as stop:
            return stop.value
