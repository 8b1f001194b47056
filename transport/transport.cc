#include "transport/transport.h"

#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "transport/registry.h"

namespace wsync::transport {
namespace {

// `offset + length` must stay inside a region of `region_len` bytes; written so it cannot overflow.
absl::Status CheckRange(const char* side, uint64_t offset, uint64_t length, uint64_t region_len) {
  if (offset > region_len || length > region_len - offset) {
    return absl::OutOfRangeError(absl::StrCat(side, " range [", offset, ", +", length,
                                              ") is outside the region of ", region_len, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateWrite(const WriteRequest& w) {
  if (w.src == nullptr) return absl::InvalidArgumentError("write request has no source region");
  if (w.dst == nullptr) return absl::InvalidArgumentError("write request has no destination region");
  absl::Status s = CheckRange("source", w.src_offset, w.length, w.src->length());
  if (!s.ok()) return s;
  return CheckRange("destination", w.dst_offset, w.length, w.dst->length());
}

absl::Status Endpoint::Write(absl::Span<const WriteRequest> writes, absl::Duration timeout) {
  absl::StatusOr<BatchId> batch = Post(writes);
  if (!batch.ok()) return batch.status();
  return Wait(*batch, timeout);
}

absl::StatusOr<std::unique_ptr<Transport>> CreateFirstViableTransport(const std::string& list,
                                                                      const TransportOptions& opts) {
  std::vector<std::string> names = absl::StrSplit(list, ',', absl::SkipWhitespace());
  if (names.empty()) return absl::InvalidArgumentError("no transport given (want e.g. tcp, verbs or verbs,tcp)");
  for (std::string& name : names) name = std::string(absl::StripAsciiWhitespace(name));
  for (size_t i = 0; i < names.size(); ++i) {
    // A typo later in the list must not hide behind a viable first entry.
    if (FindTransport(names[i]) == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown transport \"", names[i], "\" in \"", list, "\" (known: ", KnownTransports(), ")"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (names[j] == names[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat("transport \"", names[i], "\" is listed twice in \"", list, "\""));
      }
    }
  }
  std::vector<std::string> reasons;
  for (const std::string& name : names) {
    WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<Transport> t, CreateTransport(name, opts));
    if (t->viable()) return t;
    reasons.push_back(absl::StrCat(name, ": ", t->reason()));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      names.size() == 1 ? "transport not viable on this host: " : "no listed transport is viable on this host: ",
      absl::StrJoin(reasons, "; "),
      names.size() == 1 ? " (list a fallback explicitly, e.g. --transport verbs,tcp, to use another)" : ""));
}

}  // namespace wsync::transport
