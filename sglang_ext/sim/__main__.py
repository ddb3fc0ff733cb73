import sys

from sglang_ext.sim.commands import main

sys.exit(main())
