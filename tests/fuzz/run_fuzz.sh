#!/usr/bin/env bash
# Runs every fuzz target of build-fuzz/ for SECONDS each, starting from the checked-in seeds
# (tests/fuzz/corpus/<target>) plus what earlier runs found (build-fuzz/corpus/<target>; the
# checked-in seeds are never modified). Fails on the first crash, leak, timeout or sanitizer
# report, leaving the input in build-fuzz/artifacts/. Prints each target's executions.
# A fuzzer uses one core: FUZZ_JOBS of them (default: the CPU count) run side by side, each
# for its full SECONDS.
#   tests/fuzz/run_fuzz.sh SECONDS [TARGET...]
set -euo pipefail
seconds=${1:?usage: run_fuzz.sh SECONDS [TARGET...]}
shift
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(descriptor address messages config weights ep_handle shm_ring)
jobs=${FUZZ_JOBS:-$(nproc)}
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/build-fuzz/bin
mkdir -p "$root/build-fuzz/artifacts"

# One target: its exit status in build-fuzz/fuzz_<t>.rc, its log beside it.
fuzz_one() {
  local t=$1 work=$root/build-fuzz/corpus/$1 log=$root/build-fuzz/fuzz_$1.log rc=0
  mkdir -p "$work"
  "$bin/fuzz_$t" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$root/build-fuzz/artifacts/${t}-" \
    "$work" "$root/tests/fuzz/corpus/$t" >"$log" 2>&1 || rc=$?
  echo "$rc" >"$root/build-fuzz/fuzz_$t.rc"
}

pids=()
trap '[ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true' EXIT
for t in "${targets[@]}"; do
  rm -f "$root/build-fuzz/fuzz_$t.rc"
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  fuzz_one "$t" &
  pids+=($!)
done
wait
pids=()
printf '%-12s %14s %10s %8s\n' target executions exec/s corpus
failed=0
for t in "${targets[@]}"; do
  log=$root/build-fuzz/fuzz_$t.log
  if [ "$(cat "$root/build-fuzz/fuzz_$t.rc" 2>/dev/null || echo 1)" != 0 ]; then
    echo "fuzz_$t FAILED; its log (last 40 lines):"
    tail -40 "$log"
    failed=1
    continue
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  printf '%-12s %14s %10s %8s\n' "$t" "$execs" "$rate" "$(ls "$root/build-fuzz/corpus/$t" | wc -l)"
done
exit "$failed"
