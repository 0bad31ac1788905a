#!/bin/bash
# The shm transport's copies by several threads, on a many-core host (the GPU machine's), from
# the repository root after tools/gpu/bundle.sh: FABRIC_SHM_COPY_THREADS=1 (the receiving worker
# copies alone) against the default (half the CPUs, at most 8), alternating, ROUNDS times:
#   1. fabric-bench single writes (SIZES) and paged writes of 64 KiB pages, raw libfabric shm
#      in the same run;
#   2. bench/ep_bench.py's inter-node path over shm on GPU 0 (two one-GPU "nodes"), prefill
#      then decode (needs the GPU and builds the fabric_lib module; EP=0 skips it).
# Logs go under OUT (default /tmp/shm-copy-out); every step runs under `timeout`. REUSE_MODULE=1
# keeps a module already built in /tmp/shm-copy-mod.
set -u
ROOT=$PWD
OUT=${OUT:-/tmp/shm-copy-out}
ROUNDS=${ROUNDS:-2}
SIZES=${SIZES:-64KiB,256KiB,1MiB,16MiB}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$ROOT/.gpu/lib:${LD_LIBRARY_PATH:-} PATH=$ROOT/.gpu/bin:$PATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
start=$(date +%s)
elapsed() { echo "$(($(date +%s) - start)) s"; }
echo "host: $(nproc) CPUs; $(grep -m1 'model name' /proc/cpuinfo)" | tee "$OUT/machine.txt"
for r in $(seq "$ROUNDS"); do for t in 1 0; do
  echo "== fabric-bench, threads $t, round $r ($(elapsed)) =="
  FABRIC_SHM_COPY_THREADS=$t timeout -k 10 150 fabric-bench --provider shm --nic shm \
    --op single,paged --sizes "$SIZES" --page-sizes 64KiB --pages 10000 --iters 5 --baseline raw \
    >"$OUT/bench_t${t}_r$r.txt" 2>&1
  echo "exit $?"; grep -E "^\[[0-9]+/[0-9]+\] .*:" "$OUT/bench_t${t}_r$r.txt"
done; done
[ "${EP:-1}" = 1 ] || exit 0
echo "== the fabric_lib module ($(elapsed)) =="
[ -f /tmp/shm-copy-mod/fabric_lib/__init__.py ] && [ "${REUSE_MODULE:-0}" = 1 ] ||
  bash tools/gpu/build_module.sh /tmp/shm-copy-mod . .gpu/libfabriclib.a 240 >"$OUT/build_module.log" 2>&1
[ -f /tmp/shm-copy-mod/fabric_lib/__init__.py ] || { echo "no module"; tail -20 "$OUT/build_module.log"; exit 1; }
for shape in prefill decode; do for r in $(seq "$ROUNDS"); do for t in 1 0; do
  iters=$([ $shape = prefill ] && echo 10 || echo 200)
  warm=$([ $shape = prefill ] && echo 2 || echo 20)
  echo "-- ep_bench $shape over shm, threads $t, round $r ($(elapsed))"
  FABRIC_SHM_COPY_THREADS=$t PYTHONPATH=/tmp/shm-copy-mod timeout -k 10 100 python3 bench/ep_bench.py \
    --devices 0,0 --gpus-per-node 1 --provider shm --nics shm --shapes $shape --iters $iters \
    --warmup $warm --proxy-memory host --json "$OUT/ep_${shape}_t${t}_r$r.json" \
    >"$OUT/ep_${shape}_t${t}_r$r.txt" 2>&1
  echo "exit $?"; grep -v "^$" "$OUT/ep_${shape}_t${t}_r$r.txt" | tail -8
done; done; done
echo "== done ($(elapsed)) =="
