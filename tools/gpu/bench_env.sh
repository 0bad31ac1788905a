# Sourced by the CPU benchmark scripts of tools/gpu/: the bundle's binaries and libraries first
# on the paths, the output folder $out (from $OUT, else the default given as $1) made, and the
# host's CPU count recorded there.
export LD_LIBRARY_PATH=$PWD/.gpu/lib:${LD_LIBRARY_PATH:-}
export PATH=$PWD/.gpu/bin:$PATH
out=${OUT:-$1}
mkdir -p "$out"
nproc >"$out/nproc.txt"
