"""One simulation: a workload replayed at one offered rate through one policy on one rank."""

from __future__ import annotations

from dataclasses import dataclass

from sglang_ext.policy.admission import AdmissionError
from sglang_ext.policy.batch_former import DEFAULT_MAX_TOKEN_BUDGET
from sglang_ext.policy.policies import POLICIES, BatchPolicy, PolicyContext, PolicySettingError
from sglang_ext.policy.slo import Slo, SloCatalog
from sglang_ext.policy.step_model import StepModelFile
from sglang_ext.policy.variants import FairBatchingVariant  # also registers the variants
from sglang_ext.sim.disagg import Arrival, DisaggConfig, run_disaggregated
from sglang_ext.sim.engine import SimEngine
from sglang_ext.sim.fitting.calibration import offline_step_model
from sglang_ext.sim.metrics import LatencySamples, latency_samples, percentiles_ms, summarize
from sglang_ext.sim.policy_spec import (  # noqa: F401  re-exported: the runner's callers name specs
    DEFAULT_TOKEN_BUDGETS,
    PolicySpec,
    PolicySpecError,
    parse_admission,
    parse_policy,
)
from sglang_ext.sim.profile import HardwareProfile
from sglang_ext.sim.startup_calibration import calibrate_on_device
from sglang_ext.sim.workloads import Workload


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
    # a step-model file's models; None: the offline fit of ``step_form`` on the profile
    step_model: StepModelFile | None = None
    step_form: str = "knee"
    # a knee model learns its knee online (PolicyContext.learn_knee)
    learn_knee: bool = True
    # a FairBatching-family policy fits its step model on the device before the workload
    # (sglang_ext.sim.startup_calibration), as a scheduler with ``calibrate = true`` does
    calibrate: bool = False
    # the prefill/decode split and link of the policies that run disaggregated
    disagg: DisaggConfig = DisaggConfig()


@dataclass(frozen=True)
class RunResult:
    policy: str
    load: dict  # one entry of results.json "loads"
    samples: LatencySamples | None


def build_policy(scenario: Scenario, spec: PolicySpec, **context_overrides) -> BatchPolicy:
    step_model = scenario.step_model or offline_step_model(scenario.profile, scenario.step_form)
    context = PolicyContext(
        global_slo=scenario.catalog.default,
        initial_step_model=step_model.model,
        initial_linear_model=step_model.linear,
        max_token_budget=scenario.max_token_budget,
        gpu_memory_gb=scenario.profile.memory_gb,
        token_budget=spec.token_budget,
        settings=spec.settings,
        learn_knee=scenario.learn_knee,
        **({} if spec.admission is None else {"admission": spec.admission}),
        **context_overrides,
    )
    try:
        return POLICIES.get(spec.base)(context)
    except (AdmissionError, PolicySettingError) as exc:
        raise PolicySpecError(f"{spec.label}: {exc}") from None


def request_slo(catalog: SloCatalog, slo_class: str | None) -> tuple[Slo, str]:
    """A workload request's SLO and its effective class: its own, else the default class."""
    slo = catalog.resolve({"class": slo_class} if slo_class else None)
    return slo, slo_class or catalog.default_class


def replay(scenario: Scenario, policy: BatchPolicy, rate: float) -> tuple[SimEngine, float]:
    """Run the scenario's workload at ``rate`` through ``policy``; request ids are the
    workload's indices. Returns the engine and the run's duration."""
    workload = scenario.workload.with_arrivals(scenario.arrivals, rate, scenario.seed)
    if scenario.calibrate and policy.takes_admission:
        calibrate_on_device(scenario.profile, policy, scenario.catalog.default, scenario.seed)
    engine = SimEngine(scenario.profile, policy, seed=scenario.seed)
    for index, request in enumerate(workload.requests):
        engine.advance_to(request.arrival_s)
        slo, slo_class = request_slo(scenario.catalog, request.slo_class)
        engine.submit(index, request.arrival_s, request.prompt_tokens, request.output_tokens, slo,
                      slo_class)
    last_arrival = workload.requests[-1].arrival_s
    engine.run_until_idle(last_arrival + scenario.drain_s)
    return engine, max(engine.now, last_arrival)


def simulate(
    scenario: Scenario, spec: PolicySpec, rate: float, *, keep_samples: bool = False
) -> RunResult:
    """One run: a colocated policy on one simulated rank, a disaggregated one on
    ``scenario.disagg``'s prefill and decode ranks."""
    if not POLICIES.get(spec.base).disaggregated:
        return simulate_colocated(scenario, spec, rate, keep_samples=keep_samples)
    return simulate_disaggregated(scenario, spec, rate, keep_samples=keep_samples)


def simulate_colocated(
    scenario: Scenario, spec: PolicySpec, rate: float, *, keep_samples: bool = False
) -> RunResult:
    engine, duration = replay(scenario, build_policy(scenario, spec), rate)
    records = engine.records.values()
    load = summarize(records, rate, duration)
    error = engine.policy.step_model.error
    load["steps"] = engine.steps
    load["gpu_busy_fraction"] = engine.busy_s / engine.now if engine.now > 0 else 0.0
    load["step_model_mean_abs_rel_error"] = error.mean_abs_relative
    load["step_model_outliers"] = error.outliers
    learned = engine.policy.step_model.coefficients
    load["step_model"] = {"form": learned.form, **learned.fields()}
    if isinstance(engine.policy, FairBatchingVariant) and engine.policy.variant.margin:
        load["mean_margin"] = engine.policy.mean_margin
    return RunResult(spec.label, load, latency_samples(records) if keep_samples else None)


def simulate_disaggregated(
    scenario: Scenario, spec: PolicySpec, rate: float, *, keep_samples: bool = False
) -> RunResult:
    """A disaggregated policy on ``scenario.disagg``'s prefill and decode ranks
    (``sglang_ext.sim.disagg``); the load point adds the GPU count, effective RPS per GPU
    and the transfer figures to a colocated run's."""
    config = scenario.disagg
    workload = scenario.workload.with_arrivals(scenario.arrivals, rate, scenario.seed)
    arrivals = [
        Arrival(index, r.arrival_s, r.prompt_tokens, r.output_tokens,
                *request_slo(scenario.catalog, r.slo_class))
        for index, r in enumerate(workload.requests)
    ]
    run = run_disaggregated(arrivals, scenario.profile, lambda: build_policy(scenario, spec),
                            config, seed=scenario.seed, drain_s=scenario.drain_s)
    records = run.records.values()
    load = summarize(records, rate, run.duration_s)
    prefill_busy = sum(e.busy_s for e in run.prefill_engines)
    decode_busy = sum(r.busy_s for r in run.decode_ranks)
    load["steps"] = run.steps
    load["gpu_busy_fraction"] = (prefill_busy + decode_busy) / (run.duration_s * config.gpus)
    load["gpus"] = config.gpus
    load["effective_rps_per_gpu"] = load["effective_rps"] / config.gpus
    load["disaggregated"] = {
        "prefill_ranks": config.prefill_ranks,
        "decode_ranks": config.decode_ranks,
        "link_gbps": config.link_gbps,
        "prefill_busy_fraction": prefill_busy / (run.duration_s * config.prefill_ranks),
        "decode_busy_fraction": decode_busy / (run.duration_s * config.decode_ranks),
        "partial_decode_steps": sum(r.partial_steps for r in run.decode_ranks),
        "kv_transfer_ms": percentiles_ms(run.transfer_s),
        "decode_queue_ms": percentiles_ms(run.decode_wait_s),
    }
    return RunResult(spec.label, load, latency_samples(records) if keep_samples else None)
