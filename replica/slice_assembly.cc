#include "replica/slice_assembly.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"

namespace wsync::replica {

bool SlicesOverlap(const TensorSlice& a, const TensorSlice& b) {
  return a.row0 < b.row0 + b.rows && b.row0 < a.row0 + a.rows && a.col0 < b.col0 + b.cols && b.col0 < a.col0 + a.cols;
}

bool SlicesCover(absl::Span<const TensorRead> need, absl::Span<const TensorSlice> landed) {
  for (const TensorRead& n : need) {
    uint64_t covered = 0;
    for (const TensorSlice& g : landed) {
      const int64_t r0 = std::max(n.row0, g.row0), r1 = std::min(n.row0 + n.rows, g.row0 + g.rows);
      const int64_t c0 = std::max(n.col0, g.col0), c1 = std::min(n.col0 + n.cols, g.col0 + g.cols);
      if (r1 > r0 && c1 > c0) covered += static_cast<uint64_t>((r1 - r0) * (c1 - c0));
    }
    if (covered < static_cast<uint64_t>(n.rows * n.cols)) return false;
  }
  return true;
}

void LandSlice(const TensorSlice& s, size_t elem_size, absl::Span<const PlacedRect> rects, const uint8_t* data,
               absl::FunctionRef<uint8_t*(int layout)> buffer) {
  // All in bytes of the tensor's 2-D row-major view: the slice covers columns [c0, c1) of rows [row0, row0 + rows);
  // a rectangle's i-th row is the tensor bytes [a, a + row_bytes), a = src_offset + i * src_pitch, which may span
  // several tensor rows (a contiguous run).
  const uint64_t es = elem_size;
  const uint64_t trow = static_cast<uint64_t>(s.full_cols) * es;
  const uint64_t c0 = static_cast<uint64_t>(s.col0) * es, c1 = static_cast<uint64_t>(s.col0 + s.cols) * es;
  const uint64_t slice_row = static_cast<uint64_t>(s.cols) * es;
  const uint64_t begin = static_cast<uint64_t>(s.row0) * trow + c0;
  const uint64_t end = static_cast<uint64_t>(s.row0 + s.rows - 1) * trow + c1;
  for (const PlacedRect& r : rects) {
    if (r.rows <= 0 || r.row_bytes == 0) continue;
    // Only the rectangle's rows that can meet [begin, end).
    int64_t i0 = 0, i1 = r.rows;
    if (r.src_pitch > 0) {
      if (end <= r.src_offset) continue;
      i1 = std::min<int64_t>(r.rows, static_cast<int64_t>((end - 1 - r.src_offset) / r.src_pitch) + 1);
      if (begin >= r.src_offset + r.row_bytes)
        i0 = static_cast<int64_t>((begin - r.src_offset - r.row_bytes) / r.src_pitch) + 1;
    }
    uint8_t* dst = buffer(r.layout) + r.offset;
    for (int64_t i = i0; i < i1; ++i) {
      const uint64_t a = r.src_offset + static_cast<uint64_t>(i) * r.src_pitch, b = a + r.row_bytes;
      const int64_t t0 = std::max<int64_t>(s.row0, static_cast<int64_t>(a / trow));
      const int64_t t1 = std::min<int64_t>(s.row0 + s.rows, static_cast<int64_t>((b - 1) / trow) + 1);
      for (int64_t t = t0; t < t1; ++t) {
        const uint64_t row = static_cast<uint64_t>(t) * trow;
        const uint64_t lo = std::max(a, row + c0), hi = std::min(b, row + c1);
        if (lo >= hi) continue;
        std::memcpy(dst + static_cast<uint64_t>(i) * r.pitch + (lo - a),
                    data + static_cast<uint64_t>(t - s.row0) * slice_row + (lo - row - c0), hi - lo);
      }
    }
  }
}

void StageSlice(const TensorSlice& s, size_t elem_size, const uint8_t* data, uint8_t* whole) {
  const size_t row_bytes = static_cast<size_t>(s.cols) * elem_size;
  for (int64_t r = 0; r < s.rows; ++r)
    std::memcpy(whole + static_cast<size_t>((s.row0 + r) * s.full_cols + s.col0) * elem_size,
                data + static_cast<size_t>(r) * row_bytes, row_bytes);
}

bool IsExpertTensor(absl::string_view name) { return absl::StrContains(name, ".experts."); }

bool IsScaleFrame(absl::string_view name) { return absl::EndsWith(name, "_scale_inv"); }

}  // namespace wsync::replica
