#!/usr/bin/env bash
# CTest fixture of the netlab tests: `lab_fixture.sh up NAME LINKS RATE SKIP_FILE` brings the
# lab up (after removing any leftover of an interrupted run); `lab_fixture.sh down NAME` tears
# it down. Where a lab cannot exist here (not root, no `ip`, network namespaces refused), `up`
# writes the reason into SKIP_FILE and succeeds, and the tests skip with that reason.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
netlab="$here/../../tools/netlab"
action=${1:?usage: lab_fixture.sh up NAME LINKS RATE SKIP_FILE | down NAME}
name=${2:?name}

cannot() {
  echo "netlab: tests will skip: $*"
  echo "$*" >"$skip_file"
  exit 0
}

case "$action" in
  up)
    links=${3:?links}
    rate=${4:?rate}
    skip_file=${5:?skip file}
    rm -f "$skip_file"
    [ "$(id -u)" = 0 ] || cannot "not root (network namespaces need root)"
    command -v ip >/dev/null || cannot "no 'ip' command (iproute2)"
    command -v tc >/dev/null || cannot "no 'tc' command (iproute2)"
    probe="$name-probe"
    ip netns del "$probe" 2>/dev/null || true
    if ! err=$(ip netns add "$probe" 2>&1); then
      cannot "network namespace creation refused: $err"
    fi
    ip netns del "$probe"
    "$netlab" down --name "$name"
    "$netlab" up --name "$name" --links "$links" --rate "$rate"
    ;;
  down)
    if [ "$(id -u)" = 0 ] && command -v ip >/dev/null; then
      "$netlab" down --name "$name"
    fi
    ;;
  *)
    echo "lab_fixture.sh: unknown action '$action'" >&2
    exit 2
    ;;
esac
