// GPU twin of replica/fp8.cc. Per quantization block: max |x| over the block, the block's scale in IEEE float32
// (correctly rounded division, no fast math), then every element's code. The per-element x / scale is the correctly
// rounded quotient computed from the block's reciprocal and one FMA correction (replica/fp8_quotient.h says why that
// equals the division) — the division itself costs more than the memory traffic. The e4m3 conversion is the CPU's
// bit-level one (FloatToE4m3 in fp8.h), or on sm_89+ in the vectorized kernel the hardware's round-to-nearest-even
// saturating conversion with NaN codes set as the CPU sets them (Code2). Nothing here may be contracted or
// approximated: the output must equal the CPU quantizer's byte for byte (tests/cuda/fp8_cuda_test).
//
// Two kernels: QuantizeVecKernel for 128x128 and 64x64 blocks over 16-byte aligned rows (the production shapes),
// which loads each block once into registers with 16-byte loads and stores 4 or 8 codes at a time; QuantizeKernel
// for everything else (other block sizes, odd strides), one element per thread step.
#include "replica/fp8_cuda.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "replica/fp8_quotient.h"

namespace wsync::replica {
namespace {

// f16 → float32, exact widening by bits (as F16ToFloat in fp8.h).
__device__ __forceinline__ float HalfToFloat(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t mag = h & 0x7FFFu;
  uint32_t normal = (mag << 13) + (112u << 23);
  if (mag >= 0x7C00u) normal += (112u << 23);
  const uint32_t sub =
      __float_as_uint(__fmul_rn(static_cast<float>(static_cast<int32_t>(mag)), 5.9604644775390625e-8f));
  return __uint_as_float(sign | (mag < 0x0400u ? sub : normal));
}

__device__ __forceinline__ float LoadAsFloat(const uint8_t* base, int64_t index, int kind) {
  if (kind == 0) {  // bf16
    const uint16_t b = reinterpret_cast<const uint16_t*>(base)[index];
    return __uint_as_float(static_cast<uint32_t>(b) << 16);
  }
  if (kind == 1) return HalfToFloat(reinterpret_cast<const uint16_t*>(base)[index]);
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

// The e4m3 code of x / scale. NaN signs as on the CPU (x86 SSE/AVX): a NaN input keeps its sign; a NaN the
// division creates (±inf / inf, in a block whose amax is inf) is the default NaN, which is negative. The GPU returns
// an unsigned canonical NaN either way. `finite` is block-uniform: only a block whose amax is inf divides.
__device__ __forceinline__ uint8_t Code(float x, float scale, float recip, bool finite) {
  float y = finite ? Fp8Quotient(x, scale, recip) : __fdiv_rn(x, scale);
  if (y != y) y = __uint_as_float(x != x ? (__float_as_uint(x) | 0x00400000u) : 0xFFC00000u);
  return ToE4m3(y);
}

__device__ __forceinline__ float BlockScale(float amax, bool ue8m0) {
  float scale = __fdiv_rn(amax > kFp8AmaxEps ? amax : kFp8AmaxEps, kFp8E4M3Max);
  if (ue8m0) {
    const uint32_t u = __float_as_uint(scale);
    const uint32_t e = u & 0x7F800000u;
    scale = __uint_as_float((u & 0x007FFFFFu) == 0 ? e : e + 0x00800000u);
  }
  return scale;
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
  const float scale = BlockScale(amax, ue8m0);
  if (tx == 0 && ty == 0) scale_inv[br * scale_stride + bc] = scale;
  const bool finite = scale < INFINITY;
  const float recip = Fp8Reciprocal(scale);
  for (int r = ty; r < nr; r += kThreadsY) {
    const int64_t row = (r0 + r) * src_stride + c0;
    uint8_t* out = dst + (r0 + r) * dst_stride + c0;
    for (int c = tx; c < nc; c += kThreadsX) {
      const float x = LoadAsFloat(src, row + c, kind);
      out[c] = Code(x, scale, recip, finite);
    }
  }
}

constexpr int kVecThreads = 256;

// Element j of a 16-byte vector of elements of `kind` (0 bf16, 1 f16, 2 f32), as float32.
template <int kKind>
__device__ __forceinline__ float Element(const uint4& v, int j) {
  const int k = kKind == 2 ? j : j >> 1;  // j is a constant after unrolling: no local-memory indexing
  const uint32_t w = k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
  if constexpr (kKind == 2) return __uint_as_float(w);
  const uint32_t h = (j & 1) ? (w >> 16) : (w & 0xFFFFu);
  if constexpr (kKind == 0) return __uint_as_float(h << 16);
  return HalfToFloat(h);
}

// The e4m3 codes of two elements (x0 in the low byte). On sm_89+ one cvt.rn.satfinite.e4m3x2.f32 converts the two
// quotients: round to nearest even, subnormals, and finite overflow and ±inf saturating to ±448, as FloatToE4m3 does;
// only its NaN is unsigned, so NaN codes are set here by Code's rule (a NaN input keeps its sign, a NaN the division
// created is 0xFF). fp8_cuda_test checks the result against the CPU byte for byte. Elsewhere: Code, twice.
__device__ __forceinline__ uint32_t Code2(float x0, float x1, float scale, float recip, bool finite) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const float y0 = finite ? Fp8Quotient(x0, scale, recip) : __fdiv_rn(x0, scale);
  const float y1 = finite ? Fp8Quotient(x1, scale, recip) : __fdiv_rn(x1, scale);
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(y1), "f"(y0));
  const uint32_t nan0 = x0 != x0 ? (((__float_as_uint(x0) >> 24) & 0x80u) | 0x7Fu) : 0xFFu;
  const uint32_t nan1 = x1 != x1 ? (((__float_as_uint(x1) >> 24) & 0x80u) | 0x7Fu) : 0xFFu;
  const uint32_t c0 = y0 != y0 ? nan0 : (pair & 0xFFu);
  const uint32_t c1 = y1 != y1 ? nan1 : (pair >> 8);
  return c0 | (c1 << 8);
#else
  return Code(x0, scale, recip, finite) | (static_cast<uint32_t>(Code(x1, scale, recip, finite)) << 8);
#endif
}

// The codes of a thread's vectors (rows r0, r0 + kRowsPerStep, ...), stored 4 or 8 bytes at a time.
template <int kKind, int kSteps, int kRowsPerStep, bool kFinite>
__device__ __forceinline__ void StoreCodes(const uint4 (&v)[kSteps], int64_t r0, int64_t rows, int64_t c, uint8_t* dst,
                                           int64_t dst_stride, float scale, float recip) {
  constexpr int kVec = kKind == 2 ? 4 : 8;
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    const int64_t r = r0 + static_cast<int64_t>(i) * kRowsPerStep;
    if (r >= rows) break;
    uint32_t packed[kVec / 4] = {};
#pragma unroll
    for (int j = 0; j < kVec; j += 2)
      packed[j >> 2] |= Code2(Element<kKind>(v[i], j), Element<kKind>(v[i], j + 1), scale, recip, kFinite)
                        << ((j & 3) * 8);
    uint8_t* out = dst + r * dst_stride + c;
    if constexpr (kVec == 8) {
      *reinterpret_cast<uint2*>(out) = make_uint2(packed[0], packed[1]);
    } else {
      *reinterpret_cast<uint32_t*>(out) = packed[0];
    }
  }
}

