#!/bin/bash
# make bench-peers on a GPU host that has no registry and no -dev packages: the host-memory rows
# of bench/peers/peers.py run there with what is carried from the build machine.
#
#   tools/gpu/peers.sh pack          build machine, after `make build` and
#                                    `tools/nixl/build_wheel_plugin.sh .venv`: .gpu-peers/ (bins,
#                                    libraries, the FABRIC plugin) and the wheels for Python 3.12
#                                    in .whl-peers/{nixl,mooncake,uccl}/ (one folder a call: the
#                                    device takes 64 MiB a call with the tree)
#   tools/gpu/peers.sh install DIR   GPU host: the wheels of DIR into .gpu-site/ (kept between
#                                    calls), the FABRIC plugin beside the NIXL wheel's plugins
#   tools/gpu/peers.sh run OUT [peers.py options]
#                                    GPU host: bench/peers/peers.py with the image's python3
#
# Everything lands in git-ignored folders (.gpu-peers, .whl-peers, .gpu-site).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY_TAGS=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

pack() {
  local exclude
  exclude=$(git rev-parse --git-path info/exclude)
  for d in /.gpu-peers/ /.whl-peers/ /.gpu-site/; do
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
  cp "$plugin" .gpu-peers/ && strip --strip-debug .gpu-peers/libplugin_FABRIC.so
  rm -rf .whl-peers && mkdir -p .whl-peers/nixl .whl-peers/mooncake .whl-peers/uccl
  # NIXL: the version tests/e2e/vllm/requirements.txt pins; the GPU host has CUDA 13.
  pip download -q --no-deps "${PY_TAGS[@]}" -d .whl-peers/nixl nixl==1.4.0 nixl-cu13==1.4.0
  pip download -q --no-deps "${PY_TAGS[@]}" -d .whl-peers/mooncake \
    mooncake-transfer-engine-non-cuda==0.3.13.post1
  # UCCL's wheel links CUDA 12's runtime, which the CUDA 13 image lacks: carried too.
  pip download -q --no-deps "${PY_TAGS[@]}" -d .whl-peers/uccl uccl==0.1.1 \
    nvidia-cuda-runtime-cu12==12.9.79
  # intervaltree (UCCL's one requirement) is published as a source distribution only.
  pip wheel -q --no-deps -w .whl-peers/uccl intervaltree==3.1.0
  du -sh .gpu-peers .whl-peers/*
}

install() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target .gpu-site "$1"/*.whl
  local plugins=.gpu-site/.nixl_cu13.mesonpy.libs/plugins
  if [ -d "$plugins" ]; then cp .gpu-peers/libplugin_FABRIC.so "$plugins/"; fi
  ls .gpu-site
}

run() {
  local out=$1
  shift
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
  install) install "$2" ;;
  run) shift; run "$@" ;;
  *) sed -n 2,14p "$0"; exit 2 ;;
esac
