#!/usr/bin/env bash
# One entry point for a fresh Debian 12 machine: installs what is missing, builds, then runs the demo or the tests.
#
#   tools/cli/quickstart.sh demo    # install + build what the demo runs + end-to-end demo (exit status = its result)
#   tools/cli/quickstart.sh test    # install + build + the whole test suite (ctest)
#   tools/cli/quickstart.sh build   # install + build only
#   tools/cli/quickstart.sh packages  # print the Debian packages it installs
#
# Environment: BUILD_DIR (default ./build), JOBS (default: nproc), WSYNC_SKIP_INSTALL=1 to skip apt-get.
set -euo pipefail

cd "$(dirname "$0")/../.."
mode=${1:-demo}
build=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}

packages=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev catch2 nlohmann-json3-dev libcli11-dev libxxhash-dev libcpp-httplib-dev
  libsqlite3-dev openssl libssl-dev
  libibverbs-dev librdmacm-dev ibverbs-utils perftest iperf3
  libfabric1 libfabric-dev libfabric-bin  # the fabric transport (headers to build, the library and fi_info to run)
  python3 python3-numpy python3-yaml python3-venv
  iproute2 python3-matplotlib
  # only for the tests labelled etcd (coordinator high availability); wsync itself needs no etcd library
  etcd-server
  # only for the ui test: certutil/pk12util give headless Chromium a client certificate (chromium itself and
  # librsvg2-bin, larger, are installed by that test when missing)
  libnss3-tools
  # only for daemon_thread_safety_test: clang's -Wthread-safety checks the coordinator's lock annotations
  clang
)

install_missing() {
  [ "${WSYNC_SKIP_INSTALL:-0}" = 1 ] && return 0
  local missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "quickstart: installing ${missing[*]}"
  local sudo=()
  [ "$(id -u)" -ne 0 ] && sudo=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

configure() {
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
}

build_all() {
  configure
  cmake --build "$build" -j "$jobs"
}

# Only the programs the demo runs (it names them), not every test and benchmark.
build_demo() {
  configure
  mapfile -t targets < <(tools/cli/demo.sh --binaries)
  cmake --build "$build" -j "$jobs" --target "${targets[@]}"
}

# ctest as a direct child of this script, told to stop (SIGTERM: it kills its running tests) when this script dies,
# however it is stopped (.ci/run killed by a timeout): a test run stopped from outside leaves no test running.
ctest_tied() {
  setpriv --pdeathsig TERM ctest "$@"
}

# Runs every test of build directory $1, then fails when a test was skipped although this machine kind can have what it needs: only
# tests labelled `cuda` (no GPU here) or `rdma_device` (an RDMA device on the host itself; their soft-RoCE VM
# variants run instead) may skip; a skipped engine/sglang/mooncake/rdma/cluster test means a peer that the test
# installs itself could not be set up, which is a failure, not a pass.
run_tests_and_check_skips() {
  local dir=$1 log rc=0
  log=$(mktemp)
  # `extended`: long emulated runs (the whole SGLang stack over soft-RoCE, ~17 min), run on demand (tests/README.md).
  ctest_tied --test-dir "$dir" --output-on-failure -j "$jobs" --timeout 600 -LE extended 2>&1 | tee "$log" || rc=$?
  mapfile -t skipped < <(sed -n 's/^ *[0-9]*\/[0-9]* Test *#[0-9]*: \([^ ]*\) .*\*\*\*Skipped.*/\1/p' "$log")
  mapfile -t may_skip < <(ctest --test-dir "$dir" -N -L '^(cuda|rdma_device)$' | sed -n 's/^ *Test *#[0-9]*: \(.*\)$/\1/p')
  rm -f "$log"
  local bad=()
  for t in "${skipped[@]}"; do
    [[ " ${may_skip[*]} " == *" $t "* ]] || bad+=("$t")
  done
  if [ ${#bad[@]} -gt 0 ]; then
    echo "quickstart: FAILED: these tests were skipped although this machine can install what they need: ${bad[*]}" >&2
    echo "quickstart: (only tests labelled cuda or rdma_device may skip here; see the test's output above)" >&2
    return 1
  fi
  [ ${#skipped[@]} -gt 0 ] && echo "quickstart: skipped (no GPU / no host RDMA device on this machine): ${skipped[*]}"
  return "$rc"
}

# The tests labelled `asan` (ring, fd passing, transports, fuzzers) again in an AddressSanitizer +
# UndefinedBehaviorSanitizer build of their own ($build-asan): a memory error fails the run.
run_sanitizer_tests() {
  local sbuild="$1-asan"
  cmake -S . -B "$sbuild" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWSYNC_SANITIZE=address,undefined \
    -DWSYNC_BUILD_BENCH=OFF >/dev/null
  mapfile -t targets < <(cd "$sbuild" && ctest -N -L '^asan$' | sed -n 's/^ *Test *#[0-9]*: \(.*\)$/\1/p')
  [ ${#targets[@]} -gt 0 ] || { echo "quickstart: no tests labelled asan" >&2; return 1; }
  echo "quickstart: sanitizer build of ${targets[*]}"
  cmake --build "$sbuild" -j "$jobs" --target "${targets[@]}"
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest_tied --test-dir "$sbuild" --output-on-failure -j "$jobs" --timeout 600 -L '^asan$'
}

# ThreadSanitizer build of the concurrency tests (label tsan: the source/coordinator lifecycle hammered from several
# threads, the tcp transport's cancel and stream threads). Only their targets are built. Debian's gRPC, protobuf and
# Abseil are not instrumented: tests/tsan.supp lists what of theirs TSan cannot see through (nothing of ours).
run_tsan_tests() {
  local tbuild="$1-tsan" supp
  supp="$(pwd)/tests/tsan.supp"
  cmake -S . -B "$tbuild" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWSYNC_SANITIZE=thread \
    -DWSYNC_BUILD_BENCH=OFF >/dev/null
  mapfile -t targets < <(cd "$tbuild" && ctest -N -L '^tsan$' | sed -n 's/^ *Test *#[0-9]*: \(.*\)$/\1/p')
  [ ${#targets[@]} -gt 0 ] || { echo "quickstart: no tests labelled tsan" >&2; return 1; }
  echo "quickstart: thread-sanitizer build of ${targets[*]}"
  cmake --build "$tbuild" -j "$jobs" --target "${targets[@]}"
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$supp" \
    ctest_tied --test-dir "$tbuild" --output-on-failure -j "$jobs" --timeout 600 -L '^tsan$'
}

case "$mode" in
  packages)
    printf '%s\n' "${packages[@]}"
    ;;
  demo)
    install_missing
    build_demo
    exec tools/cli/demo.sh --bin "$build/bin"
    ;;
  test)
    install_missing
    build_all
    run_tests_and_check_skips "$build"
    run_sanitizer_tests "$build"
    run_tsan_tests "$build"
    ;;
  build)
    install_missing
    build_all
    ;;
  *)
    echo "usage: tools/cli/quickstart.sh demo|test|build|packages" >&2
    exit 2
    ;;
esac