// One thread block of 256 threads per kBlock x kBlock quantization block. A block row is kPerRow threads, each
// holding one 16-byte vector (8 bf16/f16 or 4 f32 elements) per row it covers; all of the block's data is loaded
// once into registers (8 or 16 vectors per thread), reduced, and quantized from there — one read of the input, one
// write of the codes. Needs: src and every src row 16-byte aligned, cols a multiple of the vector width, dst and
// every dst row aligned to the vector width. Ragged edges: whole vectors outside the tensor are skipped.
template <int kKind, int kBlock>
__global__ void __launch_bounds__(kVecThreads, kBlock == 128 ? 3 : 4)
    QuantizeVecKernel(const uint8_t* __restrict__ src, int64_t rows, int64_t cols, int64_t src_stride,
                      uint8_t* __restrict__ dst, int64_t dst_stride, float* __restrict__ scale_inv,
                      int64_t scale_stride, bool ue8m0) {
  constexpr int kSize = kKind == 2 ? 4 : 2;
  constexpr int kVec = 16 / kSize;
  constexpr int kPerRow = kBlock / kVec;
  constexpr int kRowsPerStep = kVecThreads / kPerRow;
  constexpr int kSteps = kBlock / kRowsPerStep;
  static_assert(kVecThreads % kPerRow == 0 && kBlock % kRowsPerStep == 0, "block rows must tile the thread block");
  const int t = threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kBlock + t / kPerRow;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kBlock + (t % kPerRow) * kVec;
  const bool col_in = c < cols;
  uint4 v[kSteps];
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    const int64_t r = r0 + static_cast<int64_t>(i) * kRowsPerStep;
    v[i] = make_uint4(0, 0, 0, 0);  // outside the tensor: zeros, which leave the maximum alone
    if (col_in && r < rows) v[i] = __ldg(reinterpret_cast<const uint4*>(src + (r * src_stride + c) * kSize));
  }
  float m = 0.0f;  // fmaxf ignores NaN, as the CPU's maximum does
