#!/usr/bin/env bash
# The main job on its embedded default: replay the bundled Azure sample through the
# simulator for every policy over a range of loads and print the comparison. By default
# the quick demo (about a minute on 2 cores): the baselines at the settings the full
# sweep tuned, shipped in configs/tuned_baselines.toml, over 11 loads; --full is the full
# sweep that tunes them (about 1,100 simulations, 15-20 minutes), --retune tunes them on
# the scenario given.
# Extra arguments go to `python -m sglang_ext.sim sweep` (see --help).
source "$(dirname "$0")/_env.sh"
exec python -m sglang_ext.sim sweep "$@"
