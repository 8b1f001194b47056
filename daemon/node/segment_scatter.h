#pragma once
// Applying checked delta records (docs/delta.md) into segment memory the target daemon does not map: `cuda`
// segments. The target decides which records go where and what checksum each range holds (target_delta.cc); a
// SegmentScatter only validates, stages and writes. Two implementations: one over host memory (MakeHostScatter: the
// reference, and what tests put behind a cuda segment so that the target's device path runs on a CPU), one over GPU
// memory (target_node_cuda.cc: replica/delta_cuda.h's CudaScatter from a page-locked staging buffer).

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "replica/delta.h"

namespace wsync::daemon {

// One segment's scatter. Not thread-safe: ApplyDelta (one at a time) is its only caller.
class SegmentScatter {
 public:
  virtual ~SegmentScatter() = default;
  // Copies [offset, offset + bytes) of the segment into `out` (host memory) and returns when it is there: the base
  // check of a range whose checksum the target has not recorded (a range last written dense).
  virtual absl::Status ReadBack(uint64_t offset, uint64_t bytes, uint8_t* out) = 0;
  // Validates `enc` (replica::delta::Inspect), that it covers `bytes` and that it was encoded against a base whose
  // checksum is `base` (what the range holds now); then stages it for [offset, offset + bytes). Nothing is written
  // before Flush (except into a host mirror of device memory, written at once: the target flushes what was staged
  // before a refused record anyway and gives that rank dense writes next); a refused encoding stages nothing. InvalidArgument (corrupt, wrong length, out of the segment) or
  // FailedPrecondition (another base).
  virtual absl::StatusOr<replica::delta::Info> Add(uint64_t offset, uint64_t bytes, const uint8_t* enc,
                                                   uint64_t enc_bytes, uint64_t base) = 0;
  // Writes everything staged and returns when it is in the memory; the staging is empty afterwards (also on error).
  virtual absl::Status Flush() = 0;
};

// What every SegmentScatter::Add checks first, whatever memory is behind it: [offset, offset + bytes) inside a
// segment of `segment_bytes` (`segment` names it in the error), `enc` well-formed and covering exactly `bytes`, and
// encoded against the base whose checksum is `base`.
absl::StatusOr<replica::delta::Info> CheckRecord(uint64_t offset, uint64_t bytes, uint64_t segment_bytes,
                                                 absl::string_view segment, const uint8_t* enc, uint64_t enc_bytes,
                                                 uint64_t base);

// Over `bytes` of host memory at `data` (not owned; must outlive the scatter).
std::unique_ptr<SegmentScatter> MakeHostScatter(uint8_t* data, uint64_t bytes);

}  // namespace wsync::daemon
