#!/usr/bin/env bash
# Runs a test binary against the real Mooncake Transfer Engine: installs the pinned engine into the cache
# (tools/testing/engines/install_mooncake.sh; seconds when warm) and points the test at that venv's python and at
# tests/engines/mooncake_peer.py. An install failure fails the test (exit 1); it never turns into a skip.
#
#   tests/engines/run_mooncake_test.sh build/tests/transport/transport_mooncake_test [catch2 args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if ! PY="$("${ROOT}/tools/testing/engines/install_mooncake.sh" | tail -n1)" || [[ ! -x "${PY}" ]]; then
  echo "run_mooncake_test: installing the Mooncake Transfer Engine failed (see above)" >&2
  exit 1
fi
export WSYNC_MOONCAKE_PYTHON="${PY}"
export WSYNC_MOONCAKE_PEER="${ROOT}/tests/engines/mooncake_peer.py"
exec "$@"
