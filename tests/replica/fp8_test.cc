#include "replica/fp8.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace wsync::replica {
namespace {

// e4m3fn value of a code from the format's definition (1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no
// infinities, S.1111.111 is NaN), written independently of fp8.h.
double RefDecode(int code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return s ? -mag : mag;
}

// Nearest code by exhaustive search, ties to the even code, |x| > 448 saturating, NaN → 0x7F|sign.
int RefEncode(float x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xFF : 0x7F;
  const double a = std::fabs(static_cast<double>(x));
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7E; ++c) {
    const double err = std::fabs(RefDecode(c) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  if (a > 448.0) best = 0x7E;
  return (std::signbit(x) ? 0x80 : 0) | best;
}

uint16_t Bf16(float f) { return FloatToBf16(f); }

TEST_CASE("e4m3 decode: hand-known values", "[fp8]") {
  CHECK(E4m3ToFloat(0x00) == 0.0f);
  CHECK(std::signbit(E4m3ToFloat(0x80)));
  CHECK(E4m3ToFloat(0x80) == 0.0f);
  CHECK(E4m3ToFloat(0x01) == std::ldexp(1.0f, -9));  // smallest subnormal
  CHECK(E4m3ToFloat(0x02) == std::ldexp(1.0f, -8));
  CHECK(E4m3ToFloat(0x07) == 7 * std::ldexp(1.0f, -9));  // largest subnormal
  CHECK(E4m3ToFloat(0x08) == std::ldexp(1.0f, -6));      // smallest normal
  CHECK(E4m3ToFloat(0x38) == 1.0f);
  CHECK(E4m3ToFloat(0x3C) == 1.5f);
  CHECK(E4m3ToFloat(0x40) == 2.0f);
  CHECK(E4m3ToFloat(0x77) == 240.0f);
  CHECK(E4m3ToFloat(0x78) == 256.0f);
  CHECK(E4m3ToFloat(0x7E) == 448.0f);
  CHECK(E4m3ToFloat(0xFE) == -448.0f);
  CHECK(E4m3ToFloat(0xB8) == -1.0f);
  CHECK(std::isnan(E4m3ToFloat(0x7F)));
  CHECK(std::isnan(E4m3ToFloat(0xFF)));
}

TEST_CASE("e4m3 decode matches the format definition for all 256 codes", "[fp8]") {
  for (int c = 0; c < 256; ++c) {
    INFO("code " << c);
    const double ref = RefDecode(c);
    const float got = E4m3ToFloat(static_cast<uint8_t>(c));
    if (std::isnan(ref)) {
      CHECK(std::isnan(got));
    } else {
      CHECK(static_cast<double>(got) == ref);
      CHECK(std::signbit(got) == ((c & 0x80) != 0));
    }
  }
}

TEST_CASE("e4m3 round trip of all 256 codes", "[fp8]") {
  for (int c = 0; c < 256; ++c) {
    INFO("code " << c);
    CHECK(FloatToE4m3(E4m3ToFloat(static_cast<uint8_t>(c))) == c);
  }
}

TEST_CASE("e4m3 encode: ties go to the even code", "[fp8]") {
  for (int c = 0; c < 0x7E; ++c) {
    INFO("between codes " << c << " and " << c + 1);
    const float lo = E4m3ToFloat(static_cast<uint8_t>(c));
    const float hi = E4m3ToFloat(static_cast<uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;  // exact in float32
    const int even = (c & 1) == 0 ? c : c + 1;
    CHECK(FloatToE4m3(mid) == even);
    CHECK(FloatToE4m3(-mid) == (0x80 | even));
    CHECK(FloatToE4m3(std::nextafter(mid, 0.0f)) == c);
    CHECK(FloatToE4m3(std::nextafter(mid, 1000.0f)) == c + 1);
  }
  CHECK(FloatToE4m3(std::ldexp(1.0f, -10)) == 0x00);      // half the smallest subnormal: tie to 0
  CHECK(FloatToE4m3(3 * std::ldexp(1.0f, -10)) == 0x02);  // 1.5 * 2^-9: tie to 2 * 2^-9
  CHECK(FloatToE4m3(std::ldexp(1.0f, -11)) == 0x00);
  CHECK(FloatToE4m3(1.0625f) == 0x38);                        // 1 + 1/16: tie between 1.0 and 1.125 → 1.0
  CHECK(FloatToE4m3(1.1875f) == 0x3A);                        // 1.125 + 1/16: tie → 1.25 (mantissa 2)
  CHECK(FloatToE4m3(15.5f * std::ldexp(1.0f, -10)) == 0x08);  // 7.75 * 2^-9 rounds up into the first normal
}

TEST_CASE("e4m3 encode saturates and keeps NaN", "[fp8]") {
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(FloatToE4m3(448.0f) == 0x7E);
  CHECK(FloatToE4m3(449.0f) == 0x7E);
  CHECK(FloatToE4m3(464.0f) == 0x7E);  // the tie that would round to 480 (NaN's code) saturates
  CHECK(FloatToE4m3(500.0f) == 0x7E);
  CHECK(FloatToE4m3(1e30f) == 0x7E);
  CHECK(FloatToE4m3(std::numeric_limits<float>::max()) == 0x7E);
  CHECK(FloatToE4m3(inf) == 0x7E);
  CHECK(FloatToE4m3(-inf) == 0xFE);
  CHECK(FloatToE4m3(-1e30f) == 0xFE);
  CHECK(FloatToE4m3(std::numeric_limits<float>::quiet_NaN()) == 0x7F);
  CHECK(FloatToE4m3(-std::numeric_limits<float>::quiet_NaN()) == 0xFF);
  CHECK(FloatToE4m3(std::numeric_limits<float>::denorm_min()) == 0x00);
  CHECK(FloatToE4m3(-0.0f) == 0x80);
}

TEST_CASE("e4m3 encode agrees with exhaustive nearest-code search", "[fp8]") {
  // Every bf16 bit pattern (all exponents, both signs, NaN/inf), then random float32 in the interesting range.
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float x = Bf16ToFloat(static_cast<uint16_t>(b));
    INFO("bf16 bits " << b << " value " << x);
    REQUIRE(FloatToE4m3(x) == RefEncode(x));
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-14.0f, 10.0f);
  for (int i = 0; i < 200000; ++i) {
    float x = std::exp2(exponent(rng));
    if (i & 1) x = -x;
    INFO("value " << x);
    REQUIRE(FloatToE4m3(x) == RefEncode(x));
  }
}

TEST_CASE("bf16 and f16 conversions", "[fp8]") {
  CHECK(Bf16ToFloat(0x3F80) == 1.0f);
  CHECK(Bf16ToFloat(0xC000) == -2.0f);
  CHECK(FloatToBf16(1.0f) == 0x3F80);
  CHECK(FloatToBf16(BitsToFloat(0x3F808000u)) == 0x3F80);  // tie → even
  CHECK(FloatToBf16(BitsToFloat(0x3F818000u)) == 0x3F82);  // tie → even (up)
  CHECK(FloatToBf16(BitsToFloat(0x3F808001u)) == 0x3F81);
  CHECK(FloatToBf16(std::numeric_limits<float>::infinity()) == 0x7F80);
  CHECK((FloatToBf16(std::numeric_limits<float>::quiet_NaN()) & 0x7FFF) > 0x7F80);
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(b));
    if (!std::isnan(f)) REQUIRE(FloatToBf16(f) == b);
  }
  CHECK(F16ToFloat(0x3C00) == 1.0f);
  CHECK(F16ToFloat(0xC000) == -2.0f);
  CHECK(F16ToFloat(0x7BFF) == 65504.0f);
  CHECK(F16ToFloat(0x0400) == std::ldexp(1.0f, -14));
  CHECK(F16ToFloat(0x0001) == std::ldexp(1.0f, -24));
  CHECK(F16ToFloat(0x03FF) == 1023 * std::ldexp(1.0f, -24));
  CHECK(F16ToFloat(0x8001) == -std::ldexp(1.0f, -24));
  CHECK(F16ToFloat(0x7C00) == std::numeric_limits<float>::infinity());
  CHECK(F16ToFloat(0xFC00) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(F16ToFloat(0x7E00)));
  CHECK(std::signbit(F16ToFloat(0x8000)));
}

