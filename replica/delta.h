#pragma once
// Exact deltas between two versions of one byte range (an engine parameter, in engine layout and dtype).
//
// An encoded delta turns `bytes` bytes of a base into the new bytes. It is self-describing: a fixed header (format
// id, element size, range length, element count, XXH3-64 of the base range and of the new range, a checksum of the
// frame itself) followed by the payload: an index section and the changed elements' new values, in index order.
// Index formats, chosen per call by computed size:
//   kBitmap — one bit per element (many scattered changes);
//   kGaps   — one LEB128 varint per changed element: its distance from the previous one (few scattered changes);
//   kRuns   — LEB128 (gap, run length - 1) pairs (clustered changes, e.g. a rescaled FP8 block's rows).
// Elements are compared as whole units of 1, 2 or 4 bytes: bf16/fp16 use 2, FP8 codes 1, fp32 block scales 4.
//
// Thread safety: every function is pure over its arguments; callers may encode or apply disjoint ranges on several
// threads at once.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace wsync::replica::delta {

enum class Format : uint8_t { kBitmap = 1, kGaps = 2, kRuns = 3 };

// Size of the fixed header every encoding starts with.
inline constexpr uint64_t kHeaderBytes = 56;

struct EncodeResult {
  // Elements whose bytes differ. When dense_smaller is set the scan may have stopped early: a lower bound then.
  uint64_t changed_elems = 0;
  uint64_t encoded_bytes = 0;  // appended to *out (header included); 0 when dense_smaller
  bool dense_smaller = false;
  // Checksum() of the base and of the new range, as written in the header; 0 when dense_smaller. The caller may keep
  // new_checksum as the range's base checksum for its next encoding (EncodeOptions).
  uint64_t base_checksum = 0;
  uint64_t new_checksum = 0;
};

struct EncodeOptions {
  // Checksum() of `old`'s current bytes when the caller knows it (the new_checksum of this range's previous encoding,
  // kept while nothing else wrote the range): saves one of the two hash passes. It must be the checksum of exactly
  // the bytes in `old`: it is what the target checks its own bytes against before applying.
  std::optional<uint64_t> base_checksum;
};

// Appends to *out the encoding of old→neu (elem_size 1, 2 or 4 bytes; bytes a multiple of it). If the smallest
// encoding would exceed `limit` bytes, appends nothing and returns dense_smaller = true. No change at all still
// encodes (a header only, kHeaderBytes): applying it checks that the target holds the expected base.
EncodeResult Encode(const uint8_t* old, const uint8_t* neu, uint64_t bytes, uint32_t elem_size, uint64_t limit,
                    std::string* out);

// A cheap look before Encode, for ranges where nearly every element changed (e.g. a full fine-tuning step): compares
// `samples` 64-byte chunks spread evenly over the range, extrapolates the smallest encoding's size from them (changed
// values plus the cheapest index) and answers true when a delta would not save a tenth of `limit`: Encode would scan
// (and stage) most of the range to save little or nothing. False promises nothing (Encode still decides exactly);
// ranges under 4 × `samples` chunks are not sampled (false). Only changes laid out in step with the sampling stride
// can mislead it, and then the range goes dense: more bytes, never wrong ones.
bool SampledDenseSmaller(const uint8_t* old, const uint8_t* neu, uint64_t bytes, uint32_t elem_size, uint64_t limit,
                         uint32_t samples = 256);

// The same, then copies neu into old (one pass over both buffers where possible: the source's replica is `old`).
// Only the 64-byte chunks that differ are written, in the same pass as the compare.
// The copy happens whatever the result (also when dense_smaller); old and neu must not overlap.
EncodeResult CopyAndEncode(uint8_t* dst_old, const uint8_t* neu, uint64_t bytes, uint32_t elem_size, uint64_t limit,
                           std::string* out);
