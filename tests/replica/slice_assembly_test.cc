// Slice assembly (replica/slice_assembly.h): slices landed one by one, in any order, leave the layout buffers exactly
// as the whole tensor copied by its placements would (computed here row by row from the whole tensor, not through
// the slices), and nothing else; a subset lands exactly the bytes of the elements it holds.
#include "replica/slice_assembly.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace wsync::replica {
namespace {

constexpr uint8_t kFill = 0xEE;
constexpr int64_t kRows = 37, kCols = 29;
constexpr size_t kEs = 2;  // bf16

uint8_t WholeByte(uint64_t i) { return static_cast<uint8_t>((i * 131 + 7) ^ (i >> 8)); }

TensorSlice Slice(int64_t r0, int64_t rows, int64_t c0, int64_t cols) {
  TensorSlice s;
  s.name = "model.layers.0.mlp.down_proj.weight";
  s.full_shape = {kRows, kCols};
  s.offsets = {r0, c0};
  s.extents = {rows, cols};
  s.row0 = r0, s.rows = rows, s.col0 = c0, s.cols = cols;
  s.full_rows = kRows, s.full_cols = kCols;
  return s;
}

// The slice's data as a trainer pushes it: its rows × cols elements, row-major.
std::vector<uint8_t> SliceData(const TensorSlice& s) {
  std::vector<uint8_t> out;
  for (int64_t r = s.row0; r < s.row0 + s.rows; ++r)
    for (uint64_t b = (r * kCols + s.col0) * kEs; b < (r * kCols + s.col0 + s.cols) * kEs; ++b)
      out.push_back(WholeByte(b));
  return out;
}

// A TP column shard with gaps between rows, a contiguous run of whole rows, a strided run whose rows span several
// tensor rows and start mid-element-row: every shape PlaceRects produces.
std::vector<PlacedRect> Rects() {
  const uint64_t trow = kCols * kEs;
  return {
      {0, 100, 19 * kEs + 8, 10 * kEs, trow, kRows, 19 * kEs},
      {1, 7, 0, 5 * trow, 0, 1, 15 * trow},
      {1, 15 * trow + 64, 2 * trow + 10, 20 * trow + 4, 4 * trow, 3, 2 * trow + 6},
  };
}

// Whether tensor byte `b` belongs to an element of one of `slices`.
bool Held(uint64_t b, const std::vector<TensorSlice>& slices) {
  const int64_t e = static_cast<int64_t>(b / kEs), r = e / kCols, c = e % kCols;
  return std::any_of(slices.begin(), slices.end(), [&](const TensorSlice& s) {
    return r >= s.row0 && r < s.row0 + s.rows && c >= s.col0 && c < s.col0 + s.cols;
  });
}

// The buffers after the placements copied the tensor bytes the slices hold, row by row from the whole tensor.
std::vector<std::vector<uint8_t>> Expected(const std::vector<TensorSlice>& landed, size_t buffer_bytes) {
  std::vector<std::vector<uint8_t>> out(2, std::vector<uint8_t>(buffer_bytes, kFill));
  for (const PlacedRect& r : Rects())
    for (int64_t i = 0; i < r.rows; ++i)
      for (uint64_t k = 0; k < r.row_bytes; ++k) {
        const uint64_t b = r.src_offset + i * r.src_pitch + k;
        if (Held(b, landed)) out[r.layout][r.offset + i * r.pitch + k] = WholeByte(b);
      }
  return out;
}

std::vector<TensorSlice> Grid() {
  const std::vector<int64_t> rows = {0, 3, 17, 30, kRows}, cols = {0, 1, 12, kCols};
  std::vector<TensorSlice> out;
  for (size_t i = 0; i + 1 < rows.size(); ++i)
    for (size_t j = 0; j + 1 < cols.size(); ++j)
      out.push_back(Slice(rows[i], rows[i + 1] - rows[i], cols[j], cols[j + 1] - cols[j]));
  return out;
}

}  // namespace

TEST_CASE("slices landed in any order place the tensor as its placements would; a subset lands only its elements") {
  constexpr size_t kBuffer = 4096;
  std::vector<TensorSlice> slices = Grid();
  std::mt19937 rng(5);
  for (int round = 0; round < 3; ++round) {
    std::shuffle(slices.begin(), slices.end(), rng);
    std::vector<std::vector<uint8_t>> buffers(2, std::vector<uint8_t>(kBuffer, kFill));
    const std::vector<PlacedRect> rects = Rects();
    std::vector<TensorSlice> landed;
    for (const TensorSlice& s : slices) {
      const std::vector<uint8_t> data = SliceData(s);
      LandSlice(s, kEs, rects, data.data(), [&](int layout) { return buffers[layout].data(); });
      landed.push_back(s);
      if (landed.size() == slices.size() / 2) CHECK(buffers == Expected(landed, kBuffer));
    }
    CHECK(buffers == Expected(landed, kBuffer));
  }
}

TEST_CASE("slices staged into the whole tensor rebuild it byte for byte") {
  std::vector<uint8_t> whole(kRows * kCols * kEs, kFill);
  for (const TensorSlice& s : Grid()) {
    const std::vector<uint8_t> data = SliceData(s);
    StageSlice(s, kEs, data.data(), whole.data());
  }
  for (uint64_t b = 0; b < whole.size(); ++b) {
    INFO("byte " << b);
    REQUIRE(whole[b] == WholeByte(b));
  }
}

TEST_CASE("overlap and coverage of slices") {
  CHECK(SlicesOverlap(Slice(0, 4, 0, 4), Slice(3, 2, 3, 2)));
  CHECK_FALSE(SlicesOverlap(Slice(0, 4, 0, 4), Slice(4, 2, 0, 4)));  // touching rows
  CHECK_FALSE(SlicesOverlap(Slice(0, 4, 0, 4), Slice(0, 4, 4, 2)));  // touching columns
  CHECK(SlicesOverlap(Slice(2, 1, 0, kCols), Slice(0, kRows, 5, 1)));

  TensorRead a;
  a.row0 = 0, a.rows = 10, a.col0 = 10, a.cols = 19;  // a column shard of the first ten rows
  TensorRead b;
  b.row0 = 30, b.rows = 7, b.col0 = 0, b.cols = kCols;
  const std::vector<TensorRead> need = {a, b};
  std::vector<TensorSlice> landed = {Slice(0, 10, 0, kCols)};
  CHECK_FALSE(SlicesCover(need, landed));
  landed.push_back(Slice(30, 7, 0, 20));
  CHECK_FALSE(SlicesCover(need, landed));  // b lacks columns [20, 29)
  landed.push_back(Slice(30, 7, 20, 9));
  CHECK(SlicesCover(need, landed));  // rows 10..29 are read by nobody here: never needed
  CHECK(SlicesCover({}, {}));
}

TEST_CASE("push-order and frame rules of the model names") {
  CHECK(IsExpertTensor("model.layers.3.mlp.experts.17.down_proj.weight"));
  CHECK_FALSE(IsExpertTensor("model.layers.3.mlp.shared_experts.down_proj.weight"));
  CHECK(IsScaleFrame("model.layers.3.mlp.experts.17.down_proj.weight_scale_inv"));
  CHECK_FALSE(IsScaleFrame("model.layers.3.mlp.experts.17.down_proj.weight"));
}

}  // namespace wsync::replica
