// base/checked_size.h: sizes that would wrap 64 bits are errors naming the thing, never a small wrapped value.
// Expectations are computed here with 128-bit arithmetic, not with the helper.

#include "base/checked_size.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <vector>

#include "absl/strings/match.h"

namespace wsync {
namespace {

TEST_CASE("checked size: products, sums and alignment that fit are exact; overflow is nullopt") {
  const uint64_t big = uint64_t{1} << 63;
  CHECK(CheckedMul(3, 5) == std::optional<uint64_t>(15));
  CHECK(CheckedMul(big, 1) == std::optional<uint64_t>(big));
  CHECK_FALSE(CheckedMul(big, 2));
  CHECK_FALSE(CheckedMul(uint64_t{1} << 32, uint64_t{1} << 32));
  CHECK(CheckedAdd(UINT64_MAX - 1, 1) == std::optional<uint64_t>(UINT64_MAX));
  CHECK_FALSE(CheckedAdd(UINT64_MAX, 1));
  CHECK(CheckedAlignUp(65, 64) == std::optional<uint64_t>(128));
  CHECK(CheckedAlignUp(128, 64) == std::optional<uint64_t>(128));
  CHECK_FALSE(CheckedAlignUp(UINT64_MAX - 10, 64));  // would wrap to a small value with (v + a - 1) / a * a
  CHECK_FALSE(CheckedAlignUp(5, 0));
}

TEST_CASE("checked size: shape x dtype matches 128-bit arithmetic and refuses what does not fit") {
  const std::vector<std::vector<int64_t>> ok = {{}, {0}, {7, 3}, {163840, 7168}, {384, 4096, 7168}, {int64_t{1} << 62}};
  for (const auto& shape : ok) {
    unsigned __int128 n = 1;
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    auto b = ShapeBytes(shape, DType::kF32, "t");
    if (n * 4 > UINT64_MAX) {
      CHECK_FALSE(b.ok());
    } else {
      REQUIRE(b.ok());
      CHECK(*b == static_cast<uint64_t>(n * 4));
    }
  }
  // 2^32 x 2^32 elements wrap to 0 in 64 bits; 2^62 f32 elements are 2^64 bytes.
  auto wrap = ShapeBytes({int64_t{1} << 32, int64_t{1} << 32}, DType::kBF16, "parameter w");
  REQUIRE_FALSE(wrap.ok());
  CHECK(absl::StrContains(wrap.status().message(), "parameter w"));
  CHECK_FALSE(ShapeBytes({int64_t{1} << 62}, DType::kF32, "t").ok());
  auto neg = ShapeBytes({4, -1}, DType::kBF16, "tensor x");
  REQUIRE_FALSE(neg.ok());
  CHECK(absl::StrContains(neg.status().message(), "negative"));
  CHECK_FALSE(ShapeBytes({4}, DType::kInvalid, "t").ok());
}

}  // namespace
}  // namespace wsync
