# Runs inside the rxe lab's guest (busybox sh): fabric-info on the verbs provider, the
# conformance suite with the verbs backend, then the verbs tests. Exit status: 0 when all pass.
#   guest_suite.sh CONFORMANCE_TESTS VERBS_TESTS FABRIC_INFO|-
conformance=$1
verbs=$2
info=$3
status=0
uptime_s() { cut -d' ' -f1 /proc/uptime; }

if [ "$info" != "-" ]; then
  "$info" --provider verbs --nic rxe0 || status=1
fi

# The 300 MiB single write is left out: the guest has 512 MiB of memory.
t0=$(uptime_s)
"$conformance" --gtest_filter='*/verbs:-*SeveralHundredMiB*' || status=1
t1=$(uptime_s)
"$verbs" --gtest_brief=1 || status=1
t2=$(uptime_s)
echo "RXELAB-TIMES conformance $(awk "BEGIN { print $t1 - $t0 }") s, verbs tests $(awk "BEGIN { print $t2 - $t1 }") s"
exit $status
