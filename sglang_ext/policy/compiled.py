"""Which decision path this process runs: the compiled one (``_compiled.c``, built on
install where a C compiler exists) or the pure-Python reference it must match bit for bit.

``FAIRBATCHING_PURE_PYTHON=1`` in the environment runs the reference even where the
compiled module is built. Callers read :data:`queue_forecast` at each call (None: the
reference), so a test can switch paths by setting it.
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
#: the admission forecast of a RequestTable (admission._compiled_forecast), or None
queue_forecast: Callable | None = None if _built is None else _built.queue_forecast
#: FairBatching's triage of a RequestTable (row_groups._compiled_triage), or None
triage: Callable | None = None if _built is None else _built.triage
#: the SGLang adapter's KV outlook of a decision's table (kv_outlook_of_table), or None
kv_outlook: Callable | None = None if _built is None else _built.kv_outlook


#: the rows past their give-up time (policies._overdue_rows), or None
overdue: Callable | None = None if _built is None else _built.overdue
#: whether the smooth step leaves a prefill late (RowGroups.smooth_step), or None
prefills_late: Callable | None = None if _built is None else _built.prefills_late

#: what the compiled module provides, each None where the reference runs
FUNCTIONS = ("queue_forecast", "triage", "kv_outlook", "overdue", "prefills_late")


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
