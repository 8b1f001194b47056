#pragma once
// A slice of an HF tensor pushed by a trainer rank that holds only part of it (a TP shard, some experts).
//
// On the wire a slice is an ordinary ring tensor frame whose shape is the slice's extents and whose name carries the
// tensor's name, its full shape and the slice's offsets: "<name>|slice|<d0>x<d1>...|<o0>,<o1>...". HF names never
// contain '|'. Keeping the frame format unchanged means every producer (C++, C API, Python) only formats a name.
//
// Accepted forms (ValidateSlice): a range along dim 0 with every other dim whole (row ranges of a 2-D tensor, whole
// experts of a stacked per-expert tensor), or any rectangle of a 2-D tensor (e.g. a column range). Each maps to one
// rectangle of the tensor's 2-D row-major view [rows, cols] (1-D tensors as [n, 1]) that the replica reads.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace wsync {

struct TensorSlice {
  std::string name;                 // the HF tensor's name
  std::vector<int64_t> full_shape;  // the whole tensor's shape
  std::vector<int64_t> offsets;     // per dim
  std::vector<int64_t> extents;     // per dim: the shape of the data pushed
  // The slice as a rectangle of the 2-D view, in elements.
  int64_t row0 = 0, rows = 0, col0 = 0, cols = 0;
  int64_t full_rows = 0, full_cols = 0;
  std::string Describe() const;  // "rows [a, b) cols [c, d) of [R, C]"
};

inline constexpr absl::string_view kSliceMarker = "|slice|";

// "<name>|slice|<full shape>|<offsets>".
std::string EncodeSliceName(absl::string_view name, absl::Span<const int64_t> full_shape,
                            absl::Span<const int64_t> offsets);

// Checks a slice and fills its 2-D rectangle. InvalidArgument naming the tensor and the ranges for mismatched ranks,
// negative or out-of-range offsets/extents, empty slices and forms other than the accepted ones.
absl::Status ValidateSlice(TensorSlice* s);

// std::nullopt for a plain (whole-tensor) frame name; otherwise the validated slice whose data has shape `extents`.
absl::StatusOr<std::optional<TensorSlice>> ParseSliceName(absl::string_view frame_name,
                                                          absl::Span<const int64_t> extents);

}  // namespace wsync
