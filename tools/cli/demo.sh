#!/usr/bin/env bash
# End-to-end demo on 127.0.0.1 with free ports: a coordinator, 2 source daemons (2 trainer ranks each, separate
# processes using the client library), 2 target daemons and 2 reference engine instances at TP=2. Runs N
# consecutive updates; after each one every engine rank verifies every parameter bit-exactly against its own
# independent loader. Exit status is non-zero on any mismatch or failure. Every gRPC channel runs mutual TLS with
# per-role certificates made by tools/cli/wsync-certs.sh (WSYNC_DEMO_INSECURE=1: plain loopback instead).
#
#   tools/cli/demo.sh [--bin DIR] [--model CONFIG.json] [--updates N] [--transport tcp|verbs]
#   tools/cli/demo.sh --binaries     # the programs it runs, one per line (quickstart.sh builds only these)
set -euo pipefail
binaries=(wsync-coordinator wsyncd wsync-engine-ref wsync-trainer-demo)

here=$(cd "$(dirname "$0")/../.." && pwd)
bin="$here/build/bin"
model="$here/tests/data/models/Qwen__Qwen3-0.6B/config.json"
updates=3
transport=tcp
tp=2
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --updates) updates=$2; shift 2 ;;
    --transport) transport=$2; shift 2 ;;
    --tp) tp=$2; shift 2 ;;
    --binaries) printf '%s\n' "${binaries[@]}"; exit 0 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "demo: unknown argument $1" >&2; exit 2 ;;
  esac
done
for b in "${binaries[@]}"; do
  [ -x "$bin/$b" ] || { echo "demo: $bin/$b is missing; build first (cmake --build build --target ${binaries[*]})" >&2; exit 2; }
done
[ -f "$model" ] || { echo "demo: model config $model not found" >&2; exit 2; }

