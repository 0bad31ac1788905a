#!/usr/bin/env bash
# make bench-peers: fabric-lib beside its peer transfer engines, over TCP loopback, one system
# after another (bench/peers/peers.py). Usage: bench/peers/run.sh [OUT_DIR] [peers.py options]
# OUT_DIR defaults to build/bench-peers. Installs bench/peers/requirements.txt into .venv, which
# tests/e2e/vllm/setup_venv.sh makes (NIXL's wheel, torch); the FABRIC plugin must be installed
# beside the wheel's plugins (tools/nixl/build_wheel_plugin.sh .venv), else that row says why.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv}
if [[ ! -x $VENV/bin/python ]]; then
  echo "bench-peers: $VENV is missing: run tests/e2e/vllm/setup_venv.sh first" >&2
  exit 2
fi
# Pinned and without a resolver, as tests/e2e/vllm/setup_venv.sh installs; downloads cached in
# the environment's folder only.
PIP_CACHE_DIR=$VENV/.pip-cache "$VENV/bin/pip" install --quiet --disable-pip-version-check \
  --no-deps -r bench/peers/requirements.txt
exec "$VENV/bin/python" bench/peers/peers.py "$@"
