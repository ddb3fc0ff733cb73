#!/usr/bin/env bash
# Side-by-side benchmark on the emulated GPU: stock SGLang, tuned stock (mixed chunks of
# 256 / 512 / 1024) and FairBatching over several seeds
# (see benchmarks/server/stock_vs_fairbatching.py). Saves every point to
# out/bench_sglang/points.jsonl and renders docs/bench/sglang/. Extra arguments go to
# `python -m benchmarks.server.stock_vs_fairbatching` (see --help), e.g. --resume, --quick,
# --configs, --seeds, --render-only.
FB_EXTRAS=dev,sglang
source "$(dirname "$0")/_env.sh"
exec python -m benchmarks.server.stock_vs_fairbatching "$@"
