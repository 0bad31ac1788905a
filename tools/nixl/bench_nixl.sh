#!/usr/bin/env bash
# nixlbench over the FABRIC plugin against fabric-bench, the same shape, in one run:
#
#   tools/nixl/bench_nixl.sh [--quick] [--provider tcp|shm] [--rounds N] [--out FILE.md]
#
# For WRITE and READ, batch 1 and 64, blocks 4 KiB to 64 MiB:
#   nixlbench: two processes on loopback (ASIO runtime, no etcd), one agent each, backend FABRIC;
#              each iteration posts one request of <batch> descriptors and polls it to the end
#   fabric-bench: --op single (or read) --window <batch>: the engine alone, <batch> transfers
#              kept in flight
# Both use the same provider and NIC (FABRIC_PROVIDER, FABRIC_NICS=lo for tcp). The table gives
# GB/s (10^9 bytes/s) of each and their ratio; nothing is asserted. Each row runs both twice,
# interleaved, and keeps the best of each, so that load from elsewhere on the machine hits both
# alike. On hosts with fewer than 8 CPUs both run the engine without worker spin (the plugin's
# default there).
#
# Needs what tools/nixl/build_nixl.sh built ($NIXL_WORK/env.sh, nixlbench, fabric-bench).
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${NIXL_WORK:-$repo/.nixl}
provider=tcp
quick=0
rounds_arg=""
out=$work/bench-nixl.md
while [ $# -gt 0 ]; do
  case $1 in
    --quick) quick=1 ;;
    --provider) provider=$2; shift ;;
    --out) out=$2; shift ;;
    --rounds) rounds_arg=$2; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
# NIXL_ENV, NIXLBENCH, FABRIC_BENCH: another layout (tools/nixl/gpu_bundle.sh's .nixl/gpu).
# shellcheck disable=SC1090
source "${NIXL_ENV:-$work/env.sh}"
# nixlbench links libcuda; on a host without a driver, the toolkit's stub satisfies the loader
# (nothing of it is called for DRAM).
if ! ldconfig -p | grep -q 'libcuda.so.1 '; then
  mkdir -p "$work/cuda-stub"
  stub=$(ls /usr/local/cuda/lib64/stubs/libcuda.so 2>/dev/null || true)
  [ -n "$stub" ] && ln -sf "$stub" "$work/cuda-stub/libcuda.so.1"
  export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$work/cuda-stub
fi
export FABRIC_PROVIDER=$provider
nic=lo
[ "$provider" = shm ] && nic=shm
export FABRIC_NICS=$nic
# The plugin's engine does not spin on hosts with fewer than 8 CPUs (plugins/nixl,
# BackendOptions::parse); fabric-bench gets the same configuration there.
fb_env=()
if [ "$(nproc)" -lt 8 ]; then fb_env=(env FABRIC_SPIN_US=0 FABRIC_INFLIGHT_SPIN_US=0); fi

nixlbench=${NIXLBENCH:-$work/nixlbench-build/nixlbench}
fabric_bench=${FABRIC_BENCH:-$work/fabric-build/bin/fabric-bench}
if [ "$quick" = 1 ]; then
  sizes=(65536 1048576 16777216)
  iters=64; factor=16; warmup=8; fb_iters=2; rounds=1
else
  sizes=(4096 8192 16384 32768 65536 131072 262144 524288 1048576 2097152 4194304 8388608
    16777216 33554432 67108864)
  iters=256; factor=32; warmup=32; fb_iters=3; rounds=2
fi
[ -n "$rounds_arg" ] && rounds=$rounds_arg
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
log() { printf '== %s: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

best() {  # the larger of two numbers, either of which may be empty (a failed run)
  python3 -c "import sys; v = [float(x) for x in sys.argv[1:] if x]; print(max(v) if v else '')" "$@"
}

human() {  # bytes -> "4 KiB"
  local b=$1
  if [ "$b" -ge 1048576 ]; then echo "$((b / 1048576)) MiB"; else echo "$((b / 1024)) KiB"; fi
}

# nixlbench <op> <batch> <size>: prints "size GB/s" lines for the one block size.
run_nixlbench() {
  local op=$1 batch=$2 size=$3 port=$((20000 + RANDOM % 20000))
  # nixlbench wants block * batch to fit its buffer (each process allocates it).
  local buffer=$((size * batch > (1 << 30) ? size * batch : (1 << 30)))
  local args=(--backend FABRIC --runtime_type ASIO --asio_port "$port" --op_type "$op"
    --start_block_size "$size" --max_block_size "$size" --start_batch_size "$batch"
    --max_batch_size "$batch" --num_iter "$iters" --warmup_iter "$warmup"
    --large_blk_iter_ftr "$factor" --total_buffer_size "$buffer")
  (cd "$tmp" && timeout 600 "$nixlbench" "${args[@]}" >"$tmp/target.log" 2>&1) &
  local target=$!
  sleep 0.5
  (cd "$tmp" && timeout 600 "$nixlbench" "${args[@]}" >"$tmp/initiator.log" 2>&1) || true
  wait $target || true
  # The initiator's (or either's) table row: block, batch, GB/s, ...
  cat "$tmp/initiator.log" "$tmp/target.log" |
    awk -v s="$size" '$1 == s && $2 ~ /^[0-9]+$/ && $3 ~ /^[0-9.]+$/ { print $3; exit }'
}

# fabric-bench <op> <window> <size>: GB/s.
run_fabric_bench() {
  local op=$1 window=$2 size=$3 fb_op=single
  [ "$op" = READ ] && fb_op=read
  local pass=$(((size * window * 4 + 1048575) / 1048576))
  [ "$pass" -lt 64 ] && pass=64
  [ "$pass" -gt 4096 ] && pass=4096
  timeout 600 "${fb_env[@]}" "$fabric_bench" --op "$fb_op" --provider "$provider" --nic "$nic" \
    --sizes "$size" --window "$window" --iters "$fb_iters" --warmup 1 --pass-mib "$pass" \
    --baseline none --json "$tmp/fb.json" >"$tmp/fb.log" 2>&1 || true
  python3 - "$tmp/fb.json" "$size" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception:
    print(""); sys.exit()
for r in d["results"]:
    if r["bytes"] == int(sys.argv[2]) and r["op"] in ("single", "read"):
        print(f'{r["gbps"] / 8:.3f}')
        break
else:
    print("")
PY
}

{
  echo "nixlbench (FABRIC plugin, two processes, ASIO runtime) against fabric-bench, provider"
  echo "$provider, NIC $nic, $(nproc) CPUs, $(date -u '+%Y-%m-%d %H:%M UTC')."
  echo
  echo "| op | batch | block | nixlbench GB/s | fabric-bench GB/s | ratio |"
  echo "| --- | ---: | ---: | ---: | ---: | ---: |"
} >"$out"
for op in WRITE READ; do
  for batch in 1 64; do
    for size in "${sizes[@]}"; do
      log "$op batch $batch $(human "$size")"
      nb="" fb=""
      for _ in $(seq "$rounds"); do  # the best of each, rounds interleaved
        nb=$(best "$nb" "$(run_nixlbench "$op" "$batch" "$size")")
        fb=$(best "$fb" "$(run_fabric_bench "$op" "$batch" "$size")")
      done
      ratio=$(python3 -c "import sys; a, b = sys.argv[1:]; print(f'{float(a) / float(b):.2f}' if a and b else '-')" "$nb" "$fb")
      echo "| $op | $batch | $(human "$size") | ${nb:--} | ${fb:--} | $ratio |" | tee -a "$out" >&2
    done
  done
done
log "table: $out"
cat "$out"
