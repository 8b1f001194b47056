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
start=$(date +%s)
bash "$harness" "$@"
rc=$?
echo "run_in_rxe_vm: exit $rc after $(( $(date +%s) - start )) s in the VM" >&2
case $rc in
  125) echo "run_in_rxe_vm: FAILED: the VM harness failed (exit 125) before the test could run" >&2; rc=1 ;;
  124) echo "run_in_rxe_vm: the VM hit RXE_VM_TIMEOUT=$RXE_VM_TIMEOUT s" >&2 ;;
  77) echo "run_in_rxe_vm: FAILED: the test skipped inside the VM (verbs not viable on rxe0): that is a bug" >&2; rc=1 ;;
esac
exit $rc
