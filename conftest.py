"""Markers by folder: where a test lives says what it costs.

The fast part of the suite is ``-m "not slow and not e2e"``. Every test under a folder of
:data:`FOLDER_MARKERS` gets that folder's markers, so a test that starts processes is
kept out of the fast part by where it is put, not by a marker someone has to remember:

* ``tests/e2e/``: stock SGLang servers on the emulated GPU (``e2e``);
* ``tests/controlplane/processes/``: a daemon, simulated ranks, the gateway or the CLI as
  processes (``slow``);
* ``tests/adapter/harness/``: a real SGLang ``Scheduler`` in a fresh interpreter per
  scenario (``slow``).

A test elsewhere that runs a multi-second simulation, or starts a process, carries
``@pytest.mark.slow`` (or its module ``pytestmark``) itself. The markers are declared in
pyproject.toml; docs/tests.md says what each folder covers.

The fixtures ``compiled_path``, ``reference_path`` and ``decision_path`` (both, as two
runs of a test) choose between the compiled decision path and its pure-Python reference.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sglang_ext.policy import compiled

ROOT = Path(__file__).resolve().parent

#: set by the test script where a C compiler exists: the compiled path must be built there
REQUIRE_COMPILED_ENV = "FAIRBATCHING_REQUIRE_COMPILED"

#: folder, relative to the repository -> the markers of every test under it
FOLDER_MARKERS: dict[str, tuple[str, ...]] = {
    "tests/e2e": ("e2e",),
    "tests/controlplane/processes": ("slow",),
    "tests/adapter/harness": ("slow",),
}


def folder_markers(path: Path) -> tuple[str, ...]:
    """The markers a test file at ``path`` gets from the folders it lies in."""
    try:
        relative = path.resolve().relative_to(ROOT)
    except ValueError:  # outside the repository
        return ()
    return tuple(marker for folder, markers in FOLDER_MARKERS.items()
                 if relative.is_relative_to(folder) for marker in markers)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    by_file: dict[Path, tuple[str, ...]] = {}
    for item in items:
        markers = by_file.setdefault(item.path, folder_markers(item.path))
        for marker in markers:
            item.add_marker(marker)


@pytest.fixture
def compiled_path() -> None:
    """The compiled decision path: skipped where it is not built, failed where
    ``FAIRBATCHING_REQUIRE_COMPILED`` says it must be."""
    if not compiled.built():
        if os.environ.get(REQUIRE_COMPILED_ENV):
            pytest.fail(f"the compiled path is required here: {compiled.decision_path()}")
        pytest.skip(compiled.decision_path())


@pytest.fixture
def reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pure-Python reference, wherever the compiled path is built."""
    for name in compiled.FUNCTIONS:
        monkeypatch.setattr(compiled, name, None)


@pytest.fixture(params=["compiled", "reference"])
def decision_path(request: pytest.FixtureRequest) -> str:
    """A test run twice: on the compiled decision path and on the reference."""
    request.getfixturevalue(f"{request.param}_path")
    return request.param
