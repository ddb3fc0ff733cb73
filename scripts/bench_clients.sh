#!/usr/bin/env bash
# Standard clients against the OpenAI-compatible gateway, unmodified: SGLang's serving
# benchmark (`python -m sglang.benchmark.serving`, completions and chat backends, streamed
# and not, --goodput) against a daemon with simulated ranks and the gateway, plus what the
# gateway answers to the SGLang-only endpoints it calls
# (see benchmarks/controlplane/standard_clients.py).
# Renders docs/bench/clients.md and clients.json; raw outputs under out/bench_clients/.
# Extra arguments go to `python -m benchmarks.controlplane.standard_clients` (see --help),
# e.g. --quick, --runs oai, --rate, --seconds, --render-only.
FB_EXTRAS=dev,sglang
source "$(dirname "$0")/_env.sh"
exec python -m benchmarks.controlplane.standard_clients "$@"
