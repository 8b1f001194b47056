#!/bin/bash
# Runs inside the soft-RoCE guest (rxe0, see run_in_rxe_vm.sh): the fabric suite on the verbs;ofi_rxm provider
# (transport_fabric_vm_test), and bench_transport --fabric there (fabric vs raw libfabric vs verbs vs tcp in one run;
# transport_fabric_vm_bench, label extended). Given both, one VM boot covers both, suite first.
# The bench's figures are printed, not asserted (benchmarks are not tests); the suite's exit status is the verdict.
#
# Usage: fabric_in_vm.sh [--suite TEST_EXECUTABLE] [--bench BENCH_EXECUTABLE]
# (the guest gets no environment from the host: settings travel as arguments, e.g. through /usr/bin/env)
set -u
test_bin="" bench_bin=""
while [ $# -gt 0 ]; do
  case $1 in
    --suite) test_bin=${2:-}; shift 2 || break ;;
    --bench) bench_bin=${2:-}; shift 2 || break ;;
    *) break ;;
  esac
done
if [ $# -ne 0 ] || { [ -z "$test_bin" ] && [ -z "$bench_bin" ]; }; then
  echo "usage: $0 [--suite TEST_EXECUTABLE] [--bench BENCH_EXECUTABLE]" >&2
  exit 2
fi
provider="verbs;ofi_rxm"
# The guest's default memlock limit (8 MiB) is below what the bench registers; the tests run as root there.
ulimit -l unlimited
# ofi_rxm sizes each endpoint's verbs completion queue for FI_UNIVERSE_SIZE peers (default 256), beyond rxe's
# max_cqe: fi_enable then fails with EINVAL. A small device needs a smaller universe (docs/operations.md).
export FI_UNIVERSE_SIZE=${FI_UNIVERSE_SIZE:-32}

if [ -n "$test_bin" ]; then
  start=$(date +%s)
  # Every case but the idle-CPU bound: under software emulation (TCG) a provider call costs many times its CPU on
  # the host (5% of a core measured there), so that bound holds for real CPUs only; it runs on the host's providers.
  WSYNC_FABRIC_TEST_PROVIDER=$provider "$test_bin" --durations yes "~[.]~[idle]"
  rc=$?
  echo "fabric_in_vm: suite on $provider exit $rc after $(($(date +%s) - start)) s" >&2
  [ $rc -eq 0 ] || exit $rc
fi

if [ -n "$bench_bin" ]; then
  start=$(date +%s)
  # Small sizes and short windows: under emulation the rates are CPU-bound, meaningful only as ratios in this run.
  # Each repetition costs about a minute under TCG; WSYNC_FABRIC_VM_BENCH_REPEAT=3 gives medians of alternating
  # repetitions. Figures, not a verdict: the bench's exit status is reported, not returned (benchmarks are not tests).
  "$bench_bin" --fabric --fabric-provider "$provider" --per-size-ms "${WSYNC_FABRIC_VM_BENCH_MS:-200}" \
    --max-size $((4 << 20)) --repeat "${WSYNC_FABRIC_VM_BENCH_REPEAT:-1}"
  echo "fabric_in_vm: bench_transport --fabric on $provider exit $? after $(($(date +%s) - start)) s" >&2
fi
exit 0
