#!/bin/bash
# fabric_lib.ep on a machine with two GPUs (kind nvidia-h200-x2), from the repository root, with
# the bundle that tools/gpu/bundle.sh made in BUNDLE (default .gpu): builds the fabric_lib Python
# module against that machine's python3 as run_cuda_ipc.sh does, runs tests/python/test_ep.py,
# then bench/ep_bench.py (decode and prefill, fabric_lib.ep against NCCL all_to_all_single, and
# against DeepEP's intranode kernels when .baselines/deepep-build holds the package that
# tools/gpu/build_deepep.sh made: carry .baselines).
# Logs go under OUT (default /tmp/ep-out). Every step runs under `timeout`, cut to what is left of
# a 330-second budget (the bench keeps its last 60 s), so the whole stays under six minutes:
# test_ep.py runs each two-rank scenario twice (one node, and two one-GPU nodes through the
# proxies), about 170 s on one H200.
# NVLink multicast stays off in every process.
set -u
BUNDLE=${BUNDLE:-.gpu}
ROOT=$PWD
OUT=${OUT:-/tmp/ep-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=$ROOT/$BUNDLE/lib:${LD_LIBRARY_PATH:-} PYTHONUNBUFFERED=1
start=$(date +%s)
elapsed() { echo "$(($(date +%s) - start)) s"; }
left() { local l=$((330 - $1 - ($(date +%s) - start))); echo $((l > 5 ? l : 5)); }  # $1: reserved
[ -f "$BUNDLE/libfabriclib.a" ] || { echo "no $BUNDLE/libfabriclib.a: run tools/gpu/bundle.sh first"; exit 1; }

echo "== the machine =="
{
  timeout -k 10 20 nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  timeout -k 10 20 nvidia-smi topo -m
  timeout -k 10 30 python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPUs', torch.cuda.device_count())"
} 2>&1 | tee "$OUT/machine.txt"

echo "== build the Python module ($(elapsed)) =="
PKG=/tmp/ep-pkg
bash tools/gpu/build_module.sh "$PKG" . "$BUNDLE/libfabriclib.a" "$(left 100)" || exit 1

echo "== tests/python/test_ep.py ($(elapsed)) =="
PYTHONPATH=$PKG timeout -k 10 "$(left 60)" python3 -m pytest -v -rs --durations=0 -p no:cacheprovider tests/python/test_ep.py \
  >"$OUT/test_ep.log" 2>&1
echo "pytest exit $?"
grep -E "PASSED|FAILED|SKIPPED|ERROR|^E " "$OUT/test_ep.log" | head -60
tail -3 "$OUT/test_ep.log"

echo "== bench/ep_bench.py ($(elapsed)) =="
deepep=$([ -d .baselines/deepep-build/deep_ep ] && echo ":$ROOT/.baselines/deepep-build")
[ -n "$deepep" ] && echo "(DeepEP from .baselines/deepep-build)"
PYTHONPATH=$PKG$deepep timeout -k 10 "$(left 0)" python3 bench/ep_bench.py --iters 200 --json "$OUT/ep_bench.json" \
  >"$OUT/ep_bench.txt" 2>&1
echo "bench exit $?"
cat "$OUT/ep_bench.txt" | tail -40
echo "== done ($(elapsed)) =="
