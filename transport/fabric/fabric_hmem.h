#pragma once
// Device memory (RegisterSink) on the fabric backend: registered with the provider directly (FI_HMEM, an MR of
// iface FI_HMEM_CUDA) where the provider offers it, else written through the sink's page-locked host mirror. The
// choice is a pure function; CudaDeviceOrdinal asks the CUDA driver, loaded at run time like libfabric itself.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace wsync::transport::fabric {

// WSYNC_FABRIC_HMEM: "0" never registers device memory (host mirror always), "1" requires it (RegisterSink fails
// where it cannot), unset or "auto": directly where possible, else the mirror.
enum class HmemMode { kAuto, kOff, kRequired };
absl::StatusOr<HmemMode> ParseHmemMode(const char* value);

struct DeviceMemoryChoice {
  bool direct = false;
  std::string reason;  // why not direct (empty when direct)
};

// `provider_hmem`: the opened domains carry FI_HMEM; `pointer`: whether the memory's device pointer and device
// ordinal were found (the sink's dma-buf export, then the CUDA driver).
DeviceMemoryChoice ChooseDeviceMemoryPath(const std::string& provider, bool provider_hmem, HmemMode mode,
                                          const absl::Status& pointer);

// The CUDA device ordinal of a device pointer (cuPointerGetAttribute through a dlopen'ed libcuda.so.1).
absl::StatusOr<int> CudaDeviceOrdinal(uint64_t device_ptr);

}  // namespace wsync::transport::fabric
