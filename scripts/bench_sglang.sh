#!/usr/bin/env bash
# Side-by-side benchmark on the emulated GPU: stock SGLang, tuned stock (mixed chunks of
# 256 / 512 / 1024) and FairBatching over several seeds (see scripts/bench_sglang.py).
# Saves every point to out/bench_sglang/points.jsonl and renders docs/bench/sglang/.
# Extra arguments go to scripts/bench_sglang.py (see --help), e.g. --resume, --quick,
# --configs, --seeds, --render-only.
FB_EXTRAS=dev,sglang
source "$(dirname "$0")/_env.sh"
exec python scripts/bench_sglang.py "$@"
