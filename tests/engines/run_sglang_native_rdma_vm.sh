#!/usr/bin/env bash
# engine_sglang_native_rdma_vm_test: the SGLang-native end-to-end test (sglang_native_e2e_test.py) with SGLang's
# transfer engine and wsync's sources on protocol rdma, inside the soft-RoCE VM (rxe0). Software emulation makes
# Python imports slow in the guest, so the expectation (SGLang's own loaders fed the trainer's tensors; no RDMA
# involved) is computed here on the host first and read by the guest (it sees the host filesystem read-only).
#
#   tests/engines/run_sglang_native_rdma_vm.sh HARNESS BIN_DIR     HARNESS: ../shared/tools/rxe-vm/run-in-rxe-vm.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HARNESS="$1"
BIN="$(cd "$2" && pwd)"
MODEL="${ROOT}/tests/data/tiny/qwen3-tiny.json"
work="$(mktemp -d "${TMPDIR:-/tmp}/wsync-sglang-rdma-XXXXXX")"
trap 'rm -rf "${work}"' EXIT
mkdir "${work}/model"
cp "${MODEL}" "${work}/model/config.json"
MPY="$("${ROOT}/tools/testing/engines/install_mooncake.sh" | tail -n1)"
SPY="$("${ROOT}/tests/replica/sglang_venv.sh" | tail -n1)"
[[ -x "${MPY}" && -x "${SPY}" ]] || { echo "run_sglang_native_rdma_vm: the pinned venvs did not come up" >&2; exit 1; }
MSITE="$("${MPY}" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
start=$(date +%s)
"${SPY}" -W ignore "${ROOT}/tests/engines/sglang_native_peer.py" --config "${work}/model/config.json" --tp 2 \
  --mooncake-site "${MSITE}" --expect 0,1,2,3 | tail -n1 > "${work}/expect.json"
echo "run_sglang_native_rdma_vm: expectation on the host in $(( $(date +%s) - start )) s" >&2
exec "${ROOT}/tests/transport/run_in_rxe_vm.sh" "${HARNESS}" "${ROOT}/tests/engines/run_mooncake_test.sh" \
  "${ROOT}/tests/replica/sglang_venv.sh" /usr/bin/python3 "${ROOT}/tests/engines/sglang_native_e2e_test.py" \
  --bin "${BIN}" --model "${MODEL}" --protocol rdma --expect-file "${work}/expect.json"