TEST_CASE("block quantization: a block with a hand-computed scale", "[fp8]") {
  // amax 896 → scale 896/448 = 2, inverse 0.5.
  const std::vector<float> vals = {896.0f, 1.0f, -3.0f, 0.0f, -896.0f, 0.25f, 100.0f, 1.0f / 256};
  std::vector<uint16_t> src;
  for (float v : vals) src.push_back(Bf16(v));
  std::vector<uint8_t> dst(8, 0xAA);
  float scale = -1;
  REQUIRE(QuantizeFp8Block(DType::kBF16, reinterpret_cast<const uint8_t*>(src.data()), 2, 4, 4, 128, 128, dst.data(), 4,
                           &scale, 1)
              .ok());
  CHECK(scale == 2.0f);
  CHECK(dst[0] == 0x7E);  // 448
  CHECK(dst[1] == 0x30);  // 0.5
  CHECK(dst[2] == 0xBC);  // -1.5
  CHECK(dst[3] == 0x00);
  CHECK(dst[4] == 0xFE);  // -448
  CHECK(dst[5] == 0x20);  // 0.125 = 2^-3
  CHECK(dst[6] == 0x64);  // 50: tie between 48 (2^5 * 1.5) and 52 → the even mantissa, 48
  CHECK(dst[7] == 0x01);  // 2^-8 * 0.5 = 2^-9, the smallest subnormal
}

