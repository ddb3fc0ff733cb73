#!/usr/bin/env bash
# Side-by-side benchmark on the emulated GPU: stock SGLang, tuned stock (mixed chunks of
# 512) and FairBatching (see scripts/bench_sglang.py). Writes docs/bench/sglang/.
# Extra arguments go to scripts/bench_sglang.py (see --help), e.g. --quick.
FB_EXTRAS=dev,sglang
source "$(dirname "$0")/_env.sh"
exec python scripts/bench_sglang.py "$@"
