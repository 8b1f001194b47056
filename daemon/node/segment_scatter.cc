#include "daemon/node/segment_scatter.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace wsync::daemon {
namespace {

absl::Status InRange(uint64_t offset, uint64_t bytes, uint64_t segment_bytes, absl::string_view segment) {
  if (offset > segment_bytes || bytes > segment_bytes - offset)
    return absl::InvalidArgumentError(
        absl::StrCat("range [", offset, ", +", bytes, ") is outside ", segment, " (", segment_bytes, " bytes)"));
  return absl::OkStatus();
}

class HostScatter final : public SegmentScatter {
 public:
  HostScatter(uint8_t* data, uint64_t bytes) : data_(data), bytes_(bytes) {}

  absl::Status ReadBack(uint64_t offset, uint64_t bytes, uint8_t* out) override {
    WSYNC_RETURN_IF_ERROR(InRange(offset, bytes, bytes_, "the segment"));
    std::memcpy(out, data_ + offset, bytes);
    return absl::OkStatus();
  }

  absl::StatusOr<replica::delta::Info> Add(uint64_t offset, uint64_t bytes, const uint8_t* enc, uint64_t enc_bytes,
                                           uint64_t base) override {
    WSYNC_ASSIGN_OR_RETURN(replica::delta::Info info,
                           CheckRecord(offset, bytes, bytes_, "the segment", enc, enc_bytes, base));
    // The values are copied now: the caller's encoding need not outlive the call, as with the device's staging.
    Staged s{offset, info.elem_size, {}, {}};
    WSYNC_RETURN_IF_ERROR(
        replica::delta::ForEachRun(enc, enc_bytes, [&](uint64_t first, uint64_t count, const uint8_t* values) {
          s.runs.push_back({first * info.elem_size, count * info.elem_size});
          s.values.insert(s.values.end(), values, values + count * info.elem_size);
        }));
    staged_.push_back(std::move(s));
    return info;
  }

  absl::Status Flush() override {
    for (const Staged& s : staged_) {
      uint64_t at = 0;
      for (const auto& [off, len] : s.runs) {
        std::memcpy(data_ + s.offset + off, s.values.data() + at, len);
        at += len;
      }
    }
    staged_.clear();
    return absl::OkStatus();
  }

 private:
  struct Staged {
    uint64_t offset;
    uint32_t elem_size;
    std::vector<std::pair<uint64_t, uint64_t>> runs;  // (byte offset in the range, bytes)
    std::vector<uint8_t> values;
  };

  uint8_t* data_;
  uint64_t bytes_;
  std::vector<Staged> staged_;
};

}  // namespace

absl::StatusOr<replica::delta::Info> CheckRecord(uint64_t offset, uint64_t bytes, uint64_t segment_bytes,
                                                 absl::string_view segment, const uint8_t* enc, uint64_t enc_bytes,
                                                 uint64_t base) {
  WSYNC_RETURN_IF_ERROR(InRange(offset, bytes, segment_bytes, segment));
  WSYNC_ASSIGN_OR_RETURN(replica::delta::Info info, replica::delta::Inspect(enc, enc_bytes));
  if (info.range_bytes != bytes)
    return absl::InvalidArgumentError(
        absl::StrCat("delta covers ", info.range_bytes, " bytes, the destination has ", bytes));
  if (info.base_checksum != base)
    return absl::FailedPreconditionError(
        "delta base mismatch: the destination does not hold the delta's base (by the checksum recorded when it was "
        "last written)");
  return info;
}

std::unique_ptr<SegmentScatter> MakeHostScatter(uint8_t* data, uint64_t bytes) {
  return std::make_unique<HostScatter>(data, bytes);
}

}  // namespace wsync::daemon
