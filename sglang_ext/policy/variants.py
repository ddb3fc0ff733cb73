"""Beyond the paper: FairBatching variants, each its own named policy.

None is mixed into ``fb``; the report measures each against it. Every variant takes the
step-model file's form (the knee model, ``sglang_ext.policy.knee_step_model``, in the
bundled files); ``fb`` keeps the paper's linear model. The table ``VARIANTS`` says what
each changes, and one class, :class:`FairBatchingVariant`, does all of it; ``fb-kairos``
is its own class.

- ``fb-anchor``: after the first token, a request's deadlines are ``t_0 + tpot * j``
  (the first token keeps ``arrival + ttft``). The paper's envelope anchors TPOT at
  ``arrival + ttft``, so a request whose first token came early carries slack it
  can spend in one long gap, which the max-TPOT metric users measure counts as a
  violation.
- ``fb-margin``: the time budget shrinks by a safety margin learned from the step
  model's observed error (the p95 of recent relative errors, capped at 50%), so a
  step predicted to fit its budget still fits when the prediction runs long; and every
  token is planned two margins of a TPOT before its deadline (a deferred decode must
  survive the running step's error and its own).
- ``fb-kairos``: inside the prefill group, Kairos's urgency order (Kairos §3.1,
  Algorithm 1): predict each queued prefill's finish time under FCFS from a running
  prefill-throughput estimate, score ``(ttft - (finish - arrival)) / ttft / input
  length``, and sort descending, as Kairos does.
- ``fb-anchor-margin``: the first two together (:class:`FairBatchingVariant` says why they
  need each other); ``fb-anchor-margin-pab`` adds ``fb-pab``'s admission control to it.
- ``fb-smooth``: ``fb-anchor-margin`` that spends slack only where a deadline needs it.
  With anchored deadlines a stream that ran ahead carries seconds of slack, and
  Algorithm 1 spends it: the time budget stretches to the smallest slack and any queued
  prompt parks every decode with slack, so streams stall for hundreds of milliseconds
  while every SLO still holds. ``fb-smooth`` runs every decode in a step of one TPOT
  whenever the prompts queued still meet their deadlines at that pace, and always when
  they need more KV memory than the rank has free: deferring decodes then frees no
  memory for them, holds the deferred requests' memory longer, and what the longer step
  admits is retracted and recomputed once the running outputs fill the pool.
- ``fb-steady``: ``fb-smooth`` that never falls back to Algorithm 1's long step: every
  decode runs in every step of one TPOT and prompts fill the rest, even when an in-time
  prompt would need a decode's slack to meet its TTFT. On a GPU whose decode-only step
  is a large share of the TPOT (the weights' read of a model that fills its card), a
  deferred decode saves little of a step and costs its stream a gap; the fallback's long
  steps then lose more than they save.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from sglang_ext.policy.admission import AdmissionMode, AdmissionRule, AdmissionSettings
from sglang_ext.policy.batch_former import Triage, pack, smooth_step
from sglang_ext.policy.policies import POLICIES, BatchPolicy, FairBatching, PolicyContext
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.policy.view import BatchDecision, RequestState

MAX_MARGIN = 0.5
DEADLINE_GUARD_STEPS = 2
MAX_GUARD_SHARE = 0.5  # of a TPOT: the time budget's floor keeps at least half a TPOT
MARGIN_WARMUP_STEPS = 20
THROUGHPUT_EWMA = 0.1


class Step(enum.Enum):
    """How a variant forms its step (module docstring: ``fb-smooth``, ``fb-steady``)."""

    PAPER = "paper"  # Algorithm 1's step and deferrals
    SMOOTH = "smooth"  # every decode in a step of one TPOT while the prompts keep their deadlines
    STEADY = "steady"  # every decode in every step of one TPOT; prompts take the rest


@dataclass(frozen=True)
class Variant:
    """What a variant changes from the paper's ``fb``; each is one registered policy."""

    name: str
    anchored: bool = False  # after the first token, deadlines count from it
    margin: bool = False  # the time budget shrunk by the learned error margin
    step: Step = Step.PAPER
    implied_admission: AdmissionSettings | None = None  # what the name stands for


PAB_REJECT = AdmissionSettings(AdmissionMode.REJECT, AdmissionRule.PAB)

