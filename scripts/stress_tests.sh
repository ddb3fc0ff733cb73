#!/usr/bin/env bash
# The SGLang and end-to-end suites on a busy machine: each run is
#   scripts/test.sh tests/adapter tests/e2e
# (the same environment as CI) beside CPU-burning busy loops started by this script,
# which are always killed when it exits. Catches tests whose verdict depends on the
# machine being idle.
#
#   scripts/stress_tests.sh [--runs N] [--busy K] [--logs DIR] [-- PYTEST ARGS...]
#
#   --runs N   runs, one after another (default 3)
#   --busy K   busy loops beside each run (default 2, one per core of the 2-core CI VM)
#   --logs DIR where each run's pytest output goes (default out/stress-<time>/)
#   -- ARGS    pytest arguments instead of the default "tests/adapter tests/e2e -q"
#
# Prints one PASS/FAIL line per run (duration, pytest's summary line, log file) and a
# summary; exits 0 only if every run passed.
set -uo pipefail
# Job control: each background job gets its own process group and keeps SIGINT (without
# it bash starts background jobs with SIGINT ignored), so pytest can be interrupted
# cleanly and tear down the servers it started.
set -m

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
runs=3
busy=2
log_dir=""
pytest_args=(tests/adapter tests/e2e -q)

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs="${2:-}"; shift 2 ;;
    --runs=*) runs="${1#*=}"; shift ;;
    --busy) busy="${2:-}"; shift 2 ;;
    --busy=*) busy="${1#*=}"; shift ;;
    --logs) log_dir="${2:-}"; shift 2 ;;
    --logs=*) log_dir="${1#*=}"; shift ;;
    --) shift; [ $# -gt 0 ] && pytest_args=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
for value in "$runs" "$busy"; do
  [[ "$value" =~ ^[0-9]+$ ]] || { echo "error: --runs and --busy take a whole number, got '$value'" >&2; exit 2; }
done
[ "$runs" -ge 1 ] || { echo "error: --runs must be at least 1" >&2; exit 2; }
log_dir="${log_dir:-$repo_root/out/stress-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$log_dir"

busy_pids=()
test_pid=""
# Started in the background of a shell without job control (nohup, CI, `... &`), this
# script inherits SIGINT ignored, and so would pytest; GNU env can restore it.
default_sigint=()
if env --default-signal=INT true 2>/dev/null; then
  default_sigint=(env --default-signal=INT)
fi

start_busy_loops() {
  local i
  for ((i = 0; i < busy; i++)); do
    # A subshell spinning in bash builtins: one core's worth of demand, no I/O.
    ( while :; do :; done ) &
    busy_pids+=("$!")
  done
}

stop_busy_loops() {
  local pid
  for pid in "${busy_pids[@]}"; do
    kill "$pid" 2>/dev/null
  done
  for pid in "${busy_pids[@]}"; do
    wait "$pid" 2>/dev/null
  done
  busy_pids=()
}

cleanup() {
  if [ -n "$test_pid" ] && kill -0 "$test_pid" 2>/dev/null; then
    # SIGINT: pytest tears its session down (the servers it started stop with it).
    kill -INT -- "-$test_pid" 2>/dev/null
    wait "$test_pid" 2>/dev/null
  fi
  test_pid=""
  stop_busy_loops
}
trap cleanup EXIT
trap 'echo "interrupted" >&2; exit 130' INT TERM

echo "stress: $runs run(s) of scripts/test.sh ${pytest_args[*]} beside $busy busy loop(s); logs in $log_dir"
passed=0
for ((run = 1; run <= runs; run++)); do
  log="$log_dir/run-$run.log"
  start_busy_loops
  started=$(date +%s)
  "${default_sigint[@]}" "$repo_root/scripts/test.sh" "${pytest_args[@]}" >"$log" 2>&1 &
  test_pid=$!
  wait "$test_pid"
  status=$?
  test_pid=""
  elapsed=$(( $(date +%s) - started ))
  stop_busy_loops
  summary="$(grep -a -E '^=*.*[0-9]+ (passed|failed|error)' "$log" | tail -n 1 | sed 's/^=* *//; s/ *=*$//')"
  summary="${summary:-no pytest summary line (exit $status)}"
  if [ "$status" -eq 0 ]; then
    verdict=PASS
    passed=$((passed + 1))
  else
    verdict=FAIL
  fi
  line="run $run/$runs: $verdict in $((elapsed / 60))m$(printf '%02d' $((elapsed % 60)))s - $summary ($log)"
  echo "$line"
  [ "$verdict" = PASS ] || grep -a -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /'
done

echo "stress summary: $passed/$runs runs passed beside $busy busy loop(s)"
[ "$passed" -eq "$runs" ]