work=$(mktemp -d /tmp/wsync-demo.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  if [ "${WSYNC_DEMO_KEEP:-0}" = 1 ]; then echo "demo: logs kept in $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT

# Waits for a port file written by a process once it serves; fails early if the process died.
wait_port() {
  local file=$1 pid=$2 name=$3
  for _ in $(seq 1 600); do
    if [ -s "$file" ]; then cat "$file"; return 0; fi
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "demo: $name exited before serving; its log:" >&2; tail -n 30 "$work/$name.log" >&2; return 1
    fi
    sleep 0.1
  done
  echo "demo: $name did not start within 60 s" >&2; return 1
}
start() {  # start NAME CMD... ; runs in the background with its log in $work/NAME.log
  local name=$1; shift
  "$@" >"$work/$name.log" 2>&1 &
  pids+=($!)
  last_pid=$!
}

# mTLS: a CA and one certificate per process, CN "<role>:<id>" (docs/security.md).
certs="$work/certs"
tls() { :; }
if [ "${WSYNC_DEMO_INSECURE:-0}" != 1 ]; then
  # Beside this script: tools/cli in the checkout, the bin directory of an installed tree (the container image).
  "$(cd "$(dirname "$0")" && pwd)/wsync-certs.sh" "$certs" coordinator:demo engine:engine0 engine:engine1 target:infer-node0 \
    target:infer-node1 source:train-node0 source:train-node1 trainer:demo >/dev/null
  tls() { echo --tls-ca "$certs/ca.pem" --tls-cert "$certs/$1.pem" --tls-key "$certs/$1-key.pem"; }
  echo "mTLS on: certificates in $certs"
fi

start coordinator "$bin/wsync-coordinator" --listen 127.0.0.1:0 --port-file "$work/coordinator.port" $(tls coordinator-demo)
coord="127.0.0.1:$(wait_port "$work/coordinator.port" "$last_pid" coordinator)"
echo "coordinator on $coord"

for e in 0 1; do
  start "engine$e" "$bin/wsync-engine-ref" --id "engine$e" --model "$model" --tp "$tp" \
    --listen 127.0.0.1:0 --port-file "$work/engine$e.port" $(tls "engine-engine$e")
  eng[$e]="127.0.0.1:$(wait_port "$work/engine$e.port" "$last_pid" "engine$e")"
done
for e in 0 1; do
  start "target$e" "$bin/wsyncd" --listen 127.0.0.1:0 --role target --node-id "infer-node$e" --coordinator "$coord" \
    --engine "reference+grpc://${eng[$e]}" --engine-socket "$work/target$e.sock" --transport "$transport" \
    --port-file "$work/target$e.port" $(tls "target-infer-node$e")
  wait_port "$work/target$e.port" "$last_pid" "target$e" >/dev/null
done
for s in 0 1; do
  start "source$s" "$bin/wsyncd" --listen 127.0.0.1:0 --role source --node-id "train-node$s" --coordinator "$coord" \
    --trainer-ranks 2 --ring-mib 384 --transport "$transport" --trainer-socket "$work/source$s.sock" \
    --port-file "$work/source$s.port" $(tls "source-train-node$s")
  wait_port "$work/source$s.port" "$last_pid" "source$s" >/dev/null
  src[$s]="$work/source$s.sock"  # trainer ranks reach their daemon through its local socket
done
echo "engines ${eng[*]}; source daemons ${src[*]}; running $updates updates of $(basename "$(dirname "$model")")"
echo "(each update: begun, pushed, committed with its phases, then every engine rank verified; 3 to 25 s per update"
echo " of Qwen3-0.6B on a 2-core machine, one to a few minutes in all)"

# The driving rank's lines (each update begun, pushed, committed with its phases, verified) as they come: its
# standard output is a pipe (a FIFO) that tee copies to ours and to trainer0.out. tee ends at the pipe's end of
# file, i.e. once the trainer has exited and every line it wrote has been copied; the demo waits for that, so no
# line is lost however loaded the machine is (no sleep, no polling of a file).
mkfifo "$work/trainer0.fifo"
tee "$work/trainer0.out" <"$work/trainer0.fifo" &
follow=$!
trainers=()
for s in 0 1; do
  for r in 0 1; do
    g=$((s * 2 + r))
    extra=()
    out="$work/trainer$g.out"
    if [ $g -eq 0 ]; then
      extra=(--drive --coordinator "$coord" --verify-engine "${eng[0]}" --verify-engine "${eng[1]}")
      out="$work/trainer0.fifo"
    fi
    "$bin/wsync-trainer-demo" --daemon "${src[$s]}" --model "$model" --local-rank $r --global-rank $g \
      --updates "$updates" "${extra[@]}" $(tls trainer-demo) >"$out" 2>"$work/trainer$g.log" &
    trainers+=($!)
    pids+=($!)  # stopped with the daemons if the demo is interrupted
  done
done
rc=0
# The first trainer to fail ends the demo: the others would only wait for an update that cannot complete.
remaining=("${trainers[@]}")
while [ ${#remaining[@]} -gt 0 ]; do
  ended=
  st=0
  wait -n -p ended "${remaining[@]}" || st=$?
  [ -n "$ended" ] || break  # none of them is a child any more (cannot happen; guards the loop)
  next=()
  for p in "${remaining[@]}"; do [ "$p" = "$ended" ] || next+=("$p"); done
  remaining=("${next[@]}")
  if [ $st -ne 0 ]; then rc=1; break; fi
done
if [ $rc -ne 0 ]; then
  for p in "${remaining[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${remaining[@]}"; do wait "$p" 2>/dev/null || true; done
  for i in "${!trainers[@]}"; do
    if grep -q ' E \[' "$work/trainer$i.log"; then echo "demo: trainer $i failed:" >&2; grep ' E \[' "$work/trainer$i.log" | tail -n 5 >&2; fi
  done
fi
wait "$follow" || true  # every line of the driving rank printed (the trainer has exited: the pipe is at its end)
if [ $rc -ne 0 ]; then
  for f in coordinator source0 source1 target0 target1; do echo "--- $f" >&2; tail -n 10 "$work/$f.log" >&2; done
  grep -q '^wsync demo:' "$work/trainer0.out" || echo "wsync demo: FAILED (see the logs above)"
fi
exit $rc
