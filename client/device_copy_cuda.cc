#include <cuda_runtime.h>

#include <algorithm>
#include <map>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/cuda_status.h"
#include "base/status.h"
#include "client/device_copy.h"
#include "replica/fp8_cuda.h"

namespace wsync::client {
namespace {

class CudaCopier final : public DeviceCopier {
 public:
  CudaCopier(void* ring, uint64_t bytes, std::string name, double reg_s)
      : ring_(ring), bytes_(bytes), name_(std::move(name)), reg_s_(reg_s) {}

  ~CudaCopier() override {
    if (absl::Status s = Drain(); !s.ok()) spdlog::warn("ring {}: {}", name_, std::string(s.message()));
    for (auto& [dev, q] : queues_) {
      cudaSetDevice(dev);
      cudaEventDestroy(q.ready);
      cudaEventDestroy(q.done);
      cudaStreamDestroy(q.stream);
      if (q.scratch != nullptr) cudaFree(q.scratch);
    }
    if (cudaError_t e = cudaHostUnregister(ring_); e != cudaSuccess)
      spdlog::warn("ring {}: cudaHostUnregister: {}", name_, cudaGetErrorString(e));
    while (!destinations_.empty()) UnregisterDestination(destinations_.begin()->first);
  }

  absl::Status RegisterDestination(void* addr, uint64_t bytes, const std::string& what) override {
    if (destinations_.count(addr)) return absl::OkStatus();
    const absl::Time t0 = absl::Now();
    WSYNC_CUDA_RETURN_IF_ERROR(cudaHostRegister(addr, bytes, cudaHostRegisterPortable),
                               absl::StrCat("page-locking ", what, " (", bytes, " bytes; raise RLIMIT_MEMLOCK)"));
    spdlog::info("{}: {} MiB page-locked for CUDA placement in {:.3f}s (once per replica)", what, bytes >> 20,
                 absl::ToDoubleSeconds(absl::Now() - t0));
    destinations_[addr] = Destination{bytes, what};
    return absl::OkStatus();
  }

  void UnregisterDestination(void* addr) override {
    auto it = destinations_.find(addr);
    if (it == destinations_.end()) return;
    if (cudaError_t e = cudaHostUnregister(addr); e != cudaSuccess)
      spdlog::warn("{}: cudaHostUnregister: {}", it->second.what, cudaGetErrorString(e));
    destinations_.erase(it);
  }

