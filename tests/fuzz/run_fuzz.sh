#!/usr/bin/env bash
# Runs every fuzz target of build-fuzz/ for SECONDS each, starting from the checked-in seeds
# (tests/fuzz/corpus/<target>) plus what earlier runs found (build-fuzz/corpus/<target>; the
# checked-in seeds are never modified). Fails on the first crash, leak, timeout or sanitizer
# report, leaving the input in build-fuzz/artifacts/. Prints each target's executions.
#   tests/fuzz/run_fuzz.sh SECONDS [TARGET...]
set -euo pipefail
seconds=${1:?usage: run_fuzz.sh SECONDS [TARGET...]}
shift
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(descriptor address messages config weights ep_handle shm_ring)
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/build-fuzz/bin
mkdir -p "$root/build-fuzz/artifacts"
printf '%-12s %14s %10s %8s\n' target executions exec/s corpus
for t in "${targets[@]}"; do
  work=$root/build-fuzz/corpus/$t
  mkdir -p "$work"
  log=$root/build-fuzz/fuzz_$t.log
  if ! "$bin/fuzz_$t" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="$root/build-fuzz/artifacts/${t}-" \
      "$work" "$root/tests/fuzz/corpus/$t" >"$log" 2>&1; then
    echo "fuzz_$t FAILED; its log (last 40 lines):"
    tail -40 "$log"
    exit 1
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  printf '%-12s %14s %10s %8s\n' "$t" "$execs" "$rate" "$(ls "$work" | wc -l)"
done
