#pragma once
// Device-to-host hand-over of GPU tensors into a trainer's ring: the ring's data area is page-locked
// once per session (cudaHostRegister of the memfd mapping), and each push of a CUDA tensor is one
// cudaMemcpyAsync into the tensor's ring slot on this copier's stream, ordered after the work already queued on
// the producer's stream (an event), without waiting for it. The client keeps pushing (the next tensor's copy queues
// behind this one) and calls Drain before it publishes a bucket, so the daemon never sees a slot still being
// copied into. No per-push registration.
//
// Built with WSYNC_WITH_CUDA (device_copy_cuda.cc); without it (device_copy_none.cc) Create fails with
// Unimplemented saying so. Threading: one thread at a time, like the TrainerClient that owns it.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/dtype.h"

namespace wsync::client {

class DeviceCopier {
 public:
  // Page-locks [ring, ring + bytes) (the ring's data area). `ring_name` is for errors.
  static absl::StatusOr<std::unique_ptr<DeviceCopier>> Create(void* ring, uint64_t bytes,
                                                              const std::string& ring_name);
  virtual ~DeviceCopier() = default;  // unregisters the ring after the last copy finished

  // Checks that `src` is device memory of CUDA device `device` (an ordinal of this process) before anything is
  // reserved for it; InvalidArgument naming the tensor otherwise.
  virtual absl::Status Check(absl::string_view name, const void* src, uint64_t bytes, int device) = 0;
  // Queues the copy of `bytes` bytes at device pointer `src` (checked) into `dst` (inside the registered ring),
  // ordered after the work queued so far on `producer_stream` (the cudaStream_t as an integer, 0 = the legacy
  // default stream). The source must stay unchanged until Drain returned.
  virtual absl::Status CopyAsync(absl::string_view name, uint8_t* dst, const void* src, uint64_t bytes, int device,
                                 uint64_t producer_stream) = 0;
  // FP8 block quantization on the GPU before the copy (halves the bytes a bf16 tensor moves over PCIe): queues the
  // quantization of the row-major [rows, cols] bf16/f16/f32 tensor at `src` (checked) into this copier's device
  // scratch on its stream, ordered after the work queued so far on `producer_stream`, with wsync's convention
  // (replica/fp8.h; byte-identical to the CPU quantizer). `out` receives the staged codes (rows*cols float8_e4m3fn)
  // and scales (float32 [ceil(rows/block_n), ceil(cols/block_k)]), device memory this copier owns: copy them into
  // the ring with CopyStagedAsync before the next QuantizeFp8Async (which reuses the scratch; the stream orders it).
  struct Fp8Staged {
    const void* codes = nullptr;
    const void* scales = nullptr;
    uint64_t code_bytes = 0, scale_bytes = 0;
  };
  virtual absl::Status QuantizeFp8Async(absl::string_view name, DType dtype, const void* src, int64_t rows,
                                        int64_t cols, int block_n, int block_k, bool ue8m0, int device,
                                        uint64_t producer_stream, Fp8Staged* out) = 0;
  // Queues the copy of `bytes` staged bytes (from QuantizeFp8Async on `device`) into `dst` inside the ring, after
  // everything queued on this copier's stream.
  virtual absl::Status CopyStagedAsync(absl::string_view name, uint8_t* dst, const void* staged, uint64_t bytes,
                                       int device) = 0;
  // Zero-copy placement: page-locks [addr, addr + bytes) (the trainer's mapping of a replica layout buffer) as a
  // further destination of Copy2DAsync, once per mapping; UnregisterDestination (after a Drain) or the copier's
  // destruction releases it. `what` is for errors.
  virtual absl::Status RegisterDestination(void* addr, uint64_t bytes, const std::string& what) = 0;
  virtual void UnregisterDestination(void* addr) = 0;
  // Queues a 2-D device-to-host copy (cudaMemcpy2DAsync): `rows` rows of `row_bytes` bytes from `src` (row pitch
  // `src_pitch`) to `dst` (row pitch `dst_pitch`), which must lie inside a registered destination. `src` is a checked
  // device pointer of `device` ordered after the work queued so far on `producer_stream`, or, with `staged`, bytes
  // of this copier's fp8 scratch (from QuantizeFp8Async; ordered on the copier's stream, producer_stream unused).
  virtual absl::Status Copy2DAsync(absl::string_view name, uint8_t* dst, uint64_t dst_pitch, const void* src,
                                   uint64_t src_pitch, uint64_t row_bytes, int64_t rows, int device,
                                   uint64_t producer_stream, bool staged) = 0;
  // Waits until every queued copy has landed; the first asynchronous error otherwise.
  virtual absl::Status Drain() = 0;
  // Copies queued since creation, and the time the ring's registration took.
  virtual uint64_t copies() const = 0;
  virtual double register_seconds() const = 0;
};

}  // namespace wsync::client
