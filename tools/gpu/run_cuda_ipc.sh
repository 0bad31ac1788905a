#!/bin/bash
# On a GPU machine, from the repository root, with a bundle made by tools/gpu/bundle.sh in
# BUNDLE (default .gpu): the CUDA IPC path's GPU tests (two processes; on a one-GPU machine
# both on that GPU; with two GPUs, again with the peer on GPU 1), fabric-bench-gpu over the path
# and over the staged path (and GPU 0 -> GPU 1 where there are two), and the Python
# CUDA-tensor tests when PYTHON=1 (the module is built there, as run_python.sh does). Output
# goes to stdout and, when OUT is set, to files under it.
BUNDLE=${BUNDLE:-.gpu}
ROOT=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=$ROOT/$BUNDLE/lib:$LD_LIBRARY_PATH PYTHONUNBUFFERED=1
export FABRIC_TEST_PEER_BIN=$ROOT/$BUNDLE/fabric_test_peer
OUT=${OUT:-/tmp/cuda-ipc-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
cd "$BUNDLE" || exit 1
echo "== fabric_gpu_tests (CUDA IPC and staged) =="
timeout -k 10 240 ./fabric_gpu_tests --gtest_filter='*CudaIpcCuda*:*StagedCuda*' >"$OUT/gpu_tests.log" 2>&1
echo "exit $?"
grep -aE "^\[ *(OK|FAILED|PASSED|SKIPPED) |Failure|Expected|Which is|actual|error" "$OUT/gpu_tests.log" | head -80
for args in "--provider shm" "--provider shm --staged"; do
  echo "== fabric-bench-gpu $args --op staged --iters 11 =="
  timeout -k 10 120 ./fabric-bench-gpu $args --op staged --iters 11 2>&1 | tee -a "$OUT/bench.txt"
done
# Two GPUs or more: the peer process on GPU 1, so that the copies cross NVLink.
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  echo "== fabric_gpu_tests, the peer on GPU 1 =="
  FABRIC_TEST_IPC_PEER_DEVICES=1,0 timeout -k 10 240 ./fabric_gpu_tests --gtest_filter='*CudaIpcCuda*' \
    >"$OUT/gpu_tests_2gpu.log" 2>&1
  echo "exit $?"
  grep -aE "^\[ *(OK|FAILED|PASSED|SKIPPED) |Failure" "$OUT/gpu_tests_2gpu.log" | head -40
  echo "== fabric-bench-gpu --provider shm --op staged --iters 11 --peer-gpu 1 =="
  timeout -k 10 120 ./fabric-bench-gpu --provider shm --op staged --iters 11 --peer-gpu 1 2>&1 |
    tee -a "$OUT/bench.txt"
fi
cd "$ROOT" || exit 1
[ "${PYTHON:-0}" = 1 ] || exit 0
echo "== Python: build the module, run tests/python/test_cuda.py =="
SRC=${PYSRC:-.}
BUNDLE=$BUNDLE bash tools/gpu/build_module.sh /tmp/pkg "$SRC" || exit 1
PYTHONPATH=/tmp/pkg timeout -k 10 240 python3 -m pytest -v -rs -p no:cacheprovider \
  $SRC/tests/python/test_cuda.py >"$OUT/pytest.log" 2>&1
echo "pytest exit $?"
grep -E "PASSED|FAILED|SKIPPED|^E " "$OUT/pytest.log" | head -60
tail -3 "$OUT/pytest.log"
