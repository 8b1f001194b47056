#pragma once
// The EngineAdapter for a vLLM server (kind "vllm"), driven through vLLM's HTTP API (VLLM_SERVER_DEV_MODE=1) and
// its weight-transfer backend "wsync" (client/vllm). Call sequence and failure semantics: docs/engines.md.
//
// What each method sends (reference: engine-apis.md §2):
//   Describe          GET /get_world_size, GET /weight_info, GET /is_paused
//   RequestAttach     POST /init_weight_transfer_engine {"init_info":{socket, engine_id, token, mode, protocol: 1}}
//   Pause             abort    → POST /pause?mode=abort&clear_cache=false
//                     retract  → POST /pause?mode=keep&clear_cache=true   (default; running requests go back to
//                                                                          the waiting queue, KV recomputed)
//                     in_place → POST /pause?mode=keep&clear_cache=false  (running requests keep their KV)
//   PostProcess       POST /start_weight_update, POST /update_weights {"update_info":{"version"}},
//                     POST /finish_weight_update {"weight_version"}; finish is not called when update fails
//   SetWeightVersion  POST /update_weight_version {"new_version"}, then GET /weight_info must read it
//   Continue          POST /reset_prefix_cache?reset_running_requests=true (retried while vLLM says
//                     {"success":false}), then POST /resume
//
// Timeouts: every HTTP exchange (connect, then each read and write) is bounded by `call_timeout`, except
// /update_weights and /finish_weight_update, which get max(call_timeout, 300 s) because vLLM loads and repacks the
// weights inside them.
// Errors name the engine (id and address), the method and the request, and carry vLLM's answer (HTTP status and
// its error message, or the raw body cut at 2 KiB). Codes: cannot connect / connection lost → Unavailable; no
// answer in time → DeadlineExceeded; 404 (route not mounted) → FailedPrecondition; other 4xx → InvalidArgument;
// 5xx → Internal (Aborted for /update_weights: vLLM has ended the update session); a 200 whose body is not what
// vLLM documents → Internal.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/common/engine_adapter.h"

namespace wsync::daemon {

// `url` is the address without its "vllm+" prefix: "http://HOST:PORT[?mode=staged|direct|adapter&id=ENGINE_ID]"
// (HOST may be a bracketed IPv6 literal; a trailing "/" is allowed, any other path is not). The engine id defaults
// to "vllm-HOST-PORT"; the attach mode to "staged". InvalidArgument naming the address when it is malformed, has an
// unknown query key or a bad mode, or when `call_timeout` is not positive and finite. Connects lazily (no I/O here).
absl::StatusOr<std::unique_ptr<EngineAdapter>> MakeVllmAdapter(const std::string& url, absl::Duration call_timeout);

}  // namespace wsync::daemon
