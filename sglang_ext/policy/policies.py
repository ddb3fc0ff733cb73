"""Named batch policies: the FairBatching family.

Every policy owns an online step model (it observes every measured step) so an
engine can read the rank's PAB whatever the policy; only the FairBatching family
uses it to form batches. Baselines of other systems live in ``sglang_ext.sim``
and register into the same :data:`POLICIES` registry.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from sglang_ext.policy import compiled
from sglang_ext.policy.admission import (
    AdmissionError,
    AdmissionMode,
    AdmissionRule,
    AdmissionSettings,
    KvOutlook,
    class_budgets,
    forecast,
    hopeless_prefills,
)
from sglang_ext.policy.batch_former import (
    DEFAULT_MAX_TOKEN_BUDGET,
    ServiceFloor,
    Triage,
    pack,
    triage,
    unserviceable_slo_reason,
)
from sglang_ext.policy.name_registry import Registry
from sglang_ext.policy.pab import prefill_admission_budget
from sglang_ext.policy.request_table import RequestTable
from sglang_ext.policy.row_groups import triage_rows
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.speed_probe import SpeedProbe
from sglang_ext.policy.step_model import (
    OnlineStepModel,
    StepCoefficients,
    StepPredictor,
    online_step_model,
)
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.policy.view import BatchDecision, RequestState


class PolicySettingError(ValueError):
    """A policy's setting is outside what the policy accepts (a user's mistake: the CLIs
    report it as a usage error)."""


@dataclass(frozen=True, slots=True)
class PolicyContext:
    global_slo: Slo  # the default SLO class; PAB's global SLO
    initial_step_model: StepPredictor  # offline fit the online model starts from
    max_token_budget: int = DEFAULT_MAX_TOKEN_BUDGET
    gpu_memory_gb: float = 80.0  # baselines derive their defaults from it, as their systems do
    token_budget: int | None = None  # for policies swept over a token budget (NAME@BUDGET)
    # other tunables by name (NAME@BUDGET,key=value), each in the policy's ``setting_names``
    settings: tuple[tuple[str, float], ...] = ()
    # False runs the printed algorithm without the lateness guard or the door's refusal
    # (batch_former); only to measure what the guard costs (benchmarks/sim/hostile.py)
    lateness_guard: bool = True
    # admission control (sglang_ext.policy.admission); the FairBatching family applies it
    admission: AdmissionSettings = AdmissionSettings()
    # seconds every in-time token is planned before its deadline for the way from the
    # scheduler to the client (detokenizer, HTTP, network), which the step model does not
    # see; only the policies with a deadline guard (``-margin`` and after) take it
    delivery_allowance_s: float = 0.0
    # the paper's linear model fitted to the same data as a knee ``initial_step_model``
    # (the step-model file's [linear] table), for the policies that keep it (fb)
    initial_linear_model: StepCoefficients | None = None
    # a knee model learns its knee online as well as its weights (OnlineKneeModel); False
    # keeps the file's knee
    learn_knee: bool = True

    def __post_init__(self) -> None:
        if self.max_token_budget < 1:
            raise ValueError(f"max_token_budget must be >= 1, got {self.max_token_budget}")
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError(f"token budget must be >= 1, got {self.token_budget}")
        if not (math.isfinite(self.delivery_allowance_s) and self.delivery_allowance_s >= 0):
            raise ValueError(f"delivery allowance must be a finite number >= 0 seconds, "
                             f"got {self.delivery_allowance_s!r}")
        for name, value in self.settings:
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"setting {name} must be a finite number > 0, got {value!r}")

    def setting(self, name: str) -> float | None:
        return dict(self.settings).get(name)

    def initial_model(self, linear: bool) -> StepPredictor:
        """The offline model a policy starts from: the paper's linear one if ``linear``."""
        if not linear or isinstance(self.initial_step_model, StepCoefficients):
            return self.initial_step_model
        if self.initial_linear_model is None:
            raise ValueError("this policy keeps the paper's linear step model: a knee "
                             "initial_step_model needs initial_linear_model beside it")
        return self.initial_linear_model


