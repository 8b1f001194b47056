// Without WSYNC_WITH_CUDA: cuda segments are refused with the reason.
#include "daemon/node/target_node_cuda.h"

#include "absl/strings/str_cat.h"

namespace wsync::daemon {

absl::StatusOr<std::unique_ptr<CudaSegment>> ImportCudaSegment(const CudaSegmentDesc&, const std::string& who) {
  return absl::UnimplementedError(absl::StrCat(who, ": a cuda segment, but this wsyncd was built without CUDA "
                                               "(WSYNC_WITH_CUDA=OFF: no nvcc at build time)"));
}

absl::StatusOr<std::unique_ptr<CudaSegment>> WrapCudaMemory(void*, uint64_t, int, const std::string& who) {
  return absl::UnimplementedError(absl::StrCat(who, ": this build has no CUDA (WSYNC_WITH_CUDA=OFF)"));
}

absl::StatusOr<std::shared_ptr<transport::RegionSink>> MakeCudaSink(void*, uint64_t, int, const std::string& who) {
  return absl::UnimplementedError(absl::StrCat(who, ": this build has no CUDA (WSYNC_WITH_CUDA=OFF)"));
}

}  // namespace wsync::daemon
