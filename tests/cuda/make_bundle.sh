#!/usr/bin/env bash
# Collects the CUDA tests and benches of a build, with every shared library they link except glibc's own, into one
# folder that runs on a GPU machine without this machine's packages (LD_LIBRARY_PATH=<bundle>/lib).
#   tests/cuda/make_bundle.sh BUILD_DIR OUT_DIR
set -euo pipefail
build=$1 out=$2
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
for b in fp8_cuda_test bench_gpu; do
  [ -x "$build/bin/$b" ] || { echo "make_bundle: $build/bin/$b missing (build with -DWSYNC_WITH_CUDA=ON)" >&2; exit 1; }
  cp "$build/bin/$b" "$out/bin/"
  strip "$out/bin/$b"
  ldd "$build/bin/$b" | awk '$3 ~ /^\// {print $3}' | while read -r l; do
    case "$(basename "$l")" in libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*) continue ;; esac
    cp -L -n "$l" "$out/lib/"
  done
done
cp "$(dirname "$0")/run_on_gpu.sh" "$out/"
du -sh "$out"
