#!/usr/bin/env bash
# Builds Abseil and NVIDIA NIXL (with its tests and nixlbench) outside the fabric-lib tree, from
# source trees fetched by hand, into a git-ignored work folder; then the FABRIC plugin against
# them. Nothing of NIXL is committed: its sources are copied into the work folder and patched
# there (see patch_nixl_copy below).
#
#   NIXL_SRC=/path/to/nixl ABSL_SRC=/path/to/abseil-cpp tools/nixl/build_nixl.sh
#
#   NIXL_SRC   a NIXL source tree (github.com/ai-dynamo/nixl, tag v1.4.0 is what was tested)
#   ABSL_SRC   an abseil-cpp source tree (github.com/abseil/abseil-cpp, tag 20250814.1)
#   NIXL_WORK  work folder (default: <repo>/.nixl, git-ignored)
#   JOBS       parallel build jobs (default 2)
#   NIXL_CUDA  auto (default): NIXL is built with CUDA when meson finds it; off: without
#   STEPS      which steps to run, in order (default "deps absl nixl nixlbench plugin")
#
# Needs (Debian 12): meson ninja-build g++ pkg-config libgtest-dev libgmock-dev pybind11-dev
# python3-dev libgflags-dev libasio-dev libtomlplusplus-dev (the "deps" step installs them with
# apt-get when it runs as root and they are missing).
#
# Results: $NIXL_WORK/prefix (Abseil and NIXL installed, libnixl.so, plugins/),
# $NIXL_WORK/nixl-build (NIXL's build: test/gtest/gtest), $NIXL_WORK/nixlbench-build/nixlbench,
# $NIXL_WORK/fabric-build (fabric-lib configured with FABRIC_NIXL_ROOT: libplugin_FABRIC.so),
# and $NIXL_WORK/env.sh to source before running anything against them.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
: "${NIXL_SRC:?set NIXL_SRC to a NIXL source tree (github.com/ai-dynamo/nixl)}"
: "${ABSL_SRC:?set ABSL_SRC to an abseil-cpp source tree (github.com/abseil/abseil-cpp)}"
NIXL_SRC=$(cd "$NIXL_SRC" && pwd)
ABSL_SRC=$(cd "$ABSL_SRC" && pwd)
work=${NIXL_WORK:-$repo/.nixl}
jobs=${JOBS:-2}
steps=${STEPS:-deps absl nixl nixlbench plugin}
prefix=$work/prefix
shims=$work/shims
mkdir -p "$work" "$shims/include/toml++" "$shims/pkgconfig"
[ -f "$NIXL_SRC/meson.build" ] || { echo "NIXL_SRC=$NIXL_SRC holds no meson.build" >&2; exit 2; }
[ -f "$ABSL_SRC/CMakeLists.txt" ] || { echo "ABSL_SRC=$ABSL_SRC holds no CMakeLists.txt" >&2; exit 2; }

log() { printf '== %s: %s\n' "$(date -u +%H:%M:%S)" "$*"; }
# NIXL's libraries land under lib/ or lib/x86_64-linux-gnu depending on meson's defaults.
nixl_libdir() { dirname "$(find "$prefix" -name libnixl.so -print -quit)"; }

step_deps() {
  local pkgs=(meson ninja-build g++ pkg-config libgtest-dev libgmock-dev pybind11-dev python3-dev
    libgflags-dev libasio-dev libtomlplusplus-dev)
  local missing=()
  for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -eq 0 ]; then return; fi
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing Debian packages: ${missing[*]} (install them, then run again)" >&2
    exit 2
  fi
  log "apt-get install ${missing[*]}"
  apt-get install -y -q "${missing[@]}" >/dev/null
}

