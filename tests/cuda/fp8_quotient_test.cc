// The GPU FP8 quantizer replaces each element's division x / scale by a multiplication with the block's
// reciprocal and one FMA correction (replica/fp8_quotient.h). Byte identity with the CPU quantizer needs that to be
// the correctly rounded quotient; these checks compare it with the IEEE division on this machine's FPU, which is
// the independent truth. Runs everywhere (no GPU needed): the GPU computes the same three IEEE operations
// (__fmul_rn, __fmaf_rn), whose results are defined bit for bit.
#include "replica/fp8_quotient.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "replica/fp8.h"

namespace wsync::replica {
namespace {

float F(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t U(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Every bf16 significand against every float32 scale significand. The exponents only scale both sides (checked
// separately below), so this is every (bf16 x, scale) pair up to exponent: 2^30 quotients, both quotient binades
// (x < scale and x >= scale).
TEST_CASE("the reciprocal-and-FMA quotient equals the division for every bf16 significand and every scale") {
  uint64_t bad = 0, n = 0;
  uint32_t first_scale = 0, first_x = 0;
  for (uint32_t sm = 0; sm < (1u << 23); ++sm) {
    const float s = F((127u << 23) | sm);
    const float r = Fp8Reciprocal(s);
    for (uint32_t xm = 0; xm < 128; ++xm) {
      const float x = F((127u << 23) | (xm << 16));
      const bool differs = U(Fp8Quotient(x, s, r)) != U(x / s);
      if (differs && bad == 0) first_scale = U(s), first_x = U(x);
      bad += differs;
      ++n;
    }
  }
  INFO("first difference: x bits " << first_x << ", scale bits " << first_scale);
  CHECK(n == (uint64_t{1} << 30));
  CHECK(bad == 0);
}

// The quantizer's real operating range: scale from the block's amax (both scale formats, amax from the 1e-10 floor
// to FLT_MAX), every bf16 x with |x| <= amax (x is in the block, ±0 and subnormals included), e4m3 codes and, where
// the residual cannot underflow (|x| >= 2^-100), the float32 quotient bits.
TEST_CASE("every bf16 element of a block quantizes to the division's code for scales across the exponent range") {
  std::vector<float> amaxes = {1e-12f, 1e-10f, 3e-10f, 1.5e-8f, 6.1e-5f, 1.0f, 448.0f, 449.0f, 1e20f, 3e38f,
                               std::numeric_limits<float>::max()};
  std::mt19937 rng(20261204);
  for (int i = 0; i < 48; ++i) amaxes.push_back(std::ldexp(1.0f + (rng() % 1000) / 1000.0f, -33 + 5 * (i % 32)));
  uint64_t bad_codes = 0, bad_quotients = 0, checked = 0;
  for (float amax : amaxes) {
    for (Fp8ScaleFormat fmt : {Fp8ScaleFormat::kFloat32, Fp8ScaleFormat::kUe8m0}) {
      const float s = Fp8BlockScale(amax, fmt);
      REQUIRE(std::isfinite(s));
      const float r = Fp8Reciprocal(s);
      for (uint32_t b = 0; b < 65536; ++b) {
        const float x = F(b << 16);
        if (std::isnan(x) || std::fabs(x) > amax) continue;
        const float want = x / s, got = Fp8Quotient(x, s, r);
        bad_codes += FloatToE4m3(got) != FloatToE4m3(want);
        // Below 2^-100 the residual underflows and the quotient may be an ulp off (its code is zero either way).
        if (std::fabs(x) >= 0x1p-100f) bad_quotients += U(got) != U(want);
        ++checked;
      }
    }
  }
  INFO(checked << " elements checked");
  CHECK(checked > 1000000);
  CHECK(bad_codes == 0);
  CHECK(bad_quotients == 0);
}

// float16 and float32 inputs carry more significand bits than bf16: random significands against random scales.
TEST_CASE("the quotient equals the division for random float32 and float16 elements") {
  std::mt19937_64 rng(7);
  uint64_t bad = 0;
  for (int i = 0; i < 20000000; ++i) {
    const uint32_t bits = static_cast<uint32_t>(rng());
    const float s = F((127u << 23) | (bits & 0x7FFFFFu));
    const uint32_t xb = static_cast<uint32_t>(rng() >> 32);
    // Alternate: a full float32 significand, and a float16-shaped one (10 bits).
    const uint32_t xm = (i & 1) ? (xb & 0x7FFFFFu) : ((xb & 0x3FFu) << 13);
    const float x = F(((126u + (xb >> 31)) << 23) | xm);
    const float r = Fp8Reciprocal(s);
    bad += U(Fp8Quotient(x, s, r)) != U(x / s);
  }
  CHECK(bad == 0);
}

// A zero keeps its sign through the correction: e4m3 encodes -0 as 0x80 and +0 as 0x00.
TEST_CASE("the quotient of a signed zero keeps the sign") {
  const float s = Fp8BlockScale(3.0f), r = Fp8Reciprocal(s);
  CHECK(U(Fp8Quotient(-0.0f, s, r)) == 0x80000000u);
  CHECK(U(Fp8Quotient(0.0f, s, r)) == 0u);
  CHECK(FloatToE4m3(Fp8Quotient(-0.0f, s, r)) == 0x80);
}

// An infinite scale (a block whose amax is inf) is outside the contract: the kernel divides there. This pins why.
TEST_CASE("an infinite scale is outside the quotient's contract") {
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(Fp8Reciprocal(inf) == 0.0f);
  CHECK(std::isnan(Fp8Quotient(1.0f, inf, Fp8Reciprocal(inf))));
  CHECK(1.0f / inf == 0.0f);
}

}  // namespace
}  // namespace wsync::replica
