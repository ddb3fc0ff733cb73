#!/usr/bin/env bash
# SGLang's router (smg) against the control-plane daemon, on two SGLang servers on the
# emulated GPU (see benchmarks/routers/__init__.py). smg gets its own small environment
# (the `bench-router` extra); the servers, the daemon and the load generator run in the
# project's SGLang environment. Saves every run to out/bench_routers/points.jsonl and
# renders docs/bench/routers.md and routers.json. Extra arguments go to
# `python -m benchmarks.routers` (see --help), e.g. --quick, --render-only, --workloads prefix.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
smg_env="$(unset FAIRBATCHING_ENV; FB_EXTRAS=bench-router; source "$here/_env.sh" >&2; echo "$FAIRBATCHING_ENV_DIR")"
export FB_SMG="$smg_env/bin/smg"
FB_EXTRAS=dev,sglang
source "$here/_env.sh"
exec python -m benchmarks.routers "$@"