TEST_CASE("block quantization: scale that is not a power of two divides x / scale", "[fp8]") {
  // amax 3 → scale 3/448; 1 / scale = 149.33... lies between 144 (2^7 * 1.125) and 160 (2^7 * 1.25) and is nearer
  // 144.
  std::vector<uint16_t> src = {Bf16(3.0f), Bf16(1.0f), Bf16(-2.0f), Bf16(0.5f)};
  std::vector<uint8_t> dst(4);
  float scale = 0;
  REQUIRE(QuantizeFp8Block(DType::kBF16, reinterpret_cast<const uint8_t*>(src.data()), 1, 4, 4, 128, 128, dst.data(), 4,
                           &scale, 1)
              .ok());
  CHECK(scale == 3.0f / 448.0f);
  CHECK(dst[0] == FloatToE4m3(std::min(3.0f / (3.0f / 448.0f), 448.0f)));
  CHECK(dst[0] == 0x7E);
  CHECK(dst[1] == 0x71);  // 144 = 2^7 * 1.125
  CHECK(dst[2] == 0xF9);  // -298.67 → -288 = -(2^8 * 1.125)
  CHECK(dst[3] == 0x69);  // 74.67 → 72 = 2^6 * 1.125
}

TEST_CASE("block quantization: all-zero block gets the eps scale", "[fp8]") {
  std::vector<uint16_t> src(16, 0);
  src[3] = 0x8000;  // -0
  std::vector<uint8_t> dst(16, 0xAA);
  float scale = -1;
  REQUIRE(QuantizeFp8Block(DType::kBF16, reinterpret_cast<const uint8_t*>(src.data()), 4, 4, 4, 4, 4, dst.data(), 4,
                           &scale, 1)
              .ok());
  CHECK(scale == 1e-10f / 448.0f);
  for (int i = 0; i < 16; ++i) CHECK(dst[i] == (i == 3 ? 0x80 : 0x00));
}

// Straightforward scalar model of the convention, for comparing the vectorized kernel.
void RefQuantize(const std::vector<float>& x, int64_t rows, int64_t cols, int bn, int bk, std::vector<uint8_t>* q,
                 std::vector<float>* s, bool ue8m0 = false) {
  const int64_t sr = (rows + bn - 1) / bn, sc = (cols + bk - 1) / bk;
  q->assign(rows * cols, 0);
  s->assign(sr * sc, 0);
  for (int64_t br = 0; br < sr; ++br) {
    for (int64_t bc = 0; bc < sc; ++bc) {
      float amax = 0;
      for (int64_t r = br * bn; r < std::min(rows, (br + 1) * bn); ++r)
        for (int64_t c = bc * bk; c < std::min(cols, (bc + 1) * bk); ++c)
          amax = std::max(amax, std::fabs(x[r * cols + c]));
      float scale = std::max(amax, 1e-10f) / 448.0f;
      if (ue8m0) scale = std::exp2(std::ceil(std::log2(static_cast<double>(scale))));  // exact in double
      (*s)[br * sc + bc] = scale;
      for (int64_t r = br * bn; r < std::min(rows, (br + 1) * bn); ++r)
        for (int64_t c = bc * bk; c < std::min(cols, (bc + 1) * bk); ++c) {
          const float v = std::min(448.0f, std::max(-448.0f, x[r * cols + c] / scale));
          (*q)[r * cols + c] = static_cast<uint8_t>(RefEncode(v));
        }
    }
  }
}

