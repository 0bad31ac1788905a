#!/bin/bash
# examples/moe_layer.py on a GPU machine, from the repository root, with the bundle that
# tools/gpu/bundle.sh made in BUNDLE (default .gpu; only its static libraries, lib/ and include/
# are used): builds the fabric_lib Python module for that machine's python3 as run_ep.sh does,
# runs the example once per argument set in MOE_RUNS (';'-separated; default: one node and two
# nodes, bf16 and fp8, on FABRIC_EP_TEST_DEVICES, default 0,1), then, with what is left of a
# 200-second budget, tests/python/test_examples_moe.py (MOE_PYTEST_K: its -k; default: all).
# Logs go under OUT (default /tmp/moe-out). On a machine with one GPU:
# FABRIC_EP_TEST_DEVICES=0,0 bash tools/gpu/run_moe_example.sh
# NVLink multicast stays off in every process.
set -u
BUNDLE=${BUNDLE:-.gpu}
OUT=${OUT:-/tmp/moe-out}
D=${FABRIC_EP_TEST_DEVICES:-0,1}
MOE_RUNS=${MOE_RUNS:-"--devices $D;--devices $D --two-nodes;--devices $D --dtype fp8;--devices $D --two-nodes --dtype fp8"}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=$PWD/$BUNDLE/lib:${LD_LIBRARY_PATH:-} PYTHONUNBUFFERED=1
start=$(date +%s)
elapsed() { echo "$(($(date +%s) - start)) s"; }
[ -f "$BUNDLE/libfabriclib.a" ] || { echo "no $BUNDLE/libfabriclib.a: run tools/gpu/bundle.sh first"; exit 1; }
timeout -k 10 30 python3 -c "import torch; print('torch', torch.__version__, 'GPUs', torch.cuda.device_count())"

echo "== build the Python module =="
PKG=/tmp/moe-pkg
bash tools/gpu/build_module.sh "$PKG" . "$BUNDLE/libfabriclib.a" 150 || exit 1
echo "built ($(elapsed))"

status=0
IFS=';' read -ra runs <<< "$MOE_RUNS"
for args in "${runs[@]}"; do
  echo "== examples/moe_layer.py $args ($(elapsed)) =="
  # shellcheck disable=SC2086
  PYTHONPATH=$PKG timeout -k 10 90 python3 examples/moe_layer.py $args 2>&1 | tee -a "$OUT/example.log"
  rc=${PIPESTATUS[0]}
  echo "exit $rc"
  [ "$rc" = 0 ] || status=1
done

left=$((200 - ($(date +%s) - start)))
if [ "$left" -gt 60 ]; then
  echo "== tests/python/test_examples_moe.py ($(elapsed), ${left} s left) =="
  FABRIC_EP_TEST_DEVICES=$D PYTHONPATH=$PKG timeout -k 10 "$left" python3 -m pytest -v -rs \
    -p no:cacheprovider -k "${MOE_PYTEST_K:-}" tests/python/test_examples_moe.py >"$OUT/pytest.log" 2>&1
  echo "pytest exit $?"
  grep -E "PASSED|FAILED|SKIPPED|ERROR|^E " "$OUT/pytest.log" | head -20
  tail -1 "$OUT/pytest.log"
else
  echo "(no time left for the pytest run: ${left} s)"
fi
echo "== done ($(elapsed)) =="
exit $status
