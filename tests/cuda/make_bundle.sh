#!/usr/bin/env bash
# Collects what tests/cuda/run_on_gpu.sh needs on a GPU machine that lacks this machine's packages (no gRPC,
# protobuf, Abseil, ...; docs/operations.md "GPU deployment"): the CUDA tests and bench, the daemons, the reference
# engine, wsyncctl and the C client library (stripped), every shared library they link except glibc's own and the
# C++ runtime (libstdc++/libgcc_s: the GPU machine's newer ones serve, and a PyTorch process needs those), and the
# scripts and data the Python tests read, in the source tree's layout. Run with LD_LIBRARY_PATH=<bundle>/lib.
# The Python client goes along as users get it: its wheel (built by tests/client/pyclient_wheel.py) plus wheels of
# its runtime requirements (grpcio, protobuf at the pinned versions) for the GPU machine's Python
# (WSYNC_GPU_PYTHON, default 3.12), in wheels/; run_on_gpu.sh installs them offline into a private folder.
#   tests/cuda/make_bundle.sh BUILD_DIR OUT_DIR
set -euo pipefail
build=$1 out=$2
src=$(cd "$(dirname "$0")/../.." && pwd)
export WSYNC_SRC=$src
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/tests/cuda" "$out/tests/client" "$out/tests/data/models/tiny-qwen3"
copy_deps() {
  ldd "$1" | awk '$3 ~ /^\// {print $3}' | while read -r l; do
    case "$(basename "$l")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*) continue ;;
    esac
    cp -L -n "$l" "$out/lib/"
  done
}
for b in fp8_cuda_test delta_scatter_cuda_test delta_device_cuda_test ring_push_cuda_test placement_cuda_test cuda_segment_test bench_gpu bench_node bench_transport bench_replica bench_control \
         wsyncd wsync-coordinator wsync-engine-ref \
         wsyncctl wsync-trainer-demo; do
  [ -x "$build/bin/$b" ] || { echo "make_bundle: $build/bin/$b missing (build with -DWSYNC_WITH_CUDA=ON)" >&2; exit 1; }
  cp "$build/bin/$b" "$out/bin/"
  strip "$out/bin/$b"
  copy_deps "$build/bin/$b"
done
# bench_control runs on etcd too where an etcd binary is on PATH (a static binary: it goes along as it is).
if command -v etcd >/dev/null; then cp "$(command -v etcd)" "$out/bin/"; fi
cp "$build/lib/libwsync_client_c.so" "$out/lib/"
strip --strip-unneeded "$out/lib/libwsync_client_c.so"
copy_deps "$build/lib/libwsync_client_c.so"
cp "$src"/tests/cuda/*.py "$src"/tests/cuda/run_on_gpu.sh "$out/tests/cuda/"
cp "$src/tests/client/python_client_test.py" "$src/tests/client/fp8_quantizer_test.py" "$out/tests/client/"
mkdir -p "$out/tests/replica" "$out/tests/data/tiny"
cp "$src/tests/replica/golden_oracle.py" "$out/tests/replica/"
cp "$src/tests/data/models/tiny-qwen3/config.json" "$out/tests/data/models/tiny-qwen3/"
# bench_node's models (its --models-dir tests/data/models in the bundle).
for m in Qwen__Qwen3-8B moonshotai__Kimi-K2-Instruct deepseek-ai__DeepSeek-V3; do
  mkdir -p "$out/tests/data/models/$m"
  cp "$src/tests/data/models/$m/config.json" "$out/tests/data/models/$m/"
done
cp "$src/tests/data/tiny/qwen3-fp8-tiny.json" "$out/tests/data/tiny/"
mkdir -p "$out/wheels"
pyver=${WSYNC_GPU_PYTHON:-3.12}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 - "$work" "$out/wheels" <<'PY'
import os, shutil, sys
sys.path.insert(0, os.path.join(os.environ["WSYNC_SRC"], "tests", "client"))
import pyclient_wheel as pw
shutil.copy(pw.build_wheel(sys.argv[1]), sys.argv[2])
print(" ".join(p for p in pw.PINS if p.split("==")[0] in ("grpcio", "protobuf")), file=open(sys.argv[1] + "/pins", "w"))
PY
# Platform wheels for the other Python, cached (downloaded from PyPI once per pin set).
cache=/var/cache/wsync/gpu-wheels-py$pyver-$(tr ' =' '-_' <"$work/pins" | tr -d '\n')
if [ ! -f "$cache/.complete" ]; then
  mkdir -p "$cache"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$cache" $(cat "$work/pins")
  touch "$cache/.complete"
fi
cp "$cache"/*.whl "$out/wheels/"
find "$out" -name __pycache__ -prune -exec rm -rf {} +
du -sh "$out"
