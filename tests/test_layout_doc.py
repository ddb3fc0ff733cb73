"""docs/layout.md names every source file and test folder that exists, and nothing else.

A file is named by its whole path in backticks (`sglang_ext/policy/slo.py`); a folder
ends with a slash (`tests/policy/`). ``__init__.py`` and ``__main__.py`` need no line of
their own, nor do generated outputs (docs/bench/, docs/report/) and fixtures.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUT = REPO / "docs" / "layout.md"
SOURCE_ROOTS = ("sglang_ext", "controlplane", "benchmarks", "scripts", "configs", "patches")
SOURCE_SUFFIXES = (".py", ".sh", ".toml", ".patch")
UNLISTED_NAMES = ("__init__.py", "__main__.py")
PATH_IN_BACKTICKS = re.compile(r"`([\w.\-]+(?:/[\w.\-]*)+)`")


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    return [line for line in out.splitlines() if (REPO / line).exists()]


def source_files() -> set[str]:
    return {
        path for path in tracked_files()
        if path.split("/")[0] in SOURCE_ROOTS and path.endswith(SOURCE_SUFFIXES)
        and Path(path).name not in UNLISTED_NAMES
    }


def existing_test_folders() -> set[str]:
    return {
        "/".join(path.split("/")[:2]) + "/" for path in tracked_files()
        if path.startswith("tests/") and path.count("/") >= 2
        and not path.startswith("tests/fixtures/")
    }


def named_paths() -> set[str]:
    return set(PATH_IN_BACKTICKS.findall(LAYOUT.read_text()))


def test_every_source_file_is_named() -> None:
    missing = sorted(source_files() - named_paths())
    assert not missing, f"docs/layout.md does not name: {missing}"


def test_every_test_folder_is_named() -> None:
    missing = sorted(existing_test_folders() - named_paths())
    assert not missing, f"docs/layout.md does not name the test folders: {missing}"


def test_every_named_path_exists() -> None:
    stale = sorted(path for path in named_paths() if not (REPO / path).exists())
    assert not stale, f"docs/layout.md names paths that do not exist: {stale}"
