#!/bin/bash
# rxe-lab: runs a command inside a Debian kernel booted under qemu (software emulation), with
# Soft-RoCE (rdma_rxe) devices on dummy interfaces. The real kernel RDMA stack, on any Debian 12
# machine, without an RDMA NIC, KVM or network access from the guest.
#
#   tools/rxe-lab/run.sh [--nics N] [--timeout S] [--cache DIR] [--file PATH]... \
#                        [--env NAME=VALUE]... -- COMMAND [ARG...]
#
# --nics N      rxe devices rxe0..rxe(N-1), each on its own dummy interface dummyI with address
#               198.18.I.1/24 (default 1)
# --timeout S   wall-clock bound for the whole boot and command (default 300)
# --cache DIR   where the kernel package is downloaded and unpacked, reused between runs
#               (default build/rxe-lab)
# --file PATH   an executable (or any file) the command needs; it lands at the same absolute path
#               in the guest, with debug info stripped and every shared library ldd lists
# --env N=V     an environment variable for the command
#
# What it does (as root on Debian 12): installs qemu-system-x86, busybox-static, rdma-core,
# ibverbs-providers and iproute2 if missing; fetches the linux-image-6.1.0-*-amd64 package that
# linux-image-amd64 depends on with `apt-get download` and unpacks it with `dpkg-deb -x` (never
# installs it); builds an initramfs (busybox as init, the modules, the files, the rxe provider);
# boots it with no network device, so nothing can leave the guest. Inside, it loads dummy,
# crc32_generic, udp_tunnel, ip6_udp_tunnel, ib_core, ib_uverbs and rdma_rxe, creates the
# interfaces and rxe devices, runs COMMAND, prints "RXELAB-RESULT <status>" and powers off.
#
# Exit status: COMMAND's status; 77 when the lab cannot run here (the reason is printed on a
# line starting "RXELAB-SKIP:"); 124 when the timeout struck.
set -euo pipefail

nics=1
timeout_s=300
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache="$script_dir/../../build/rxe-lab"
files=()
envs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --nics) nics=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    --cache) cache=$2; shift 2 ;;
    --file) files+=("$2"); shift 2 ;;
    --env) envs+=("$2"); shift 2 ;;
    --) shift; break ;;
    *) echo "rxe-lab: unknown option '$1' (see the usage at the top of $0)" >&2; exit 2 ;;
  esac
done
if [ $# -eq 0 ]; then
  echo "rxe-lab: no command given (usage: run.sh [options] -- COMMAND [ARG...])" >&2
  exit 2
fi
if ! [[ "$nics" =~ ^[1-8]$ ]]; then
  echo "rxe-lab: --nics must be 1 to 8, not '$nics'" >&2
  exit 2
fi

skip() {
  echo "RXELAB-SKIP: $*"
  exit 77
}

# --- host packages ------------------------------------------------------------------------
need=()
for p in qemu-system-x86 busybox-static rdma-core ibverbs-providers iproute2; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || skip "packages ${need[*]} are missing and this is not root"
  echo "rxe-lab: installing ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" \
    >/dev/null 2>&1 ||
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1 &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${need[@]}" >/dev/null 2>&1; } ||
    skip "cannot install ${need[*]} (apt-get failed)"
fi
command -v qemu-system-x86_64 >/dev/null || skip "qemu-system-x86_64 is not on PATH"

# --- the kernel, downloaded once ----------------------------------------------------------
mkdir -p "$cache" 2>/dev/null && [ -w "$cache" ] || skip "cannot write the cache directory $cache"
cache=$(cd "$cache" && pwd)
kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null |
  sed -n 's/.*Depends: \(linux-image-6\.1\.0-[0-9]*-amd64\)$/\1/p' | head -1)
if [ -z "$kpkg" ]; then
  # No package lists (an offline machine): use what the cache holds.
  kpkg=$(ls "$cache"/linux-image-6.1.0-*-amd64_*.deb 2>/dev/null | head -1 | xargs -r basename |
    sed 's/_.*//')
