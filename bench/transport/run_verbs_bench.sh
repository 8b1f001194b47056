#!/bin/bash
# Runs bench_transport_verbs next to perftest's ib_write_bw on the same RDMA device in the same run, and prints
# bench_transport_verbs' table and final JSON line. When the host has no RDMA device it re-runs itself inside
# the soft-RoCE VM (run-in-rxe-vm.sh), where both tools use rxe0 over loopback RoCE v2.
#
# Usage: bench/transport/run_verbs_bench.sh [BUILD_DIR | PATH/TO/bench_transport_verbs] [bench args...]
#   BUILD_DIR defaults to ./build. Environment: WSYNC_RXE_VM_SCRIPT (harness path, default
#   ../shared/tools/rxe-vm/run-in-rxe-vm.sh beside the repository), BENCH_BYTES (bytes per message size per tool,
#   default 32 MiB), RXE_VM_TIMEOUT / RXE_VM_MEM (VM settings).
# Under CPU emulation the absolute numbers mean nothing; the ratio to ib_write_bw is the figure.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
target=${1:-build}
shift || true
if [ -d "$target" ]; then
  bin=$(cd "$target" && pwd)/$(cd "$target" && find . -name bench_transport_verbs -type f -perm -u+x | head -1)
else
  bin=$(cd "$(dirname "$target")" && pwd)/$(basename "$target")
fi
[ -x "$bin" ] || { echo "bench_transport_verbs not found under $target (build it first)" >&2; exit 1; }

if [ -z "${RXE_DEV:-}" ] && ! ibv_devices 2>/dev/null | grep -q '^ *[a-z]'; then
  harness=${WSYNC_RXE_VM_SCRIPT:-$here/../../../shared/tools/rxe-vm/run-in-rxe-vm.sh}
  [ -f "$harness" ] || { echo "no RDMA device here and no VM harness at $harness" >&2; exit 77; }
  export RXE_VM_TIMEOUT=${RXE_VM_TIMEOUT:-300} RXE_VM_MEM=${RXE_VM_MEM:-2048M}
  exec bash "$harness" "$here/run_verbs_bench.sh" "$bin" "$@"
fi

dev=${RXE_DEV:-$(ibv_devices | awk 'NR>2 {print $1; exit}')}
gid=${RXE_GID_INDEX:-0}
addr=${RXE_IP:-127.0.0.1}
bytes=${BENCH_BYTES:-$((32 << 20))}
sizes="4096 16384 65536 262144 1048576 4194304 16777216 67108864"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
baseline=$work/ib_write_bw.txt
: > "$baseline"
port=18515
for s in $sizes; do
  n=$((bytes / s))
  [ "$n" -lt 5 ] && n=5
  [ "$n" -gt 20000 ] && n=20000
  common=(-d "$dev" -x "$gid" -s "$s" -n "$n" -F --report_gbits -p "$port")
  ib_write_bw "${common[@]}" > "$work/server.$s" 2>&1 &
  server=$!
  ok=0
  for _ in $(seq 1 40); do
    sleep 0.25
    if ib_write_bw "${common[@]}" "$addr" > "$work/client.$s" 2>&1; then ok=1; break; fi
  done
  wait "$server" || true
  if [ "$ok" = 1 ]; then
    # perftest data line: bytes iterations peak avg msgrate
    awk -v s="$s" '$1 == s && NF >= 4 {print s, $4}' "$work/client.$s" | tail -1 >> "$baseline"
  else
    echo "ib_write_bw failed for $s bytes:" >&2
    tail -5 "$work/client.$s" >&2
  fi
  port=$((port + 1))
done
echo "ib_write_bw -d $dev -x $gid -F --report_gbits, loopback to $addr, Gb/s:" >&2
cat "$baseline" >&2
"$bin" --baseline "$baseline" --bytes-per-size "$bytes" --device "$dev" "$@"