class BatchPolicy:
    """The seam an engine drives: ``admit`` on arrival, ``form_batch`` before each step,
    ``observe_step`` after it. ``requests`` are read, never mutated."""

    name = "abstract"
    takes_token_budget = False  # swept as NAME@BUDGET
    setting_names: tuple[str, ...] = ()  # further tunables, NAME@BUDGET,key=value
    takes_admission = False  # applies PolicyContext.admission
    takes_delivery_allowance = False  # applies PolicyContext.delivery_allowance_s
    keeps_linear_model = False  # the paper's linear step model whatever the file's form
    disaggregated = False  # runs on prefill and decode ranks apart (sglang_ext.sim.disagg)
    #: the device's speed against the initial model that the learner restarted from
    #: (``sglang_ext.policy.speed_probe``; 1: the model as given)
    speed_factor = 1.0

    def __init__(self, context: PolicyContext) -> None:
        self.context = context
        self.initial_step_model = context.initial_model(self.keeps_linear_model)
        self.step_model = online_step_model(self.initial_step_model, learn_knee=context.learn_knee)
        self.admission = context.admission  # what the policy applies (off for baselines)
        self.kv_outlook: KvOutlook | None = None
        if context.delivery_allowance_s and not self.takes_delivery_allowance:
            raise ValueError(f"policy {self.name!r} plans tokens at their deadlines and takes no "
                             "delivery allowance; use a -margin variant (fb-anchor-margin, fb-smooth)")

    @classmethod
    def default_setting(cls, name: str, context: PolicyContext, token_budget: int) -> float:
        """The value of tunable ``name`` (one of ``setting_names``) when none is given, at
        ``token_budget``; a sweep tunes the setting around it."""
        raise KeyError(f"policy {cls.name!r} has no setting {name!r}")

    def setting_value(self, name: str, token_budget: int) -> float:
        """Tunable ``name`` as configured (``NAME@...,name=value``), else its
        :meth:`default_setting` at ``token_budget``."""
        return self.context.setting(name) or self.default_setting(name, self.context, token_budget)

    def admit(
        self, requests: Sequence[RequestState], now: float, prompt_tokens: int, slo: Slo,
        arrival: float | None = None,
    ) -> bool:
        """Called when a request arrives (at ``arrival``, default ``now``), before it
        joins ``requests``."""
        return True

    def refusal(self, slo: Slo) -> str | None:
        """Why a request with ``slo`` is refused before it costs anything (the front
        door's check, decided from the initial step model), or ``None``."""
        return None

    def form_batch(self, requests: Sequence[RequestState], now: float) -> BatchDecision:
        raise NotImplementedError

    def observe_step(self, shape: StepShape, measured_s: float) -> None:
        """Called after every step with what it computed and how long it took."""
        self.step_model.observe(shape, measured_s)

    def adopt_initial_model(self, model: StepPredictor, linear: StepCoefficients) -> None:
        """Start again from ``model`` (and the linear model fitted beside it), as if it had
        been the step-model file: what a start-up calibration fitted on the device."""
        self.context = dataclasses.replace(self.context, initial_step_model=model,
                                           initial_linear_model=linear)
        self.initial_step_model = self.context.initial_model(self.keeps_linear_model)
        self.step_model = online_step_model(self.initial_step_model, learn_knee=self.context.learn_knee)

    def observe_kv(self, outlook: KvOutlook | None) -> None:
        """The rank's KV memory, given before ``admit``, ``form_batch`` and
        ``class_budgets`` when the engine knows it (``None``: admission counts
        compute only)."""
        self.kv_outlook = outlook

    def prefill_admission_budget(self, requests: Sequence[RequestState], now: float) -> float:
        return prefill_admission_budget(
            requests, now, self.step_model.coefficients, self.context.global_slo
        )

    def class_budgets(
        self, requests: Sequence[RequestState], now: float, classes: Mapping[str, Slo]
    ) -> dict[str, float]:
        """Each SLO class's admission budget in prompt tokens (what a rank publishes),
        under the policy's admission rule (``edf`` when admission is off)."""
        return class_budgets(
            self.admission.rule, requests, now, self.step_model.coefficients, classes,
            self.context.global_slo.tpot_s, self.admission.headroom, self.kv_outlook,
            self.admission.length_weight,
        )

    def form_batch_with_budgets(
        self, requests: Sequence[RequestState], now: float, classes: Mapping[str, Slo]
    ) -> tuple[BatchDecision, dict[str, float]]:
        """``(form_batch(requests, now), class_budgets(requests, now, classes))``, for a
        rank that publishes its budgets at every decision; a policy whose decision runs the
        same forecast computes it once."""
        budgets = self.class_budgets(requests, now, classes)
        return self.form_batch(requests, now), budgets


