#!/usr/bin/env bash
# The main job on its embedded default: replay the bundled Azure sample through the
# simulator for every policy over a range of loads and print the comparison.
# Extra arguments go to `python -m sglang_ext.sim sweep` (see --help).
source "$(dirname "$0")/_env.sh"
exec python -m sglang_ext.sim sweep "$@"
