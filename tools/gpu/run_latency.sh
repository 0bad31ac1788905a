#!/bin/bash
# On the GPU machine (a quiet many-core host), from the repository root, after
# tools/gpu/bundle.sh: the small-transfer rows of issue 16 (single and paged writes, imm-only
# round trips and rate, scatter to 16 and to 63 peers: the EP64 shape) over tcp and shm, each
# against raw libfabric in the same run. When the bundle also holds .gpu/bin/fabric-bench-before
# (an older build, copied there by hand), both run alternately, two rounds each, so that
# before and after share the machine's state. JSON and markdown land in $OUT (default
# /tmp/latency-out); every run is under `timeout`.
set -u
source tools/gpu/bench_env.sh /tmp/latency-out
versions=(after)
[ -x .gpu/bin/fabric-bench-before ] && versions=(before after)
rows=(--op single,paged,imm --sizes 4KiB,64KiB,256KiB,1MiB --page-sizes 4KiB --pages 100
  --iters 5 --pass-mib 32 --baseline raw)
for p in ${BENCH_PROVIDERS:-shm tcp}; do
  for round in 1 2; do
    for v in "${versions[@]}"; do
      bin=fabric-bench
      [ "$v" = before ] && bin=fabric-bench-before
      echo "== $v round $round: $bin --provider $p ${rows[*]} =="
      timeout 150 "$bin" --provider "$p" "${rows[@]}" --json "$out/${p}_${v}_$round.json" \
        --markdown "$out/${p}_${v}_$round.md" 2>&1 | grep -v '^\[' | tail -30
    done
  done
  for n in 16 63; do
    echo "== after: scatter 64 KiB to $n peers, $p =="
    timeout 150 fabric-bench --provider "$p" --op scatter --sizes 64KiB --peers "$n" --iters 5 \
      --pass-mib 32 --baseline raw --json "$out/${p}_scatter${n}.json" 2>&1 | grep -v '^\[' | tail -12
  done
done
