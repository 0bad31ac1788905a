#!/usr/bin/env bash
# Packs what a GPU host without NIXL needs to judge the FABRIC plugin into .nixl/gpu/
# (git-ignored), from what tools/nixl/build_nixl.sh built here (NIXL with CUDA, since nvcc is
# present): NIXL's and Abseil's shared libraries, the plugin, NIXL's gtest binary, the C++ VRAM
# check, the Debian libraries fabric-lib needs that Ubuntu 24.04 lacks, and run.sh. Then, on the
# GPU host, from the repository root: `bash .nixl/gpu/run.sh` (prints one line per run), and
# the benchmark as said above env.sh below.
# NIXL's Python module is not carried: it is built for this machine's Python (3.11); a host
# with another Python builds NIXL itself (tools/nixl/run_gpu.sh) for vram_two_process.py.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${NIXL_WORK:-$repo/.nixl}
out=$work/gpu
rm -rf "$out" && mkdir -p "$out/lib/plugins" "$out/bin"
libdir=$(dirname "$(find "$work/prefix" -name libnixl.so -print -quit)")
cp -L "$libdir"/*.so* "$out/lib/"
[ "$libdir" = "$work/prefix/lib" ] || cp -L "$work/prefix/lib"/libabsl_*.so* "$out/lib/"
cp "$work/fabric-build/plugins/nixl/libplugin_FABRIC.so" "$out/lib/plugins/"
cp "$work/fabric-build/bin/fabric-nixl-vram-check" "$work/nixl-build/test/gtest/gtest" \
  "$work/nixlbench-build/nixlbench" "$work/fabric-build/bin/fabric-bench" "$out/bin/"
strip "$out/lib/plugins/libplugin_FABRIC.so" "$out/bin/"* "$out/lib/"libnixl*.so* 2>/dev/null || true
for l in libhwloc.so.15 libspdlog.so.1.10 libfmt.so.9 libtomlplusplus.so.3 libgflags.so.2.2; do cp "/lib/x86_64-linux-gnu/$l" "$out/lib/"; done
# For tools/nixl/bench_nixl.sh there: NIXL_ENV=.nixl/gpu/env.sh NIXLBENCH=.nixl/gpu/bin/nixlbench
# FABRIC_BENCH=.nixl/gpu/bin/fabric-bench tools/nixl/bench_nixl.sh
cat >"$out/env.sh" <<'ENV'
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LD_LIBRARY_PATH=$here/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NIXL_PLUGIN_DIR=$here/lib/plugins
ENV
cat >"$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# On the GPU host, from the repository root: NIXL's TestTransfer for FABRIC (with a CUDA device
# its remoteMDFromSocket test moves VRAM) and the two-process VRAM check, over tcp and shm.
here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH=$here/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NIXL_PLUGIN_DIR=$here/lib/plugins NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-INFO}
out=${OUT:-/tmp/nixl-gpu}
mkdir -p "$out"
nvidia-smi -L
failed=0
for p in ${PROVIDERS:-tcp shm}; do
  FABRIC_PROVIDER=$p timeout 600 "$here/bin/gtest" --gtest_filter='fabric*/TestTransfer.*' \
    >"$out/gtest-$p.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || failed=1
  echo "gtest TestTransfer ($p): exit $rc $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/gtest-$p.log" | tr '\n' ' ')"
  grep -E 'FABRIC: agent|remoteMDFromSocket|VRAM|^\[  FAILED' "$out/gtest-$p.log" | head -6 | sed 's/^/    /'
  FABRIC_PROVIDER=$p timeout 300 "$here/bin/fabric-nixl-vram-check" >"$out/vram-$p.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || failed=1
  echo "fabric-nixl-vram-check ($p): exit $rc"
  grep -E '^(initiator|target)|FABRIC:|SKIPPED' "$out/vram-$p.log" | head -12 | sed 's/^/    /'
done
exit $failed
RUN
chmod +x "$out/run.sh"
du -sh "$out"
