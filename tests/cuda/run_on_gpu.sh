#!/usr/bin/env bash
# Runs the CUDA tests and the GPU bench from a bundle made by make_bundle.sh; logs to $OUT (or ./gpu-results).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$PWD/gpu-results}
mkdir -p "$out"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
rc=0
"$here/bin/fp8_cuda_test" >"$out/fp8_cuda_test.log" 2>&1 || rc=1
tail -3 "$out/fp8_cuda_test.log"
"$here/bin/bench_gpu" "${BENCH_MIB:-2048}" >"$out/bench_gpu.log" 2>&1 || rc=1
cat "$out/bench_gpu.log"
exit $rc
