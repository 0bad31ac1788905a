#!/bin/bash
# On the GPU machine (a quiet many-core host), from the repository root, after
# tools/gpu/bundle.sh: fabric-bench with its baselines over tcp and shm, the results written to
# $OUT (or bench/results/gpu-host, a scratch folder: a run worth keeping goes into
# bench/results/<date>_<commit>_<hardware>/, bench/results/README.md). FABRIC_BENCH_CPUS (e.g.
# 0,1) pins every process to those CPUs, to compare with a machine of that many cores. Extra
# arguments go to fabric-bench.
export LD_LIBRARY_PATH=$PWD/.gpu/lib:$LD_LIBRARY_PATH
export PATH=$PWD/.gpu/bin:$PATH
export UCX_MODULE_DIR=$PWD/.gpu/lib/ucx
if ! command -v ip >/dev/null && [ -x .gpu/ip/ip ]; then
  mkdir -p .gpu/ip/bin
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$PWD/.gpu/ip/lib" "$PWD/.gpu/ip/ip" >.gpu/ip/bin/ip
  chmod +x .gpu/ip/bin/ip
  export PATH=$PATH:$PWD/.gpu/ip/bin
fi
out=${OUT:-bench/results/gpu-host}
mkdir -p "$out"
pin=()
[ -n "${FABRIC_BENCH_CPUS:-}" ] && pin=(taskset -c "$FABRIC_BENCH_CPUS")
for p in ${BENCH_PROVIDERS:-tcp shm}; do
  echo "== fabric-bench --provider $p $* (cpus: ${FABRIC_BENCH_CPUS:-all $(nproc)}) =="
  timeout -k 10 560 "${pin[@]}" fabric-bench --provider "$p" --json "$out/$p.json" \
    --markdown "$out/$p.md" "$@" 2>&1 | grep -v '^\[' | tail -60
done