#: The variants, in the order they build on each other; ``fb-smooth`` is the shipped one.
VARIANTS: tuple[Variant, ...] = (
    Variant("fb-anchor", anchored=True),
    Variant("fb-margin", margin=True),
    Variant("fb-anchor-margin", anchored=True, margin=True),
    Variant("fb-anchor-margin-pab", anchored=True, margin=True, implied_admission=PAB_REJECT),
    Variant("fb-smooth", anchored=True, margin=True, step=Step.SMOOTH),
    Variant("fb-steady", anchored=True, margin=True, step=Step.STEADY),
)


class FairBatchingVariant(FairBatching):
    """``fb`` changed as its :class:`Variant` says; every policy of ``VARIANTS`` is this
    class with its variant (``POLICIES.get(name)``).

    - ``anchored``: slack is measured against anchored deadlines (``triage``).
    - ``margin``: after each step the margin is the p95 of the step model's recent
      relative errors (after ``MARGIN_WARMUP_STEPS``, at most ``MAX_MARGIN``); the time
      budget is divided by ``1 + margin``, and every in-time token is planned
      ``DEADLINE_GUARD_STEPS`` margins of a TPOT (plus the delivery allowance) before its
      deadline. Anchored deadlines make the budget as tight as the next token's real
      deadline, so the step model's error decides whether the first gap after a token
      lands inside it; the margin absorbs it.
    - ``step``: ``SMOOTH`` first tries
      :func:`~sglang_ext.policy.batch_former.smooth_step` (every decode, a step of one
      TPOT) and falls back to Algorithm 1's longer step and deferrals when an in-time
      prefill would miss its deadline at that pace, unless the in-time prompts need more
      KV memory than is free (:meth:`_kv_bound`; then it steps as ``STEADY`` does);
      ``STEADY`` never falls back: every
      decode still runs and the prompts take what is left of one TPOT (Algorithm 1's
      step only when nothing is in time, the lateness guard's fallback budget).
    """

    variant: ClassVar[Variant]
    keeps_linear_model = False

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self._margin = 0.0
        self._margin_total = 0.0
        self._margin_steps = 0

    @property
    def margin(self) -> float:
        return self._margin

    @property
    def mean_margin(self) -> float:
        """The margin's mean over the steps since the warm-up (0 before any)."""
        return self._margin_total / self._margin_steps if self._margin_steps else 0.0

    def observe_step(self, shape: StepShape, measured_s: float) -> None:
        """Refreshes the margin here, after the step, off the decision's critical path."""
        super().observe_step(shape, measured_s)
        if not self.variant.margin:
            return
        errors = self.step_model.errors
        if errors.samples >= MARGIN_WARMUP_STEPS:
            self._margin = min(errors.p95_abs_relative, MAX_MARGIN)
            self._margin_total += self._margin
            self._margin_steps += 1

    def _time_budget(self, init_time_budget_s: float) -> float:
        return init_time_budget_s / (1.0 + self._margin)

    def _guarded(self, tpot_s: float, guard_s: float) -> float:
        """``tpot_s - guard_s``, but never below the step worth running (the floor's
        ``min_budget_s``, or the TPOT itself when shorter)."""
        lowest = tpot_s - guard_s
        if not self.context.lateness_guard:
            return lowest
        floor = self._service_floor().min_budget_s * (1.0 + self._margin)
        if lowest < floor:
            return tpot_s if tpot_s < floor else floor
        return lowest

    def _margin_guard_s(self) -> float:
        """``DEADLINE_GUARD_STEPS`` x margin x TPOT: a decode deferred now rides a later
        step, so its token must survive two steps' prediction errors (the one running and
        its own), not one; without the guard FairBatching lands tokens on their deadlines
        and any overrun is a max-TPOT violation."""
        return min(DEADLINE_GUARD_STEPS * self._margin, MAX_GUARD_SHARE) * self.context.global_slo.tpot_s

    def _deadline_guard_s(self) -> float:
        """How long before its deadline each in-time token is planned: the margin guard
        plus the delivery allowance (``PolicyContext.delivery_allowance_s``, taken only
        with a margin), together at most ``MAX_GUARD_SHARE`` of a TPOT."""
        if not self.variant.margin:
            return 0.0
        tpot = self.context.global_slo.tpot_s
        return min(self._margin_guard_s() + self.context.delivery_allowance_s, MAX_GUARD_SHARE * tpot)

    def _form_batch(self, requests: Sequence[RequestState], now: float,
                    hopeless: frozenset | None = None) -> BatchDecision:
        if self.variant.step is Step.PAPER:
            return super()._form_batch(requests, now, hopeless)
        groups = self._triage(requests, now, self.anchored, hopeless)
        if groups is None:
            return BatchDecision.make_empty()
        coefficients = self.step_model.coefficients
        # a smooth step emits every decode's token each step, so it keeps the margin
        # guard only: the delivery allowance is for tokens planned at their deadlines
        smooth_budget = self._time_budget(self._guarded(groups.step_tpot_s, self._margin_guard_s()))
        smooth = smooth_step(groups, coefficients, smooth_budget)
        if smooth is not None:
            groups, time_budget = smooth, smooth_budget
        elif (self.variant.step is Step.STEADY or self._kv_bound(groups)) and math.isfinite(smooth_budget):
            groups = groups.steady(smooth_budget)
            time_budget = smooth_budget
        else:
            time_budget = self._time_budget(groups.init_time_budget_s)
        return pack(groups, coefficients, token_budget=self.context.max_token_budget,
                    time_budget_s=time_budget)

    def _kv_bound(self, groups: Triage) -> bool:
        """Whether the in-time prompts queued need more KV memory than the rank has free
        (the KV outlook the admission forecast keeps; False without one). Then memory,
        not step time, holds them back: a decode deferred to lengthen the step keeps its
        KV for longer and frees none, so the prompts it would make room for wait longer."""
        outlook = self.kv_outlook
        if outlook is None:
            return False
        free = outlook.free_tokens
        need = 0.0
        for _, request in groups.prefills:
            need += outlook.need_of(request)
            if need > free:
                return True
        return False


