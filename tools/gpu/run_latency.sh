#!/bin/bash
# On the GPU machine (a quiet many-core host), from the repository root, after
# tools/gpu/bundle.sh: the small-transfer rows (single and paged writes, imm-only
# round trips and rate, scatter to 16 and to 63 peers: the EP64 shape) over tcp and shm, each
# against raw libfabric in the same run. Older builds to compare with go in
# .gpu/versions/NAME/fabric-bench (copied there by hand; NAME says which commit): every version
# runs, alternately, two rounds each, so that all share the machine's state; this tree's build
# is "after". JSON and markdown land in $OUT (default /tmp/latency-out); every run is under
# `timeout`. BENCH_MODE picks fabric-bench's --mode (default worker), BENCH_OPS the ops of the
# alternated rows (default single,paged,imm), SCATTER_PEERS the scatter rows (default 16 63;
# empty: none).
set -u
source tools/gpu/bench_env.sh /tmp/latency-out
versions=()
for d in .gpu/versions/*/; do [ -x "$d/fabric-bench" ] && versions+=("$(basename "$d")"); done
versions+=(after)
bin_of() { if [ "$1" = after ]; then echo fabric-bench; else echo ".gpu/versions/$1/fabric-bench"; fi; }
# A build older than --mode (before the progress mode) runs in worker mode only: it is
# given no --mode, and left out of the other modes' rows.
mode_of() {
  if "$(bin_of "$1")" --help 2>&1 | grep -q -- '--mode'; then
    echo "--mode ${BENCH_MODE:-worker}"
  elif [ "${BENCH_MODE:-worker}" = worker ]; then echo ""; else echo skip; fi
}
rows=(--op "${BENCH_OPS:-single,paged,imm}" --sizes 4KiB,64KiB,256KiB,1MiB --page-sizes 4KiB --pages 100
  --iters 5 --pass-mib 32 --baseline raw)
for p in ${BENCH_PROVIDERS:-shm tcp}; do
  for round in 1 2; do
    for v in "${versions[@]}"; do
      bin=$(bin_of "$v")
      mode=$(mode_of "$v")
      [ "$mode" = skip ] && continue
      echo "== $v round $round: $bin --provider $p $mode ${rows[*]} =="
      # shellcheck disable=SC2086
      timeout -k 10 150 "$bin" --provider "$p" $mode "${rows[@]}" --json "$out/${p}_${v}_$round.json" \
        --markdown "$out/${p}_${v}_$round.md" 2>&1 | grep -v '^\[' | tail -30
    done
  done
  for n in ${SCATTER_PEERS-16 63}; do
    for v in "${versions[@]}"; do
      mode=$(mode_of "$v")
      [ "$mode" = skip ] && continue
      echo "== $v: scatter 64 KiB to $n peers, $p =="
      # shellcheck disable=SC2086
      timeout -k 10 150 "$(bin_of "$v")" --provider "$p" $mode --op scatter --sizes 64KiB --peers "$n" \
        --iters 5 --pass-mib 32 --baseline raw --json "$out/${p}_${v}_scatter${n}.json" 2>&1 |
        grep -v '^\[' | tail -12
    done
  done
done
