"""Stock SGLang's priority scheduling as the real-server benchmarks use it: the launch
flags of each priority mode and the priority the replay client gives each request.

How SGLang 0.5.23 does it (``sglang/srt`` in the SGLang environment):

* ``--enable-priority-scheduling`` (``arg_groups/fields/schedule.py``) sorts the waiting
  queue by ``(priority * sign, time it entered the queue)`` before every prefill batch
  (``managers/schedule_policy.py``, ``_sort_by_priority_and_fcfs``; only with
  ``--schedule-policy fcfs``, the default, or ``lof``: ``arg_groups/validation_hook.py``).
  ``sign`` is -1 by default: **larger values are more urgent**;
  ``--schedule-low-priority-values-first`` makes it +1 (smaller values first).
* A request carries its priority as the top-level ``priority`` integer of ``/generate``
  (``managers/io_struct.py``, ``GenerateReqInput.priority``) or of the OpenAI
  completions and chat requests (``entrypoints/openai/protocol.py``). A request without
  one is served last (``managers/scheduler.py``, ``_set_or_validate_priority``: the
  least urgent value) unless ``--default-priority-value`` is set.
* Priority preemption is on with it (``--disable-priority-preemption`` turns it off): when
  the running batch is full, a queued request more urgent by more than
  ``--priority-scheduling-preemption-threshold`` (default 10) retracts running ones
  (``schedule_policy.py``, ``PrefillAdder.preempt_to_schedule``).
* With ``--max-queued-requests``, a full queue drops its least urgent (then newest)
  waiting request for a strictly more urgent arrival instead of refusing the arrival
  (``scheduler.py``, ``_abort_on_queued_limit``).

The modes (``--priority`` of ``python -m benchmarks.server.trace_replay``):

* ``class``: the request's priority is minus its SLO class's TTFT target in ms
  (interactive 500 ms -> -500, standard 2000 ms -> -2000, relaxed 5000 ms -> -5000; an
  end-to-end class's is its envelope's first-token budget): the tightest TTFT class is the
  most urgent, under SGLang's default sign (larger first). Classes differ by far more than
  the preemption threshold, so an interactive request may preempt standard ones.
* ``prompt-length``: shortest prompt first. The server runs with
  ``--schedule-low-priority-values-first`` and **the client must set each request's
  priority to its prompt length in tokens** (the prompt it sends, after any cap): SGLang
  has no built-in shortest-prompt-first under priority scheduling (its
  ``--schedule-policy shortest-prefill-first`` cannot be combined with
  ``--enable-priority-scheduling``). Prompts more than 10 tokens shorter may preempt.
"""

from __future__ import annotations

from sglang_ext.policy.slo import Slo, SloCatalog

NONE, CLASS, PROMPT_LENGTH = "none", "class", "prompt-length"
PRIORITY_MODES = (NONE, CLASS, PROMPT_LENGTH)

ENABLE = "--enable-priority-scheduling"
LOW_VALUES_FIRST = "--schedule-low-priority-values-first"


def launch_args(mode: str) -> tuple[str, ...]:
    """The server flags a client priority mode needs."""
    if mode == NONE:
        return ()
    if mode == CLASS:
        return (ENABLE,)
    if mode == PROMPT_LENGTH:
        return (ENABLE, LOW_VALUES_FIRST)
    raise ValueError(f"unknown priority mode {mode!r}; known: {', '.join(PRIORITY_MODES)}")


def slo_priority(slo: Slo) -> int:
    """An SLO's priority under SGLang's default sign: minus its TTFT target in ms (the
    tightest first token is the most urgent)."""
    return -round(slo.ttft_s * 1e3)


def class_priorities(catalog: SloCatalog) -> dict[str, int]:
    """Each SLO class's priority (``class`` mode), by name."""
    return {name: slo_priority(slo) for name, slo in catalog.classes.items()}


def request_priority(mode: str, catalog: SloCatalog, slo_class: str, prompt_tokens: int) -> int | None:
    """The ``priority`` a request is sent with (``None``: the field is left out)."""
    if mode == NONE:
        return None
    if mode == CLASS:
        return slo_priority(catalog.classes[slo_class])
    if mode == PROMPT_LENGTH:
        return prompt_tokens
    raise ValueError(f"unknown priority mode {mode!r}; known: {', '.join(PRIORITY_MODES)}")
