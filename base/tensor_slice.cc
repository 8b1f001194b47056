#include "base/tensor_slice.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace wsync {
namespace {

std::string Dims(absl::Span<const int64_t> v) { return absl::StrCat("[", absl::StrJoin(v, ", "), "]"); }

absl::StatusOr<std::vector<int64_t>> ParseInts(absl::string_view text, char sep, absl::string_view what,
                                               absl::string_view name) {
  std::vector<int64_t> out;
  if (text.empty()) return out;
  for (absl::string_view t : absl::StrSplit(text, sep)) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(t, &v))
      return absl::InvalidArgumentError(absl::StrCat("slice of ", name, ": malformed ", what, " '", text, "'"));
    out.push_back(v);
  }
  return out;
}

}  // namespace

std::string TensorSlice::Describe() const {
  return absl::StrCat("rows [", row0, ", ", row0 + rows, ") cols [", col0, ", ", col0 + cols, ") of [", full_rows,
                      ", ", full_cols, "]");
}

std::string EncodeSliceName(absl::string_view name, absl::Span<const int64_t> full_shape,
                            absl::Span<const int64_t> offsets) {
  return absl::StrCat(name, kSliceMarker, absl::StrJoin(full_shape, "x"), "|", absl::StrJoin(offsets, ","));
}

absl::Status ValidateSlice(TensorSlice* s) {
  const size_t n = s->full_shape.size();
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("slice of ", s->name, " (offsets ", Dims(s->offsets), ", extents ",
                                                   Dims(s->extents), ", tensor shape ", Dims(s->full_shape),
                                                   "): ", why));
  };
  if (s->name.empty() || s->name.find('|') != std::string::npos) return bad("bad tensor name");
  if (n == 0) return bad("a scalar cannot be sliced");
  if (s->offsets.size() != n || s->extents.size() != n) return bad("offsets, extents and shape differ in rank");
  int partial = 0, last_partial = -1;
  for (size_t d = 0; d < n; ++d) {
    if (s->full_shape[d] <= 0) return bad("empty tensor");
    if (s->offsets[d] < 0 || s->extents[d] <= 0 || s->offsets[d] > s->full_shape[d] ||
        s->extents[d] > s->full_shape[d] - s->offsets[d])
      return bad(absl::StrCat("dim ", d, " range [", s->offsets[d], ", ", s->offsets[d] + s->extents[d],
                              ") is empty or outside [0, ", s->full_shape[d], ")"));
    if (s->extents[d] != s->full_shape[d]) ++partial, last_partial = static_cast<int>(d);
  }
  if (n > 2 && (partial > 1 || (partial == 1 && last_partial != 0)))
    return bad("only ranges along dim 0 (whole experts) may be sliced from a tensor of more than 2 dims");
  // 2-D view: [prod(dims[:-1]), dims[-1]]; a 1-D tensor is [n, 1].
  int64_t inner = 1;
  for (size_t d = 1; d + 1 < n; ++d) inner *= s->full_shape[d];
  s->full_cols = n >= 2 ? s->full_shape[n - 1] : 1;
  s->full_rows = n >= 2 ? s->full_shape[0] * inner : s->full_shape[0];
  s->row0 = s->offsets[0] * inner;
  s->rows = s->extents[0] * inner;
  s->col0 = n == 2 ? s->offsets[1] : 0;
  s->cols = n == 2 ? s->extents[1] : s->full_cols;
  return absl::OkStatus();
}

absl::StatusOr<std::optional<TensorSlice>> ParseSliceName(absl::string_view frame_name,
                                                          absl::Span<const int64_t> extents) {
  const size_t at = frame_name.find(kSliceMarker);
  if (at == absl::string_view::npos) return std::optional<TensorSlice>();
  TensorSlice s;
  s.name = std::string(frame_name.substr(0, at));
  std::vector<absl::string_view> parts = absl::StrSplit(frame_name.substr(at + kSliceMarker.size()), '|');
  if (parts.size() != 2)
    return absl::InvalidArgumentError(
        absl::StrCat("slice of ", s.name, ": expected '<name>|slice|<shape>|<offsets>', got '", frame_name, "'"));
  auto shape = ParseInts(parts[0], 'x', "shape", s.name);
  if (!shape.ok()) return shape.status();
  auto offsets = ParseInts(parts[1], ',', "offsets", s.name);
  if (!offsets.ok()) return offsets.status();
  s.full_shape = *std::move(shape);
  s.offsets = *std::move(offsets);
  s.extents.assign(extents.begin(), extents.end());
  if (absl::Status st = ValidateSlice(&s); !st.ok()) return st;
  return std::optional<TensorSlice>(std::move(s));
}

}  // namespace wsync
