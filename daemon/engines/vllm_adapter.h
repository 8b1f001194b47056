#pragma once
// The EngineAdapter for a vLLM server (kind "vllm"), driven through vLLM's HTTP API (VLLM_SERVER_DEV_MODE=1) and
// its weight-transfer backend "wsync" (client/vllm). Call sequence and failure semantics: docs/engines.md.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/engine_adapter.h"

namespace wsync::daemon {

// `url` is the address without its "vllm+" prefix: "http://HOST:PORT[?mode=staged|direct&id=ENGINE_ID]".
// InvalidArgument naming the address when it is malformed. Connects lazily (no I/O here).
absl::StatusOr<std::unique_ptr<EngineAdapter>> MakeVllmAdapter(const std::string& url, absl::Duration call_timeout);

}  // namespace wsync::daemon