fi
[ -n "$kpkg" ] || skip "apt knows no linux-image-6.1.0-*-amd64 (run apt-get update)"
kver=${kpkg#linux-image-}
kdir="$cache/$kpkg"
if [ ! -f "$kdir/boot/vmlinuz-$kver" ]; then
  if ! ls "$cache/${kpkg}"_*.deb >/dev/null 2>&1; then
    (cd "$cache" && apt-get download -q "$kpkg" >/dev/null 2>&1) ||
      skip "apt-get download $kpkg failed (offline?)"
  fi
  rm -rf "$kdir.tmp"
  dpkg-deb -x "$(ls "$cache/${kpkg}"_*.deb | head -1)" "$kdir.tmp"
  mv "$kdir.tmp" "$kdir"
fi
kernel="$kdir/boot/vmlinuz-$kver"
moddir="$kdir/lib/modules/$kver"

# --- the initramfs --------------------------------------------------------------------------
root=$(mktemp -d "$cache/root.XXXXXX")
console=$(mktemp "$cache/console.XXXXXX")
cleanup() { rm -rf "$root" "$console" "$root.cpio"; }
trap cleanup EXIT
mkdir -p "$root"/{bin,sbin,dev,proc,sys,tmp,etc,lib/modules,lab}
cp /bin/busybox "$root/bin/busybox"
for applet in sh mount umount insmod sleep cat echo poweroff mkdir ls grep seq env date uname \
  dmesg ps kill cut tr head tail wc sed awk true false test; do
  ln -s busybox "$root/bin/$applet"
done

# A file and the shared libraries it needs, at their own paths.
copy_with_libs() {
  local f=$1 dest="$root$1"
  [ -e "$dest" ] && return 0
  mkdir -p "$(dirname "$dest")"
  cp -L "$f" "$dest"
  if file_is_elf "$f"; then
    objcopy --strip-debug "$dest" 2>/dev/null || true
    local lib
    for lib in $(ldd "$f" 2>/dev/null | awk '/=> \//{print $3} /^\t\//{print $1}'); do
      copy_with_libs "$lib"
    done
  fi
}
file_is_elf() { [ "$(head -c 4 "$1" | od -An -c | tr -d ' ')" = '177ELF' ]; }

copy_with_libs /bin/ip
copy_with_libs /bin/rdma
ibdir=/usr/lib/x86_64-linux-gnu/libibverbs
[ -f "$ibdir/librxe-rdmav34.so" ] || skip "$ibdir/librxe-rdmav34.so is missing (ibverbs-providers)"
copy_with_libs "$ibdir/librxe-rdmav34.so"
mkdir -p "$root/etc/libibverbs.d"
cp /etc/libibverbs.d/rxe.driver "$root/etc/libibverbs.d/"
for f in "${files[@]}"; do
  [ -e "$f" ] || { echo "rxe-lab: --file '$f' does not exist" >&2; exit 2; }
  f=$(realpath "$f")
  copy_with_libs "$f"
done

modules=(drivers/net/dummy crypto/crc32_generic net/ipv4/udp_tunnel net/ipv6/ip6_udp_tunnel
  drivers/infiniband/core/ib_core drivers/infiniband/core/ib_uverbs
  drivers/infiniband/sw/rxe/rdma_rxe)
for m in "${modules[@]}"; do
  name=$(basename "$m")
  if [ -f "$moddir/kernel/$m.ko" ]; then
    cp "$moddir/kernel/$m.ko" "$root/lib/modules/$name.ko"
  elif [ -f "$moddir/kernel/$m.ko.xz" ]; then
    xz -dc "$moddir/kernel/$m.ko.xz" >"$root/lib/modules/$name.ko"
  else
    skip "the kernel package $kpkg has no module $m"
  fi
done

{
  printf 'export %q\n' "${envs[@]}" 2>/dev/null | grep -v "^export ''$" || true
} >"$root/lab/env"
# One argument is a shell script as it is; several are a command and its arguments.
if [ $# -eq 1 ]; then printf '%s\n' "$1"; else printf '%q ' "$@"; fi >"$root/lab/command"

cat >"$root/init" <<EOF
#!/bin/sh
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
echo "RXELAB-BOOTED \$(cat /proc/uptime | cut -d' ' -f1)"
insmod /lib/modules/dummy.ko numdummies=0 || echo "RXELAB-ERROR insmod dummy failed"
for m in crc32_generic udp_tunnel ip6_udp_tunnel ib_core ib_uverbs rdma_rxe; do
  insmod /lib/modules/\$m.ko || echo "RXELAB-ERROR insmod \$m failed"
done
ip link set lo up
i=0
while [ \$i -lt $nics ]; do
  ip link add dummy\$i type dummy
  ip addr add 198.18.\$i.1/24 dev dummy\$i
  ip link set dummy\$i up
  rdma link add rxe\$i type rxe netdev dummy\$i || echo "RXELAB-ERROR rdma link add rxe\$i failed"
  i=\$((i + 1))
done
echo "RXELAB-READY \$(cat /proc/uptime | cut -d' ' -f1)"
. /lab/env
cd /tmp
sh -c "\$(cat /lab/command)"
rc=\$?
echo "RXELAB-RESULT \$rc \$(cat /proc/uptime | cut -d' ' -f1)"
poweroff -f
EOF
chmod +x "$root/init"
(cd "$root" && find . | busybox cpio -o -H newc 2>/dev/null) >"$root.cpio"

# --- boot -----------------------------------------------------------------------------------
start=$(date +%s.%N)
set +e
timeout -k 10 "$timeout_s" qemu-system-x86_64 -accel tcg,thread=multi -cpu max -smp 2 -m 512 \
  -nographic -no-reboot -nic none -kernel "$kernel" -initrd "$root.cpio" \
  -append "console=ttyS0 quiet loglevel=3 panic=-1 rdinit=/init" </dev/null |
  tee "$console"
status=${PIPESTATUS[0]}
set -e
elapsed=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')
if [ "$status" = 124 ] || [ "$status" = 137 ]; then
  echo "rxe-lab: the guest ran past the ${timeout_s}s timeout"
  exit 124
fi
result=$(tr -d '\r' <"$console" | sed -n 's/^RXELAB-RESULT \([0-9]*\) .*/\1/p' | tail -1)
booted=$(tr -d '\r' <"$console" | sed -n 's/^RXELAB-READY \([0-9.]*\).*/\1/p' | tail -1)
if [ -z "$result" ] && ! tr -d '\r' <"$console" | grep -q '^RXELAB-BOOTED'; then
  # qemu could not start or the kernel never reached init: the lab cannot run here.
  skip "qemu (exit status $status) did not boot the guest to its init"
fi
if [ -z "$result" ]; then
  echo "rxe-lab: the guest printed no result line (qemu exited with $status)"
  exit 1
fi
echo "rxe-lab: guest ready after ${booted:-?} s of guest uptime; whole run ${elapsed} s;" \
  "command status $result"
exit "$result"