def _registered(variant: Variant) -> type[FairBatchingVariant]:
    policy = type(f"FairBatchingVariant[{variant.name}]", (FairBatchingVariant,), {
        "variant": variant, "name": variant.name, "anchored": variant.anchored,
        "implied_admission": variant.implied_admission,
        "takes_delivery_allowance": variant.margin,
        "__module__": __name__, "__doc__": FairBatchingVariant.__doc__,
    })
    return POLICIES.register(variant.name)(policy)


for _variant in VARIANTS:
    _registered(_variant)


class KairosPrefillRate(BatchPolicy):
    """Kairos's running prefill throughput (``prefill_tokens_per_s``), mixed in before a
    policy class: it starts at ``1 / b`` of the initial step model and follows each
    measured step with prefill tokens by an EWMA (``THROUGHPUT_EWMA``) of its tokens per
    second."""

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self.prefill_tokens_per_s = 1.0 / self.initial_step_model.usable().b_s_per_token

    def adopt_initial_model(self, model, linear) -> None:
        super().adopt_initial_model(model, linear)
        self.prefill_tokens_per_s = 1.0 / self.initial_step_model.usable().b_s_per_token

    def observe_step(self, shape: StepShape, measured_s: float) -> None:
        super().observe_step(shape, measured_s)
        if shape.prefill_tokens > 0:
            sample = shape.prefill_tokens / measured_s
            self.prefill_tokens_per_s += THROUGHPUT_EWMA * (sample - self.prefill_tokens_per_s)


@POLICIES.register("fb-kairos")
class FairBatchingKairosPrefills(KairosPrefillRate, FairBatching):
    name = "fb-kairos"
    keeps_linear_model = False

    def _reorder(self, groups: Triage, now: float) -> Triage:
        if len(groups.prefills) < 2:
            return groups
        return dataclasses.replace(groups.as_triage(), prefills=kairos_order(
            groups.prefills, now, self.prefill_tokens_per_s
        ))



def kairos_order(
    prefills: list[tuple[float, RequestState]], now: float, tokens_per_s: float
) -> list[tuple[float, RequestState]]:
    """Kairos Algorithm 1 lines 4-11 over (slack, request) pairs: FCFS finish-time
    prediction, normalised urgency, sorted descending (ties keep FCFS order)."""
    fcfs = sorted(prefills, key=lambda pair: pair[1].arrival_seq)
    cursor = now
    scored = []
    for pair in fcfs:
        request = pair[1]
        cursor += request.pending_prefill / tokens_per_s
        ttft = request.slo.ttft_s
        urgency = (ttft - (cursor - request.arrival)) / ttft
        scored.append((urgency / request.prompt_tokens, pair))
    scored.sort(key=lambda item: item[0], reverse=True)
    return [pair for _, pair in scored]
