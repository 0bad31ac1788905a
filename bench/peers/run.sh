#!/usr/bin/env bash
# make bench-peers: fabric-lib beside its peer transfer engines, over TCP loopback and same-host
# paths, one system after another (bench/peers/peers.py). Usage:
#   bench/peers/run.sh [OUT_DIR] [peers.py options]     (OUT_DIR: default build/bench-peers)
# Makes .venv when it is missing (tests/e2e/vllm/setup_venv.sh: NIXL's wheel, torch) and adds
# bench/peers/requirements.txt; builds the FABRIC plugin for the wheel's NIXL when NIXL's
# headers are there (tools/nixl/build_wheel_plugin.sh, docs/nixl.md), else the NIXL FABRIC rows
# say why they did not run.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv}
if [[ ! -x $VENV/bin/python ]]; then
  echo "bench-peers: making $VENV (tests/e2e/vllm/setup_venv.sh)"
  bash tests/e2e/vllm/setup_venv.sh
fi
# Pinned and without a resolver, as tests/e2e/vllm/setup_venv.sh installs; downloads cached in
# the environment's folder only.
PIP_CACHE_DIR=$VENV/.pip-cache "$VENV/bin/pip" install --quiet --disable-pip-version-check \
  --no-deps -r bench/peers/requirements.txt
# The plugin for the wheel's NIXL: rebuilt only where its sources changed.
if [[ -e ${NIXL_SRC:-.nixl/src/nixl}/src/api/cpp/backend/backend_engine.h ]]; then
  bash tools/nixl/build_wheel_plugin.sh "$VENV"
else
  echo "bench-peers: no NIXL headers in ${NIXL_SRC:-.nixl/src/nixl}: the wheel gets no FABRIC" \
    "plugin, its rows say so (docs/nixl.md: fetching the headers)"
fi
exec "$VENV/bin/python" bench/peers/peers.py "$@"
