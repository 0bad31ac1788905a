#!/usr/bin/env bash
# On a GPU host: builds Abseil, NIXL (with CUDA) and the FABRIC plugin from hand-carried sources
# (tools/nixl/build_nixl.sh), then runs NIXL's tests over the plugin and the VRAM check:
#
#   NIXL_SRC=/path/to/nixl ABSL_SRC=/path/to/abseil-cpp tools/nixl/run_gpu.sh
#
#   PROVIDERS  the engine's providers (default "tcp shm")
#   PYTHON     the interpreter with torch (CUDA) for the Python parts (default python3)
#
# Prints one line per run; logs in .nixl/logs. Exit non-zero if any run failed.
set -uo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${NIXL_WORK:-$repo/.nixl}
providers=${PROVIDERS:-tcp shm}
python=${PYTHON:-python3}
export PYTHON=$python

STEPS=${STEPS:-deps absl nixl plugin} "$repo/tools/nixl/build_nixl.sh" || exit 1
failed=0
PROVIDERS=$providers "$repo/tools/nixl/run_nixl_tests.sh" gtest pytest plugin || failed=1

# shellcheck disable=SC1091
source "$work/env.sh"
"$python" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.cuda.is_available(),
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
for p in $providers; do
  log=$work/logs/vram-$p.log
  FABRIC_PROVIDER=$p NIXL_LOG_LEVEL=INFO timeout 300 "$python" \
    "$repo/plugins/nixl/tests/vram_two_process.py" >"$log" 2>&1
  rc=$?
  verdict=PASS
  [ $rc -eq 0 ] || { verdict=FAIL; failed=1; }
  printf '%-34s %s  (%s)\n' "vram_two_process.py ($p)" "$verdict" "$log"
  grep -E '^(initiator|target):' "$log" | sed 's/^/    /'
done
exit $failed
