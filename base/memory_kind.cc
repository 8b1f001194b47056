#include "base/memory_kind.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace wsync {

absl::string_view MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost:
      return "host";
    case MemoryKind::kCuda:
      return "cuda";
  }
  return "?";
}

absl::StatusOr<MemoryKind> ParseMemoryKind(absl::string_view name) {
  for (MemoryKind k : {MemoryKind::kHost, MemoryKind::kCuda})
    if (name == MemoryKindName(k)) return k;
  return absl::InvalidArgumentError(absl::StrCat("unknown memory kind \"", name, "\" (known: host, cuda)"));
}

absl::string_view SegmentKindName(SegmentKind kind) {
  switch (kind) {
    case SegmentKind::kHost:
      return "host";
    case SegmentKind::kCuda:
      return "cuda";
    case SegmentKind::kMooncake:
      return "mooncake";
  }
  return "?";
}

absl::StatusOr<SegmentKind> ParseSegmentKind(absl::string_view name) {
  for (SegmentKind k : {SegmentKind::kHost, SegmentKind::kCuda, SegmentKind::kMooncake})
    if (name == SegmentKindName(k)) return k;
  return absl::InvalidArgumentError(absl::StrCat("unknown segment kind \"", name, "\" (known: host, cuda, mooncake)"));
}

MemoryKind MemoryOf(SegmentKind kind) { return kind == SegmentKind::kHost ? MemoryKind::kHost : MemoryKind::kCuda; }

}  // namespace wsync
