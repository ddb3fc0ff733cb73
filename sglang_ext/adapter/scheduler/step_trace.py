"""Per-step record of where the time between two tokens goes (``[trace] step_log``).

One JSON line per step that produced tokens, written when SGLang has processed its
result (the tokens are then on their way to the detokenizer). All times are
``time.perf_counter()`` seconds, the clock SGLang stamps requests with and, on Linux,
the same monotonic clock in every process of the machine, so a client on the same host
(``python -m benchmarks.server.trace_replay --token-times``) can join its token arrival
times to these lines (``python -m benchmarks.server.step_trace_report``). Fields:

- ``decided_at``, ``decision_s``: when the adapter started deciding the step and how long
  it and the policy took (``null`` for a step no decision formed);
- ``planned_start``: when the policy expected the step to start (the device free, under
  SGLang's overlap loop), ``predicted_s`` the step model's device time for what actually
  ran, ``budget_s`` the time budget it was formed under;
- ``launched_at``, ``done_at`` (the result on the host), ``processed_at`` (SGLang's
  output processing done), ``device_s`` (from launch, or the previous step's result,
  to this result: the measurement the step model learns from);
- ``new_tokens``, ``prefill_tokens``, ``decodes``, ``context``, ``waiting``;
- ``tokens``: ``[rid, tokens_after_step, deadline]`` for each request of the step, the
  deadline of the next token it had at decision time (``null`` when not known);
- ``parked``: the rids parked (deferred) during the step (as decided).

Off (no ``step_log``) nothing here runs: the hooks test one attribute for ``None``.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sglang_ext.policy.batch_former import token_deadline
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.policy.view import BatchDecision, RequestState

#: Lines are flushed at least this often (and when the scheduler goes idle).
FLUSH_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class TracedDecision:
    decided_at: float
    decision_s: float
    planned_start: float
    deadlines: dict[Hashable, float]
    waiting: int
    parked: tuple[Hashable, ...]


class StepTrace:
    """Writes the step log of one scheduler process."""

    def __init__(self, path: Path, clock: Any = time.perf_counter) -> None:
        self.path = path
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115
        self._clock = clock
        self._steps = itertools.count()
        self._pending: TracedDecision | None = None
        self._last_flush = clock()

    @classmethod
    def for_rank(cls, path: Path, dp_rank: int | None) -> StepTrace:
        """One file per data-parallel rank: ``steps.jsonl`` becomes ``steps.dp1.jsonl``."""
        if dp_rank is not None:
            path = path.with_name(f"{path.stem}.dp{dp_rank}{path.suffix}")
        return cls(path)

    def decided(self, decided_at: float, decision_s: float, planned_start: float,
                views: Sequence[RequestState], decision: BatchDecision, anchored: bool,
                waiting: int, parked: Collection[Any]) -> None:
        """Note the decision of the step about to launch (the policy's own view of it)."""
        chosen = set(decision.decode_ids)
        chosen.update(rid for rid, _ in decision.prefill_chunks)
        deadlines = {view.req_id: token_deadline(view, anchored)
                     for view in views if view.req_id in chosen}
        self._pending = TracedDecision(decided_at, decision_s, planned_start, deadlines, waiting,
                                       tuple(req.rid for req in parked))

    def take_decision(self) -> TracedDecision | None:
        """The decision of the step being launched now (each decision launches once)."""
        decision, self._pending = self._pending, None
        return decision

    def step_done(self, decision: TracedDecision | None, features: StepShape, launched_at: float,
                  predicted_s: float, budget_s: float | None, done_at: float,
                  device_s: float | None, reqs: Sequence[Any]) -> None:
        """Write the line of one step whose result SGLang has just processed."""
        if self._file is None:
            return
        processed_at = self._clock()
        deadlines = decision.deadlines if decision is not None else {}
        line = {
            "step": next(self._steps),
            "decided_at": None if decision is None else decision.decided_at,
            "decision_s": None if decision is None else decision.decision_s,
            "planned_start": None if decision is None else decision.planned_start,
            "waiting": None if decision is None else decision.waiting,
            "budget_s": budget_s,
            "predicted_s": predicted_s,
            "launched_at": launched_at,
            "done_at": done_at,
            "processed_at": processed_at,
            "device_s": device_s,
            "new_tokens": features.new_tokens,
            "prefill_tokens": features.prefill_tokens,
            "decodes": features.decode_requests,
            "context": features.prefill_context + features.decode_context,
            "tokens": [[req.rid, len(req.output_ids), deadlines.get(req.rid)] for req in reqs],
            "parked": [] if decision is None else list(decision.parked),
        }
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        if processed_at - self._last_flush >= FLUSH_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            self._last_flush = self._clock()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_step_log(path: str | Path) -> list[dict[str, Any]]:
    """Every line of a step log, in file order (a torn last line is skipped)."""
    lines = []
    with open(path, encoding="utf-8") as handle:
        for text in handle:
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                continue
    return lines
