#pragma once
// CUDA runtime errors as absl::Status, naming the call, the device and what it was doing ("H2D copy of 4194304
// bytes into engine e0 rank 0 segment 3"). Header-only; include it only from code built with WSYNC_WITH_CUDA.

#include <cuda_runtime.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace wsync {

inline absl::Status CudaError(cudaError_t e, absl::string_view call, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  int dev = -1;
  cudaGetDevice(&dev);
  const std::string text = absl::StrCat(call, " failed on cuda:", dev, " (", what, "): ", cudaGetErrorName(e), ": ",
                                        cudaGetErrorString(e));
  switch (e) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
      return absl::FailedPreconditionError(text);
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(text);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
      return absl::InvalidArgumentError(text);
    default:
      return absl::InternalError(text);
  }
}

}  // namespace wsync

// WSYNC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(...), absl::StrCat("D2H copy of ", n, " bytes of tensor ", name));
#define WSYNC_CUDA_RETURN_IF_ERROR(call, what)                                        \
  do {                                                                                \
    const cudaError_t wsync_cuda_e_ = (call);                                         \
    if (wsync_cuda_e_ != cudaSuccess) return ::wsync::CudaError(wsync_cuda_e_, #call, (what)); \
  } while (0)
