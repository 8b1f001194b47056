// GPU twin of replica/fp8.cc. One thread block per quantization block: a max-|x| reduction over the block in shared
// memory, the block's scale in IEEE float32 (correctly rounded division, no fast math), then every element's code
// with the same bit-level e4m3 conversion as the CPU (FloatToE4m3 in fp8.h). Nothing here may be contracted or
// approximated: the output must equal the CPU quantizer's byte for byte.
#include "replica/fp8_cuda.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"

namespace wsync::replica {
namespace {

__device__ __forceinline__ float LoadAsFloat(const uint8_t* base, int64_t index, int kind) {
  if (kind == 0) {  // bf16
    const uint16_t b = reinterpret_cast<const uint16_t*>(base)[index];
    return __uint_as_float(static_cast<uint32_t>(b) << 16);
  }
  if (kind == 1) {  // f16: exact widening by bits (as F16ToFloat)
    const uint16_t h = reinterpret_cast<const uint16_t*>(base)[index];
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t mag = h & 0x7FFFu;
    uint32_t normal = (mag << 13) + (112u << 23);
    if (mag >= 0x7C00u) normal += (112u << 23);
    const uint32_t sub = __float_as_uint(__fmul_rn(static_cast<float>(static_cast<int32_t>(mag)), 5.9604644775390625e-8f));
    return __uint_as_float(sign | (mag < 0x0400u ? sub : normal));
  }
  return reinterpret_cast<const float*>(base)[index];
}

__device__ __forceinline__ uint8_t ToE4m3(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  const uint32_t rounded = (a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  const int32_t normal = static_cast<int32_t>(rounded) - (120 << 3);
  const float biased = __fadd_rn(__uint_as_float(a), 16384.0f);
  const int32_t sub = static_cast<int32_t>(__float_as_uint(biased) - 0x46800000u);
  int32_t code = a < 0x3C800000u ? sub : normal;
  code = code > kFp8E4M3MaxCode ? kFp8E4M3MaxCode : code;
  code = a > 0x7F800000u ? kFp8E4M3NanCode : code;
  return static_cast<uint8_t>(sign | static_cast<uint32_t>(code));
}

constexpr int kThreadsX = 32, kThreadsY = 8;

// blockDim (32, 8): thread (tx, ty) covers rows ty, ty+8, ... and columns tx, tx+32, ... of its quantization block,
// so a warp reads consecutive elements of one row and no index needs a division. The second pass re-reads the
// block (from L1/L2: at most 64 KiB).
__global__ void QuantizeKernel(const uint8_t* src, int kind, int64_t rows, int64_t cols, int64_t src_stride, int bn,
                               int bk, uint8_t* dst, int64_t dst_stride, float* scale_inv, int64_t scale_stride,
                               bool ue8m0) {
  const int64_t br = blockIdx.y, bc = blockIdx.x;
  const int64_t r0 = br * bn, c0 = bc * bk;
  const int nr = static_cast<int>(min(static_cast<int64_t>(bn), rows - r0));
  const int nc = static_cast<int>(min(static_cast<int64_t>(bk), cols - c0));
  const int tx = threadIdx.x, ty = threadIdx.y;
  float m = 0.0f;
  for (int r = ty; r < nr; r += kThreadsY) {
    const int64_t row = (r0 + r) * src_stride + c0;
    for (int c = tx; c < nc; c += kThreadsX) {
      const float x = fabsf(LoadAsFloat(src, row + c, kind));
      if (x == x && x > m) m = x;  // NaN ignored
    }
  }
  // Warp maximum, then across the 8 warps.
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  __shared__ float red[kThreadsY];
  if (tx == 0) red[ty] = m;
  __syncthreads();
  float amax = red[0];
  for (int i = 1; i < kThreadsY; ++i) amax = fmaxf(amax, red[i]);
  float scale = __fdiv_rn(amax > kFp8AmaxEps ? amax : kFp8AmaxEps, kFp8E4M3Max);
  if (ue8m0) {
    const uint32_t u = __float_as_uint(scale);
    const uint32_t e = u & 0x7F800000u;
    scale = __uint_as_float((u & 0x007FFFFFu) == 0 ? e : e + 0x00800000u);
  }
  if (tx == 0 && ty == 0) scale_inv[br * scale_stride + bc] = scale;
  for (int r = ty; r < nr; r += kThreadsY) {
    const int64_t row = (r0 + r) * src_stride + c0;
    uint8_t* out = dst + (r0 + r) * dst_stride + c0;
    for (int c = tx; c < nc; c += kThreadsX) {
      const float x = LoadAsFloat(src, row + c, kind);
      float y = __fdiv_rn(x, scale);
      // NaN signs as on the CPU (x86 SSE/AVX): a NaN input keeps its sign; a NaN the division creates (±inf / inf,
      // in a block whose amax is inf) is the default NaN, which is negative. The GPU's division returns an unsigned
      // canonical NaN either way.
      if (y != y) y = __uint_as_float(x != x ? (__float_as_uint(x) | 0x00400000u) : 0xFFC00000u);
      out[c] = ToE4m3(y);
    }
  }
}

}  // namespace

absl::Status QuantizeFp8BlockCuda(DType src_dtype, const void* src, int64_t rows, int64_t cols, int64_t src_stride,
                                  int block_n, int block_k, uint8_t* dst, int64_t dst_stride, float* scale_inv,
                                  int64_t scale_stride, Fp8ScaleFormat format, void* stream) {
  int kind;
  switch (src_dtype) {
    case DType::kBF16: kind = 0; break;
    case DType::kF16: kind = 1; break;
    case DType::kF32: kind = 2; break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("fp8 quantization source must be bfloat16, float16 or float32, got ", DTypeName(src_dtype)));
  }
  if (block_n <= 0 || block_k <= 0)
    return absl::InvalidArgumentError(absl::StrCat("fp8 block size must be positive, got ", block_n, "x", block_k));
  if (rows < 0 || cols < 0)
    return absl::InvalidArgumentError(absl::StrCat("fp8 quantization of a negative shape [", rows, ", ", cols, "]"));
  if (rows == 0 || cols == 0) return absl::OkStatus();
  const int64_t grid_x = (cols + block_k - 1) / block_k, grid_y = (rows + block_n - 1) / block_n;
  if (src_stride < cols || dst_stride < cols || scale_stride < grid_x)
    return absl::InvalidArgumentError(absl::StrCat("fp8 quantization strides too small for [", rows, ", ", cols, "]"));
  if (src == nullptr || dst == nullptr || scale_inv == nullptr)
    return absl::InvalidArgumentError("fp8 quantization given a null buffer");
  if (grid_y > 65535 || grid_x > 2147483647)
    return absl::InvalidArgumentError(absl::StrCat("fp8 quantization grid too large: ", grid_y, " block rows"));
  QuantizeKernel<<<dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y)), dim3(kThreadsX, kThreadsY), 0,
                   static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(src), kind, rows, cols, src_stride, block_n, block_k, dst,
      dst_stride, scale_inv, scale_stride, format == Fp8ScaleFormat::kUe8m0);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return absl::InternalError(absl::StrCat("cudaLaunchKernel(fp8 quantize, grid ", grid_x, "x", grid_y, ", [", rows,
                                            ", ", cols, "] ", DTypeName(src_dtype), "): ", cudaGetErrorString(e)));
  return absl::OkStatus();
}

}  // namespace wsync::replica
