"""A step's planned prefill chunks, realised through SGLang's own ``PrefillAdder``.

The policy decides which requests prefill how many tokens; SGLang's adder still does
the admission work (prefix matching, KV budget, locking, chunk bookkeeping). The
planned adder admits only the planned requests, each truncated to its planned tokens,
and counts parked decodes in the KV reservation as if they were running.

SGLang carries one chunked request at a time (``Scheduler.chunked_req``; a second one
fails its ``assert self.chunked_req is None`` and kills the scheduler). Stock SGLang
never makes a second: the continuing chunk takes the whole chunk budget. A plan can
give it less (the policy's view of a prompt's remaining tokens may differ from SGLang's
after prefix matching and eviction; the KV budget may hold the continuing chunk back),
so while a chunked request continues past this step the planned adder admits no other
request that it would have to cut, nor a second cut request in one step: that request
is skipped (it waits for a later step) and a planned request that fits whole may follow.

Memory. SGLang checks a cut prompt's *whole* remainder against free KV once, when it
first admits it, and from then on continues it with a full chunk even when the
remaining budget is spent ("continuation must make progress"): stock never admits
anything beside a continuing chunk, so what was checked stays free. The planned adder
does admit prompts beside it, so it keeps that invariant explicitly:

- a cut prompt's remainder (its tokens not in KV after this step, plus its outputs'
  reserve) is held in the adder's budget, so prompts admitted beside it are checked
  against what is left after it;
- a continuing chunk gets at most what is allocatable now (free + evictable, after
  this step's decode rows and the chunks admitted before it); with nothing allocatable
  the chunked request is *carried*: it keeps its KV, nothing else is admitted this step
  (SGLang would otherwise count a chunk in flight that does not run), and the step
  decodes.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder


@dataclass(frozen=True)
class PrefillPlan:
    tokens_by_rid: Mapping[Hashable, int]
    parked_reqs: Sequence[Any] = ()

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens_by_rid.values())


def plan_from_chunks(
    chunks: Sequence[tuple[Hashable, int]],
    chunked_rid: Hashable | None,
    chunked_pending: int,
    parked_reqs: Sequence[Any] = (),
) -> PrefillPlan:
    """SGLang continues its one chunked request before admitting anything else, so a plan
    that prefills others must include it: it gets its tokens first (it is the oldest
    prefill), out of the same total."""
    tokens = dict(chunks)
    if chunked_rid is not None and tokens and chunked_rid not in tokens:
        total = sum(tokens.values())
        first = min(chunked_pending, total)
        left = total - first
        rebuilt = {chunked_rid: first}
        for rid, count in chunks:
            if left <= 0:
                break
            rebuilt[rid] = min(count, left)
            left -= rebuilt[rid]
        tokens = rebuilt
    return PrefillPlan(tokens, tuple(parked_reqs))


@functools.cache
def planned_adder_class(base: type[PrefillAdder]) -> type[PrefillAdder]:
    class PlannedPrefillAdder(base):
        def __init__(self, *args: Any, plan: PrefillPlan, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.plan = plan
            self.carried_chunk: Any = None  # the chunked request, when it does not run this step
            self._unadmitted = dict(plan.tokens_by_rid)
            total = plan.total_tokens
            self.rem_chunk_tokens = total
            self.rem_input_tokens = max(self.rem_input_tokens, total)
            self.memory_budget.total_offset += sum(
                self._get_running_request_total_token_offset(r) for r in plan.parked_reqs
            )

        def budget_state(self) -> AddReqResult:
            if not self._unadmitted or self.carried_chunk is not None:
                return AddReqResult.OTHER
            return super().budget_state()

        def add_chunked_req(self, req: Any) -> Any:
            planned = self._unadmitted.get(req.rid)
            allocatable = self._allocatable_now()
            if planned is None or allocatable <= 0:
                self._unadmitted.pop(req.rid, None)
                return self._carry(req)
            left = self._within_planned_tokens(
                req, lambda: super(PlannedPrefillAdder, self).add_chunked_req(req), cap=allocatable)
            if req not in self.can_run_list:
                return self._carry(req)
            if left is not None:
                self._hold_remainder(req)
            return left

        def add_one_req(self, req: Any, has_chunked_req: bool, truncation_align_size: Any) -> AddReqResult:
            if req.rid not in self._unadmitted:
                return AddReqResult.CONTINUE
            chunk_continues = has_chunked_req or self.new_chunked_req is not None
            if chunk_continues and self._would_truncate(req):
                return AddReqResult.CONTINUE  # skipped: a request that fits whole may follow
            result = self._within_planned_tokens(
                req,
                lambda: super(PlannedPrefillAdder, self).add_one_req(
                    req, chunk_continues, truncation_align_size
                ),
            )
            if self.new_chunked_req is req:
                self._hold_remainder(req)
            return result

        def _carry(self, req: Any) -> Any:
            """The chunked request does not run this step: its remainder stays held and
            nothing else is admitted."""
            self.carried_chunk = req
            self._hold_remainder(req)
            return req

        def _hold_remainder(self, req: Any) -> None:
            """Reserve what a cut prompt still needs after this step: its prompt tokens
            not in KV yet and its outputs, as SGLang checked when it first admitted it."""
            end = req.extend_end if req in self.can_run_list else req.prefix_len
            remainder = len(req.full_untruncated_fill_ids) - end
            self.memory_budget.total_offset += remainder + self._swa_new_tokens(req) + self.page_size

        def _allocatable_now(self) -> int:
            """KV tokens this step can still allocate (free + evictable, after the
            decode rows and what was admitted before), in whole pages."""
            allocatable = int(self.memory_budget.remaining_current)
            return allocatable // self.page_size * self.page_size

        def _would_truncate(self, req: Any) -> bool:
            extend = len(req.full_untruncated_fill_ids) - req.prefix_len
            return extend > min(self._unadmitted[req.rid], self.rem_chunk_tokens)

        def _select_prefill_admission(self, req: Any, **kwargs: Any) -> Any:
            admission = super()._select_prefill_admission(req, **kwargs)
            if kwargs.get("has_chunked_req") and getattr(admission, "is_chunked", False):
                return AddReqResult.CONTINUE
            return admission

        def _within_planned_tokens(self, req: Any, admit: Any, cap: int | None = None) -> Any:
            planned = self._unadmitted.pop(req.rid)
            total_left = self.rem_chunk_tokens
            limit = min(planned, total_left) if cap is None else min(planned, total_left, cap)
            self.rem_chunk_tokens = limit
            try:
                return admit()
            finally:
                self.rem_chunk_tokens = total_left - (limit - self.rem_chunk_tokens)

    PlannedPrefillAdder.__name__ = PlannedPrefillAdder.__qualname__ = f"Planned{base.__name__}"
    return PlannedPrefillAdder


def adder_factory(base: type[PrefillAdder], plan: PrefillPlan) -> Any:
    return functools.partial(planned_adder_class(base), plan=plan)
