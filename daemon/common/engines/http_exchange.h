#pragma once
// One HTTP/1.1 exchange with an engine's control API on a fresh connection (the engine adapters' transport):
// connect, send, read the whole answer, each bounded by `timeout`. Transport failures become statuses that name
// `where` (the caller's "engine …: method: VERB path"): cannot connect → Unavailable, no answer in time →
// DeadlineExceeded, connection lost → Unavailable. Any HTTP status is returned as an answer; mapping it is the
// adapter's business (each engine phrases its errors differently).

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace wsync::daemon {

struct HttpAnswer {
  int status = 0;
  std::string body;
};

// `body` set: POST with that JSON text; unset: GET.
absl::StatusOr<HttpAnswer> HttpExchange(const std::string& host, int port, const std::string& path,
                                        const std::optional<std::string>& body, absl::Duration timeout,
                                        const std::string& where);

}  // namespace wsync::daemon
