#!/usr/bin/env bash
# The FABRIC plugin in NIXL's Python wheel: builds and installs it (tools/nixl/build_wheel_plugin.sh,
# nothing to do when it is current), then runs plugins/nixl/tests with the wheel's Python once per
# provider, with NIXL_PLUGIN_DIR unset so that NIXL loads FABRIC and UCX from the wheel's own
# plugin folder.
#
#   tools/nixl/run_wheel_tests.sh [VENV]      (the ctest nixl_wheel, label nixl)
#
#   VENV       as build_wheel_plugin.sh: default $FABRIC_NIXL_VENV, else <repo>/.venv
#   PROVIDERS  the engine's providers to run over (default "tcp shm"; FABRIC_PROVIDER per run)
#   PYTEST_ARGS  extra pytest arguments (e.g. -k two_processes)
#
# Prints one line per provider and exits non-zero if one failed; 77 (skipped) with the reason
# when the build script skips, or the virtual environment has no pytest. Logs in
# build-nixl-wheel/logs (BUILD_DIR/logs).
set -uo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${1:-${FABRIC_NIXL_VENV:-$repo/.venv}}
build=${BUILD_DIR:-$repo/build-nixl-wheel}
providers=${PROVIDERS:-tcp shm}
logs=$build/logs

"$repo/tools/nixl/build_wheel_plugin.sh" "$venv"
rc=$?
[ $rc -eq 0 ] || exit $rc
python=$venv/bin/python
"$python" -c 'import pytest' 2>/dev/null ||
  { echo "SKIPPED: pytest is not installed in $venv ($python -m pip install pytest)"; exit 77; }

mkdir -p "$logs"
failed=0
for p in $providers; do
  log=$logs/plugin-tests-$p.log
  # shellcheck disable=SC2086
  (cd "$repo" && env -u NIXL_PLUGIN_DIR -u PYTHONPATH FABRIC_PROVIDER="$p" timeout 900 \
    "$python" -m pytest -q -rs -p no:cacheprovider -W ignore::pytest.PytestConfigWarning plugins/nixl/tests ${PYTEST_ARGS:-}) \
    >"$log" 2>&1
  status=$?
  verdict=PASS
  [ $status -eq 0 ] || { verdict=FAIL; failed=1; }
  printf '%-34s %s  %s  (%s)\n' "plugins/nixl/tests, wheel ($p)" "$verdict" "$(tail -1 "$log")" "$log"
  [ $status -eq 0 ] || tail -n 40 "$log"
done
exit $failed
