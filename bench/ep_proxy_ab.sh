#!/bin/bash
# fabric-bench-ep-proxy builds side by side: each NAME=BINARY argument runs, alternately, ROUNDS
# rounds (default 2) of every provider (PROVIDERS, default "shm tcp") and world size (WORLDS,
# default "8 16"), so that all builds share the machine's state. Each run's table lands in
# $OUT/NAME-PROVIDER-wWORLD-rROUND.txt (default OUT=/tmp/ep-proxy-ab) and the table rows on
# stdout. Every run is bounded by `timeout`. Example, this tree's build against an older one:
#   bash bench/ep_proxy_ab.sh before=/tmp/old/fabric-bench-ep-proxy after=build/bin/fabric-bench-ep-proxy
set -u
out=${OUT:-/tmp/ep-proxy-ab}
mkdir -p "$out"
[ $# -gt 0 ] || { echo "usage: $0 NAME=BINARY [NAME=BINARY ...]" >&2; exit 2; }
for round in $(seq 1 "${ROUNDS:-2}"); do
  for p in ${PROVIDERS:-shm tcp}; do
    for w in ${WORLDS:-8 16}; do
      for spec in "$@"; do
        name=${spec%%=*}
        bin=${spec#*=}
        f="$out/$name-$p-w$w-r$round.txt"
        timeout 300 "$bin" --provider "$p" --world "$w" --no-bytes --rounds "${RUNS:-300}" >"$f" 2>&1
        echo "== $name $p world $w round $round (exit $?)"
        grep -E '^\| (dispatch|combine)' "$f"
      done
    done
  done
done
