#include "replica/convert.h"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace wsync::replica {
namespace {

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST_CASE("bf16 rounding matches torch", "[replica][convert]") {
  CHECK(F32ToBf16(1.0f) == 0x3F80);
  CHECK(F32ToBf16(FromBits(0x3F808000)) == 0x3F80);  // tie, even stays
  CHECK(F32ToBf16(FromBits(0x3F818000)) == 0x3F82);  // tie, odd rounds up
  CHECK(F32ToBf16(FromBits(0x3F808001)) == 0x3F81);
  CHECK(F32ToBf16(std::numeric_limits<float>::infinity()) == 0x7F80);
  CHECK(F32ToBf16(FromBits(0x7F7FFFFF)) == 0x7F80);  // max float rounds to inf, as in torch
  CHECK(F32ToBf16(std::nanf("")) == 0x7FC0);
  CHECK(F32ToBf16(FromBits(0xFFC00001)) == 0x7FC0);
  CHECK(Bf16ToF32(0xC020) == -2.5f);
}

TEST_CASE("f16 conversions are exact and round to nearest even", "[replica][convert]") {
  // Every f16 value survives f16 → f32 → f16.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = F16ToF32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      CHECK((F32ToF16(f) & 0x7C00) == 0x7C00);
      continue;
    }
    REQUIRE(F32ToF16(f) == h);
  }
  CHECK(F16ToF32(0x0001) == std::ldexp(1.0f, -24));
  CHECK(F32ToF16(65504.0f) == 0x7BFF);
  CHECK(F32ToF16(65519.0f) == 0x7BFF);
  CHECK(F32ToF16(65520.0f) == 0x7C00);
  CHECK(F32ToF16(std::ldexp(1.0f, -25)) == 0x0000);                     // tie to even (0)
  CHECK(F32ToF16(std::ldexp(3.0f, -25)) == 0x0002);                     // 1.5 quanta → 2
  CHECK(F32ToF16(std::ldexp(1.0f, -25) * 1.0000001f) == 0x0001);
  CHECK(F32ToF16(1.0f + std::ldexp(1.0f, -11)) == 0x3C00);              // tie, even
  CHECK(F32ToF16(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3C02);          // tie, odd → up
  CHECK(F32ToF16(-0.0f) == 0x8000);
}

TEST_CASE("CopyRect copies strided rectangles", "[replica][convert]") {
  std::vector<uint16_t> src(4 * 6);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint16_t>(i);
  std::vector<uint16_t> dst(3 * 5, 0xFFFF);
  // rows 1..2, cols 2..4 of src → dst at (1, 1), dst stride 5.
  REQUIRE(CopyRect(DType::kBF16, reinterpret_cast<const uint8_t*>(src.data() + 1 * 6 + 2), 6, DType::kBF16,
                   reinterpret_cast<uint8_t*>(dst.data() + 1 * 5 + 1), 5, 2, 3)
              .ok());
  CHECK(dst[5 + 1] == 8);
  CHECK(dst[5 + 3] == 10);
  CHECK(dst[10 + 1] == 14);
  CHECK(dst[10 + 4] == 0xFFFF);
  CHECK(dst[5] == 0xFFFF);
  std::vector<float> f = {1.0f, 2.0f};
  std::vector<uint16_t> b(2);
  REQUIRE(CopyRect(DType::kF32, reinterpret_cast<const uint8_t*>(f.data()), 2, DType::kBF16,
                   reinterpret_cast<uint8_t*>(b.data()), 2, 1, 2)
              .ok());
  CHECK(b[1] == 0x4000);
  CHECK_FALSE(CopyRect(DType::kI32, reinterpret_cast<const uint8_t*>(f.data()), 2, DType::kBF16,
                       reinterpret_cast<uint8_t*>(b.data()), 2, 1, 2)
                  .ok());
  CHECK(CanConvert(DType::kF16, DType::kBF16));
  CHECK_FALSE(CanConvert(DType::kF8E4M3, DType::kBF16));
}

}  // namespace
}  // namespace wsync::replica
