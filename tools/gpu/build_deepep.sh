#!/bin/bash
# Builds DeepEP's intranode kernels on a GPU machine, as a benchmark baseline only (never part of
# this project): from the repository root, with DeepEP's public source (tag v1.2.1, commit
# 9af0e0d0e74f3577af1979c9b9e1ac2cad0104ee) exported beforehand into the git-ignored
# .baselines/DeepEP, e.g. on a machine with network access:
#   mkdir -p .baselines/DeepEP && git -C <a clone of github.com/deepseek-ai/DeepEP> archive v1.2.1 |
#     tar -x -C .baselines/DeepEP
# The build leaves NVSHMEM out (intranode kernels only: what an EP2 run over NVLink uses), for
# sm_90, with the machine's torch. The package (deep_ep/ and deep_ep_cpp*.so) goes to
# $OUT/deepep-build.tgz; unpacked into .baselines/deepep-build and put on PYTHONPATH,
# bench/ep_bench.py adds DeepEP's rows to its table (tools/gpu/run_ep.sh does so when the
# folder is there). Bounded by SECONDS_LIMIT (default 540).
set -u
SRC=.baselines/DeepEP
[ -f "$SRC/setup.py" ] || { echo "no $SRC/setup.py: export DeepEP v1.2.1 there first"; exit 1; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
work=/tmp/deepep-src
rm -rf "$work" && cp -r "$SRC" "$work"
# Intranode only: DeepEP's setup.py builds without NVSHMEM when it finds none; the machine has
# the NVSHMEM wheel, so the lookup is turned off in this scratch copy.
sed -i "s/^    nvshmem_dir = os.getenv('NVSHMEM_DIR', None)$/    nvshmem_dir = None; os.environ.pop('NVSHMEM_DIR', None)/; s/^            nvshmem_dir = importlib.util.find_spec(\"nvidia.nvshmem\").submodule_search_locations\[0\]$/            raise ModuleNotFoundError('NVSHMEM left out')/" "$work/setup.py"
# Its sm_90 build compiles relocatable device code (-rdc=true); without NVSHMEM's device link
# step the objects still need one of their own.
sed -i "s/^    nvcc_dlink = \[\]$/    nvcc_dlink = ['-dlink']/" "$work/setup.py"
grep -q "NVSHMEM left out" "$work/setup.py" && grep -q "nvcc_dlink = \['-dlink'\]" "$work/setup.py" ||
  { echo "setup.py changed: the NVSHMEM switch or the device link did not apply"; exit 1; }
cd "$work"
start=$(date +%s)
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16} timeout -k 10 "${SECONDS_LIMIT:-540}" \
  python3 setup.py build_ext --inplace >/tmp/deepep-build.log 2>&1
rc=$?
echo "build exit $rc after $(($(date +%s) - start)) s"; tail -5 /tmp/deepep-build.log
ls deep_ep_cpp*.so >/dev/null 2>&1 || exit 1
python3 -c "import sys; sys.path.insert(0, '.'); import deep_ep; print('deep_ep imports; sm90:', deep_ep.Buffer.is_sm90_compiled())" || exit 1
mkdir -p /tmp/deepep-build && cp -r deep_ep deep_ep_cpp*.so /tmp/deepep-build/
tar czf "${OUT:-/tmp}/deepep-build.tgz" -C /tmp deepep-build && ls -la "${OUT:-/tmp}/deepep-build.tgz"
