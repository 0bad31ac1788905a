#!/usr/bin/env bash
# Makes (or checks) the virtual environment of the vLLM end-to-end run from requirements.txt:
# Debian's python3, every package pinned, nothing in the system Python. A second run with the
# same requirements does nothing. Downloads are cached inside the environment's folder only.
#
#   tests/e2e/vllm/setup_venv.sh [VENV]     (default <repo>/.venv, git-ignored)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
venv=${1:-$repo/.venv}
lock=$here/requirements.txt
want=$(sha256sum "$lock" | cut -d' ' -f1)
stamp=$venv/.requirements.sha256
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "venv: $venv is up to date with $(basename "$lock")"
  exit 0
fi
python=/usr/bin/python3
"$python" -c 'import ensurepip, venv' 2>/dev/null || {
  echo "venv: $python has no venv module: apt-get install python3-venv (make deps does)" >&2
  exit 2
}
start=$(date +%s)
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
export PIP_CACHE_DIR=$venv/.pip-cache PIP_DISABLE_PIP_VERSION_CHECK=1
"$venv/bin/python" -m pip install -q --no-deps --no-compile -r "$lock"
# The set is installed without a resolver (see requirements.txt): import what the run uses.
"$venv/bin/python" -c 'import torch, vllm, nixl._api, aiohttp, transformers, tokenizers'
echo "$want" >"$stamp"
echo "venv: $venv made from $(basename "$lock") in $(($(date +%s) - start)) s ($(du -sh "$venv" | cut -f1))"