step_absl() {
  if [ -f "$prefix/lib/pkgconfig/absl_log.pc" ]; then log "Abseil already in $prefix"; return; fi
  log "Abseil from $ABSL_SRC"
  cmake -S "$ABSL_SRC" -B "$work/absl-build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_INSTALL_LIBDIR=lib \
    -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DABSL_PROPAGATE_CXX_STD=ON -DCMAKE_CXX_STANDARD=20 \
    -DBUILD_SHARED_LIBS=ON -DABSL_BUILD_TESTING=OFF -DABSL_ENABLE_INSTALL=ON >/dev/null
  nice -n 10 cmake --build "$work/absl-build" -j "$jobs"
  cmake --install "$work/absl-build" >/dev/null
}

# Debian 12 lacks three things NIXL's meson wants: toml++/toml.hpp (Debian ships toml.h), a
# pkg-config file for asio (header-only), and taskflow (only the GDS_MT plugin, not built here,
# uses it). Shims for those missing, in the work folder.
step_shims() {
  rm -f "$shims/include/toml++/toml.hpp" "$shims/pkgconfig/asio.pc" "$shims/pkgconfig/taskflow.pc"
  if [ ! -f /usr/include/toml++/toml.hpp ] && [ -f /usr/include/toml++/toml.h ]; then
    echo '#include <toml++/toml.h>' >"$shims/include/toml++/toml.hpp"
  fi
  if ! pkg-config --exists asio; then
    cat >"$shims/pkgconfig/asio.pc" <<PC
Name: asio
Description: header-only asio (Debian libasio-dev)
Version: 1.22.1
Cflags:
PC
  fi
  if ! pkg-config --exists taskflow; then
    cat >"$shims/pkgconfig/taskflow.pc" <<PC
Name: taskflow
Description: empty: no plugin built here uses it
Version: 3.6.0
Cflags:
PC
  fi
}

# The scratch copy of NIXL that is built: NIXL_SRC stays untouched. The patches only name the
# FABRIC backend where NIXL hard-codes its list, plus one missing include.
patch_nixl_copy() {
  local dst=$1
  # test/gtest/configuration.cpp uses std::ofstream without <fstream> (fails with g++ 12).
  grep -q '#include <fstream>' "$dst/test/gtest/configuration.cpp" ||
    sed -i 's|#include <limits>|#include <fstream>\n#include <limits>|' \
      "$dst/test/gtest/configuration.cpp"
  # TestTransfer instantiated for FABRIC, with and without NIXL's progress thread (inside the
  # file's namespace: next to UCX's lines).
  local tt=$dst/test/gtest/test_transfer.cpp
  grep -q '"FABRIC"' "$tt" || sed -i '/^NIXL_INSTANTIATE_TEST(ucx_no_pt, TestTransfer, "UCX"/a\
NIXL_INSTANTIATE_TEST(fabric, TestTransfer, "FABRIC", true, 2, 0, "");\
NIXL_INSTANTIATE_TEST(fabric_no_pt, TestTransfer, "FABRIC", false, 2, 0, "");\
NIXL_INSTANTIATE_TEST(fabric_telemetry, TestTransferTelemetry, "FABRIC", true, 2, 0, "");\
NIXL_INSTANTIATE_TEST(fabric_telemetry_no_pt, TestTransferTelemetry, "FABRIC", false, 2, 0, "");' "$tt"
  grep -q '"FABRIC"' "$tt" || { echo "could not add FABRIC to $tt" >&2; exit 1; }
  # nixlbench accepts only the backends it lists (twice: the check, and the parameters).
  local worker=$dst/benchmark/nixlbench/src/worker/nixl/nixl_worker.cpp
  grep -q 'compare("FABRIC") ||' "$worker" ||
    sed -i 's|0 == xferBenchConfig::backend.compare(XFERBENCH_BACKEND_UCCL) \|\||&\n        0 == xferBenchConfig::backend.compare("FABRIC") \|\||' "$worker"
  grep -q 'compare("FABRIC")) {' "$worker" ||
    sed -i 's|^    } else if (0 == xferBenchConfig::backend.compare(XFERBENCH_BACKEND_AZURE_BLOB)) {|    } else if (0 == xferBenchConfig::backend.compare("FABRIC")) {\n        std::cout << "FABRIC backend" << std::endl;\n&|' "$worker"
  [ "$(grep -c 'compare("FABRIC")' "$worker")" -eq 2 ] ||
    { echo "could not add FABRIC to $worker" >&2; exit 1; }
}

