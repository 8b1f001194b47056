// Placeholder until the adapter lands in this same change series.
#include "daemon/engines/vllm_adapter.h"

namespace wsync::daemon {
absl::StatusOr<std::unique_ptr<EngineAdapter>> MakeVllmAdapter(const std::string& url, absl::Duration) {
  return absl::UnimplementedError("the vLLM adapter is not built yet: " + url);
}
}  // namespace wsync::daemon
