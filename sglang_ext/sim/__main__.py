import sys

from sglang_ext.sim.cli import main

sys.exit(main())
