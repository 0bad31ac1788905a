#!/bin/bash
# On the GPU machine (a quiet 16-core host), from the repository root, after tools/gpu/bundle.sh
# and a copy of build/bin/fabric_conformance_tests into .gpu/: the read conformance tests (tcp,
# shm, through the reordering wrapper) with the corrupted-descriptor sweep and the signal test,
# then fabric-bench's read rows and 4 KiB read round trips beside raw fi_read, in worker and
# caller-driven progress modes; and the reads of GPU memory with CUDA memory (fabric_gpu_tests:
# staged in one process, over CUDA IPC and staged between two). Results (JSON, Markdown) go to
# $OUT; arguments go to fabric-bench (e.g. --sizes 64KiB,1MiB,16MiB --iters 10).
export LD_LIBRARY_PATH=$PWD/.gpu/lib:$LD_LIBRARY_PATH
export PATH=$PWD/.gpu/bin:$PATH
out=${OUT:-/tmp/reads}
mkdir -p "$out"
nproc; nvidia-smi --query-gpu=name --format=csv,noheader
if [ -x .gpu/fabric_conformance_tests ]; then
  echo "== fabric_conformance_tests: reads, corrupted descriptors, signals =="
  (cd .gpu && FABRIC_TEST_PEER=$PWD/fabric_test_peer timeout -k 10 240 ./fabric_conformance_tests \
    --gtest_filter='AllBackends/Reads.*:AllBackends/GpuReads.*:Backends/CorruptDescriptor.*:Signals.*' 2>&1 |
    grep -E "^\[  |sweep|Failure" | tail -40)
fi
echo "== fabric_gpu_tests: reads of CUDA memory =="
(cd .gpu && FABRIC_TEST_PEER_BIN=$PWD/fabric_test_peer timeout -k 10 240 ./fabric_gpu_tests \
  --gtest_filter='*Reads*' 2>&1 | grep -E "^\[ |Failure|error" | tail -30)
for p in ${BENCH_PROVIDERS:-tcp shm}; do
  for mode in worker progress; do
    echo "== fabric-bench --provider $p --mode $mode --op read,read-rtt --baseline raw =="
    timeout -k 10 240 fabric-bench --provider "$p" --mode "$mode" --op read,read-rtt \
      --baseline raw --json "$out/read-$p-$mode.json" --markdown "$out/read-$p-$mode.md" \
      "$@" 2>&1 | grep -v '^\[' | tail -30
  done
done
