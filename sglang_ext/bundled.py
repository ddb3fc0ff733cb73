"""Files that ship inside the package, found through it rather than through a checkout.

``data/configs`` links to the checkout's ``configs/`` (one copy in the repository); a
built wheel carries the files themselves, so an installed package finds the bundled SLO
classes, step models and GPU profiles the same way.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR: Path = Path(__file__).resolve().parent / "data"
CONFIGS_DIR: Path = DATA_DIR / "configs"
