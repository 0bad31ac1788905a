#!/bin/bash
# Packs what a GPU machine without -dev packages needs into .gpu/ (git-ignored): the GPU test
# and benchmark binaries, the static engine library and headers for building the Python
# module there, and the shared libraries Debian has and that machine lacks. Then, on the GPU
# machine, from the repository root: `bash tools/gpu/run_tests.sh` (C++ GPU suite and
# fabric-bench-gpu) and `bash tools/gpu/run_python.sh` (builds fabric_lib for its python3 and
# runs the pytest suite with CUDA tensors). Run after `make build` on a machine with nvcc.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x build/bin/fabric_gpu_tests ] || { echo "build first (make build, with nvcc present)"; exit 1; }
# (git's path for the exclude file: .git is a file in a worktree.)
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
rm -rf .gpu && mkdir -p .gpu/lib .gpu/include .gpu/bin
# fabric_test_peer: the other process of the CUDA IPC tests (run_tests.sh points
# FABRIC_TEST_PEER_BIN at it).
cp build/bin/fabric_gpu_tests build/bin/fabric-bench-gpu build/bin/fabric-bench-uvm \
  build/bin/fabric_test_peer .gpu/
strip .gpu/fabric_gpu_tests .gpu/fabric-bench-gpu .gpu/fabric-bench-uvm .gpu/fabric_test_peer
# The KV-cache GPU pipeline (fabric::kv), when built.
if [ -x build/bin/fabric-kv-gpu ]; then cp build/bin/fabric-kv-gpu .gpu/ && strip .gpu/fabric-kv-gpu; fi
cp build/lib/libfabriclib.a .gpu/ && strip --strip-debug .gpu/libfabriclib.a
# fabric::kv for the Python module's KV bindings (the etcd registry needs libcurl.so.4 there).
for l in libfabrickv.a libfabrickvetcd.a; do cp build/lib/$l .gpu/ && strip --strip-debug .gpu/$l; done
# fabric::weights (schedule, projections, the FP8 kernel) for the module's weights bindings.
cp build/lib/libfabricweights.a .gpu/ && strip --strip-debug .gpu/libfabricweights.a
# fabric::ep (the all-to-all, its kernels and proxy) for the module's ep bindings.
cp build/lib/libfabricep.a .gpu/ && strip --strip-debug .gpu/libfabricep.a
cp /usr/local/cuda/lib64/libcudart_static.a .gpu/
for l in libhwloc.so.15 libspdlog.so.1.10 libfmt.so.9; do cp "/lib/x86_64-linux-gnu/$l" .gpu/lib/; done
cp -r /usr/include/rdma /usr/include/fmt /usr/include/spdlog .gpu/include/
cp /usr/bin/fi_info .gpu/bin/
# The CPU benchmark and its baselines, for a quiet many-core host (tools/gpu/run_bench.sh).
cp build/bin/fabric-bench build/bin/fabric-bench-raw .gpu/bin/
strip .gpu/bin/fabric-bench .gpu/bin/fabric-bench-raw
for tool in ucx_perftest iperf3; do
  path=$(command -v "$tool" || true)
  [ -n "$path" ] || { echo "note: $tool is not installed here (make bench-deps); no $tool baseline there"; continue; }
  cp "$path" .gpu/bin/
  ldd "$path" | awk '/=> \// {print $3}' | grep -E 'libuc[pmst]|libiperf|libsctp|libnuma' |
    xargs -r -I{} cp {} .gpu/lib/
done
[ -d /usr/lib/x86_64-linux-gnu/ucx ] && cp -r /usr/lib/x86_64-linux-gnu/ucx .gpu/lib/
# fabric-bench runs UCX and iperf3 in a private network namespace, which needs `ip`; a GPU
# machine may lack iproute2. Its libraries go to a folder of their own (.gpu/ip/), used by it
# alone.
mkdir -p .gpu/ip/lib
cp /usr/bin/ip .gpu/ip/
ldd /usr/bin/ip | awk '/=> \// {print $3}' | grep -vE 'libc\.so|libz\.so' | xargs -r -I{} cp {} .gpu/ip/lib/
du -sh .gpu
