#!/bin/bash
# make bench-peers on a GPU host that has no registry and no -dev packages: the host-memory rows
# of bench/peers/peers.py run there with what is carried from the build machine.
#
#   tools/gpu/peers.sh pack          build machine, after `make build` and
#                                    `tools/nixl/build_wheel_plugin.sh .venv`: .gpu-peers/ (bins,
#                                    libraries) and .gpu-peers/site.tar.xz: the peers' wheels for
#                                    Python 3.12 installed into one folder with the FABRIC plugin
#                                    beside NIXL's, less what the benchmark never loads, so that
#                                    one call carries everything (the device takes 64 MiB a call)
#   tools/gpu/peers.sh run OUT [peers.py options]
#                                    GPU host: unpacks the site into .gpu-site/ and runs
#                                    bench/peers/peers.py with the image's python3
#
# Everything lands in git-ignored folders (.gpu-peers, .gpu-site).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY_TAGS=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

pack() {
  local exclude
  exclude=$(git rev-parse --git-path info/exclude)
  for d in /.gpu-peers/ /.gpu-site/; do
    grep -qx "$d" "$exclude" 2>/dev/null || echo "$d" >>"$exclude"
  done
  rm -rf .gpu-peers && mkdir -p .gpu-peers/bin .gpu-peers/lib
  cp build/bin/fabric-bench build/bin/fabric-bench-raw .gpu-peers/bin/
  strip .gpu-peers/bin/*
  for l in libhwloc.so.15 libspdlog.so.1.10 libfmt.so.9; do
    cp "/lib/x86_64-linux-gnu/$l" .gpu-peers/lib/
  done
  local plugin
  plugin=$(find .venv/lib/*/site-packages/.nixl_cu13.mesonpy.libs/plugins \
    -name libplugin_FABRIC.so | head -1)
  if [ -z "$plugin" ]; then
    echo "no FABRIC plugin in .venv (tools/nixl/build_wheel_plugin.sh .venv)"
    exit 1
  fi
  local tmp
  tmp=$(mktemp -d)
  # NIXL: the version tests/e2e/vllm/requirements.txt pins (the GPU host has CUDA 13); Mooncake:
  # bench/peers/requirements.txt's; UCCL links CUDA 12's runtime, which the image lacks.
  pip download -q --no-deps "${PY_TAGS[@]}" -d "$tmp/whl" nixl==1.4.0 nixl-cu13==1.4.0 \
    mooncake-transfer-engine-non-cuda==0.3.13.post1 uccl==0.1.1 nvidia-cuda-runtime-cu12==12.9.79
  # intervaltree (UCCL's one requirement) is published as a source distribution only.
  pip wheel -q --no-deps -w "$tmp/whl" intervaltree==3.1.0
  pip install -q --no-deps --no-compile --ignore-requires-python --target "$tmp/site" \
    "${PY_TAGS[@]}" "$tmp"/whl/*.whl
  # Not loaded by the benchmark: NIXL's EP kernels, Mooncake's store and its tools (its
  # transfer_engine_bench too: that note says so on the GPU host), UCX's perftest modules.
  (cd "$tmp/site" && rm -rf nixl_ep nixl_ep_cu13 include mooncake/store.so \
    mooncake/mooncake_master mooncake/mooncake_client mooncake/transfer_engine_bench \
    nixl_cu13.libs/ucx/libucx_perftest*)
  cp "$plugin" "$tmp/site/.nixl_cu13.mesonpy.libs/plugins/"
  strip --strip-debug "$tmp/site/.nixl_cu13.mesonpy.libs/plugins/libplugin_FABRIC.so"
  tar -C "$tmp/site" -cf - . | xz -T0 -6 >.gpu-peers/site.tar.xz
  rm -rf "$tmp"
  du -sh .gpu-peers .gpu-peers/site.tar.xz
}

run() {
  local out=$1
  shift
  if [ ! -d .gpu-site ]; then
    mkdir -p .gpu-site && xz -dc .gpu-peers/site.tar.xz | tar -C .gpu-site -xf -
  fi
  export PYTHONPATH=$PWD/.gpu-site PATH=$PWD/.gpu-site/bin:$PATH PYTHONUNBUFFERED=1
  # fabric-lib's libraries from Debian; UCCL's wheel links CUDA 12's runtime, carried as a wheel.
  local libs=$PWD/.gpu-peers/lib:$PWD/.gpu-site/nvidia/cuda_runtime/lib
  export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  python3 bench/peers/peers.py "$out" --fabric-bench .gpu-peers/bin/fabric-bench \
    --nixlbench "" "$@"
}

case ${1:-} in
  pack) pack ;;
  run) shift; run "$@" ;;
  *) sed -n 2,16p "$0"; exit 2 ;;
esac
