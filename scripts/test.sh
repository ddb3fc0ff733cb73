#!/usr/bin/env bash
# The whole test suite (what CI runs), in an environment with the `dev`, `sglang` and
# `ray` extras and SGLang patched (see _env.sh). Extra arguments go to pytest, e.g.
#   scripts/test.sh -m "not slow and not e2e"    # the fast part (docs/tests.md)
FB_EXTRAS="${FB_EXTRAS:-dev,sglang,ray}"
source "$(dirname "$0")/_env.sh"
# where a C compiler exists the install builds the compiled decision path: its tests must run
if command -v "${CC:-cc}" >/dev/null; then
  export FAIRBATCHING_REQUIRE_COMPILED="${FAIRBATCHING_REQUIRE_COMPILED:-1}"
fi
exec python -m pytest "$@"
