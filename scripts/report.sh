#!/usr/bin/env bash
# Regenerate docs/report/ (the paper's Tables 3-5 and Figure 7 in the simulator).
# Extra arguments go to `python -m benchmarks.sim.report` (see --help), e.g. --full.
source "$(dirname "$0")/_env.sh"
exec python -m benchmarks.sim.report "$@"
