#pragma once
// bench_node's CUDA tensors: the trainer's tensors in GPU memory (one cudaMalloc buffer on device 0), and the
// baseline they are pushed against, the pinned device-to-host peak of the same bytes (cudaMemcpyAsync into
// cudaMallocHost memory, on one stream and split over several). Pushing them goes through client/device_copy.h, as the
// C++ client does. Built with WSYNC_WITH_CUDA (device_tensors_cuda.cc); without it (device_tensors_none.cc) Create
// answers FailedPrecondition saying so, and bench_node prints a skip line.
//
// Threading: Create and PinnedD2hSeconds from one thread; data() from any.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace wsync::bench {

class DeviceTensors {
 public:
  // Copies `bytes` at `host` into a fresh device buffer. FailedPrecondition naming why when there is no GPU (or the
  // binary was built without CUDA): a result, not a crash.
  static absl::StatusOr<std::unique_ptr<DeviceTensors>> Create(const uint8_t* host, uint64_t bytes);
  // Whether Create can succeed here (a GPU, a CUDA build), without allocating: FailedPrecondition naming why not.
  static absl::Status Available();
  virtual ~DeviceTensors() = default;
  // The device copy of host[0, bytes): same offsets.
  virtual const uint8_t* data() const = 0;
  // "NVIDIA H200 (device 0 of 1)".
  virtual std::string Describe() const = 0;
  // Best of `reps` wall times (seconds) of copying every byte into page-locked host memory, split into `streams`
  // contiguous shares, each on its own stream, all queued at once and waited for together.
  virtual absl::StatusOr<double> PinnedD2hSeconds(int streams, int reps) = 0;
};

}  // namespace wsync::bench
