"""Where a result came from: the git commit of the checkout that produced it."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_state(repo: Path | None = None) -> dict:
    """``{"commit": short HEAD, "dirty": tracked files changed}`` of the checkout at
    ``repo`` (default: the working directory); commit ``"unknown"`` and dirty None outside
    git or when git fails."""
    def git(*args: str) -> str:
        command = ["git", *(["-C", str(repo)] if repo is not None else []), *args]
        return subprocess.run(command, capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()

    try:
        return {"commit": git("rev-parse", "--short", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}


def git_commit(repo: Path | None = None) -> str | None:
    """The short commit, ``+dirty`` with local changes; None outside git."""
    state = git_state(repo)
    if state["dirty"] is None:
        return None
    return state["commit"] + ("+dirty" if state["dirty"] else "")
