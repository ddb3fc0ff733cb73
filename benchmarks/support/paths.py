"""Where things are in this checkout, and paths shown relative to it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS_BENCH = REPO / "docs" / "bench"
#: The full Azure conversation trace, shared beside the checkout (see ../shared/README.md).
SHARED_AZURE_TRACE = REPO.parent / "shared" / "data" / "traces" / "azure_conv_2023.csv"


def pythonpath_with_checkout(env: Mapping[str, str]) -> str:
    """``env``'s ``PYTHONPATH`` with this checkout first: a child process started anywhere
    imports this checkout's packages (``benchmarks`` included), whatever the environment
    installed."""
    return os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))


def relative(path: Path) -> Path:
    """``path`` relative to the checkout when inside it, else absolute (a command recorded
    with it reruns from the checkout)."""
    resolved = Path(path).resolve()
    try:
        return resolved.relative_to(REPO)
    except ValueError:
        return resolved