TEST_CASE("block quantization matches the scalar model, with partial blocks and padded strides", "[fp8]") {
  struct Case {
    int64_t rows, cols;
    int bn, bk;
  };
  const Case cases[] = {{256, 384, 128, 128}, {128, 192, 64, 64}, {130, 200, 128, 128}, {7, 13, 4, 8},
                        {64, 64, 128, 128},   {1, 1, 128, 128},   {33, 257, 16, 32}};
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> mag(-20.0f, 4.0f);
  for (const Case& k : cases) {
    INFO("shape " << k.rows << "x" << k.cols << " block " << k.bn << "x" << k.bk);
    const int64_t src_stride = k.cols + 5, dst_stride = k.cols + 3;
    const int64_t sr = (k.rows + k.bn - 1) / k.bn, sc = (k.cols + k.bk - 1) / k.bk;
    const int64_t scale_stride = sc + 2;
    // Values spread over many magnitudes; per-block scale varies because blocks get different amax.
    std::vector<float> x(k.rows * k.cols);
    for (auto& v : x) v = Bf16ToFloat(Bf16(normal(rng) * std::exp2(mag(rng))));
    std::vector<uint8_t> ref_q;
    std::vector<float> ref_s;
    RefQuantize(x, k.rows, k.cols, k.bn, k.bk, &ref_q, &ref_s);

    std::vector<uint16_t> bf16(k.rows * src_stride, 0x7FC0);  // NaN padding must not leak into amax
    std::vector<uint16_t> f16(k.rows * src_stride, 0x7E00);
    std::vector<float> f32(k.rows * src_stride, std::numeric_limits<float>::quiet_NaN());
    for (int64_t r = 0; r < k.rows; ++r)
      for (int64_t c = 0; c < k.cols; ++c) {
        bf16[r * src_stride + c] = Bf16(x[r * k.cols + c]);
        f32[r * src_stride + c] = x[r * k.cols + c];
      }
    struct Src {
      DType dtype;
      const uint8_t* data;
    };
    std::vector<Src> srcs = {{DType::kBF16, reinterpret_cast<const uint8_t*>(bf16.data())},
                             {DType::kF32, reinterpret_cast<const uint8_t*>(f32.data())}};
    for (const Src& s : srcs) {
      INFO("dtype " << DTypeName(s.dtype));
      std::vector<uint8_t> q(k.rows * dst_stride, 0xAA);
      std::vector<float> scale(sr * scale_stride, -7.0f);
      REQUIRE(QuantizeFp8Block(s.dtype, s.data, k.rows, k.cols, src_stride, k.bn, k.bk, q.data(), dst_stride,
                               scale.data(), scale_stride)
                  .ok());
      for (int64_t r = 0; r < sr; ++r)
        for (int64_t c = 0; c < scale_stride; ++c) {
          if (c < sc) {
            REQUIRE(scale[r * scale_stride + c] == ref_s[r * sc + c]);
          } else {
            REQUIRE(scale[r * scale_stride + c] == -7.0f);  // padding untouched
          }
        }
      for (int64_t r = 0; r < k.rows; ++r)
        for (int64_t c = 0; c < dst_stride; ++c) {
          INFO("element " << r << "," << c);
          REQUIRE(q[r * dst_stride + c] == (c < k.cols ? ref_q[r * k.cols + c] : 0xAA));
        }
    }
  }
}

