#pragma once
// The EngineAdapter for wsync's reference engine (kind "reference", tools/testing/engine_ref), over its own EngineControl
// gRPC API. The coordinator calls that API directly too (control_address()).

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/common/engine_adapter.h"

namespace wsync::daemon {

// `address`: the address as given on the command line; `grpc_target`: its "HOST:PORT". No I/O here.
absl::StatusOr<std::unique_ptr<EngineAdapter>> MakeReferenceAdapter(const std::string& address, const std::string& grpc_target,
                                                    absl::Duration call_timeout);

}  // namespace wsync::daemon
