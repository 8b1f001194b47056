#!/usr/bin/env bash
# wsync's mooncake transport vs Mooncake's own writer, both writing into the same peer in one run:
#   peer      tests/engines/mooncake_peer.py with the real Mooncake Transfer Engine (pinned venv), one 256 MiB buffer
#   baseline  transfer_engine_bench --mode=initiator --operation=write --protocol=tcp (Mooncake's bench, same wheel)
#   wsync     build/bin/bench_mooncake_write (the transport the sources use for SGLang)
# Same block size (--block, default 4 MiB) and batch (8), same duration. Last line: one JSON object.
#   bench/mooncake/run_mooncake_bench.sh [BUILD_DIR] [--block BYTES] [--duration S]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${1:-${ROOT}/build}"; shift || true
BLOCK=$((4 << 20)); DURATION=3; BUF=$((256 << 20)); BATCH=8
while [[ $# -gt 0 ]]; do
  case "$1" in
    --block) BLOCK="$2"; shift 2 ;;
    --duration) DURATION="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
PY="$("${ROOT}/tools/testing/engines/install_mooncake.sh" | tail -n1)"
TEB="$(dirname "${PY}")/transfer_engine_bench"
[[ -x "${TEB}" ]] || { echo "Mooncake's transfer_engine_bench not found next to ${PY}" >&2; exit 1; }
WSYNC="${BUILD}/bin/bench_mooncake_write"
[[ -x "${WSYNC}" ]] || { echo "build ${WSYNC} first (cmake --build ${BUILD} --target bench_mooncake_write)" >&2; exit 1; }

work="$(mktemp -d)"
peer_pid=""
cleanup() { [[ -n "${peer_pid}" ]] && kill "${peer_pid}" 2>/dev/null; wait 2>/dev/null; rm -rf "${work}"; }
trap cleanup EXIT INT TERM
printf '{"regions": [[{"name": "buffer", "numel": %d, "element_size": 1}]]}\n' "${BUF}" > "${work}/layout.json"
"${PY}" "${ROOT}/tests/engines/mooncake_peer.py" --layout "${work}/layout.json" > "${work}/peer.out" 2> "${work}/peer.err" &
peer_pid=$!
for _ in $(seq 1 300); do grep -q '"ready"' "${work}/peer.out" 2>/dev/null && break; sleep 0.1; done
grep -q '"ready"' "${work}/peer.out" || { cat "${work}/peer.err" >&2; echo "peer did not start" >&2; exit 1; }
read -r SESSION BASE SIZE < <(python3 -c '
import json,sys
j=json.loads([l for l in open(sys.argv[1]) if "ready" in l][0])
print(j["session_id"], j["regions"][0][0], j["regions"][0][1])' "${work}/peer.out")
echo "peer: session ${SESSION}, buffer ${BASE} (${SIZE} bytes); block ${BLOCK} B, batch ${BATCH}, ${DURATION} s each"

( cd "${work}" && "${TEB}" --mode=initiator --metadata_server=P2PHANDSHAKE --protocol=tcp \
    --local_server_name=127.0.0.1 --segment_id="${SESSION}" --operation=write --block_size="${BLOCK}" \
    --batch_size="${BATCH}" --threads=2 --duration="${DURATION}" --buffer_size="${SIZE}" --report_unit=GB \
    > "${work}/teb.log" 2>&1 ) || { tail -20 "${work}/teb.log" >&2; exit 1; }
BASELINE="$(grep -o 'throughput [0-9.]* GB/s' "${work}/teb.log" | tail -1 | awk '{print $2}')"
[[ -n "${BASELINE}" ]] || { tail -20 "${work}/teb.log" >&2; echo "no throughput from transfer_engine_bench" >&2; exit 1; }
echo "mooncake transfer_engine_bench (write, tcp): ${BASELINE} GB/s"

"${WSYNC}" --session "${SESSION}" --base "${BASE}" --length "${SIZE}" --block "${BLOCK}" --batch "${BATCH}" \
  --duration "${DURATION}" | tee "${work}/wsync.log"
VALUE="$(grep -o 'wsync_gbps=[0-9.]*' "${work}/wsync.log" | cut -d= -f2)"
python3 -c '
import json,sys
v,b,blk=float(sys.argv[1]),float(sys.argv[2]),int(sys.argv[3])
print("ratio (wsync / Mooncake): %.2f %s" % (v/b, "(goal >= 1.0: met)" if v >= b else "(goal >= 1.0: NOT met)"))
print(json.dumps({"bench":"mooncake_tcp_write","value":round(v,4),"baseline":round(b,4),"ratio":round(v/b,3),
                  "unit":"GB/s","block_bytes":blk,"batch":8,"baseline_tool":"transfer_engine_bench"}))' \
  "${VALUE}" "${BASELINE}" "${BLOCK}"
