#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "bench/node/device_tensors.h"

namespace wsync::bench {
namespace {

absl::Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

class CudaTensors : public DeviceTensors {
 public:
  ~CudaTensors() override {
    for (cudaStream_t s : streams_) cudaStreamDestroy(s);
    if (pinned_ != nullptr) cudaFreeHost(pinned_);
    if (dev_ != nullptr) cudaFree(dev_);
  }
  const uint8_t* data() const override { return dev_; }
  std::string Describe() const override { return describe_; }

  absl::StatusOr<double> PinnedD2hSeconds(int streams, int reps) override {
    if (pinned_ == nullptr) {
      if (auto st = Cuda(cudaMallocHost(&pinned_, bytes_), "cudaMallocHost"); !st.ok()) return st;
      std::fill_n(static_cast<uint8_t*>(pinned_), bytes_, 1);  // first touch outside the timing
    }
    while (static_cast<int>(streams_.size()) < streams) {
      cudaStream_t s;
      if (auto st = Cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"); !st.ok()) return st;
      streams_.push_back(s);
    }
    const uint64_t share = (bytes_ / streams + 4095) / 4096 * 4096;
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < streams; ++i) {
        const uint64_t a = std::min(bytes_, share * i), b = std::min(bytes_, share * (i + 1));
        if (b == a) continue;
        if (auto st = Cuda(cudaMemcpyAsync(static_cast<uint8_t*>(pinned_) + a, dev_ + a, b - a, cudaMemcpyDeviceToHost,
                                           streams_[i]),
                           "cudaMemcpyAsync D2H");
            !st.ok())
          return st;
      }
      for (int i = 0; i < streams; ++i)
        if (auto st = Cuda(cudaStreamSynchronize(streams_[i]), "cudaStreamSynchronize"); !st.ok()) return st;
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  }

  uint8_t* dev_ = nullptr;
  void* pinned_ = nullptr;
  uint64_t bytes_ = 0;
  std::string describe_;
  std::vector<cudaStream_t> streams_;
};

}  // namespace

absl::Status DeviceTensors::Available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the "no device" error
    return absl::FailedPreconditionError("no CUDA device on this machine");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DeviceTensors>> DeviceTensors::Create(const uint8_t* host, uint64_t bytes) {
  if (absl::Status st = Available(); !st.ok()) return st;
  int count = 0;
  cudaGetDeviceCount(&count);
  cudaDeviceProp prop{};
  if (auto st = Cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties"); !st.ok()) return st;
  auto t = std::make_unique<CudaTensors>();
  t->bytes_ = bytes;
  t->describe_ = absl::StrCat(prop.name, " (device 0 of ", count, ")");
  if (auto st = Cuda(cudaSetDevice(0), "cudaSetDevice"); !st.ok()) return st;
  if (auto st = Cuda(cudaMalloc(&t->dev_, std::max<uint64_t>(bytes, 1)), "cudaMalloc"); !st.ok()) return st;
  if (auto st = Cuda(cudaMemcpy(t->dev_, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D"); !st.ok()) return st;
  return std::unique_ptr<DeviceTensors>(std::move(t));
}

}  // namespace wsync::bench
