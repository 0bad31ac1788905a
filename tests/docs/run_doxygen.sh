#!/usr/bin/env bash
# Builds the API reference (docs/api/Doxyfile) into OUT/html; fails on any Doxygen warning.
#   run_doxygen.sh SOURCE_DIR OUT        exit 0: built clean; 1: warnings (printed); 77: no doxygen
set -euo pipefail
src=$1
out=$2
if ! command -v doxygen >/dev/null; then
  echo "skip: doxygen is not installed (make deps installs it)"
  exit 77
fi
rm -rf "$out"
mkdir -p "$out"
rc=0
FABRIC_SOURCE_DIR=$src FABRIC_DOXYGEN_OUT=$out doxygen "$src/docs/api/Doxyfile" || rc=$?
if [ -s "$out/warnings.log" ] || [ "$rc" != 0 ]; then
  cat "$out/warnings.log" 2>/dev/null || true
  echo "doxygen: exit $rc, $(wc -l <"$out/warnings.log" 2>/dev/null || echo '?') warning line(s)"
  exit 1
fi
test -f "$out/html/classfabric_1_1TransferEngine.html"
echo "API reference: $out/html/index.html ($(find "$out/html" -name '*.html' | wc -l) pages)"
