#!/bin/bash
# The RL weight push (fabric_lib.weights) on a machine with two GPUs (kind
# nvidia-h200-x2), from the repository root, with the bundle that tools/gpu/bundle.sh made in
# BUNDLE (default .gpu): the FP8 kernel's bit-exact test (fabric_gpu_tests), the Python module
# built against that machine's python3 as run_ep.sh does, tests/python/test_weights.py (its CUDA
# variant runs there), then bench/weights_bench.py (a >= 20 GB BF16 MoE-shaped model GPU 0 ->
# GPU 1 against cudaMemcpyPeerAsync and per-tensor NCCL broadcast, and the staged fabric path).
# Logs go under OUT (default /tmp/weights-out). Every step runs under `timeout`, cut to what is
# left of a 540-second budget (the benches keep their last 300 s). NVLink multicast stays off in
# every process. BENCH_ARGS adds options to the bench (e.g. --layers 3 --iters 5).
set -u
BUNDLE=${BUNDLE:-.gpu}
ROOT=$PWD
OUT=${OUT:-/tmp/weights-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=$ROOT/$BUNDLE/lib:${LD_LIBRARY_PATH:-} PYTHONUNBUFFERED=1
start=$(date +%s)
elapsed() { echo "$(($(date +%s) - start)) s"; }
left() { local l=$((540 - $1 - ($(date +%s) - start))); echo $((l > 5 ? l : 5)); }  # $1: reserved
[ -f "$BUNDLE/libfabricweights.a" ] || { echo "no $BUNDLE/libfabricweights.a: run tools/gpu/bundle.sh first"; exit 1; }

echo "== the machine =="
{
  timeout -k 10 20 nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  timeout -k 10 20 nvidia-smi topo -m
  timeout -k 10 30 python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPUs', torch.cuda.device_count())"
  free -g | head -2
} 2>&1 | tee "$OUT/machine.txt"

echo "== fabric_gpu_tests --gtest_filter='WeightsFp8Cuda.*' ($(elapsed)) =="
timeout -k 10 "$(left 480)" "$BUNDLE/fabric_gpu_tests" --gtest_filter='WeightsFp8Cuda.*' 2>&1 |
  tee "$OUT/fp8_kernel.txt" | grep -E "^\[ |Failure|differ|skip" | tail -20

echo "== build the Python module ($(elapsed)) =="
PKG=/tmp/weights-pkg
bash tools/gpu/build_module.sh "$PKG" . "$BUNDLE/libfabriclib.a" "$(left 400)" || exit 1
PYTHONPATH=$PKG timeout -k 10 30 python3 -c "import fabric_lib, fabric_lib.weights; print('fabric_lib', fabric_lib.__version__, 'HAS_CUDA', fabric_lib.HAS_CUDA, 'FP8 kernel', fabric_lib._fabric_lib._WEIGHTS_HAS_CUDA)" ||
  exit 1

echo "== tests/python/test_weights.py ($(elapsed)) =="
PYTHONPATH=$PKG timeout -k 10 "$(left 300)" python3 -m pytest -v -rs --durations=0 -p no:cacheprovider \
  tests/python/test_weights.py >"$OUT/test_weights.log" 2>&1
echo "pytest exit $?"
grep -E "PASSED|FAILED|SKIPPED|ERROR|^E " "$OUT/test_weights.log" | head -40
tail -3 "$OUT/test_weights.log"

echo "== bench/weights_bench.py ${BENCH_ARGS:-} ($(elapsed)) =="
PYTHONPATH=$PKG timeout -k 10 "$(left 150)" python3 bench/weights_bench.py --json "$OUT/weights_bench.json" \
  ${BENCH_ARGS:-} >"$OUT/weights_bench.txt" 2>&1
echo "bench exit $?"
tail -40 "$OUT/weights_bench.txt"
echo "== bench/weights_bench.py --per-expert (1920 expert parameters; no staged rows) ($(elapsed)) =="
PYTHONPATH=$PKG timeout -k 10 "$(left 0)" python3 bench/weights_bench.py --per-expert --staged-providers "" \
  --json "$OUT/weights_bench_per_expert.json" ${BENCH_ARGS:-} >"$OUT/weights_bench_per_expert.txt" 2>&1
echo "bench exit $?"
tail -10 "$OUT/weights_bench_per_expert.txt"
echo "== bench/weights_predict.py (the 1T model from the measured rates) =="
[ -f "$OUT/weights_bench.json" ] && python3 bench/weights_predict.py --json "$OUT/weights_bench.json"
echo "== done ($(elapsed)) =="
