#!/usr/bin/env bash
# Builds libplugin_FABRIC.so for NVIDIA NIXL's Python wheel (pip's nixl, as vLLM's NixlConnector
# uses it) and installs it beside the wheel's own plugins, so that NIXL finds UCX and FABRIC with
# no NIXL_PLUGIN_DIR (docs/nixl.md, "NIXL's Python wheel").
#
#   tools/nixl/build_wheel_plugin.sh [VENV]
#
#   VENV       a virtual environment with nixl installed (default $FABRIC_NIXL_VENV, else
#              <repo>/.venv)
#   NIXL_SRC   NIXL's source tree of the wheel's version, for its headers: the wheel has none
#              (default <repo>/.nixl/src/nixl; git clone -b v1.4.0 https://github.com/ai-dynamo/nixl)
#   ABSL_SRC   abseil-cpp's source tree, for its headers (default <repo>/.nixl/src/abseil-cpp;
#              git clone -b 20250814.1 https://github.com/abseil/abseil-cpp)
#   NIXL_WHEEL_PKG  the wheel's package folder (default: the one `import nixl` picks, nixl_cu13
#              or nixl_cu12)
#   BUILD_DIR  the build tree (default <repo>/build-nixl-wheel: fabric-lib and the plugin only)
#   JOBS       parallel build jobs (default 2)
#
# Exits 77 after a line "SKIPPED: <reason>" when something it needs is missing (ctest's
# SKIP_RETURN_CODE). A second run with nothing changed configures nothing, builds nothing and
# leaves the installed file as it is.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${1:-${FABRIC_NIXL_VENV:-$repo/.venv}}
nixl_src=${NIXL_SRC:-$repo/.nixl/src/nixl}
absl_src=${ABSL_SRC:-$repo/.nixl/src/abseil-cpp}
build=${BUILD_DIR:-$repo/build-nixl-wheel}
jobs=${JOBS:-2}

skip() {
  echo "SKIPPED: $*"
  exit 77
}

python=$venv/bin/python
[ -x "$python" ] || skip "no virtual environment with NIXL's wheel at $venv (give one: \
$0 VENV, or FABRIC_NIXL_VENV=VENV; python3 -m venv VENV && VENV/bin/pip install nixl==1.4.0)"
pkg=${NIXL_WHEEL_PKG:-$("$python" -c 'import os, nixl._api; print(os.path.dirname(nixl._api.__file__))' \
  2>/dev/null)} || pkg=
{ [ -n "$pkg" ] && [ -d "$pkg" ]; } || skip "NIXL's wheel is not importable with $python \
($python -m pip install nixl==1.4.0)"
[ -f "$nixl_src/meson.build" ] || skip "no NIXL source tree at NIXL_SRC=$nixl_src: the wheel \
carries no headers (git clone -b v1.4.0 https://github.com/ai-dynamo/nixl $nixl_src)"
[ -f "$absl_src/absl/log/log.h" ] || skip "no abseil-cpp source tree at ABSL_SRC=$absl_src: \
NIXL's headers include Abseil's (git clone -b 20250814.1 https://github.com/abseil/abseil-cpp \
$absl_src)"
# Physical paths: one configuration whichever symbolic link to the venv or sources was given.
pkg=$(cd -P "$pkg" && pwd)
nixl_src=$(cd -P "$nixl_src" && pwd)
absl_src=$(cd -P "$absl_src" && pwd)

mkdir -p "$build"
# One build of this tree at a time (the ctest nixl_wheel and a hand-run may meet).
exec 9>"$build/.build.lock"
flock 9

# Configured once per set of arguments; later runs leave it to ninja, which re-runs CMake when a
# CMakeLists.txt or a copied NIXL header changed.
args=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG"
  -DFABRIC_NIXL_WHEEL="$pkg" -DFABRIC_NIXL_SRC="$nixl_src" -DFABRIC_ABSL_INCLUDE_DIR="$absl_src"
  -DFABRIC_BUILD_TESTS=OFF -DFABRIC_BUILD_TOOLS=OFF -DFABRIC_BUILD_PYTHON=OFF)
stamp=$build/.configured-with
if [ ! -f "$build/build.ninja" ] || [ "$(cat "$stamp" 2>/dev/null)" != "${args[*]}" ]; then
  rm -f "$stamp"
  out=$(cmake -S "$repo" -B "$build" "${args[@]}" 2>&1) ||
    { echo "$out" >&2; echo "configuring $build failed" >&2; exit 1; }
  reason=$(echo "$out" | sed -n 's/^-- NIXL plugin FABRIC: skipped: //p')
  [ -z "$reason" ] || skip "NIXL plugin FABRIC not built for $pkg: $reason"
  echo "$out" | grep '^-- NIXL plugin FABRIC' || true
  echo "${args[*]}" >"$stamp"
fi

if [ -n "${FABRIC_BUILD_LOCK:-}" ]; then
  flock "$FABRIC_BUILD_LOCK" nice -n 10 cmake --build "$build" -j "$jobs" --target plugin_FABRIC
else
  nice -n 10 cmake --build "$build" -j "$jobs" --target plugin_FABRIC
fi
# Beside libplugin_UCX.so: <site-packages>/.nixl_cu<N>.mesonpy.libs/plugins. CMake installs into
# a staging folder (with the installed RPATH); the file is then renamed into place, so that a
# process that has the old one loaded keeps its copy intact.
plugins=$(dirname "$pkg")/.$(basename "$pkg").mesonpy.libs/plugins
DESTDIR=$build/stage cmake --install "$build" --component nixl_wheel >/dev/null
staged=$build/stage$plugins/libplugin_FABRIC.so
if cmp -s "$staged" "$plugins/libplugin_FABRIC.so"; then
  verdict="up to date"
else
  cp "$staged" "$plugins/.libplugin_FABRIC.so.new"
  mv -f "$plugins/.libplugin_FABRIC.so.new" "$plugins/libplugin_FABRIC.so"
  verdict=installed
fi
names=$(find "$plugins" -maxdepth 1 -name 'libplugin_*.so' -printf '%f\n' | sort |
  sed 's/^libplugin_//; s/\.so$//' | tr '\n' ' ')
echo "$verdict: $plugins/libplugin_FABRIC.so (NIXL's plugins there: ${names% })"
if [ -n "${NIXL_PLUGIN_DIR:-}" ] && [ "$(cd "$NIXL_PLUGIN_DIR" 2>/dev/null && pwd)" != "$plugins" ]; then
  echo "note: NIXL_PLUGIN_DIR=$NIXL_PLUGIN_DIR is set: it replaces $plugins, so NIXL loads" \
    "FABRIC (and UCX) only from there; unset it to use this install"
fi