nixl_env() {
  export PKG_CONFIG_PATH=$prefix/lib/pkgconfig:$shims/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export CPLUS_INCLUDE_PATH=$shims/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}
  export LD_LIBRARY_PATH=$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  if [ "${NIXL_CUDA:-auto}" = off ]; then export CUDA_HOME=/nonexistent; fi
}

step_nixl() {
  step_shims
  nixl_env
  log "NIXL: scratch copy of $NIXL_SRC"
  rm -rf "$work/nixl-src"
  cp -a "$NIXL_SRC" "$work/nixl-src"
  patch_nixl_copy "$work/nixl-src"
  if [ ! -f "$work/nixl-build/build.ninja" ]; then
    # debug: NIXL builds its gtest binary only then. POSIX: the smallest plugin, so that the
    # plugin directory exists and the loader's paths are exercised.
    meson setup "$work/nixl-build" "$work/nixl-src" -Dbuildtype=debug -Denable_plugins=POSIX \
      -Dbuild_examples=false -Dwith_trace=false -Dwrap_mode=nodownload -Dprefix="$prefix" \
      -Dlibdir=lib -Dwerror=false
  fi
  log "NIXL: build (-j$jobs)"
  nice -n 10 ninja -C "$work/nixl-build" -j "$jobs"
  ninja -C "$work/nixl-build" install >/dev/null
}

step_nixlbench() {
  nixl_env
  patch_nixl_copy "$work/nixl-src"
  if [ ! -f "$work/nixlbench-build/build.ninja" ]; then
    meson setup "$work/nixlbench-build" "$work/nixl-src/benchmark/nixlbench" \
      -Dbuildtype=release -Dnixl_path="$prefix" -Dlibdir=lib -Dwrap_mode=nodownload
  fi
  log "nixlbench: build"
  nice -n 10 ninja -C "$work/nixlbench-build" -j "$jobs"
}

# fabric-lib with the plugin, in its own build folder so that the main build stays untouched.
step_plugin() {
  nixl_env
  log "fabric-lib + plugin against $prefix"
  cmake -S "$repo" -B "$work/fabric-build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DFABRIC_NIXL_ROOT="$prefix" -DFABRIC_BUILD_TESTS=OFF -DFABRIC_BUILD_PYTHON=OFF >/dev/null
  if [ -n "${FABRIC_BUILD_LOCK:-}" ]; then
    flock "$FABRIC_BUILD_LOCK" nice -n 10 cmake --build "$work/fabric-build" -j "$jobs" \
      --target plugin_FABRIC fabric-bench
  else
    nice -n 10 cmake --build "$work/fabric-build" -j "$jobs" --target plugin_FABRIC fabric-bench
  fi
  local libdir pydir
  libdir=$(nixl_libdir)
  # nixl_cu<N> is the installed module; the "nixl" meta package (not built: it needs uv) only
  # re-exports it, so its sources are used as they are.
  pydir=$(dirname "$(dirname "$(find "$prefix" -name _api.py -path '*nixl_cu*' -print -quit)")")
  cat >"$work/env.sh" <<ENV
# Source before running NIXL against the FABRIC plugin built by tools/nixl/build_nixl.sh.
export LD_LIBRARY_PATH=$libdir:$prefix/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
export NIXL_PLUGIN_DIR=$work/fabric-build/plugins/nixl
export PYTHONPATH=$pydir:$work/nixl-src/src/bindings/python/nixl-meta\${PYTHONPATH:+:\$PYTHONPATH}
ENV
  log "plugin: $work/fabric-build/plugins/nixl/libplugin_FABRIC.so; source $work/env.sh"
}

main() {
  for s in $steps; do "step_$s"; done
}
main
