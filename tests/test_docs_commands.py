"""The README and docs/*.md as a newcomer meets them: their cheap commands run as written,
their relative links resolve, and the README keeps the two set-up commands CI depends on.

The rule for a cheap command: a fenced block whose opening line is exactly ```bash and
whose previous line is exactly `<!-- cheap -->`, in README.md or docs/*.md (the pages, not
the generated docs/report/ and docs/bench/). Mark a block cheap only when every line runs
in seconds on a CPU, needs no server, GPU or network, and writes only to new paths
relative to the working directory (e.g. the simulator's default `out/run-<time>/`).

Each block runs as written, as one `bash -euo pipefail` script (every line must succeed),
in a scratch directory that mirrors the repository root: one symlink per top-level entry
except `.git` and `out`, so relative paths such as `configs/` and `tests/fixtures/` resolve
and what a command writes lands in the scratch directory. `python` and the console scripts
are the test interpreter's (its bin directory first on PATH), importing this checkout
(PYTHONPATH = the repository root). A block that writes into the checkout fails the test.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHEAP_MARK = "<!-- cheap -->"
TIMEOUT_S = 120

SETUP_BLOCK = """```bash
scripts/demo.sh    # the main job: replay the bundled Azure sample through every policy, print the comparison
scripts/test.sh    # the whole test suite (what CI runs; `scripts/test.sh -m "not slow and not e2e"` for the fast part)
```"""


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def cheap_blocks(path: Path) -> list[tuple[int, str]]:
    """(line number of the fence, the block's text) for every cheap block of a page."""
    lines = path.read_text().split("\n")
    blocks = []
    i = 0
    while i < len(lines):
        if lines[i] == "```bash" and i > 0 and lines[i - 1].strip() == CHEAP_MARK:
            end = lines.index("```", i + 1)  # ValueError: an unclosed block fails loudly
            blocks.append((i + 1, "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return blocks


ALL_BLOCKS = [
    pytest.param(path, line, text, id=f"{path.relative_to(ROOT)}:{line}")
    for path in doc_pages()
    for line, text in cheap_blocks(path)
]


def test_cheap_blocks_are_found():
    assert any(p.values[0].name == "README.md" for p in ALL_BLOCKS)
    assert len(ALL_BLOCKS) >= 4, [p.id for p in ALL_BLOCKS]


def _checkout_changes() -> set[str] | None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    out = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=ROOT, capture_output=True, text=True,
    )
    return set(out.stdout.splitlines()) if out.returncode == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize(("path", "line", "text"), ALL_BLOCKS)
def test_cheap_block_runs_as_written(path: Path, line: int, text: str, tmp_path: Path):
    work = tmp_path / "root"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "out"):
            (work / entry.name).symlink_to(entry)
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    before = _checkout_changes()
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", text],
        cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, (
        f"{path.relative_to(ROOT)}:{line} exited {proc.returncode}\n--- block\n{text}"
        f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    )
    after = _checkout_changes()
    if before is not None and after is not None:
        assert after == before, f"the block changed the checkout: {sorted(after ^ before)}"


# [label](target) and ![alt](target), outside fenced blocks; a code span in a label is fine.
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http:, https:, mailto:, or an anchor on the same page
        targets.append(target.split("#", 1)[0])
    return targets


@pytest.mark.parametrize("path", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    links = relative_links(path)
    missing = [t for t in links if not (path.parent / t).exists()]
    assert not missing, f"{path.relative_to(ROOT)}: links to missing files: {missing}"


def test_readme_links_every_docs_page():
    linked = {(ROOT / t).resolve() for t in relative_links(ROOT / "README.md")}
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_readme_keeps_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    assert "## Set-up: two commands" in text
    assert SETUP_BLOCK in text
