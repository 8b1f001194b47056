#pragma once
// Memory and segment kinds, one type each, shared by the planner, the source and the target. Their names ("host",
// "cuda", "mooncake") exist only at the edges: MemorySegment.kind on the wire, an engine's attach message, CLI flags
// and rate-file curve names. Each is parsed once where it enters (an unknown name is InvalidArgument naming it and
// the known ones); nothing past that point compares strings.

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace wsync {

// Where bytes live.
enum class MemoryKind : uint8_t {
  kHost,  // CPU memory
  kCuda,  // a CUDA device's memory
};

// What an engine memory segment is, and so how it is reached.
enum class SegmentKind : uint8_t {
  kHost,      // shared memory the engine handed its target daemon as an fd: mapped there
  kCuda,      // device memory the target daemon imported (CUDA IPC): written through a sink
  kMooncake,  // memory the engine's own Mooncake Transfer Engine registered: written by the mooncake backend alone
};

// "host", "cuda".
absl::string_view MemoryKindName(MemoryKind kind);
absl::StatusOr<MemoryKind> ParseMemoryKind(absl::string_view name);
// "host", "cuda", "mooncake".
absl::string_view SegmentKindName(SegmentKind kind);
absl::StatusOr<SegmentKind> ParseSegmentKind(absl::string_view name);
// The memory a segment of `kind` is: a Mooncake engine registers its device memory.
MemoryKind MemoryOf(SegmentKind kind);

}  // namespace wsync
