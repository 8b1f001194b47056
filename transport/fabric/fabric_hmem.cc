#include "transport/fabric/fabric_hmem.h"

#include <dlfcn.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace wsync::transport::fabric {

absl::StatusOr<HmemMode> ParseHmemMode(const char* value) {
  if (value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0) return HmemMode::kAuto;
  if (std::strcmp(value, "0") == 0) return HmemMode::kOff;
  if (std::strcmp(value, "1") == 0) return HmemMode::kRequired;
  return absl::InvalidArgumentError(absl::StrCat("WSYNC_FABRIC_HMEM='", value, "' is not 0, 1 or auto"));
}

DeviceMemoryChoice ChooseDeviceMemoryPath(const std::string& provider, bool provider_hmem, HmemMode mode,
                                          const absl::Status& pointer) {
  if (mode == HmemMode::kOff) return {false, "disabled by WSYNC_FABRIC_HMEM=0"};
  if (!provider_hmem)
    return {false, absl::StrCat("provider ", provider,
                                " offers no device memory registration (FI_HMEM, FI_MR_HMEM), or this libfabric "
                                "was built without CUDA support")};
  if (!pointer.ok()) return {false, absl::StrCat("no device pointer for the memory: ", pointer.message())};
  return {true, ""};
}

absl::StatusOr<int> CudaDeviceOrdinal(uint64_t device_ptr) {
  // The driver API by hand: this library does not link CUDA (libfabric's own CUDA support loads it the same way).
  static void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return absl::FailedPreconditionError("libcuda.so.1 cannot be loaded (no CUDA driver here)");
  using Fn = int (*)(void*, int, unsigned long long);
  static Fn fn = reinterpret_cast<Fn>(dlsym(lib, "cuPointerGetAttribute"));
  if (fn == nullptr) return absl::FailedPreconditionError("libcuda.so.1 has no cuPointerGetAttribute");
  constexpr int kDeviceOrdinal = 9;  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
  int ordinal = -1;
  if (int rc = fn(&ordinal, kDeviceOrdinal, device_ptr); rc != 0 || ordinal < 0)
    return absl::FailedPreconditionError(absl::StrCat("cuPointerGetAttribute(DEVICE_ORDINAL) of 0x",
                                                      absl::Hex(device_ptr), " failed (CUresult ", rc,
                                                      "): not CUDA device memory"));
  return ordinal;
}

}  // namespace wsync::transport::fabric
