#!/usr/bin/env bash
# Admission control in the real server on the emulated GPU: FairBatching reject / defer vs
# the best stock mixed-chunk configuration with a queue limit or waiting timeout (see
# benchmarks/server/admission.py). Saves every point; --resume continues.
FB_EXTRAS=dev,sglang
source "$(dirname "$0")/_env.sh"
exec python -m benchmarks.server.admission "$@"
