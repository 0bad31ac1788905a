#!/usr/bin/env bash
# Installs fabric-lib from a build directory into a fresh prefix, then builds tests/consumer
# against that copy twice, with find_package(fabric CONFIG) and with pkg-config, and runs both.
#   run.sh BUILD_DIR WORK_DIR
# Exit 0: both built and ran a verified write; 77: tcp cannot be opened here (skip).
set -euo pipefail
build=$1
work=$2
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"
mkdir -p "$work"
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" >"$work/install.log"
echo "installed into $prefix: $(find "$prefix" -type f | wc -l) files"

echo "== find_package(fabric CONFIG) =="
cmake -S "$here" -B "$work/cmake-build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_PREFIX_PATH="$prefix" >"$work/cmake-configure.log"
cmake --build "$work/cmake-build" >"$work/cmake-build.log"
rc=0
"$work/cmake-build/consumer" || rc=$?
[ "$rc" = 77 ] && exit 77
[ "$rc" = 0 ]

echo "== pkg-config fabric =="
export PKG_CONFIG_PATH=$(dirname "$(find "$prefix" -name fabric.pc)")${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
flags=$(pkg-config --cflags --libs fabric)
echo "pkg-config --cflags --libs fabric: $flags"
# shellcheck disable=SC2086
${CXX:-g++} -std=c++20 -Wall -Wextra -Werror "$here/consumer.cc" -o "$work/consumer-pc" $flags
"$work/consumer-pc"
