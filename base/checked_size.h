#pragma once
// Overflow-checked size arithmetic: the one place where element counts, byte sizes, offsets and alignments that come
// from outside the process (trainer frames, engine attach messages, SGLang's weight tables, C API callers) are
// multiplied, added or rounded up. Every such computation calls these instead of plain `*`, `+` or an align macro,
// so a crafted dimension cannot wrap a size into a small, plausible value.

#include <cstdint>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/dtype.h"

namespace wsync {

// a * b, a + b; nullopt when the result does not fit 64 bits.
inline std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}
inline std::optional<uint64_t> CheckedAdd(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}
// `a` rounded up to a multiple of `align` (> 0); nullopt when that does not fit 64 bits or align is 0.
inline std::optional<uint64_t> CheckedAlignUp(uint64_t a, uint64_t align) {
  if (align == 0) return std::nullopt;
  const uint64_t rem = a % align;
  return rem == 0 ? std::optional<uint64_t>(a) : CheckedAdd(a, align - rem);
}

// Elements of `shape`: InvalidArgument naming `what` for a negative dimension or a product above 2^64 - 1.
inline absl::StatusOr<uint64_t> ShapeElements(absl::Span<const int64_t> shape, absl::string_view what) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    std::optional<uint64_t> next = d < 0 ? std::nullopt : CheckedMul(n, static_cast<uint64_t>(d));
    if (!next) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": shape [", absl::StrJoin(shape, ", "), "] has ",
                                                     d < 0 ? "a negative dimension" : "more than 2^64 elements"));
    }
    n = *next;
  }
  return n;
}

// Bytes of `numel` elements of `dtype`: InvalidArgument naming `what` for an invalid dtype or a size above 2^64 - 1.
inline absl::StatusOr<uint64_t> ElementBytes(uint64_t numel, DType dtype, absl::string_view what) {
  const uint64_t elem = DTypeSize(dtype);
  if (elem == 0) return absl::InvalidArgumentError(absl::StrCat(what, ": invalid dtype ", static_cast<int>(dtype)));
  std::optional<uint64_t> bytes = CheckedMul(numel, elem);
  if (!bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", numel, " elements of ", DTypeName(dtype), " are more than 2^64 - 1 bytes"));
  }
  return *bytes;
}

// Bytes of a tensor of `shape` × `dtype` (ShapeElements then ElementBytes).
inline absl::StatusOr<uint64_t> ShapeBytes(absl::Span<const int64_t> shape, DType dtype, absl::string_view what) {
  absl::StatusOr<uint64_t> n = ShapeElements(shape, what);
  if (!n.ok()) return n.status();
  return ElementBytes(*n, dtype, what);
}

}  // namespace wsync
