#pragma once
// `cuda` segments of the target (docs/engines.md, "CUDA segments"): GPU memory of an engine process, imported once
// when the rank attaches from a legacy CUDA IPC handle (cudaIpcOpenMemHandle) and written through a pinned staging
// pool: the tcp transport receives each write into a staging chunk, the chunk is copied host-to-device on a stream
// while the next ones arrive (several in flight), and a batch is acknowledged only after its copies finished.
//
// Built with WSYNC_WITH_CUDA (target_node_cuda.cc); without it (target_node_cuda_none.cc) every import fails with
// Unimplemented saying so. The CUDA runtime is linked statically and touched only when a cuda segment attaches, so a
// daemon on a machine without a GPU runs as before.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/node/segment_scatter.h"
#include "transport/transport.h"

namespace wsync::daemon {

// What an attach message says about one cuda segment (already validated for shape, not against the device).
struct CudaSegmentDesc {
  std::string ipc_handle;   // the 64 bytes of a cudaIpcMemHandle_t
  std::string device_uuid;  // the 16 bytes of the device's UUID (cudaDeviceProp::uuid) in the engine process
  uint64_t offset = 0;      // where the segment starts inside the allocation the handle names
  uint64_t bytes = 0;
};

// One imported segment. Closing it (destruction) closes the IPC mapping; the transport region that writes through
// sink() must be gone first.
class CudaSegment {
 public:
  virtual ~CudaSegment() = default;
  virtual std::shared_ptr<transport::RegionSink> sink() const = 0;
  // "cuda:0 (NVIDIA H200)" for logs.
  virtual std::string device() const = 0;
  // Where delta records are applied (docs/delta.md, "GPU memory"): made on first use, owned by the segment; the
  // caller is ApplyDelta, one at a time.
  virtual absl::StatusOr<SegmentScatter*> Scatter() = 0;
};

// Opens the handle on the device with the given UUID and checks that [offset, offset + bytes) lies inside the
// allocation. Errors name `who` (engine, rank, segment), the CUDA call and the device: an unknown device UUID
// (the engine's GPU is not visible to this daemon: CUDA_VISIBLE_DEVICES), a handle whose process has exited, a
// range outside the allocation.
absl::StatusOr<std::unique_ptr<CudaSegment>> ImportCudaSegment(const CudaSegmentDesc& desc, const std::string& who);
// A cuda segment over `bytes` of device memory this process allocated on CUDA device `device` (not imported:
// nothing is closed when it goes; the memory must outlive it). tests/cuda/delta_device_cuda_test puts it behind a
// target to run the device path of delta updates on a GPU.
absl::StatusOr<std::unique_ptr<CudaSegment>> WrapCudaMemory(void* device_ptr, uint64_t bytes, int device,
                                                            const std::string& who);
// How a target imports cuda segments (TargetOptions::import_cuda_segment; tests put host memory behind one).
using CudaSegmentImporter =
    std::function<absl::StatusOr<std::unique_ptr<CudaSegment>>(const CudaSegmentDesc&, const std::string&)>;

// The staging sink an import builds, over `bytes` of device memory at `device_ptr` on CUDA device `device` of this
// process (bench/gpu measures the staging path with it).
absl::StatusOr<std::shared_ptr<transport::RegionSink>> MakeCudaSink(void* device_ptr, uint64_t bytes, int device,
                                                                    const std::string& who);

}  // namespace wsync::daemon
