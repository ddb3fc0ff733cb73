"""One simulation: a workload replayed at one offered rate through one policy on one rank."""

from __future__ import annotations

from dataclasses import dataclass

import sglang_ext.policy.variants  # noqa: F401  registers fb-anchor, fb-margin, fb-kairos
import sglang_ext.sim.baselines  # noqa: F401  registers the baselines
from sglang_ext.policy.batch_former import DEFAULT_MAX_TOKEN_BUDGET
from sglang_ext.policy.policies import POLICIES, BatchPolicy, PolicyContext
from sglang_ext.policy.registry import UnknownNameError
from sglang_ext.policy.slo import SloCatalog
from sglang_ext.policy.step_model import StepCoefficients
from sglang_ext.sim.calibration import offline_fit
from sglang_ext.sim.engine import SimEngine
from sglang_ext.sim.metrics import LatencySamples, latency_samples, summarize
from sglang_ext.sim.profile import HardwareProfile
from sglang_ext.sim.workloads import Workload

DEFAULT_TOKEN_BUDGETS = (256, 512, 1024, 2048, 4096)


class PolicySpecError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class PolicySpec:
    base: str  # registered policy name
    token_budget: int | None = None

    @property
    def label(self) -> str:
        return self.base if self.token_budget is None else f"{self.base}@{self.token_budget}"

    @property
    def sweeps_budget(self) -> bool:
        return POLICIES.get(self.base).takes_token_budget


def parse_policy(text: str) -> PolicySpec:
    """``NAME`` or ``NAME@BUDGET`` (only for policies that take a token budget)."""
    base, _, budget_text = text.partition("@")
    try:
        factory = POLICIES.get(base)
    except UnknownNameError as exc:
        raise PolicySpecError(str(exc)) from None
    if not budget_text:
        return PolicySpec(base)
    if not factory.takes_token_budget:
        raise PolicySpecError(f"policy {base!r} takes no token budget (got {text!r})")
    try:
        budget = int(budget_text)
    except ValueError:
        raise PolicySpecError(f"token budget in {text!r} must be an integer") from None
    if budget < 1:
        raise PolicySpecError(f"token budget in {text!r} must be >= 1")
    return PolicySpec(base, budget)


@dataclass(frozen=True)
class Scenario:
    """Everything but the policy and the rate; shared by every run of a sweep."""

    workload: Workload
    profile: HardwareProfile
    catalog: SloCatalog
    arrivals: str = "trace"
    seed: int = 0
    drain_s: float = 120.0
    max_token_budget: int = DEFAULT_MAX_TOKEN_BUDGET
    initial_step_model: StepCoefficients | None = None  # None: offline fit of the profile


@dataclass(frozen=True)
class RunResult:
    policy: str
    load: dict  # one entry of results.json "loads"
    samples: LatencySamples | None


def build_policy(scenario: Scenario, spec: PolicySpec) -> BatchPolicy:
    context = PolicyContext(
        global_slo=scenario.catalog.default,
        initial_step_model=scenario.initial_step_model or offline_fit(scenario.profile),
        max_token_budget=scenario.max_token_budget,
        gpu_memory_gb=scenario.profile.memory_gb,
        token_budget=spec.token_budget,
    )
    return POLICIES.get(spec.base)(context)


def simulate(
    scenario: Scenario, spec: PolicySpec, rate: float, *, keep_samples: bool = False
) -> RunResult:
    workload = scenario.workload.with_arrivals(scenario.arrivals, rate, scenario.seed)
    engine = SimEngine(scenario.profile, build_policy(scenario, spec), seed=scenario.seed)
    resolve = scenario.catalog.resolve
    for index, request in enumerate(workload.requests):
        engine.advance_to(request.arrival_s)
        slo = resolve({"class": request.slo_class} if request.slo_class else None)
        engine.submit(index, request.arrival_s, request.prompt_tokens, request.output_tokens, slo)
    last_arrival = workload.requests[-1].arrival_s
    engine.run_until_idle(last_arrival + scenario.drain_s)
    records = engine.records.values()
    load = summarize(records, rate, max(engine.now, last_arrival))
    error = engine.policy.step_model.error
    load["steps"] = engine.steps
    load["gpu_busy_fraction"] = engine.busy_s / engine.now if engine.now > 0 else 0.0
    load["step_model_mean_abs_rel_error"] = error.mean_abs_relative
    load["step_model_outliers"] = error.outliers
    learned = engine.policy.step_model.coefficients
    load["step_model"] = {
        "a_s": learned.a_s,
        "b_s_per_token": learned.b_s_per_token,
        "c_s_per_context_token": learned.c_s_per_context_token,
    }
    return RunResult(spec.label, load, latency_samples(records) if keep_samples else None)