#pragma unroll
  for (int i = 0; i < kSteps; ++i)
#pragma unroll
    for (int j = 0; j < kVec; ++j) m = fmaxf(m, fabsf(Element<kKind>(v[i], j)));
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  __shared__ float red[kVecThreads / 32];
  if ((t & 31) == 0) red[t >> 5] = m;
  __syncthreads();
  float amax = red[0];
#pragma unroll
  for (int i = 1; i < kVecThreads / 32; ++i) amax = fmaxf(amax, red[i]);
  const float scale = BlockScale(amax, ue8m0);
  if (t == 0) scale_inv[static_cast<int64_t>(blockIdx.y) * scale_stride + blockIdx.x] = scale;
  if (!col_in) return;
  const float recip = Fp8Reciprocal(scale);
  // One block-uniform branch, not one per element: only a block whose amax is inf divides.
  if (scale < INFINITY) {
    StoreCodes<kKind, kSteps, kRowsPerStep, true>(v, r0, rows, c, dst, dst_stride, scale, recip);
  } else {
    StoreCodes<kKind, kSteps, kRowsPerStep, false>(v, r0, rows, c, dst, dst_stride, scale, recip);
  }
}

template <int kKind>
void LaunchVec(int block, dim3 grid, cudaStream_t stream, const uint8_t* src, int64_t rows, int64_t cols,
               int64_t src_stride, uint8_t* dst, int64_t dst_stride, float* scale_inv, int64_t scale_stride,
               bool ue8m0) {
  if (block == 128) {
    QuantizeVecKernel<kKind, 128><<<grid, kVecThreads, 0, stream>>>(src, rows, cols, src_stride, dst, dst_stride,
                                                                    scale_inv, scale_stride, ue8m0);
  } else {
    QuantizeVecKernel<kKind, 64><<<grid, kVecThreads, 0, stream>>>(src, rows, cols, src_stride, dst, dst_stride,
                                                                   scale_inv, scale_stride, ue8m0);
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
  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y));
  const cudaStream_t cs = static_cast<cudaStream_t>(stream);
  const bool ue8m0 = format == Fp8ScaleFormat::kUe8m0;
  const auto* in = static_cast<const uint8_t*>(src);
  const int64_t esize = static_cast<int64_t>(DTypeSize(src_dtype)), vec = 16 / esize;
  const bool vec_ok = block_n == block_k && (block_n == 128 || block_n == 64) &&
                      reinterpret_cast<uintptr_t>(src) % 16 == 0 && (src_stride * esize) % 16 == 0 &&
                      cols % vec == 0 && reinterpret_cast<uintptr_t>(dst) % vec == 0 && dst_stride % vec == 0;
  if (vec_ok && kind == 0) {
    LaunchVec<0>(block_n, grid, cs, in, rows, cols, src_stride, dst, dst_stride, scale_inv, scale_stride, ue8m0);
  } else if (vec_ok && kind == 1) {
    LaunchVec<1>(block_n, grid, cs, in, rows, cols, src_stride, dst, dst_stride, scale_inv, scale_stride, ue8m0);
  } else if (vec_ok) {
    LaunchVec<2>(block_n, grid, cs, in, rows, cols, src_stride, dst, dst_stride, scale_inv, scale_stride, ue8m0);
  } else {
    QuantizeKernel<<<grid, dim3(kThreadsX, kThreadsY), 0, cs>>>(in, kind, rows, cols, src_stride, block_n, block_k,
                                                                dst, dst_stride, scale_inv, scale_stride, ue8m0);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return absl::InternalError(absl::StrCat("cudaLaunchKernel(fp8 quantize, grid ", grid_x, "x", grid_y, ", [", rows,
                                            ", ", cols, "] ", DTypeName(src_dtype), "): ", cudaGetErrorString(e)));
  return absl::OkStatus();
}

}  // namespace wsync::replica
