#!/usr/bin/env bash
# Fair capacity in the real server on the emulated GPU: FairBatching's
# shipped fb-defer against stock SGLang at its best (mixed chunk with its queue limit or
# waiting timeout, priority scheduling by class or shortest prompt first), capacity at
# 90%/99% by bisection and overload at 1.5x/2x (see benchmarks/server/fair_capacity.py).
# Saves every probe; --resume continues; --dry-run prints the plan and its length.
FB_EXTRAS=dev,sglang
source "$(dirname "$0")/_env.sh"
exec python -m benchmarks.server.fair_capacity "$@"
