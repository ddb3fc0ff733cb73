"""Which decision path this process runs: the compiled one (``_compiled.c``, built on
install where a C compiler exists) or the pure-Python reference it must match bit for bit.
The path covers each decision's passes over its table and the step model's learning
after each step.

``FAIRBATCHING_PURE_PYTHON=1`` in the environment runs the reference even where the
compiled module is built. Callers read the functions (:data:`FUNCTIONS`) at each call
(None: the reference), so a test can switch paths by setting them.
"""

from __future__ import annotations

import os
from collections.abc import Callable

PURE_PYTHON_ENV = "FAIRBATCHING_PURE_PYTHON"

try:
    from sglang_ext.policy import _compiled
except ImportError as error:
    _compiled = None
    _missing = f"the compiled module is not built ({error})"
else:
    _missing = ""

_forced_pure = os.environ.get(PURE_PYTHON_ENV, "").strip() not in ("", "0")

_built = None if _forced_pure else _compiled

#: what the compiled module provides, each None where the reference runs
FUNCTIONS = ("queue_forecast", "triage", "kv_outlook", "overdue", "prefills_late",
             "decision_columns", "knee_update", "knee_system")

#: the admission forecast of a RequestTable (admission._compiled_forecast)
queue_forecast: Callable | None = getattr(_built, "queue_forecast", None)
#: FairBatching's triage of a RequestTable (row_groups._compiled_triage)
triage: Callable | None = getattr(_built, "triage", None)
#: the SGLang adapter's KV outlook of a decision's table (kv_outlook_of_table)
kv_outlook: Callable | None = getattr(_built, "kv_outlook", None)
#: the rows past their give-up time (policies._overdue_rows)
overdue: Callable | None = getattr(_built, "overdue", None)
#: whether the smooth step leaves a prefill late (RowGroups.smooth_step)
prefills_late: Callable | None = getattr(_built, "prefills_late", None)
#: the SGLang adapter's columns of a decision (request_store.DecisionColumns.table)
decision_columns: Callable | None = getattr(_built, "decision_columns", None)
#: one step's update of the online knee model's normal equations (OnlineKneeModel.observe)
knee_update: Callable | None = getattr(_built, "knee_update", None)
#: the online knee model's anchored system of the candidate in use (OnlineKneeModel._solve_current)
knee_system: Callable | None = getattr(_built, "knee_system", None)


def built() -> bool:
    """Whether this process runs the compiled path (every function of it)."""
    return all(globals()[name] is not None for name in FUNCTIONS)


def decision_path() -> str:
    """One line for a start-up log: which path decides, and why not the compiled one."""
    if built():
        return f"compiled ({os.path.basename(_compiled.__file__)})"
    if _compiled is not None:
        return f"pure Python ({PURE_PYTHON_ENV} is set)"
    return f"pure Python: {_missing}"
