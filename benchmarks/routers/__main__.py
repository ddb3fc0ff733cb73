"""``python -m benchmarks.routers``: see :mod:`benchmarks.routers` and ``--help``."""

import sys

from benchmarks.routers.command import main

if __name__ == "__main__":
    sys.exit(main())
