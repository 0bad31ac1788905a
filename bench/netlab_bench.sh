#!/usr/bin/env bash
# Multi-NIC aggregation on the network-namespace lab (tools/netlab): fabric-bench in namespace
# a, its peer in namespace b, over N veth links of a shaped rate each. Prints aggregate Gbps ÷
# the sum of the links' rates for single writes (1 MiB, 32 MiB) and paged writes (64 KiB
# pages), for N = 1, 2, 4 equal links and two unequal sets (one link at half rate) with
# weighted sharding (the default), equal-4 and the unequal sets again with equal shares
# (FABRIC_WEIGHTED_SHARDING=0), and one unshaped run that shows the CPU is not what limits the
# shaped runs. Writes bench/results/netlab.{md,json}. Needs root. Usage (see `make
# bench-netlab`):
#
#   bench/netlab_bench.sh [RATE_MBIT] [OUT_DIR]      (defaults: 400, bench/results)
#
# NETLAB_ONLY=REGEX runs only the cases whose name matches (e.g. NETLAB_ONLY=unequal).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
netlab="$root/tools/netlab"
bench="$root/build/bin/fabric-bench"
rate=${1:-400}
out=${2:-$root/bench/results}
lab=fabbench
# A jumbo MTU, as RDMA fabrics have: per-packet headers cost 0.7 % of the rate instead of 4 %.
mtu=9000
# Per row: 3 timed passes of 128 MiB after one warm-up (medians reported).
bench_args=(--provider tcp --op single,paged --sizes 1MiB,32MiB --page-sizes 64KiB --pages 100
  --iters 3 --warmup 1 --pass-mib 128 --baseline none)

[ "$(id -u)" = 0 ] || { echo "bench-netlab: needs root (network namespaces)" >&2; exit 1; }
[ -x "$bench" ] || { echo "bench-netlab: $bench missing (make build)" >&2; exit 1; }
[[ "$rate" =~ ^[0-9]+$ ]] || { echo "bench-netlab: RATE_MBIT must be a number" >&2; exit 2; }
work=$(mktemp -d /tmp/bench-netlab.XXXXXX)
trap '"$netlab" down --name "$lab" || true; rm -rf "$work"' EXIT
mkdir -p "$out"

# run NAME RATES [WEIGHTED]: RATES comma-separated in Mbit (one per link; "0" for unshaped
# links); WEIGHTED 1 (default) or 0, Config::weighted_sharding.
run() {
  local name=$1 rates=$2 weighted=${3:-1}
  [[ "$name" =~ ${NETLAB_ONLY:-.} ]] || return 0
  local -a r
  IFS=, read -r -a r <<<"$rates"
  local n=${#r[@]} nics="" shaping=()
  for ((i = 0; i < n; i++)); do nics+="${nics:+,}veth$i"; done
  if [ "${r[0]}" != 0 ]; then
    local spec=""
    for x in "${r[@]}"; do spec+="${spec:+,}${x}mbit"; done
    shaping=(--rates "$spec")
  fi
  "$netlab" down --name "$lab"
  "$netlab" up --name "$lab" --links "$n" --mtu "$mtu" "${shaping[@]}"
  echo "== $name: $n link(s), ${shaping[*]:-unshaped}, weighted sharding $weighted"
  "$netlab" exec --name "$lab" a -- env FABRIC_WEIGHTED_SHARDING="$weighted" \
    "$bench" "${bench_args[@]}" --nic "$nics" \
    --peer-prefix "ip netns exec $lab-b" --json "$work/$name.json" | sed -n '/^single/,$p'
  echo "$name $rates $weighted" >>"$work/runs"
  "$netlab" down --name "$lab"
}

half=$((rate / 2))
run equal-1 "$rate"
run equal-2 "$rate,$rate"
run equal-4 "$rate,$rate,$rate,$rate"
run unequal-2 "$rate,$half"
run unequal-4 "$rate,$rate,$rate,$half"
run equal-4-even "$rate,$rate,$rate,$rate" 0
run unequal-2-even "$rate,$half" 0
run unequal-4-even "$rate,$rate,$rate,$half" 0
run unshaped-4 "0,0,0,0"

/usr/bin/python3 - "$work" "$out" "$rate" "$mtu" "${bench_args[*]}" <<'EOF'
import json, sys, datetime
work, out, rate, mtu, args = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
runs = [line.split() for line in open(f"{work}/runs")]
def label(r):
    if r["op"] == "paged":
        return f"paged {r['page_bytes'] // 1024} KiB x {r['pages']}"
    return f"single {r['bytes'] // (1 << 20)} MiB"
rows = []
for name, rates, weighted in runs:
    mbit = [int(x) for x in rates.split(",")]
    data = json.load(open(f"{work}/{name}.json"))
    for r in data["results"]:
        total = sum(mbit) / 1000.0
        rows.append({
            "run": name, "links": len(mbit), "rates_mbit": mbit, "row": label(r),
            "weighted_sharding": weighted == "1",
            "gbps": r["gbps"], "sum_gbps": total if total else None,
            "ratio": r["gbps"] / total if total else None,
            "n_x_slowest": r["gbps"] / (len(mbit) * min(mbit) / 1000.0) if total else None,
            "verified": r["verified"]})
date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
json.dump({"date": date, "rate_mbit": rate, "mtu": int(mtu), "fabric_bench_args": args,
           "rows": rows}, open(f"{out}/netlab.json", "w"), indent=1)
lines = [f"Aggregation over the netlab (veth links shaped with htb, MTU {mtu}), {date}.",
         f"fabric-bench {args}, median of the timed passes; every pass verified.", "",
         "| links | rates (Mbit) | sharding | row | Gbps | sum of rates Gbps | ratio | Gbps / (N x slowest) |",
         "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]
for r in rows:
    f = lambda v: "-" if v is None else f"{v:.3f}"
    rates = "unshaped" if r["sum_gbps"] is None else "/".join(map(str, r["rates_mbit"]))
    mode = "weighted" if r["weighted_sharding"] else "equal"
    lines.append(f"| {r['links']} | {rates} | {mode} | {r['row']} | {r['gbps']:.3f} | {f(r['sum_gbps'])} "
                 f"| {f(r['ratio'])} | {f(r['n_x_slowest'])} |")
text = "\n".join(lines) + "\n"
open(f"{out}/netlab.md", "w").write(text)
print()
print(text)
EOF
