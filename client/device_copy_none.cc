// Without WSYNC_WITH_CUDA: pushing a CUDA tensor is refused with the reason.
#include "client/device_copy.h"

#include "absl/strings/str_cat.h"

namespace wsync::client {

absl::StatusOr<std::unique_ptr<DeviceCopier>> DeviceCopier::Create(void*, uint64_t, const std::string& ring_name) {
  return absl::UnimplementedError(absl::StrCat("ring ", ring_name, ": this wsync client library was built without "
                                               "CUDA (WSYNC_WITH_CUDA=OFF), so it cannot push CUDA tensors; push "
                                               "host tensors or rebuild with CUDA"));
}

}  // namespace wsync::client
