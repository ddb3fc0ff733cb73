"""Reading a user's TOML file, with every failure as one error naming the file."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any


def read_toml(path: str | Path, error: type[ValueError], what: str) -> dict[str, Any]:
    """Parse ``path``; a missing, unreadable, non-UTF-8 or invalid file raises ``error``."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise error(f"{path}: no such {what} file") from None
    except OSError as exc:
        raise error(f"{path}: cannot read {what} file: {exc.strerror or exc}") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{path}: invalid TOML: {exc}") from None
