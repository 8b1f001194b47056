// The GPU FP8 block quantizer must produce exactly the CPU quantizer's bytes (codes and scales) for the same input:
// bf16/f16/f32, 128x128 and 64x64 (the vectorized kernel where rows are 16-byte aligned, else the general one) and
// 256x256 blocks, both scale formats, ragged edges, strided rows, and hostile values (NaN, ±inf, subnormals, huge,
// all-zero and all-NaN blocks). Exit 0 pass, 1 mismatch, 77 no CUDA device.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "replica/fp8.h"
#include "replica/fp8_cuda.h"
#include "tests/cuda/cuda_check.h"

using namespace wsync;
using namespace wsync::replica;

namespace {

// Random element bits of `dtype` with special values sprinkled in.
std::vector<uint8_t> MakeInput(DType dtype, int64_t rows, int64_t stride, std::mt19937_64& rng) {
  const size_t esz = DTypeSize(dtype);
  std::vector<uint8_t> buf(static_cast<size_t>(rows * stride) * esz);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 999);
  std::uniform_int_distribution<int> expo(-30, 30);
  for (int64_t i = 0; i < rows * stride; ++i) {
    float f = normal(rng) * std::ldexp(1.0f, expo(rng) / 3);
    const int k = pick(rng);
    if (k == 0) f = NAN;
    if (k == 1) f = INFINITY;
    if (k == 2) f = -INFINITY;
    if (k == 3) f = 1e-42f;    // float32 subnormal
    if (k == 4) f = 3e38f;
    if (k == 5) f = -0.0f;
    if (k == 6) f = 6e-8f;     // f16 subnormal range
    uint8_t* p = buf.data() + static_cast<size_t>(i) * esz;
    if (dtype == DType::kF32) {
      std::memcpy(p, &f, 4);
    } else if (dtype == DType::kBF16) {
      const uint16_t b = FloatToBf16(f);
      std::memcpy(p, &b, 2);
    } else {
      // float → binary16 by scanning (exactness does not matter: any bit pattern is a valid input).
      uint32_t u;
      std::memcpy(&u, &f, 4);
      const uint16_t h = static_cast<uint16_t>(((u >> 16) & 0x8000u) | ((rng() & 0x7FFFu)));
      std::memcpy(p, &h, 2);
    }
  }
  return buf;
}

int RunCase(DType dtype, int64_t rows, int64_t cols, int block, Fp8ScaleFormat fmt, std::mt19937_64& rng) {
  // Some cases strided: by 5 elements (misaligned rows: the general kernel), or by 24 (16-byte aligned rows: the
  // vectorized kernel with a stride).
  const int64_t src_stride = cols + (cols % 3 == 0 ? 5 : (cols == 1000 ? 24 : 0));
  const int64_t dst_stride = cols, scale_cols = (cols + block - 1) / block, scale_rows = (rows + block - 1) / block;
  std::vector<uint8_t> in = MakeInput(dtype, rows, src_stride, rng);
  const size_t esz = DTypeSize(dtype);
  if (rows >= block && cols >= block) {  // block (0,0) all zero
    for (int64_t r = 0; r < block; ++r) std::memset(in.data() + static_cast<size_t>(r * src_stride) * esz, 0, block * esz);
  }
  std::vector<uint8_t> cpu_q(static_cast<size_t>(rows * dst_stride)), gpu_q(cpu_q.size(), 0xAB);
  std::vector<float> cpu_s(static_cast<size_t>(scale_rows * scale_cols)), gpu_s(cpu_s.size(), -1.0f);
  if (!QuantizeFp8Block(dtype, in.data(), rows, cols, src_stride, block, block, cpu_q.data(), dst_stride, cpu_s.data(),
                        scale_cols, fmt)
           .ok()) {
    std::printf("CPU quantizer refused the case\n");
    return 1;
  }
  void *d_in, *d_q, *d_s;
  const std::string what = std::to_string(rows) + "x" + std::to_string(cols) + " " + std::string(DTypeName(dtype));
  WSYNC_CUDA_CHECK(cudaMalloc(&d_in, in.size()), what);
  WSYNC_CUDA_CHECK(cudaMalloc(&d_q, gpu_q.size()), what);
  WSYNC_CUDA_CHECK(cudaMalloc(&d_s, gpu_s.size() * 4), what);
  WSYNC_CUDA_CHECK(cudaMemcpy(d_in, in.data(), in.size(), cudaMemcpyHostToDevice), what);
  auto st = QuantizeFp8BlockCuda(dtype, d_in, rows, cols, src_stride, block, block, static_cast<uint8_t*>(d_q),
                                 dst_stride, static_cast<float*>(d_s), scale_cols, fmt);
  if (!st.ok()) {
    std::printf("GPU quantizer: %s\n", st.ToString().c_str());
    return 1;
  }
  WSYNC_CUDA_CHECK(cudaDeviceSynchronize(), what);
  WSYNC_CUDA_CHECK(cudaMemcpy(gpu_q.data(), d_q, gpu_q.size(), cudaMemcpyDeviceToHost), what);
  WSYNC_CUDA_CHECK(cudaMemcpy(gpu_s.data(), d_s, gpu_s.size() * 4, cudaMemcpyDeviceToHost), what);
  cudaFree(d_in);
  cudaFree(d_q);
  cudaFree(d_s);
  size_t bad_q = 0, bad_s = 0;
  for (size_t i = 0; i < cpu_q.size(); ++i) bad_q += cpu_q[i] != gpu_q[i];
  if (std::memcmp(cpu_s.data(), gpu_s.data(), cpu_s.size() * 4) != 0)
    for (size_t i = 0; i < cpu_s.size(); ++i) bad_s += std::memcmp(&cpu_s[i], &gpu_s[i], 4) != 0;
  std::printf("%-9s %5lldx%-5lld block %3d %-7s: %zu of %zu codes and %zu of %zu scales differ\n",
              std::string(DTypeName(dtype)).c_str(), static_cast<long long>(rows), static_cast<long long>(cols), block,
              fmt == Fp8ScaleFormat::kUe8m0 ? "ue8m0" : "float32", bad_q, cpu_q.size(), bad_s, cpu_s.size());
  return bad_q == 0 && bad_s == 0 ? 0 : 1;
}

}  // namespace

int main() {
  RequireCudaDevice("fp8_cuda_test");
  std::mt19937_64 rng(20261204);
  int failures = 0, cases = 0;
  const int64_t shapes[][2] = {{1, 1}, {7, 300}, {128, 128}, {129, 257}, {384, 1000}, {1000, 384}, {2048, 7168},
                               {4096, 4096}, {513, 64}};
  for (DType d : {DType::kBF16, DType::kF16, DType::kF32})
    for (int block : {128, 64, 256})  // 256: the uncached kernel
      for (Fp8ScaleFormat f : {Fp8ScaleFormat::kFloat32, Fp8ScaleFormat::kUe8m0})
        for (const auto& s : shapes) {
          failures += RunCase(d, s[0], s[1], block, f, rng);
          ++cases;
        }
  // Bad input is refused before anything runs.
  failures += QuantizeFp8BlockCuda(DType::kI32, nullptr, 1, 1, 1, 128, 128, nullptr, 1, nullptr, 1).ok() ? 1 : 0;
  std::printf("fp8_cuda_test: %d of %d cases byte-identical to the CPU quantizer\n", cases - failures, cases);
  return failures == 0 ? 0 : 1;
}