  absl::Status Copy2DAsync(absl::string_view name, uint8_t* dst, uint64_t dst_pitch, const void* src,
                           uint64_t src_pitch, uint64_t row_bytes, int64_t rows, int device, uint64_t producer_stream,
                           bool staged) override {
    const std::string what = absl::StrCat("tensor ", name, ": ", rows, " rows of ", row_bytes,
                                          " bytes from cuda:", device, " into the replica");
    if (rows <= 0 || row_bytes == 0) return absl::OkStatus();
    const uint64_t span = static_cast<uint64_t>(rows - 1) * dst_pitch + row_bytes;
    bool inside = false;
    for (const auto& [addr, d] : destinations_) {
      const auto* base = static_cast<const uint8_t*>(addr);
      inside |= dst >= base && span <= d.bytes && dst + span <= base + d.bytes;
    }
    if (!inside)
      return absl::InternalError(absl::StrCat(what, ": the destination lies outside the registered replica"));
    WSYNC_ASSIGN_OR_RETURN(Queue * q, QueueFor(device, what));
    WSYNC_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), what);
    if (!staged) {
      WSYNC_CUDA_RETURN_IF_ERROR(cudaEventRecord(q->ready, reinterpret_cast<cudaStream_t>(producer_stream)), what);
      WSYNC_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(q->stream, q->ready, 0), what);
    }
    WSYNC_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, static_cast<size_t>(rows),
                                                 cudaMemcpyDeviceToHost, q->stream),
                               what);
    q->pending = true;
    ++copies_;
    return absl::OkStatus();
  }

  absl::Status Check(absl::string_view name, const void* src, uint64_t bytes, int device) override {
    const std::string what = absl::StrCat("tensor ", name, ": ", bytes, " bytes from cuda:", device, " at 0x", absl::Hex(reinterpret_cast<uintptr_t>(src)));
    cudaPointerAttributes attr{};
    if (cudaError_t e = cudaPointerGetAttributes(&attr, src); e != cudaSuccess) {
      cudaGetLastError();
      return CudaError(e, "cudaPointerGetAttributes", what);
    }
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
      return absl::InvalidArgumentError(absl::StrCat(what, ": the pointer is not device memory (push it as a host "
                                                     "tensor)"));
    if (attr.device != device)
      return absl::InvalidArgumentError(absl::StrCat(what, ": the memory belongs to cuda:", attr.device,
                                                     ", not the device given"));
    return QueueFor(device, what).status();
  }

  absl::Status CopyAsync(absl::string_view name, uint8_t* dst, const void* src, uint64_t bytes, int device,
                         uint64_t producer_stream) override {
    const std::string what = absl::StrCat("tensor ", name, ": ", bytes, " bytes from cuda:", device, " at 0x", absl::Hex(reinterpret_cast<uintptr_t>(src)));
    if (dst < static_cast<uint8_t*>(ring_) || bytes > bytes_ ||
        dst + bytes > static_cast<uint8_t*>(ring_) + bytes_)
      return absl::InternalError(absl::StrCat(what, ": the ring slot lies outside the registered ring"));
    WSYNC_ASSIGN_OR_RETURN(Queue * q, QueueFor(device, what));
    WSYNC_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), what);
    // Ordered after what the producer has queued so far, without blocking the host.
    WSYNC_CUDA_RETURN_IF_ERROR(cudaEventRecord(q->ready, reinterpret_cast<cudaStream_t>(producer_stream)), what);
    WSYNC_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(q->stream, q->ready, 0), what);
    WSYNC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, q->stream), what);
    q->pending = true;
    ++copies_;
    return absl::OkStatus();
  }

  absl::Status QuantizeFp8Async(absl::string_view name, DType dtype, const void* src, int64_t rows, int64_t cols,
                                int block_n, int block_k, bool ue8m0, int device, uint64_t producer_stream,
                                Fp8Staged* out) override {
    const std::string what = absl::StrCat("tensor ", name, ": fp8 quantization of [", rows, ", ", cols, "] ",
                                          DTypeName(dtype), " on cuda:", device);
    if (rows <= 0 || cols <= 0 || block_n <= 0 || block_k <= 0)
      return absl::InvalidArgumentError(absl::StrCat(what, ": needs a non-empty 2-D tensor and a positive block (",
                                                     block_n, "x", block_k, ")"));
    WSYNC_ASSIGN_OR_RETURN(Queue * q, QueueFor(device, what));
    const uint64_t code_bytes = static_cast<uint64_t>(rows) * static_cast<uint64_t>(cols);
    const int64_t srows = (rows + block_n - 1) / block_n, scols = (cols + block_k - 1) / block_k;
    const uint64_t scale_bytes = static_cast<uint64_t>(srows) * static_cast<uint64_t>(scols) * sizeof(float);
    const uint64_t scale_off = (code_bytes + 255) / 256 * 256;  // the scales start 256-byte aligned
    WSYNC_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), what);
    if (q->scratch_bytes < scale_off + scale_bytes) {
      // Grown to the largest tensor quantized so far (once per size class, not per push). The old scratch may still
      // be read by queued copies: wait for them first.
      WSYNC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(q->stream), what);
      if (q->scratch != nullptr) WSYNC_CUDA_RETURN_IF_ERROR(cudaFree(q->scratch), what);
      q->scratch = nullptr;
      q->scratch_bytes = 0;
      const uint64_t want = std::max<uint64_t>(scale_off + scale_bytes, 1 << 20);
      WSYNC_CUDA_RETURN_IF_ERROR(cudaMalloc(&q->scratch, want),
                                 absl::StrCat(what, ": allocating ", want, " bytes of fp8 scratch"));
      q->scratch_bytes = want;
    }
    WSYNC_CUDA_RETURN_IF_ERROR(cudaEventRecord(q->ready, reinterpret_cast<cudaStream_t>(producer_stream)), what);
    WSYNC_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(q->stream, q->ready, 0), what);
    auto* codes = static_cast<uint8_t*>(q->scratch);
    auto* scales = reinterpret_cast<float*>(codes + scale_off);
    WSYNC_RETURN_IF_ERROR_CTX(
        replica::QuantizeFp8BlockCuda(dtype, src, rows, cols, cols, block_n, block_k, codes, cols, scales, scols,
                                      ue8m0 ? replica::Fp8ScaleFormat::kUe8m0 : replica::Fp8ScaleFormat::kFloat32,
                                      q->stream),
        what);
    q->pending = true;
    ++quantized_;
    *out = Fp8Staged{codes, scales, code_bytes, scale_bytes};
    return absl::OkStatus();
  }

  absl::Status CopyStagedAsync(absl::string_view name, uint8_t* dst, const void* staged, uint64_t bytes,
                               int device) override {
    const std::string what = absl::StrCat("tensor ", name, ": ", bytes, " staged bytes from cuda:", device);
    if (dst < static_cast<uint8_t*>(ring_) || bytes > bytes_ || dst + bytes > static_cast<uint8_t*>(ring_) + bytes_)
      return absl::InternalError(absl::StrCat(what, ": the ring slot lies outside the registered ring"));
    auto it = queues_.find(device);
    if (it == queues_.end() || it->second.scratch == nullptr ||
        static_cast<const uint8_t*>(staged) < static_cast<const uint8_t*>(it->second.scratch) ||
        static_cast<const uint8_t*>(staged) + bytes > static_cast<const uint8_t*>(it->second.scratch) +
                                                          it->second.scratch_bytes)
      return absl::InternalError(absl::StrCat(what, ": not inside this copier's fp8 scratch"));
    WSYNC_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), what);
    WSYNC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, staged, bytes, cudaMemcpyDeviceToHost, it->second.stream), what);
    it->second.pending = true;
    ++copies_;
    return absl::OkStatus();
  }

  absl::Status Drain() override {
    for (auto& [dev, q] : queues_) {
      if (!q.pending) continue;
      const std::string what = absl::StrCat("ring ", name_, ": waiting for the D2H copies from cuda:", dev);
      WSYNC_CUDA_RETURN_IF_ERROR(cudaSetDevice(dev), what);
      WSYNC_CUDA_RETURN_IF_ERROR(cudaEventRecord(q.done, q.stream), what);
      WSYNC_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(q.done), what);
      q.pending = false;
    }
    return absl::OkStatus();
  }

  uint64_t copies() const override { return copies_; }
  double register_seconds() const override { return reg_s_; }

 private:
  struct Queue {
    cudaStream_t stream = nullptr;
    cudaEvent_t ready = nullptr;  // recorded on the producer's stream before each copy
    cudaEvent_t done = nullptr;   // recorded on `stream` by Drain
    bool pending = false;
    void* scratch = nullptr;  // fp8 codes + scales of the tensor being quantized (QuantizeFp8Async)
    uint64_t scratch_bytes = 0;
  };

  absl::StatusOr<Queue*> QueueFor(int device, const std::string& what) {
    auto it = queues_.find(device);
    if (it != queues_.end()) return &it->second;
    int n = 0;
    WSYNC_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&n), what);
    if (device < 0 || device >= n)
      return absl::InvalidArgumentError(absl::StrCat(what, ": this process sees ", n, " CUDA devices"));
    WSYNC_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), what);
    Queue q;
    WSYNC_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&q.stream, cudaStreamNonBlocking), what);
    WSYNC_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&q.ready, cudaEventDisableTiming), what);
    WSYNC_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&q.done, cudaEventDisableTiming), what);
    return &queues_.emplace(device, q).first->second;
  }

  struct Destination {
    uint64_t bytes = 0;
    std::string what;
  };

  void* ring_;
  uint64_t bytes_;
  std::map<void*, Destination> destinations_;  // registered replica mappings (placement)
  std::string name_;
  double reg_s_;
  uint64_t copies_ = 0, quantized_ = 0;
  std::map<int, Queue> queues_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceCopier>> DeviceCopier::Create(void* ring, uint64_t bytes,
                                                                  const std::string& ring_name) {
  int n = 0;
  if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess || n == 0)
    return absl::FailedPreconditionError(absl::StrCat("ring ", ring_name, ": pushing a CUDA tensor, but this process "
                                                      "sees no CUDA device (", e != cudaSuccess ? cudaGetErrorString(e)
                                                                                                 : "0 devices", ")"));
  const absl::Time t0 = absl::Now();
  // Portable: the pinning holds for every device's context, so tensors of any device copy at full rate.
  WSYNC_CUDA_RETURN_IF_ERROR(
      cudaHostRegister(ring, bytes, cudaHostRegisterPortable),
      absl::StrCat("page-locking ring ", ring_name, " (", bytes, " bytes; raise RLIMIT_MEMLOCK or lower --ring-mib)"));
  const double s = absl::ToDoubleSeconds(absl::Now() - t0);
  spdlog::info("ring {}: {} MiB page-locked for CUDA copies in {:.3f}s (once per session)", ring_name, bytes >> 20, s);
  return std::unique_ptr<DeviceCopier>(std::make_unique<CudaCopier>(ring, bytes, ring_name, s));
}

}  // namespace wsync::client