POLICIES: Registry[Callable[[PolicyContext], BatchPolicy]] = Registry("policy")


class _LatenessGuarded(BatchPolicy):
    """The FairBatching family: the lateness guard in every triage, and the door's
    refusal of a TPOT no rank can honour (``sglang_ext.policy.batch_former``)."""

    takes_admission = True
    #: the admission these names stand for (``fb-pab``: reject under the PAB rule)
    implied_admission: AdmissionSettings | None = None

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self.admission = _resolved_admission(self.name, self.implied_admission, context.admission)
        self._floor: tuple[StepPredictor, ServiceFloor] | None = None  # of the model it was for
        self._speed_probe: SpeedProbe | None = SpeedProbe(self.initial_step_model)

    def observe_step(self, shape: StepShape, measured_s: float) -> None:
        """Learns the step; over the first steps, also the device's speed against the file
        (``sglang_ext.policy.speed_probe``): a device slower than the file at every kind
        of step restarts the learner from the file scaled to it."""
        super().observe_step(shape, measured_s)
        probe = self._speed_probe
        if probe is None:
            return
        factor = probe.observe(shape, measured_s)
        if factor is not None:
            self.speed_factor = factor
            initial = self.initial_step_model
            learner = online_step_model(initial.with_weights([w * factor for w in initial.weights]),
                                        learn_knee=self.context.learn_knee)
            for seen, seconds in probe.samples:
                learner.observe(seen, seconds)
            learner.keep_errors(self.step_model.errors)
            self.step_model = learner
        if probe.done:
            self._speed_probe = None

    def admit(
        self, requests: Sequence[RequestState], now: float, prompt_tokens: int, slo: Slo,
        arrival: float | None = None,
    ) -> bool:
        admission = self.admission
        if admission.mode is not AdmissionMode.REJECT:
            return True
        coefficients = self.step_model.coefficients
        if admission.rule is AdmissionRule.PAB:
            return prompt_tokens <= prefill_admission_budget(requests, now, coefficients, slo)
        queue = forecast(
            requests, now, coefficients, self.context.global_slo.tpot_s, admission.headroom,
            self.kv_outlook,
        )
        waited = 0.0 if arrival is None else max(0.0, now - arrival)
        return prompt_tokens <= queue.budget(slo.ttft_s - waited)

    def refusal(self, slo: Slo) -> str | None:
        if not self.context.lateness_guard:
            return None
        return unserviceable_slo_reason(slo, self.initial_step_model)

    def _triage(self, requests: Sequence[RequestState], now: float, anchored: bool = False,
                hopeless: frozenset | None = None):
        """``hopeless``: the forecast's, when the caller has it (under ``defer``)."""
        floor = None
        if self.context.lateness_guard:
            floor = self._service_floor()
        if hopeless is None:
            hopeless = frozenset()
            if self.admission.mode is AdmissionMode.DEFER and (
                    compiled.queue_forecast is not None and type(requests) is RequestTable
                    or _any_prefill_queued(requests)):  # the compiled forecast checks itself
                hopeless = hopeless_prefills(
                    requests, now, self.step_model.coefficients, self.context.global_slo.tpot_s,
                    self.admission.headroom, self.kv_outlook, self.admission.length_weight,
                )
        if type(requests) is RequestTable:
            return triage_rows(requests, now, anchored, floor, hopeless, self._deadline_guard_s())
        return triage(
            requests, now, anchored=anchored, floor=floor, hopeless=hopeless,
            deadline_guard_s=self._deadline_guard_s(),
        )

    def adopt_initial_model(self, model: StepPredictor, linear: StepCoefficients) -> None:
        super().adopt_initial_model(model, linear)
        self._floor = None
        self._speed_probe = SpeedProbe(self.initial_step_model)
        self.speed_factor = 1.0

    def _service_floor(self) -> ServiceFloor:
        """The lateness guard's floor: serviceability from the initial model, as the
        door decides it, the budget's lower bound from the online one; recomputed only
        when the step model has changed (after a step, not at every decision)."""
        coefficients = self.step_model.coefficients
        if self._floor is None or self._floor[0] is not coefficients:
            self._floor = coefficients, ServiceFloor.of(
                self.initial_step_model, self.context.global_slo.tpot_s, coefficients)
        return self._floor[1]

    def _deadline_guard_s(self) -> float:
        return 0.0

    def _expired(self, requests: Sequence[RequestState], now: float) -> tuple[Hashable, ...]:
        """Under ``defer``: requests still without a first token ``max_defer_s`` after
        their TTFT deadline, which the engine ends (aborts) before the step."""
        if self.admission.mode is not AdmissionMode.DEFER:
            return ()
        limit = self.admission.max_defer_s
        if type(requests) is RequestTable:
            rows = _overdue_rows(requests, now, limit)
            return tuple(requests.ids_at(rows)) if len(rows) else ()
        return tuple([
            r.req_id for r in requests
            if r.next_output_index == 0 and now - r.arrival - r.slo.ttft_s > limit
        ])

    def form_batch(self, requests: Sequence[RequestState], now: float) -> BatchDecision:
        expired = self._expired(requests, now)
        if not expired:
            return self._form_batch(requests, now)
        if type(requests) is RequestTable:
            kept_rows = np.ones(len(requests), dtype=bool)
            kept_rows[_overdue_rows(requests, now, self.admission.max_defer_s)] = False
            kept = requests.rows(kept_rows)
        else:
            gone = set(expired)
            kept = [r for r in requests if r.req_id not in gone]
        decision = self._form_batch(kept, now)
        return dataclasses.replace(decision, abort_ids=expired)

    def form_batch_with_budgets(
        self, requests: Sequence[RequestState], now: float, classes: Mapping[str, Slo]
    ) -> tuple[BatchDecision, dict[str, float]]:
        """Under admission ``defer`` with the ``edf`` rule, one forecast gives both the
        budgets and the decision's hopeless prefills (``forecast(...).hopeless`` is what
        ``hopeless_prefills`` finds); otherwise, or when a request expires (the decision
        is then formed without it), the two calls."""
        admission = self.admission
        if (admission.mode is not AdmissionMode.DEFER or admission.rule is not AdmissionRule.EDF
                or self._expired(requests, now)):
            return super().form_batch_with_budgets(requests, now, classes)
        queue = forecast(
            requests, now, self.step_model.coefficients, self.context.global_slo.tpot_s,
            admission.headroom, self.kv_outlook, admission.length_weight,
        )
        budgets = {name: queue.budget(slo.ttft_s) for name, slo in classes.items()}
        return self._form_batch(requests, now, queue.hopeless), budgets

    def _form_batch(self, requests: Sequence[RequestState], now: float,
                    hopeless: frozenset | None = None) -> BatchDecision:
        """The decision over ``requests`` (none expired); ``hopeless`` as in :meth:`_triage`."""
        raise NotImplementedError


