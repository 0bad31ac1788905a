#!/bin/bash
# fabric_lib.ep's inter-node path on a machine with one GPU (kind nvidia-h200), from the
# repository root, with the bundle that tools/gpu/bundle.sh made in BUNDLE (default .gpu): both
# ranks' processes on GPU 0 as two one-GPU "nodes" (every byte through the two proxies and their
# engines over loopback). Builds the fabric_lib module (tools/gpu/build_module.sh), and, when
# $BUNDLE/versions/$BEFORE holds an older build (its include/, src/, python/ and libfabriclib.a),
# that one too; then
#   1. bench/ep_bench.py decode over tcp and over shm, the older build and this one alternating,
#      each with the proxies' areas in each of MEMORIES (default "auto"; e.g. "host gpu": this
#      build only, as older ones take no --proxy-memory);
#   2. tests/python/test_ep.py's two_nodes cases (FABRIC_EP_TEST_DEVICES=0,0), then the rest;
#   3. bench/ep_bench.py prefill over shm, both builds, each of MEMORIES.
# Logs go under OUT (default /tmp/ep1-out). Every step runs under `timeout`, cut to what is left
# of a BUDGET-second budget (default 540). The figures are this path's cost on one host with the
# two ranks time-slicing one GPU: upper bounds, not two nodes'.
set -u
BUNDLE=${BUNDLE:-.gpu}
BEFORE=${BEFORE:-before-ep}
BUDGET=${BUDGET:-540}
MEMORIES=${MEMORIES:-auto}
ROOT=$PWD
OUT=${OUT:-/tmp/ep1-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=$ROOT/$BUNDLE/lib:${LD_LIBRARY_PATH:-} PYTHONUNBUFFERED=1
start=$(date +%s)
elapsed() { echo "$(($(date +%s) - start)) s"; }
left() { local l=$((BUDGET - $1 - ($(date +%s) - start))); echo $((l > 5 ? l : 5)); }  # $1: reserved
[ -f "$BUNDLE/libfabriclib.a" ] || { echo "no $BUNDLE/libfabriclib.a: run tools/gpu/bundle.sh first"; exit 1; }

echo "== the machine =="
{
  timeout -k 10 20 nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  timeout -k 10 30 python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPUs', torch.cuda.device_count())"
} 2>&1 | tee "$OUT/machine.txt"

echo "== build the modules ($(elapsed)) =="
builds=(after)
bash tools/gpu/build_module.sh /tmp/ep1-after . "$BUNDLE/libfabriclib.a" "$(left 300)" &
if [ -f "$BUNDLE/versions/$BEFORE/libfabriclib.a" ]; then
  builds=("$BEFORE" after)
  bash tools/gpu/build_module.sh "/tmp/ep1-$BEFORE" "$BUNDLE/versions/$BEFORE" \
    "$BUNDLE/versions/$BEFORE/libfabriclib.a" "$(left 300)" &
fi
wait
for b in "${builds[@]}"; do [ -f /tmp/ep1-$b/fabric_lib/__init__.py ] || { echo "no module $b"; exit 1; }; done

# bench BUILD SHAPE PROVIDER ITERS WARMUP RESERVE MEMORY
bench() {
  local name="ep_$2_$3_$1$([ "$7" = auto ] || echo "_$7")"
  echo "-- ep_bench $2 over $3, build $1, proxy memory $7 ($(elapsed))"
  PYTHONPATH=/tmp/ep1-$1 timeout -k 10 "$(left "$6")" python3 bench/ep_bench.py --devices 0,0 --gpus-per-node 1 \
    --provider "$3" --nics "$([ "$3" = tcp ] && echo lo || echo shm)" --shapes "$2" --iters "$4" --warmup "$5" \
    --proxy-memory "$7" --json "$OUT/$name.json" >"$OUT/$name.txt" 2>&1
  echo "exit $?"; grep -v "^$" "$OUT/$name.txt" | tail -22
}

echo "== 1. decode ($(elapsed)) =="
for p in tcp shm; do for b in "${builds[@]}"; do for m in $MEMORIES; do
  bench "$b" decode "$p" 200 20 330 "$m"
done; done; done

echo "== 2. tests/python/test_ep.py ($(elapsed)) =="
FABRIC_EP_TEST_DEVICES=0,0 PYTHONPATH=/tmp/ep1-after timeout -k 10 "$(left 150)" python3 -m pytest -v -rs --durations=0 \
  -p no:cacheprovider -k two_nodes tests/python/test_ep.py >"$OUT/test_ep_two_nodes.log" 2>&1
echo "pytest two_nodes exit $?"
grep -E "PASSED|FAILED|SKIPPED|ERROR|^E " "$OUT/test_ep_two_nodes.log" | head -40
tail -2 "$OUT/test_ep_two_nodes.log"

echo "== 3. prefill ($(elapsed)) =="
for b in "${builds[@]}"; do for m in $MEMORIES; do bench "$b" prefill shm 10 2 100 "$m"; done; done

FABRIC_EP_TEST_DEVICES=0,0 PYTHONPATH=/tmp/ep1-after timeout -k 10 "$(left 5)" python3 -m pytest -v -rs \
  -p no:cacheprovider -k "not two_nodes" tests/python/test_ep.py >"$OUT/test_ep_one_node.log" 2>&1
echo "pytest one_node exit $?"
grep -E "FAILED|ERROR|^E " "$OUT/test_ep_one_node.log" | head -20
tail -2 "$OUT/test_ep_one_node.log"
echo "== done ($(elapsed)) =="
