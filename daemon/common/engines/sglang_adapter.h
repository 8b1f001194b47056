#pragma once
// The EngineAdapter for an unmodified SGLang server (kind "sglang", 0.5.23), driven through SGLang's own HTTP API,
// whose weight memory wsync's sources write directly through the Mooncake Transfer Engine that SGLang registered it
// with (--remote-instance-weight-loader-start-seed-via-transfer-engine). No wsync process runs on the SGLang node;
// a `wsyncd --role target --engine sglang+http://…` anywhere serves as the engine's adapter process.
// Call sequence and failure semantics: docs/engines.md, "SGLang"; facts: engine-apis.md §1.
//
// What each method sends:
//   Describe        GET /server_info (tp_size, pp_size, dp_size, ep_size, enable_dp_attention,
//                   speculative_algorithm), GET /model_info
//   RemoteLayouts   GET <bootstrap>/get_transfer_engine_info?rank=R for every TP rank R: the Mooncake session id and
//                   {name: [data_ptr, numel, element_size]}; checked parameter by parameter against wsync's table
//                   of SGLang's layout for the model (--engine …&config=PATH) before anything is written. An engine
//                   running a speculative draft model is refused here (Unimplemented), naming whose table each rank's
//                   entry is: SGLang 0.5.23's draft runner publishes under the same tp_rank after the target, so
//                   the target's memory cannot be located (docs/engines.md, "Speculative drafts")
//   Pause           POST /pause_generation {"mode"}, then POST /begin_weight_update {"selector":"target"}
//   PostProcess     POST /end_weight_update {} (SGLang runs post_load_weights and the quantization post-processing)
//   SetWeightVersion POST /update_weight_version {"new_version", "abort_all_requests": false}; GET /model_info must
//                   then report it
//   Continue        GET /flush_cache (timeout 0, while still paused), then POST /continue_generation
//                   {"torch_empty_cache": true}
// /health is never called (it runs a generation and blocks while paused).
// Errors name the engine (id and address), the method and the request, and carry SGLang's message
// ({"success": false, "message"}, {"error": {"message"}}, {"message"} or the plain text of /flush_cache).
// Codes: cannot connect → Unavailable; no answer in time → DeadlineExceeded; 404 → FailedPrecondition (a route or
// a bootstrap rank that does not exist); other 4xx and {"success": false} → FailedPrecondition naming SGLang's
// message; 5xx → Internal.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/common/engine_adapter.h"

namespace wsync::daemon {

// `url` is the address without its "sglang+" prefix:
//   "http://HOST:PORT?config=PATH[&bootstrap=HOST:PORT][&id=ENGINE_ID]"
// config: the model's Hugging Face config.json (what SGLang serves; wsync builds SGLang's layout from it).
// bootstrap: SGLang's engine-info bootstrap server (--engine-info-bootstrap-port), default HOST:6789.
// id: default "sglang-HOST-PORT". InvalidArgument naming the address when it is malformed.
absl::StatusOr<std::unique_ptr<EngineAdapter>> MakeSglangAdapter(const std::string& url, absl::Duration call_timeout);

}  // namespace wsync::daemon
