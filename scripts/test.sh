#!/usr/bin/env bash
# The whole test suite (what CI runs). Extra arguments go to pytest, e.g.
#   scripts/test.sh -m "not slow"    # the fast part, in seconds
source "$(dirname "$0")/_env.sh"
exec python -m pytest "$@"
