#!/usr/bin/env bash
# `cmake --install` of the build tree into a temporary prefix, then a separate project (tests/client/consumer) that
# finds it with find_package(wsync) and links wsync::client and wsync::client_c; both programs must run: the C++ one
# against a live coordinator (its status answered), the C one printing the library version.
#   install_test.sh BUILD_DIR SOURCE_DIR VERSION   (VERSION: the project's, which the consumer asks find_package for)
set -euo pipefail
build=$1 src=$2 version=$3
work=$(mktemp -d /tmp/wsync-install-test.XXXXXX)
coord_pid=
cleanup() { [ -n "$coord_pid" ] && kill "$coord_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
cmake --install "$build" --prefix "$work/prefix" >"$work/install.log"
for f in lib/cmake/wsync/wsyncConfig.cmake include/client/coordinator_client.h include/wsync/v1/coordinator.grpc.pb.h \
         bin/wsyncd bin/wsync-coordinator bin/wsyncctl; do
  [ -e "$work/prefix/$f" ] || { echo "install_test: $f was not installed" >&2; exit 1; }
done
cmake -S "$src/tests/client/consumer" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DWSYNC_VERSION="$version" >"$work/configure.log" \
  || { cat "$work/configure.log" >&2; exit 1; }
cmake --build "$work/build" -j "${JOBS:-2}" >"$work/build.log" || { tail -40 "$work/build.log" >&2; exit 1; }
"$work/build/consumer_c" | grep -q "libwsync_client_c " || { echo "install_test: consumer_c printed no version" >&2; exit 1; }
# Against a coordinator started from the installed binaries.
"$work/prefix/bin/wsync-coordinator" --listen 127.0.0.1:0 --port-file "$work/port" >"$work/coord.log" 2>&1 &
coord_pid=$!
for _ in $(seq 100); do [ -s "$work/port" ] && break; sleep 0.1; done
[ -s "$work/port" ] || { echo "install_test: installed coordinator did not start" >&2; cat "$work/coord.log" >&2; exit 1; }
out=$("$work/build/consumer" "127.0.0.1:$(cat "$work/port")")
echo "$out"
grep -q "answered" <<<"$out"
# And against nothing: a clear error, not a hang.
set +e
timeout 20 "$work/build/consumer" 127.0.0.1:1 >"$work/none.log"; rc=$?
set -e
[ "$rc" = 3 ] || { echo "install_test: consumer against no coordinator exited $rc (want 3)" >&2; cat "$work/none.log" >&2; exit 1; }
echo "install_test: ok (installed tree, find_package(wsync), wsync::client and wsync::client_c)"
