#!/bin/bash
# Runs a test executable inside the soft-RoCE VM (rdma_rxe on a stock kernel under QEMU), because the host
# kernel may have no RDMA support. Exit status is the test's, except: 77 (skipped, with the reason printed) when
# the VM cannot be set up here at all (harness missing, QEMU not installable); a failure once the VM is reachable
# (harness error 125, or the test skipping inside the guest because verbs is not viable there) is a failure (1),
# never a skip: the guest always has rxe0, so "no RDMA device" inside it means the verbs path is broken.
#
# Usage: run_in_rxe_vm.sh HARNESS TEST_EXECUTABLE [ARGS...]
#   HARNESS  path to run-in-rxe-vm.sh. Settings pass through the environment (RXE_VM_TIMEOUT, RXE_VM_MEM, ...).
set -u

skip() {
  echo "SKIP: $*" >&2
  exit 77
}

if [ $# -lt 2 ]; then
  echo "usage: $0 HARNESS TEST_EXECUTABLE [ARGS...]" >&2
  exit 2
fi
harness=$1
shift
[ -f "$harness" ] || skip "soft-RoCE VM harness not found at $harness"
[ -x "$1" ] || { echo "test executable $1 not found" >&2; exit 1; }

if ! command -v qemu-system-x86_64 >/dev/null 2>&1; then
  echo "run_in_rxe_vm: QEMU missing, installing it through the harness" >&2
  bash "$harness" --prepare >&2 || skip "QEMU could not be installed (run-in-rxe-vm.sh --prepare failed)"
fi

export RXE_VM_TIMEOUT=${RXE_VM_TIMEOUT:-200}
# The guest prints this before it runs the test. A VM that has not printed it RXE_VM_START_TIMEOUT s after it was
# started stalled while booting under emulation (seen once: no line from the guest in 360 s) and is started once
# more; a test that hangs inside a running guest is never retried (RXE_VM_TIMEOUT ends it).
marker="run_in_rxe_vm: the guest runs the test"
start_limit=${RXE_VM_START_TIMEOUT:-150}
work=$(mktemp -d)
pid=""
# The VM runs in a session of its own (below): whoever stops this script (ctest at its TIMEOUT) stops the VM too.
trap '[ -n "$pid" ] && kill -TERM -- "-$pid" 2>/dev/null; rm -rf "$work"' EXIT
trap 'exit 143' TERM INT
start=$(date +%s)
for attempt in 1 2; do
  : >"$work/stderr"
  t0=$(date +%s)
  # Its own process group, so that a stalled VM can be stopped with everything the harness started.
  setsid bash "$harness" bash -c 'echo "$0" >&2; exec "$@"' "$marker" "$@" 2>"$work/stderr" &
  pid=$!
  tail -s 0.2 -c +1 -f --pid="$pid" "$work/stderr" >&2 &
  tail_pid=$!
  started=0 stalled=0
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$started" = 0 ]; then
      if grep -qF "$marker" "$work/stderr"; then
        started=1
      elif [ $(( $(date +%s) - t0 )) -ge "$start_limit" ]; then
        stalled=1
        kill -TERM -- "-$pid" 2>/dev/null
      fi
    fi
    sleep 1
  done
  wait "$pid"
  rc=$?
  pid=""
  wait "$tail_pid" 2>/dev/null
  if [ "$stalled" = 1 ] && [ "$attempt" = 1 ]; then
    echo "run_in_rxe_vm: the VM did not start the test within $start_limit s (no line from the guest): starting it once more" >&2
    continue
  fi
  [ "$stalled" = 1 ] && { echo "run_in_rxe_vm: the VM did not start the test within $start_limit s twice" >&2; rc=124; }
  break
done
echo "run_in_rxe_vm: exit $rc after $(( $(date +%s) - start )) s in the VM" >&2
case $rc in
  125) echo "run_in_rxe_vm: FAILED: the VM harness failed (exit 125) before the test could run" >&2; rc=1 ;;
  124) [ "$stalled" = 1 ] || echo "run_in_rxe_vm: the VM hit RXE_VM_TIMEOUT=$RXE_VM_TIMEOUT s" >&2 ;;
  77) echo "run_in_rxe_vm: FAILED: the test skipped inside the VM (verbs not viable on rxe0): that is a bug" >&2; rc=1 ;;
esac
exit $rc