EncodeResult CopyAndEncode(uint8_t* dst_old, const uint8_t* neu, uint64_t bytes, uint32_t elem_size, uint64_t limit,
                           const EncodeOptions& options, std::string* out);

// Validates the whole encoding first (header, lengths, indices in range, base checksum equals the checksum of
// dst's current bytes) and only then applies it; on any error dst is untouched and the Status says what is wrong
// (InvalidArgument for corrupt/out of range, FailedPrecondition for a base mismatch). *consumed: bytes of `enc` used.
// dst_bytes must equal the range length the delta was encoded for.
absl::Status Apply(uint8_t* dst, uint64_t dst_bytes, const uint8_t* enc, uint64_t enc_bytes, uint64_t* consumed);

// What a validated encoding says about itself.
struct Info {
  Format format = Format::kGaps;
  uint32_t elem_size = 0;
  uint64_t range_bytes = 0;
  uint64_t changed_elems = 0;
  uint64_t base_checksum = 0;  // Checksum() of the base range
  uint64_t new_checksum = 0;   // Checksum() of the range after applying
  uint64_t encoded_bytes = 0;  // header + payload: what Apply consumes
};

// Validates everything that can be checked without the base bytes (header, frame checksum, lengths, every index
// below the element count) — for targets whose memory the host cannot read (GPU segments): they compare
// base_checksum with the checksum they recorded when they last wrote the range.
absl::StatusOr<Info> Inspect(const uint8_t* enc, uint64_t enc_bytes);

// Calls fn(first_elem, count, values) for each run of consecutive changed elements, in index order; `values` points
// at count × elem_size new bytes inside `enc`. Runs Inspect first: on a corrupt encoding fn is never called.
absl::Status ForEachRun(const uint8_t* enc, uint64_t enc_bytes,
                        const std::function<void(uint64_t first_elem, uint64_t count, const uint8_t* values)>& fn);

// The checksum the header carries (XXH3-64, seed 0), for callers that record what they wrote.
uint64_t Checksum(const uint8_t* data, uint64_t bytes);

// Checksum() of a range fed in consecutive pieces (for memory the caller reads a piece at a time, e.g. GPU memory
// read back through a bounded buffer). Not thread-safe.
class ChecksumStream {
 public:
  ChecksumStream();
  ~ChecksumStream();
  ChecksumStream(const ChecksumStream&) = delete;
  ChecksumStream& operator=(const ChecksumStream&) = delete;
  void Update(const uint8_t* data, uint64_t bytes);
  uint64_t Digest() const;

 private:
  void* state_;  // XXH3_state_t
};

// Targets nothing runs beside (memory an engine registered for one-sided writes: SGLang with Mooncake) cannot decode
// an encoding; they can take the changed bytes as one-sided writes instead, each costing a fixed overhead per write
// request plus its bytes at the link's rate (both measured: docs/delta.md, "Mooncake").
struct OneSidedCost {
  double per_write_seconds = 0;
  double bytes_per_second = 1;
};
struct OneSidedPlan {
  bool dense = true;                                  // one write of the whole range is cheaper (writes is then empty)
  std::vector<std::pair<uint64_t, uint64_t>> writes;  // (byte offset in the range, bytes), ascending
  uint64_t write_bytes = 0;                           // bytes the coalesced writes carry
  double runs_seconds = 0;                            // predicted: the coalesced writes
  double dense_seconds = 0;                           // predicted: one dense write
};
// Validates `enc` (Inspect), coalesces its runs of changed elements into writes — a gap of unchanged bytes costs less
// to write again (the source's copy holds the same bytes) than a separate request when it is shorter than
// per_write_seconds × bytes_per_second, so it is bridged — and picks the cheaper of those writes and one dense write.
absl::StatusOr<OneSidedPlan> PlanOneSidedWrites(const uint8_t* enc, uint64_t enc_bytes, const OneSidedCost& cost);

}  // namespace wsync::replica::delta
