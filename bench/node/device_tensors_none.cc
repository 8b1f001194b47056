#include "absl/status/status.h"
#include "bench/node/device_tensors.h"

namespace wsync::bench {

absl::StatusOr<std::unique_ptr<DeviceTensors>> DeviceTensors::Create(const uint8_t*, uint64_t) {
  return absl::FailedPreconditionError("this bench_node was built without CUDA (WSYNC_WITH_CUDA off)");
}

absl::Status DeviceTensors::Available() {
  return absl::FailedPreconditionError("this bench_node was built without CUDA (WSYNC_WITH_CUDA off)");
}

}  // namespace wsync::bench
