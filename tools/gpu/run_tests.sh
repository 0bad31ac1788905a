#!/bin/bash
# On the GPU machine, from the repository root, after tools/gpu/bundle.sh ran on the build
# machine: the GPU test suite, then the watcher, staged and pipeline benchmarks.
export LD_LIBRARY_PATH=$PWD/.gpu/lib:$LD_LIBRARY_PATH
cd .gpu || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== fabric_gpu_tests =="
timeout 300 ./fabric_gpu_tests 2>&1 | tail -45
echo "== fabric-bench-uvm --events 20000 --cpu 2 =="
timeout 120 ./fabric-bench-uvm --events 20000 --cpu 2 2>&1 | tail -6
echo "== fabric-bench-gpu --provider shm =="
timeout 200 ./fabric-bench-gpu --provider shm --iters 15 2>&1 | tail -20
echo "== fabric-bench-gpu --provider tcp --op staged =="
timeout 120 ./fabric-bench-gpu --provider tcp --op staged --iters 7 2>&1 | tail -8
