#!/bin/bash
# Builds the fabric_lib Python module on a GPU machine against its python3 and the bundle that
# tools/gpu/bundle.sh made (BUNDLE, default .gpu), into PKG/fabric_lib (made anew):
#
#   bash tools/gpu/build_module.sh PKG [SRC [LIB [SECONDS]]]
#
# SRC: the tree whose python/, include/ and src/ are compiled (default .); LIB: the engine
# library to link (default BUNDLE/libfabriclib.a; an older build's, to measure it beside this
# one); SECONDS: the bound on the compile and on the link, each (default 300). The compiler's
# output goes to PKG.log. Exits non-zero, with the log's tail, when the module does not build or
# import.
set -u
PKG=$1 SRC=${2:-.} BUNDLE=${BUNDLE:-.gpu}
LIB=${3:-$BUNDLE/libfabriclib.a} SECONDS_EACH=${4:-300}
OBJ=$PKG.obj LOG=$PKG.log
rm -rf "$PKG" "$OBJ" "$LOG" && mkdir -p "$PKG/fabric_lib" "$OBJ"
cp "$SRC"/python/fabric_lib/*.py "$SRC"/python/fabric_lib/*.pyi "$SRC"/python/fabric_lib/py.typed "$PKG/fabric_lib/"
EXT=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
FL="-O2 -std=c++20 -fPIC -fvisibility=hidden -DFABRIC_VERSION=\"0.1.0\" -DFABRIC_WITH_CUDA=1 -I$SRC/include -I$SRC/src -I$BUNDLE/include -I/usr/local/cuda/include $(python3 -m pybind11 --includes)"
for f in "$SRC"/python/src/*.cc; do
  timeout -k 10 "$SECONDS_EACH" c++ $FL -c "$f" -o "$OBJ/$(basename "$f").o" >>"$LOG" 2>&1 &
done
wait
# One group: fabric::weights calls fabric::kv's registry; every library calls the engine's.
timeout -k 10 "$SECONDS_EACH" c++ -shared "$OBJ"/*.o -Wl,--start-group "$BUNDLE/libfabricweights.a" \
  "$BUNDLE/libfabricep.a" "$BUNDLE/libfabrickvetcd.a" "$BUNDLE/libfabrickv.a" "$LIB" -Wl,--end-group \
  "$BUNDLE/libcudart_static.a" -L"$BUNDLE/lib" -Wl,--as-needed -l:libfabric.so.1 -Wl,--no-as-needed -l:libibverbs.so.1 \
  -l:libhwloc.so.15 -l:libfmt.so.9 -l:libspdlog.so.1.10 -l:libcurl.so.4 -l:libcrypto.so.3 -lpthread -ldl -lrt \
  -o "$PKG/fabric_lib/_fabric_lib$EXT" >>"$LOG" 2>&1 ||
  { echo "the module did not build ($LOG):"; tail -40 "$LOG"; exit 1; }
PYTHONPATH=$PKG timeout -k 10 30 python3 -c "import fabric_lib, fabric_lib.ep; print('$PKG: fabric_lib', fabric_lib.__version__, 'HAS_CUDA', fabric_lib.HAS_CUDA)"
