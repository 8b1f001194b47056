#!/usr/bin/env bash
# Runs every `cuda` test and the GPU bench from a bundle made by make_bundle.sh (run from the bundle's root, or
# give it as $1); logs to $OUT (or ./gpu-results), one file per test plus summary.txt. Exit 1 if any test failed.
set -uo pipefail
root=$(cd "${1:-$(dirname "$0")/../..}" && pwd)
out=${OUT:-$PWD/gpu-results}
mkdir -p "$out"
export LD_LIBRARY_PATH="$root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
cd "$root"
# The Python client and its pinned requirements, as make_bundle.sh shipped them: installed offline into a private
# folder that shadows the machine's own grpcio/protobuf (the generated stubs need at least the pinned versions).
if ls wheels/*.whl >/dev/null 2>&1; then
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" wheels/*.whl \
    >"$out/pip.log" 2>&1 || { echo "pip install of the bundle's wheels failed:"; cat "$out/pip.log"; exit 1; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
python3 -c 'import torch, numpy; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())' \
  >>"$out/gpu.txt" 2>&1
rc=0
run() {  # name, timeout, command...
  local name=$1 t=$2
  shift 2
  local t0=$SECONDS
  timeout "$t" "$@" >"$out/$name.log" 2>&1
  local r=$?
  local verdict=pass
  [ $r -eq 77 ] && verdict=skipped
  [ $r -ne 0 ] && [ $r -ne 77 ] && { verdict="FAIL (rc $r)"; rc=1; }
  echo "$name: $verdict in $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
}
run fp8_cuda_test 240 bin/fp8_cuda_test
run ring_push_cuda_test 120 bin/ring_push_cuda_test
run delta_scatter_cuda_test 180 bin/delta_scatter_cuda_test 256
run delta_device_cuda_test 60 bin/delta_device_cuda_test
run placement_cuda_test 120 bin/placement_cuda_test
run cuda_segment_test 180 bin/cuda_segment_test tests/cuda/cuda_engine.py
run cuda_push_e2e_test 150 python3 tests/cuda/cuda_push_e2e_test.py --coordinator bin/wsync-coordinator \
  --wsyncd bin/wsyncd --engine-ref bin/wsync-engine-ref --wsyncctl bin/wsyncctl --lib lib/libwsync_client_c.so \
  --model tests/data/models/tiny-qwen3/config.json
run fp8_quantizer_cuda_test 240 python3 tests/client/fp8_quantizer_test.py --device all
run cuda_fp8_push_e2e_test 180 python3 tests/cuda/cuda_fp8_push_e2e_test.py --coordinator bin/wsync-coordinator \
  --wsyncd bin/wsyncd --engine-ref bin/wsync-engine-ref --wsyncctl bin/wsyncctl --trainer-demo bin/wsync-trainer-demo \
  --model tests/data/tiny/qwen3-fp8-tiny.json
run bench_gpu 180 bin/bench_gpu "${BENCH_MIB:-2048}"
tail -n 12 "$out/bench_gpu.log"
for f in delta_scatter_cuda_test delta_device_cuda_test ring_push_cuda_test placement_cuda_test cuda_segment_test cuda_push_e2e_test fp8_quantizer_cuda_test cuda_fp8_push_e2e_test; do echo "== $f"; tail -n 8 "$out/$f.log"; done
exit $rc
