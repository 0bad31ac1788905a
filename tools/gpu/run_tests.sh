#!/bin/bash
# On the GPU machine, from the repository root, after tools/gpu/bundle.sh ran on the build
# machine: the GPU test suite, then the watcher, GPU-memory and pipeline benchmarks.
export LD_LIBRARY_PATH=$PWD/.gpu/lib:$LD_LIBRARY_PATH
cd .gpu || exit 1
export FABRIC_TEST_PEER_BIN=$PWD/fabric_test_peer  # the CUDA IPC tests' other process
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== fabric_gpu_tests =="
timeout -k 10 300 ./fabric_gpu_tests 2>&1 | grep -E "^\[ |path|Failure|error" | tail -60
echo "== fabric-bench-uvm --events 20000 --cpu 2 =="
timeout -k 10 120 ./fabric-bench-uvm --events 20000 --cpu 2 2>&1 | tail -6
# --provider shm: GPU to GPU over the CUDA IPC path (same host); --staged: the staged path.
for args in "--provider shm" "--provider shm --staged" "--provider tcp --op staged"; do
  echo "== fabric-bench-gpu $args --iters 11 =="
  timeout -k 10 150 ./fabric-bench-gpu $args --iters 11 2>&1 | tail -12
done
if [ -x ./fabric-kv-gpu ]; then
  for p in shm tcp; do
    echo "== fabric-kv-gpu --provider $p --requests 8 =="
    timeout -k 10 240 ./fabric-kv-gpu --provider $p --requests 8 2>&1 | tail -16
  done
fi
