# Runs inside the rxe lab's guest (busybox sh): fabric-info on the verbs provider, the
# conformance suite with the verbs backend, then the verbs tests. Exit status: 0 when all pass.
#   guest_suite.sh CONFORMANCE_TESTS VERBS_TESTS FABRIC_INFO|-
conformance=$1
verbs=$2
info=$3
status=0
uptime_s() { cut -d' ' -f1 /proc/uptime; }
# Each program is bounded on its own (about 30 s and 6 s in a passing run on the 2-core VM), so
# that one that hangs leaves the others their time and the log says which one it was.
bounded() {
  limit=$1
  shift
  timeout -s KILL "$limit" "$@"
  rc=$?
  [ $rc -eq 137 ] && echo "RXELAB-SUITE: $1 ran past ${limit} s and was killed"
  return $rc
}

if [ "$info" != "-" ]; then
  "$info" --provider verbs --nic rxe0 || status=1
fi

# The 300 MiB single write is left out: the guest has 512 MiB of memory.
t0=$(uptime_s)
bounded 240 "$conformance" --gtest_filter='*/verbs:-*SeveralHundredMiB*' || status=1
t1=$(uptime_s)
bounded 120 "$verbs" --gtest_brief=1 || status=1
t2=$(uptime_s)
echo "RXELAB-TIMES conformance $(awk "BEGIN { print $t1 - $t0 }") s, verbs tests $(awk "BEGIN { print $t2 - $t1 }") s"
exit $status