def _overdue_rows(table: RequestTable, now: float, limit: float) -> np.ndarray:
    """The rows of the table's requests still without a first token ``limit`` seconds
    after their TTFT deadline (``_LatenessGuarded._expired``'s test, per row), in order."""
    columns = table.columns
    overdue = compiled.overdue
    if overdue is not None:
        return np.array(overdue(columns.next_index, columns.arrival, columns.ttft, now, limit),
                        dtype=np.intp)
    return ((columns.next_index == 0) & (now - columns.arrival - columns.ttft > limit)).nonzero()[0]


def _any_prefill_queued(requests: Sequence[RequestState]) -> bool:
    """Whether the forecast can find anything hopeless (only queued prefills can be).
    Newest first: an engine keeps its requests in arrival order, and the queued are the
    newest."""
    if type(requests) is RequestTable:
        return np.count_nonzero(requests.decoding) < len(requests)
    for request in reversed(requests):
        if request.pending_prefill > 0:
            return True
    return False


def _resolved_admission(
    name: str, implied: AdmissionSettings | None, configured: AdmissionSettings
) -> AdmissionSettings:
    """A policy name that implies an admission (``fb-pab``) and configured settings must
    agree; configured ``off`` takes the implied one."""
    if implied is None or configured.mode is AdmissionMode.OFF:
        return implied or configured
    if (configured.mode, configured.rule) != (implied.mode, implied.rule):
        raise AdmissionError(
            f"policy {name!r} means admission mode {implied.mode.value!r} with rule "
            f"{implied.rule.value!r}, but admission mode {configured.mode.value!r} with rule "
            f"{configured.rule.value!r} is configured: name the policy without '-pab' to use "
            "the configured admission, or configure mode 'reject' with rule 'pab'"
        )
    return configured


