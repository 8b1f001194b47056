#pragma once
// x / scale, correctly rounded to float32, without a division per element: the GPU FP8 quantizer's inner step
// (replica/fp8_cuda.cu), here so the host can check it against the division (tests/replica/fp8_quotient_test.cc).
//
// With recip = RN(1 / scale) (once per block), q0 = RN(x * recip) is within one ulp of x / scale (faithful); the
// residual e = x - q0 * scale is then exact in one FMA, and RN(q0 + e * recip) is RN(x / scale) (Markstein's
// theorem: a faithful quotient corrected once with a reciprocal within half an ulp rounds correctly).
// The sign is x's (scale > 0): the correction of a zero quotient would otherwise turn -0 into +0, which e4m3
// encodes differently (0x80, 0x00). Preconditions, all met inside a block with finite scale: scale and recip are normal floats (scale is
// max(amax, 1e-10) / 448 or a power of two above it, so 2^-42 < scale < 2^120), x is finite or NaN, and the
// quotient is at most ~448 in magnitude. Where the residual would underflow (|x| < 2^-100) the result may be one ulp
// off, but the quotient is below 2^-57 (scale > 2^-43), far under the smallest e4m3 step (2^-10 rounds to 0), so the
// e4m3 code is the same signed zero either way.
// A block whose scale is infinite (amax = inf) must divide instead: recip is 0 there and 0 * inf is NaN.

#include <cmath>

#if defined(__CUDACC__)
#define WSYNC_FP8_HD __host__ __device__ __forceinline__
#else
#define WSYNC_FP8_HD inline
#endif

namespace wsync::replica {

WSYNC_FP8_HD float Fp8Reciprocal(float scale) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(scale);
#else
  return 1.0f / scale;
#endif
}

WSYNC_FP8_HD float Fp8Quotient(float x, float scale, float recip) {
#if defined(__CUDA_ARCH__)
  const float q0 = __fmul_rn(x, recip);
  const float e = __fmaf_rn(-q0, scale, x);
  return copysignf(__fmaf_rn(e, recip, q0), x);
#else
  const float q0 = x * recip;
  const float e = std::fma(-q0, scale, x);
  return std::copysign(std::fma(e, recip, q0), x);
#endif
}

}  // namespace wsync::replica
