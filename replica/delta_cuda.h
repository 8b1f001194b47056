#pragma once
// Applying delta encodings (replica/delta.h) to GPU memory: the host validates each encoding and stages its changed
// runs in page-locked memory; then either one copy of the staged values and run table to the device and a kernel
// that scatters them (kKernel), or one cudaMemcpyAsync per run straight from the staging buffer (kMemcpyBatch).
// Built only with WSYNC_WITH_CUDA. tests/cuda/delta_scatter_cuda_test checks both bit-exactly against the dense bytes
// and times them.
//
// The device's current bytes cannot be hashed by the host, so the base check is the caller's: it passes the
// checksum it recorded when it last wrote the range (delta::Checksum of those bytes), and Add refuses an encoding
// made against another base.

#include <cstdint>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "replica/delta.h"

namespace wsync::replica::delta {

enum class ScatterMethod { kKernel, kMemcpyBatch };

// Not thread-safe: one owner, one stream.
class CudaScatter {
 public:
  // `stream`: a cudaStream_t (nullptr: the default stream).
  static absl::StatusOr<std::unique_ptr<CudaScatter>> Create(void* stream = nullptr);
  ~CudaScatter();
  CudaScatter(const CudaScatter&) = delete;
  CudaScatter& operator=(const CudaScatter&) = delete;

  // Validates `enc` (Inspect: header, frame checksum, every index in range), that it covers dst_bytes, and, when
  // `recorded_base` is given, that it was encoded against those bytes; then stages its runs for [dst, dst + dst_bytes)
  // (a device pointer). Nothing reaches the device before Flush; a refused encoding stages nothing.
  // InvalidArgument for a corrupt or mismatched encoding, FailedPrecondition for another base.
  absl::StatusOr<Info> Add(uint8_t* dst, uint64_t dst_bytes, const uint8_t* enc, uint64_t enc_bytes,
                           std::optional<uint64_t> recorded_base);

  // Writes everything staged to the device by `method` and waits for it; the staging is empty afterwards (also when
  // it fails).
  absl::Status Flush(ScatterMethod method);

  uint64_t staged_runs() const { return runs_; }
  uint64_t staged_value_bytes() const { return value_bytes_; }

  // What the kernel reads per staged piece of a run (a run is cut into pieces of at most kMaxPieceBytes).
  struct Piece {
    uint64_t dst;         // device address
    uint32_t src;         // byte offset in the staged values
    uint32_t bytes_size;  // bytes (low 24 bits) | element size << 24
  };
  static constexpr uint32_t kMaxPieceBytes = 256;

 private:
  CudaScatter() = default;
  absl::Status Reserve(uint64_t pieces, uint64_t value_bytes);

  void* stream_ = nullptr;
  uint8_t* host_values_ = nullptr;  // page-locked
  Piece* host_pieces_ = nullptr;    // page-locked
  uint8_t* dev_values_ = nullptr;
  Piece* dev_pieces_ = nullptr;
  uint64_t values_cap_ = 0, pieces_cap_ = 0;
  uint64_t value_bytes_ = 0, pieces_ = 0, runs_ = 0;
};

}  // namespace wsync::replica::delta