@POLICIES.register("fb")
class FairBatching(_LatenessGuarded):
    """Algorithm 1 under the adaptive time budget.

    Variants (``sglang_ext.policy.variants``) change it through ``anchored`` (slack
    measured from the first token) and the ``_reorder`` / ``_time_budget`` hooks."""

    name = "fb"
    anchored = False
    keeps_linear_model = True  # the paper's; variants take the step-model file's form

    def _form_batch(self, requests: Sequence[RequestState], now: float,
                    hopeless: frozenset | None = None) -> BatchDecision:
        groups = self._triage(requests, now, self.anchored, hopeless)
        if groups is None:
            return BatchDecision.make_empty()
        return pack(
            self._reorder(groups, now), self.step_model.coefficients,
            token_budget=self.context.max_token_budget,
            time_budget_s=self._time_budget(groups.init_time_budget_s),
        )

    def _reorder(self, groups: Triage, now: float) -> Triage:
        return groups

    def _time_budget(self, init_time_budget_s: float) -> float:
        return init_time_budget_s


@POLICIES.register("fb-pab")
class FairBatchingWithAdmission(FairBatching):
    """``fb`` that rejects a new request whose prompt exceeds the rank's PAB at the
    request's SLO (the same as ``fb`` with admission mode ``reject``, rule ``pab``)."""

    name = "fb-pab"
    implied_admission = AdmissionSettings(AdmissionMode.REJECT, AdmissionRule.PAB)


@POLICIES.register("fb-fb")
class FairBatchingFixedBudget(_LatenessGuarded):
    """FairBatching's grouping and order under a fixed token budget (swept like Sarathi's)."""

    name = "fb-fb"
    takes_token_budget = True

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self.token_budget = context.token_budget or 2048

    def _form_batch(self, requests: Sequence[RequestState], now: float,
                    hopeless: frozenset | None = None) -> BatchDecision:
        groups = self._triage(requests, now, hopeless=hopeless)
        if groups is None:
            return BatchDecision.make_empty()
        return pack(
            groups, self.step_model.coefficients, token_budget=self.token_budget, time_budget_s=None
        )


@POLICIES.register("fb-tb")
class FairBatchingDerivedTokenBudget(_LatenessGuarded):
    """Each step's token budget is the time budget converted through a tokens-only
    model ``a' + b' * new_tokens`` (learned online like the full model)."""

    name = "fb-tb"
    keeps_linear_model = True  # converts time to tokens through a' + b' * new_tokens

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self.tokens_only_model = OnlineStepModel(self.initial_step_model, use_context=False)

    def observe_step(self, shape: StepShape, measured_s: float) -> None:
        super().observe_step(shape, measured_s)
        self.tokens_only_model.observe(shape, measured_s)

    def adopt_initial_model(self, model: StepPredictor, linear: StepCoefficients) -> None:
        super().adopt_initial_model(model, linear)
        self.tokens_only_model = OnlineStepModel(self.initial_step_model, use_context=False)

    def _form_batch(self, requests: Sequence[RequestState], now: float,
                    hopeless: frozenset | None = None) -> BatchDecision:
        groups = self._triage(requests, now, hopeless=hopeless)
        if groups is None:
            return BatchDecision.make_empty()
        tokens_only = self.tokens_only_model.coefficients
        derived = (groups.init_time_budget_s - tokens_only.a_s) / tokens_only.b_s_per_token
        budget = max(1, min(self.context.max_token_budget, math.floor(derived)))
        return pack(groups, tokens_only, token_budget=budget, time_budget_s=None)
