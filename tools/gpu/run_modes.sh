#!/bin/bash
# On the GPU machine (a quiet many-core host), from the repository root, after
# tools/gpu/bundle.sh: fabric-bench's three modes (worker, callbacks, progress: fabric-bench
# --mode) over tcp and shm, single 4 KiB and 64 KiB writes and imm-only round trips and rate,
# each against raw libfabric in the same run. The host's CPUs are shared
# with nothing else, so the tracefs mount for sys/op is attempted (root). JSON and markdown
# land in $OUT (default /tmp/modes-out); every run is under `timeout`. BENCH_PROVIDERS and
# BENCH_MODES narrow the loops; FABRIC_* tuning variables (FABRIC_WAIT_SPIN_US, ...) pass
# through to the client and its peers.
set -u
source tools/gpu/bench_env.sh /tmp/modes-out
# What a clock read costs depends on the clock source; the CPU model explains per-op costs.
cat /sys/devices/system/clocksource/clocksource0/current_clocksource >"$out/clocksource.txt" 2>&1
grep -m1 'model name' /proc/cpuinfo >"$out/cpu.txt" 2>&1
env | grep '^FABRIC_' >"$out/env.txt" || true
mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null ||
  echo "note: no tracefs: sys/op reads n/a"
for p in ${BENCH_PROVIDERS:-tcp shm}; do
  for m in ${BENCH_MODES:-worker callbacks progress}; do
    echo "== $p $m =="
    timeout -k 10 100 fabric-bench --provider "$p" --mode "$m" --op single,imm --sizes 4KiB,64KiB \
      --iters 5 --pass-mib 32 --baseline raw --json "$out/$p-$m.json" \
      --markdown "$out/$p-$m.md" 2>&1 | grep -E '^  (4 KiB|64 KiB|imm) |FAILED|note'
  done
done
