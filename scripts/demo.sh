#!/usr/bin/env bash
# The main job: the shipped FairBatching configuration against the three strongest
# baselines, on one SLO class and on a mix of three, in the simulator (about two minutes
# on 2 cores): `python -m sglang_ext.sim demo`. The baselines are chosen and set by the
# full sweeps shipped in configs/tuned_baselines*.toml.
#
#   scripts/demo.sh [--jobs N] [--out DIR]   the demo
#   scripts/demo.sh --all [SWEEP OPTIONS]    every policy: `python -m sglang_ext.sim sweep`
#                                            (--full tunes every baseline itself, 25-45 min)
source "$(dirname "$0")/_env.sh"
if [ "${1:-}" = "--all" ]; then
  shift
  exec python -m sglang_ext.sim sweep "$@"
fi
exec python -m sglang_ext.sim demo "$@"
