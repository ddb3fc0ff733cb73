"""A benchmark's result: the printed Markdown table beside the JSON with every run."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write_outputs(out: Path, stem: str, text: str, doc: dict) -> None:
    """``OUT/STEM.md`` (the printed table) and ``OUT/STEM.json`` (every run)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out / stem}.md and {stem}.json", file=sys.stderr)
