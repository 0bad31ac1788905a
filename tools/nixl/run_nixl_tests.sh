#!/usr/bin/env bash
# Runs NIXL's own tests against the FABRIC plugin, with what tools/nixl/build_nixl.sh built:
#
#   tools/nixl/run_nixl_tests.sh [gtest] [pytest] [example] [plugin]   (default: all four)
#
#   gtest     NIXL's TestTransfer (and TestTransferTelemetry) instantiated for FABRIC, with and
#             without NIXL's progress thread, once per provider in PROVIDERS
#   pytest    test/python/test_nixl_api.py --backend FABRIC, once per provider
#   example   examples/python/expanded_two_peers.py --backend FABRIC: two processes, loopback
#   plugin    plugins/nixl/tests: data, notifications, metrics, and bad input through NIXL
#             (unknown agent, unregistered memory, a descriptor outside a registration, a
#             peer that dies mid-transfer) failing the request, never the agent
#
#   PROVIDERS  the engine's providers to run over (default "tcp shm"; FABRIC_PROVIDER per run)
#   NIXL_WORK  the work folder of build_nixl.sh (default <repo>/.nixl)
#   FABRIC_NIXL_PLUGIN_DIR  where libplugin_FABRIC.so is (default: the work folder's build)
#
# Prints one line per run and exits non-zero if any failed; logs in $NIXL_WORK/logs.
set -uo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${NIXL_WORK:-$repo/.nixl}
providers=${PROVIDERS:-tcp shm}
what=${*:-gtest pytest example plugin}
# 77: skipped (ctest's SKIP_RETURN_CODE), nothing to run against.
[ -f "$work/env.sh" ] || { echo "SKIPPED: no $work/env.sh: run tools/nixl/build_nixl.sh first"; exit 77; }
# shellcheck disable=SC1091
source "$work/env.sh"
# FABRIC_NIXL_PLUGIN_DIR: another build of the plugin (ctest's) than the work folder's.
if [ -n "${FABRIC_NIXL_PLUGIN_DIR:-}" ]; then export NIXL_PLUGIN_DIR=$FABRIC_NIXL_PLUGIN_DIR; fi
logs=$work/logs
mkdir -p "$logs"
failed=0
# Debian's python3 has torch and numpy, which NIXL's Python tests need.
python=${PYTHON:-$( [ -x /usr/bin/python3 ] && echo /usr/bin/python3 || echo python3)}

report() {  # name, exit status, log, summary
  local verdict=PASS
  [ "$2" -eq 0 ] || { verdict=FAIL; failed=1; }
  printf '%-34s %s  %s  (%s)\n' "$1" "$verdict" "$4" "$3"
}

run_gtest() {
  local p=$1 log=$logs/gtest-$1.log
  NIXL_LOG_LEVEL=INFO FABRIC_PROVIDER=$p timeout 900 "$work/nixl-build/test/gtest/gtest" \
    --gtest_filter='fabric*/TestTransfer*' >"$log" 2>&1
  local rc=$?
  report "gtest TestTransfer ($p)" $rc "$log" "$(grep -E '^\[  PASSED  \]|^\[  FAILED  \]|tests ran' "$log" | tr '\n' ' ')"
}

run_pytest() {
  local p=$1 log=$logs/pytest-$1.log
  (cd "$work/nixl-src/test/python" && FABRIC_PROVIDER=$p timeout 900 "$python" -m pytest -q \
    -p no:cacheprovider test_nixl_api.py --backend FABRIC) >"$log" 2>&1
  local rc=$?
  report "pytest test_nixl_api.py ($p)" $rc "$log" "$(tail -1 "$log")"
}

# NIXL's examples call torch.set_default_device("cpu") (torch >= 2.0); Debian 12's torch is 1.13.
# A sitecustomize for the example's processes adds it, for "cpu" only, where it is missing.
torch_shim() {
  mkdir -p "$work/torch-shim"
  cat >"$work/torch-shim/sitecustomize.py" <<'PY'
import torch

if not hasattr(torch, "set_default_device"):
    def set_default_device(device):
        if str(device) != "cpu":
            raise RuntimeError(f"torch {torch.__version__} cannot set default device {device}")

    torch.set_default_device = set_default_device
PY
  echo "$work/torch-shim"
}

run_example() {
  local p=$1 log=$logs/example-$1.log
  local port=$((20000 + RANDOM % 20000))
  local shim
  shim=$(torch_shim)
  (
    cd "$work/nixl-src/examples/python" || exit 2
    export FABRIC_PROVIDER=$p PYTHONPATH=$shim:$PYTHONPATH
    timeout 300 "$python" expanded_two_peers.py --mode target --ip 127.0.0.1 --port "$port" \
      --backend FABRIC &
    target=$!
    sleep 2
    timeout 300 "$python" expanded_two_peers.py --mode initiator --ip 127.0.0.1 --port "$port" \
      --backend FABRIC
    i=$?
    wait $target
    t=$?
    echo "initiator exit $i, target exit $t"
    [ $i -eq 0 ] && [ $t -eq 0 ]
  ) >"$log" 2>&1
  local rc=$?
  report "expanded_two_peers.py ($p)" $rc "$log" "$(tail -1 "$log")"
}

run_plugin() {
  local p=$1 log=$logs/plugin-$1.log
  (cd "$repo" && FABRIC_PROVIDER=$p timeout 900 "$python" -m pytest -q -p no:cacheprovider \
    plugins/nixl/tests) >"$log" 2>&1
  local rc=$?
  report "plugins/nixl/tests ($p)" $rc "$log" "$(tail -1 "$log")"
}

for w in $what; do
  for p in $providers; do "run_$w" "$p"; done
done
exit $failed
