#include "transport/verbs/verbs_handles.h"

#include <cstring>

#include "spdlog/spdlog.h"

namespace wsync::transport::verbs::internal {

void LogReleaseFailure(const char* what, int rc) noexcept {
  // spdlog reports its own failures through its error handler and does not throw from log calls.
  spdlog::warn("verbs: {} failed: {} ({}); the handle is leaked", what, std::strerror(rc), rc);
}

}  // namespace wsync::transport::verbs::internal
