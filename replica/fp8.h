#pragma once
// FP8 (float8_e4m3fn) block quantization and the scalar conversions it rests on.
//
// Convention: the one RL trainers apply when they hand bf16 weights to SGLang as a DeepSeek-style FP8 checkpoint
// (slime/miles `blockwise_cast_to_fp8_triton`; e4m3fn weight + float32 `weight_scale_inv` per block_n x block_k):
//   amax   = max |x| over the block, in float32 (NaN elements ignored)
//   scale  = max(amax, 1e-10f) / 448.0f       float32 division; an all-zero block gets 1e-10f/448 and q = 0
//   q      = e4m3fn(clamp(x / scale, ±448))   float32 division, exactly torch's
//                                             (w.float() / scale).to(torch.float8_e4m3fn) with scale = amax / 448
//                                             (multiplying by a reciprocal instead, as some Triton kernels do,
//                                             differs in the last bit of ~0.1-0.3 % of the codes)
//   stored = scale (dequantization: x ≈ q * scale_inv)
// The e4m3fn cast rounds to nearest, ties to even, and saturates finite overflow (and ±inf) to ±448 like the GPU's
// `cvt.rn.satfinite`; torch's CPU `.to(torch.float8_e4m3fn)` does not saturate, which is why the reference clamps
// first. NaN stays NaN (0x7F / 0xFF): a NaN input keeps its sign; the NaN that ±inf / inf creates (a block whose
// amax is inf) is the x86 default NaN, negative, so 0xFF (the GPU quantizer, replica/fp8_cuda.cu, reproduces both).
// Blocks at the right/bottom edge may be partial; their amax covers only the elements that exist. All arithmetic is IEEE float32 without contraction, so a numpy float32 model reproduces it bit
// for bit (a GPU kernel's approximate division may differ from it in the last bit of `inv`).

#include <cstdint>
#include <cstring>

#include "absl/status/status.h"
#include "base/dtype.h"

namespace wsync::replica {

inline constexpr float kFp8E4M3Max = 448.0f;
inline constexpr float kFp8AmaxEps = 1e-10f;
inline constexpr uint8_t kFp8E4M3MaxCode = 0x7E;  // 448
inline constexpr uint8_t kFp8E4M3NanCode = 0x7F;

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float Bf16ToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

// Round to nearest even; NaN stays a (quiet) NaN with its sign.
inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// IEEE binary16 → float32 (exact; subnormals, inf and NaN kept). Branch-free so loops over it vectorize.
inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t mag = h & 0x7FFFu;
  // Normal: rebias the exponent (15 → 127). Inf/NaN: exponent field all ones, so push it to 255.
  uint32_t normal = (mag << 13) + (112u << 23);
  normal = mag >= 0x7C00u ? normal + (112u << 23) : normal;
  // Subnormal (and zero): mantissa * 2^-24, exact in float32.
  const uint32_t sub = FloatBits(static_cast<float>(static_cast<int32_t>(mag)) * 5.9604644775390625e-8f);
  return BitsToFloat(sign | (mag < 0x0400u ? sub : normal));
}

// float32 → float8_e4m3fn: round to nearest even, finite overflow and ±inf saturate to ±448, NaN → 0x7F|sign.
// Branch-free (selects only) so loops over it vectorize.
inline uint8_t FloatToE4m3(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // Normal range (|f| >= 2^-6): round the float32 mantissa to 3 bits at bit 20 (ties to even), then rebias the
  // exponent from 127 to 7 (subtract 120 << 3 in the code domain). A carry out of the mantissa bumps the exponent,
  // which is exactly the right rounding.
  const uint32_t rounded = (a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  const int32_t normal = static_cast<int32_t>(rounded) - (120 << 3);
  // Subnormal range (|f| < 2^-6, quantum 2^-9): adding 2^14 leaves a float32 whose ulp is 2^-9, so the FPU's own
  // round-to-nearest-even produces the mantissa; 8 means it rounded up to the smallest normal, which is code 0x08.
  const float biased = BitsToFloat(a) + 16384.0f;
  const int32_t sub = static_cast<int32_t>(FloatBits(biased) - 0x46800000u);
  int32_t code = a < 0x3C800000u ? sub : normal;
  code = code > kFp8E4M3MaxCode ? kFp8E4M3MaxCode : code;
  code = a > 0x7F800000u ? kFp8E4M3NanCode : code;
  return static_cast<uint8_t>(sign | static_cast<uint32_t>(code));
}

// float8_e4m3fn → float32 (exact). 0x7F/0xFF are NaN; there is no infinity.
inline float E4m3ToFloat(uint8_t q) {
  const uint32_t sign = static_cast<uint32_t>(q & 0x80u) << 24;
  const uint32_t exp = (q >> 3) & 0xFu;
  const uint32_t mant = q & 0x7u;
  if ((q & 0x7Fu) == 0x7Fu) return BitsToFloat(sign | 0x7FC00000u);
  if (exp == 0) return BitsToFloat(sign | FloatBits(static_cast<float>(mant) * 0.001953125f));  // mant * 2^-9
  return BitsToFloat(sign | ((exp + 120u) << 23) | (mant << 20));
}

// How a block's scale is stored. kFloat32: amax / 448 as is. kUe8m0: rounded up to a power of two (the UE8M0
// scales DeepGEMM-enabled engines use): 2^ceil(log2(amax / 448)), computed exactly on the float's bits (torch's
// `2 ** ceil(log2(s))` agrees except where float32 log2 rounds a value a few ulps above a power of two down onto
// it); every |x / scale| is then <= 448 and the division is exact.
enum class Fp8ScaleFormat { kFloat32, kUe8m0 };

// A positive normal float rounded up to a power of two (itself when it is one).
inline float RoundUpToPow2(float s) {
  const uint32_t u = FloatBits(s);
  const uint32_t exp = u & 0x7F800000u;
  return BitsToFloat((u & 0x007FFFFFu) == 0 ? exp : exp + 0x00800000u);
}

// The per-block scale for a block whose max |x| is `amax` (see the convention above).
inline float Fp8BlockScale(float amax, Fp8ScaleFormat format = Fp8ScaleFormat::kFloat32) {
  const float s = (amax > kFp8AmaxEps ? amax : kFp8AmaxEps) / kFp8E4M3Max;
  return format == Fp8ScaleFormat::kUe8m0 ? RoundUpToPow2(s) : s;
}

// Quantizes a row-major [rows, cols] slice (row stride `src_stride` elements) of bf16/f16/f32 data into fp8 e4m3
// (row stride `dst_stride` bytes) and float32 scale_inv [ceil(rows/bn), ceil(cols/bk)] (row stride `scale_stride`
// floats), with the convention above. Blocks are aligned to the slice's origin: the caller passes slices that start
// on a block boundary of the full tensor (SGLang shards block-quantized weights in whole blocks).
// Thread-safe; writes only dst and scale_inv. InvalidArgument for an unsupported dtype or bad sizes/strides.
absl::Status QuantizeFp8Block(DType src_dtype, const uint8_t* src, int64_t rows, int64_t cols, int64_t src_stride,
                              int block_n, int block_k, uint8_t* dst, int64_t dst_stride, float* scale_inv,
                              int64_t scale_stride, Fp8ScaleFormat format = Fp8ScaleFormat::kFloat32);

}  // namespace wsync::replica
