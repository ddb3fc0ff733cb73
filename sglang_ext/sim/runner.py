"""One simulation: a workload replayed at one offered rate through one policy on one rank."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import sglang_ext.sim.baselines  # noqa: F401  registers the baselines
import sglang_ext.sim.kairos  # noqa: F401  registers Kairos and its baseline (disaggregated)
import sglang_ext.sim.slo_anneal  # noqa: F401  registers slo-anneal (SLO-aware annealing)
import sglang_ext.sim.study_policies  # noqa: F401  registers the batching study's policies
from sglang_ext.policy.admission import AdmissionError, AdmissionSettings, GiveUp
from sglang_ext.policy.batch_former import DEFAULT_MAX_TOKEN_BUDGET
from sglang_ext.policy.policies import POLICIES, BatchPolicy, PolicyContext
from sglang_ext.policy.registry import UnknownNameError
from sglang_ext.policy.slo import Slo, SloCatalog
from sglang_ext.policy.step_model import StepModelFile
from sglang_ext.policy.variants import FairBatchingWithMargin  # also registers the variants
from sglang_ext.sim.calibration import offline_step_model
from sglang_ext.sim.disagg import Arrival, DisaggConfig, run_disaggregated
from sglang_ext.sim.engine import SimEngine
from sglang_ext.sim.metrics import LatencySamples, latency_samples, percentiles_ms, summarize
from sglang_ext.sim.profile import HardwareProfile
from sglang_ext.sim.workloads import Workload

#: Sarathi's and fb-fb's budgets swept by default: 32 to 8192, doubling; a sweep then
#: refines around the best (``sglang_ext.sim.tuning``).
DEFAULT_TOKEN_BUDGETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


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
    """``MODE[:RULE][:GIVE_UP]`` (``reject``, ``defer``, ``reject:pab``, ``defer:latest``)."""
    mode, *options = text.split(":")
    words = {}
    for option in options:
        key = "give_up" if option in {g.value for g in GiveUp} else "rule"
        if key in words:
            raise PolicySpecError(f"admission {text!r}: two values for its {key}")
        words[key] = option
    try:
        return AdmissionSettings.parse(mode, **words)
    except AdmissionError as exc:
        raise PolicySpecError(str(exc)) from None


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
        **({} if spec.admission is None else {"admission": spec.admission}),
        **context_overrides,
    )
    try:
        return POLICIES.get(spec.base)(context)
    except AdmissionError as exc:
        raise PolicySpecError(f"{spec.label}: {exc}") from None


def request_slo(catalog: SloCatalog, slo_class: str | None) -> tuple[Slo, str]:
    """A workload request's SLO and its effective class: its own, else the default class."""
    slo = catalog.resolve({"class": slo_class} if slo_class else None)
    return slo, slo_class or catalog.default_class


def replay(scenario: Scenario, policy: BatchPolicy, rate: float) -> tuple[SimEngine, float]:
    """Run the scenario's workload at ``rate`` through ``policy``; request ids are the
    workload's indices. Returns the engine and the run's duration."""
    workload = scenario.workload.with_arrivals(scenario.arrivals, rate, scenario.seed)
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
    if POLICIES.get(spec.base).disaggregated:
        return simulate_disaggregated(scenario, spec, rate, keep_samples=keep_samples)
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
    if isinstance(engine.policy, FairBatchingWithMargin):
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