TEST_CASE("block quantization of f16 input equals that of the same values in f32", "[fp8]") {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> bits(0, 0x7BFF);  // finite f16 magnitudes
  const int64_t rows = 40, cols = 70;
  std::vector<uint16_t> h(rows * cols);
  std::vector<float> f(rows * cols);
  for (size_t i = 0; i < h.size(); ++i) {
    h[i] = static_cast<uint16_t>(bits(rng) | ((i & 1) ? 0x8000 : 0));
    f[i] = F16ToFloat(h[i]);
  }
  std::vector<uint8_t> qh(rows * cols), qf(rows * cols);
  std::vector<float> sh(4 * 5), sf(4 * 5);
  REQUIRE(QuantizeFp8Block(DType::kF16, reinterpret_cast<const uint8_t*>(h.data()), rows, cols, cols, 16, 16, qh.data(),
                           cols, sh.data(), 5)
              .ok());
  REQUIRE(QuantizeFp8Block(DType::kF32, reinterpret_cast<const uint8_t*>(f.data()), rows, cols, cols, 16, 16, qf.data(),
                           cols, sf.data(), 5)
              .ok());
  CHECK(qh == qf);
  CHECK(sh == sf);
}

TEST_CASE("block quantization: NaN and inf elements", "[fp8]") {
  std::vector<float> x = {1.0f, std::numeric_limits<float>::quiet_NaN(), -2.0f, 0.5f};
  std::vector<uint8_t> q(4);
  float s = 0;
  REQUIRE(
      QuantizeFp8Block(DType::kF32, reinterpret_cast<const uint8_t*>(x.data()), 1, 4, 4, 128, 128, q.data(), 4, &s, 1)
          .ok());
  CHECK(s == 2.0f / 448.0f);  // NaN ignored by amax
  CHECK(q[1] == 0x7F);
  CHECK(q[2] == 0xFE);
}

TEST_CASE("block quantization rejects bad arguments", "[fp8]") {
  uint8_t src[8] = {}, dst[8] = {};
  float s[4] = {};
  CHECK(QuantizeFp8Block(DType::kI32, src, 1, 2, 2, 128, 128, dst, 2, s, 1).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(QuantizeFp8Block(DType::kBF16, src, 1, 2, 2, 0, 128, dst, 2, s, 1).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(QuantizeFp8Block(DType::kBF16, src, 1, 4, 2, 128, 128, dst, 4, s, 1).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(QuantizeFp8Block(DType::kBF16, src, 1, 4, 4, 2, 2, dst, 4, s, 1).code() ==
        absl::StatusCode::kInvalidArgument);                                     // scale stride 1 < 2 scale columns
  CHECK(QuantizeFp8Block(DType::kBF16, src, 0, 4, 4, 2, 2, dst, 4, s, 1).ok());  // empty is fine
}

}  // namespace
}  // namespace wsync::replica

namespace wsync::replica {
namespace {

TEST_CASE("block quantization: UE8M0 scales are the next power of two; codes divide by them", "[fp8]") {
  CHECK(RoundUpToPow2(1.0f) == 1.0f);
  CHECK(RoundUpToPow2(0.75f) == 1.0f);
  CHECK(RoundUpToPow2(3.0f / 448.0f) == 1.0f / 128);
  CHECK(RoundUpToPow2(std::nextafter(0.5f, 1.0f)) == 1.0f);
  // Random blocks against the scalar model with UE8M0 scales.
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t rows = 96, cols = 160;
  std::vector<float> x(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float mag = std::exp2(static_cast<float>(r % 13) - 8.0f);
    for (int64_t c = 0; c < cols; ++c) x[r * cols + c] = BitsToFloat(FloatBits(nd(rng) * mag) & 0xFFFF0000u);
  }
  std::vector<uint16_t> src(x.size());
  for (size_t i = 0; i < x.size(); ++i) src[i] = static_cast<uint16_t>(FloatBits(x[i]) >> 16);
  std::vector<uint8_t> q(x.size()), want_q;
  std::vector<float> s(((rows + 31) / 32) * ((cols + 31) / 32)), want_s;
  REQUIRE(QuantizeFp8Block(DType::kBF16, reinterpret_cast<const uint8_t*>(src.data()), rows, cols, cols, 32, 32,
                           q.data(), cols, s.data(), (cols + 31) / 32, Fp8ScaleFormat::kUe8m0)
              .ok());
  RefQuantize(x, rows, cols, 32, 32, &want_q, &want_s, /*ue8m0=*/true);
  CHECK(s == want_s);
  CHECK(q == want_q);
  for (float v : s) CHECK((FloatBits(v) & 0x007FFFFFu) == 0);  // powers of two
}

}  // namespace
}  // namespace wsync::replica
