// Slice descriptors: the wire form round-trips, every accepted form maps to the right rectangle of the 2-D view,
// and malformed slices are refused naming the tensor and the ranges.
#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "base/tensor_slice.h"

namespace wsync {
namespace {

TensorSlice Parse(const std::string& name, std::vector<int64_t> extents) {
  auto s = ParseSliceName(name, extents);
  INFO(s.status().ToString());
  REQUIRE(s.ok());
  REQUIRE(s->has_value());
  return **s;
}

TEST_CASE("slice names round-trip and map to 2-D rectangles", "[slice]") {
  // Rows of a 2-D tensor (a column-parallel TP shard).
  TensorSlice a = Parse(EncodeSliceName("model.layers.0.self_attn.q_proj.weight", {4096, 1024}, {2048, 0}), {1024, 1024});
  CHECK(a.name == "model.layers.0.self_attn.q_proj.weight");
  CHECK(a.full_shape == std::vector<int64_t>{4096, 1024});
  CHECK((a.row0 == 2048 && a.rows == 1024 && a.col0 == 0 && a.cols == 1024));
  // Columns of a 2-D tensor (a row-parallel TP shard).
  TensorSlice b = Parse(EncodeSliceName("o", {64, 128}, {0, 96}), {64, 32});
  CHECK((b.row0 == 0 && b.rows == 64 && b.col0 == 96 && b.cols == 32 && b.full_cols == 128));
  // Whole experts of a stacked [E, N, K] tensor: rows of the [E*N, K] view.
  TensorSlice c = Parse(EncodeSliceName("experts", {8, 6, 4}, {2, 0, 0}), {3, 6, 4});
  CHECK((c.row0 == 12 && c.rows == 18 && c.col0 == 0 && c.cols == 4 && c.full_rows == 48));
  // A 1-D range is rows of [n, 1].
  TensorSlice d = Parse(EncodeSliceName("bias", {10}, {4}), {6});
  CHECK((d.row0 == 4 && d.rows == 6 && d.cols == 1));
  // Plain names are not slices.
  auto plain = ParseSliceName("model.norm.weight", std::vector<int64_t>{64});
  REQUIRE(plain.ok());
  CHECK_FALSE(plain->has_value());
}

TEST_CASE("malformed slices are refused naming tensor and ranges", "[slice]") {
  struct Case {
    std::string name;
    std::vector<int64_t> extents;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {EncodeSliceName("q", {8, 4}, {6, 0}), {4, 4}, "dim 0 range [6, 10) is empty or outside [0, 8)"},
      {EncodeSliceName("q", {8, 4}, {-1, 0}), {4, 4}, "outside"},
      {EncodeSliceName("q", {8, 4}, {0, 0}), {0, 4}, "empty"},
      {EncodeSliceName("q", {8, 4}, {0}), {4, 4}, "differ in rank"},
      {EncodeSliceName("e", {8, 6, 4}, {0, 2, 0}), {8, 2, 4}, "dim 0"},
      {"q|slice|8x4", {4, 4}, "expected"},
      {"q|slice|8xA|0,0", {4, 4}, "malformed shape"},
  };
  for (const auto& c : cases) {
    INFO(c.name);
    auto s = ParseSliceName(c.name, c.extents);
    REQUIRE_FALSE(s.ok());
    CHECK(s.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(s.status().message(), c.expect));
    CHECK(absl::StrContains(s.status().message(), c.name.substr(0, 1)));
  }
}

}  // namespace
}  // namespace wsync
