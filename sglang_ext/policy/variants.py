"""Beyond the paper: FairBatching variants, each its own named policy.

None is mixed into ``fb``; the report measures each against it. Every variant takes the
step-model file's form (the knee model, ``sglang_ext.policy.knee_step_model``, in the
bundled files); ``fb`` keeps the paper's linear model.
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
- ``fb-anchor-margin``: the first two together (see its docstring for why they need
  each other); ``fb-anchor-margin-pab`` adds ``fb-pab``'s admission control to it.
- ``fb-smooth``: ``fb-anchor-margin`` that spends slack only where a deadline needs it.
  With anchored deadlines a stream that ran ahead carries seconds of slack, and
  Algorithm 1 spends it: the time budget stretches to the smallest slack and any queued
  prompt parks every decode with slack, so streams stall for hundreds of milliseconds
  while every SLO still holds. ``fb-smooth`` runs every decode in a step of one TPOT
  whenever the prompts queued still meet their deadlines at that pace.
- ``fb-steady``: ``fb-smooth`` that never falls back to Algorithm 1's long step: every
  decode runs in every step of one TPOT and prompts fill the rest, even when an in-time
  prompt would need a decode's slack to meet its TTFT. On a GPU whose decode-only step
  is a large share of the TPOT (the weights' read of a model that fills its card), a
  deferred decode saves little of a step and costs its stream a gap; the fallback's long
  steps then lose more than they save.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from sglang_ext.policy.batch_former import Triage, pack, smooth_step
from sglang_ext.policy.policies import (
    POLICIES,
    BatchPolicy,
    FairBatching,
    FairBatchingWithAdmission,
    PolicyContext,
)
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.policy.view import BatchDecision, RequestState

MAX_MARGIN = 0.5
DEADLINE_GUARD_STEPS = 2
MAX_GUARD_SHARE = 0.5  # of a TPOT: the time budget's floor keeps at least half a TPOT
MARGIN_WARMUP_STEPS = 20
THROUGHPUT_EWMA = 0.1


@POLICIES.register("fb-anchor")
class FairBatchingAnchored(FairBatching):
    name = "fb-anchor"
    keeps_linear_model = False
    anchored = True


@POLICIES.register("fb-margin")
class FairBatchingWithMargin(FairBatching):
    name = "fb-margin"
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
        error = self.step_model.error
        if error.samples >= MARGIN_WARMUP_STEPS:
            self._margin = min(error.p95_abs_relative, MAX_MARGIN)
            self._margin_total += self._margin
            self._margin_steps += 1

    def _time_budget(self, init_time_budget_s: float) -> float:
        return init_time_budget_s / (1.0 + self.margin)

    def _guarded(self, tpot_s: float, guard_s: float) -> float:
        """``tpot_s - guard_s``, but never below the step worth running (the floor's
        ``min_budget_s``, or the TPOT itself when shorter)."""
        lowest = tpot_s - guard_s
        if not self.context.lateness_guard:
            return lowest
        floor = self._service_floor().min_budget_s * (1.0 + self.margin)
        if lowest < floor:
            return tpot_s if tpot_s < floor else floor
        return lowest

    takes_delivery_allowance = True

    def _margin_guard_s(self) -> float:
        """``DEADLINE_GUARD_STEPS`` x margin x TPOT: a decode deferred now rides a later
        step, so its token must survive two steps' prediction errors (the one running and
        its own), not one; without the guard FairBatching lands tokens on their deadlines
        and any overrun is a max-TPOT violation."""
        return min(DEADLINE_GUARD_STEPS * self.margin, MAX_GUARD_SHARE) * self.context.global_slo.tpot_s

    def _deadline_guard_s(self) -> float:
        """How long before its deadline each in-time token is planned: the margin guard
        plus the delivery allowance (``PolicyContext.delivery_allowance_s``), together at
        most ``MAX_GUARD_SHARE`` of a TPOT."""
        tpot = self.context.global_slo.tpot_s
        return min(self._margin_guard_s() + self.context.delivery_allowance_s, MAX_GUARD_SHARE * tpot)


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
        return dataclasses.replace(groups, prefills=kairos_order(
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


@POLICIES.register("fb-anchor-margin")
class FairBatchingAnchoredWithMargin(FairBatchingWithMargin):
    """``fb-anchor`` and ``fb-margin`` together. Anchored deadlines make the time budget
    as tight as the next token's real deadline, so the step model's error decides
    whether the first gap after a token lands inside it; the margin absorbs it."""

    name = "fb-anchor-margin"
    anchored = True


@POLICIES.register("fb-anchor-margin-pab")
class FairBatchingAnchoredWithMarginAndAdmission(
    FairBatchingAnchoredWithMargin, FairBatchingWithAdmission
):
    """``fb-anchor-margin`` with ``fb-pab``'s admission rule (reject a new request whose
    prompt exceeds the rank's PAB). PAB guards TTFT; the paper's ``fb`` mostly fails on
    TPOT, which PAB cannot help, while ``fb-anchor-margin`` fails on TTFT under
    overload, which it can."""

    name = "fb-anchor-margin-pab"


@POLICIES.register("fb-smooth")
class FairBatchingSmooth(FairBatchingAnchoredWithMargin):
    """``fb-anchor-margin`` that spends slack only where a deadline needs it: each step
    first tries :func:`~sglang_ext.policy.batch_former.smooth_step` (every decode, a
    step of one TPOT) and falls back to Algorithm 1's longer step and deferrals when an
    in-time prefill would miss its deadline at that pace."""

    name = "fb-smooth"

    def _form_batch(self, requests: Sequence[RequestState], now: float,
                    hopeless: frozenset | None = None) -> BatchDecision:
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
        else:
            groups, time_budget = self._not_smooth(groups, smooth_budget)
        return pack(groups, coefficients, token_budget=self.context.max_token_budget,
                    time_budget_s=time_budget)

    def _not_smooth(self, groups: Triage, smooth_budget_s: float) -> tuple[Triage, float]:
        """The step when the smooth one is refused: Algorithm 1's (its groups, its budget)."""
        return groups, self._time_budget(groups.init_time_budget_s)


@POLICIES.register("fb-steady")
class FairBatchingSteady(FairBatchingSmooth):
    """``fb-smooth`` whose every step is the smooth one (module docstring): when
    :func:`~sglang_ext.policy.batch_former.smooth_step` is refused, every decode still runs
    and the prompts take what is left of one TPOT. With nothing in time the step is
    Algorithm 1's (the lateness guard's fallback budget)."""

    name = "fb-steady"

    def _not_smooth(self, groups: Triage, smooth_budget_s: float) -> tuple[Triage, float]:
        if not math.isfinite(smooth_budget_s):
            return super()._not_smooth(groups, smooth_budget_s)
        every_decode = dataclasses.replace(
            groups, init_time_budget_s=smooth_budget_s, deferrable_decodes=[],
            urgent_decodes=groups.urgent_decodes + groups.deferrable_decodes)
        return every_decode, smooth_budget_s
