#include "daemon/node/target_node_cuda.h"

#include <cuda.h>  // driver types for cuMemGetAddressRange, reached through the runtime's entry-point query
#include <cuda_runtime.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "base/cuda_status.h"
#include "base/status.h"
#include "replica/delta_cuda.h"

namespace wsync::daemon {
namespace {

// Staging per device: 16 chunks of 4 MiB (64 MiB page-locked), allocated when the first cuda segment of that device
// attaches and kept for the daemon's life. 4 MiB copies run at the pinned H2D peak; 16 leave every tcp stream a
// few chunks in flight while it receives the next.
constexpr uint64_t kChunkBytes = 4ull << 20;
constexpr int kChunks = 16;

std::string Hex(const std::string& bytes) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (unsigned char c : bytes) {
    s += d[c >> 4];
    s += d[c & 15];
  }
  return s;
}

// Page-locked staging chunks and the one stream their host-to-device copies run on (copies of one device in one
// direction share a copy engine; one stream keeps them in submission order, so a Flush event covers every earlier
// copy). Thread-safe.
class StagingPool {
 public:
  static absl::StatusOr<std::shared_ptr<StagingPool>> ForDevice(int dev) {
    static std::mutex mu;
    static std::map<int, std::shared_ptr<StagingPool>> pools;
    std::lock_guard<std::mutex> l(mu);
    auto& p = pools[dev];
    if (p != nullptr) return p;
    auto pool = std::shared_ptr<StagingPool>(new StagingPool(dev));
    WSYNC_RETURN_IF_ERROR(pool->Init());
    p = pool;
    return p;
  }

  ~StagingPool() {
    cudaSetDevice(dev_);
    for (auto& s : slots_) {
      if (s.done != nullptr) cudaEventDestroy(s.done);
      if (s.host != nullptr) cudaFreeHost(s.host);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::StatusOr<transport::RegionSink::Staging> Acquire(const std::string& who) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return !free_.empty() || !in_flight_.empty(); });
    int slot;
    if (!free_.empty()) {
      slot = free_.front();
      free_.pop_front();
      return transport::RegionSink::Staging{slots_[slot].host, slot};
    }
    // Every chunk is in flight: take the oldest once its copy finished.
    slot = in_flight_.front();
    in_flight_.pop_front();
    l.unlock();
    cudaSetDevice(dev_);
    if (absl::Status s = CudaError(cudaEventSynchronize(slots_[slot].done), "cudaEventSynchronize",
                                   absl::StrCat("H2D copy of a staging chunk into ", who));
        !s.ok()) {
      Cancel(slot);
      return s;
    }
    return transport::RegionSink::Staging{slots_[slot].host, slot};
  }

  absl::Status Submit(int slot, void* dst, uint64_t len, const std::string& who, uint64_t offset) {
    cudaSetDevice(dev_);
    const std::string what = absl::StrCat("H2D copy of ", len, " bytes to offset ", offset, " of ", who);
    if (absl::Status s = CudaError(cudaMemcpyAsync(dst, slots_[slot].host, len, cudaMemcpyHostToDevice, stream_),
                                   "cudaMemcpyAsync", what);
        !s.ok()) {
      Cancel(slot);
      return s;
    }
    absl::Status s = CudaError(cudaEventRecord(slots_[slot].done, stream_), "cudaEventRecord", what);
    std::lock_guard<std::mutex> l(mu_);
    if (s.ok()) {
      in_flight_.push_back(slot);
    } else {
      free_.push_back(slot);
    }
    cv_.notify_one();
    return s;
  }

  void Cancel(int slot) {
    std::lock_guard<std::mutex> l(mu_);
    free_.push_back(slot);
    cv_.notify_one();
  }

  absl::Status Flush(const std::string& who) {
    cudaSetDevice(dev_);
    const std::string what = absl::StrCat("waiting for the H2D copies into ", who);
    cudaEvent_t ev = nullptr;
    WSYNC_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), what);
    absl::Status s = CudaError(cudaEventRecord(ev, stream_), "cudaEventRecord", what);
    if (s.ok()) s = CudaError(cudaEventSynchronize(ev), "cudaEventSynchronize", what);
    cudaEventDestroy(ev);
    return s;
  }

  int device() const { return dev_; }

 private:
  struct Slot {
    uint8_t* host = nullptr;
    cudaEvent_t done = nullptr;
  };
  explicit StagingPool(int dev) : dev_(dev) {}

  absl::Status Init() {
    WSYNC_CUDA_RETURN_IF_ERROR(cudaSetDevice(dev_), absl::StrCat("staging pool of device ", dev_));
    const absl::Time t0 = absl::Now();
    WSYNC_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "staging stream");
    slots_.resize(kChunks);
    for (int i = 0; i < kChunks; ++i) {
      void* p = nullptr;
      WSYNC_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, kChunkBytes, cudaHostAllocPortable),
                                 absl::StrCat("page-locked staging chunk ", i, " of ", kChunkBytes, " bytes"));
      slots_[i].host = static_cast<uint8_t*>(p);
      WSYNC_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&slots_[i].done, cudaEventDisableTiming),
                                 "staging chunk event");
      free_.push_back(i);
    }
    spdlog::info("cuda:{}: {} staging chunks of {} MiB page-locked in {:.3f}s", dev_, kChunks, kChunkBytes >> 20,
                 absl::ToDoubleSeconds(absl::Now() - t0));
    return absl::OkStatus();
  }

  const int dev_;
  cudaStream_t stream_ = nullptr;
  std::vector<Slot> slots_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int> free_, in_flight_;  // in_flight_: submission order
};

// A driver API function through the runtime's entry-point query (the daemon does not link libcuda); null when the
// driver does not offer it.
void* DriverEntry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess)
    return nullptr;
  return fn;
}

class CudaSink final : public transport::RegionSink {
 public:
  CudaSink(std::shared_ptr<StagingPool> pool, uint8_t* dst, uint64_t bytes, std::string who)
      : pool_(std::move(pool)), dst_(dst), bytes_(bytes), who_(std::move(who)) {}
  ~CudaSink() override {
    if (mirror_ != nullptr) {
      cudaSetDevice(pool_->device());
      cudaFreeHost(mirror_);
    }
  }

  // GPUDirect RDMA: a dma-buf over the host-page-aligned range around the segment (cuMemGetHandleForAddressRange).
  absl::StatusOr<Dmabuf> ExportDmabuf() override {
    const int dev = pool_->device();
    WSYNC_CUDA_RETURN_IF_ERROR(cudaSetDevice(dev), who_);
    using AttrFn = CUresult (*)(int*, CUdevice_attribute, CUdevice);
    auto attr = reinterpret_cast<AttrFn>(DriverEntry("cuDeviceGetAttribute"));
    int supported = 0;
    if (attr == nullptr || attr(&supported, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev) != CUDA_SUCCESS ||
        supported == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("cuda:", dev, " reports no dma-buf support (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: the "
                       "driver or kernel is too old, or the open kernel modules are not in use)"));
    }
    using Fn = CUresult (*)(void*, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long);
    auto fn = reinterpret_cast<Fn>(DriverEntry("cuMemGetHandleForAddressRange"));
    if (fn == nullptr)
      return absl::FailedPreconditionError("the CUDA driver has no cuMemGetHandleForAddressRange (older than 11.7)");
    const uint64_t page = 4096, start = reinterpret_cast<uint64_t>(dst_);
    const uint64_t lo = start & ~(page - 1), hi = (start + bytes_ + page - 1) & ~(page - 1);
    int fd = -1;
    if (CUresult r = fn(&fd, lo, hi - lo, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0); r != CUDA_SUCCESS || fd < 0)
      return absl::FailedPreconditionError(absl::StrCat("cuMemGetHandleForAddressRange(dma-buf, ", hi - lo,
                                                        " bytes of ", who_, ") failed with CUresult ", r));
    return Dmabuf{fd, start - lo, start};
  }

  // The staging alternative for a NIC writer: page-locked host memory as large as the segment, filled from it.
  absl::StatusOr<uint8_t*> HostMirror() override {
    std::lock_guard<std::mutex> l(mirror_mu_);
    if (mirror_ != nullptr) return mirror_;
    WSYNC_CUDA_RETURN_IF_ERROR(cudaSetDevice(pool_->device()), who_);
    void* p = nullptr;
    WSYNC_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, bytes_, cudaHostAllocPortable),
                               absl::StrCat("page-locked host mirror of ", bytes_, " bytes for ", who_));
    if (absl::Status st = CudaError(cudaMemcpy(p, dst_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy",
                                    absl::StrCat("filling the host mirror of ", who_));
        !st.ok()) {
      cudaFreeHost(p);
      return st;
    }
    mirror_ = static_cast<uint8_t*>(p);
    return mirror_;
  }

  absl::Status CopyMirror() override {
    std::lock_guard<std::mutex> l(mirror_mu_);
    if (mirror_ == nullptr) return absl::FailedPreconditionError(absl::StrCat(who_, " has no host mirror"));
    WSYNC_CUDA_RETURN_IF_ERROR(cudaSetDevice(pool_->device()), who_);
    return CudaError(cudaMemcpy(dst_, mirror_, bytes_, cudaMemcpyHostToDevice), "cudaMemcpy",
                     absl::StrCat("H2D copy of the host mirror (", bytes_, " bytes) into ", who_));
  }

  // The host mirror if a NIC writer made one (null otherwise): delta records must reach it too, or its next
  // CopyMirror would put back what they replaced.
  uint8_t* mirror() {
    std::lock_guard<std::mutex> l(mirror_mu_);
    return mirror_;
  }
  uint8_t* device_data() const { return dst_; }
  int device() const { return pool_->device(); }

  uint64_t length() const override { return bytes_; }
  uint64_t chunk_bytes() const override { return kChunkBytes; }
  absl::StatusOr<Staging> Acquire() override { return pool_->Acquire(who_); }
  absl::Status Submit(const Staging& s, uint64_t offset, uint64_t len) override {
    if (offset > bytes_ || len > bytes_ - offset || len > kChunkBytes) {
      pool_->Cancel(s.slot);
      return absl::OutOfRangeError(absl::StrCat("write [", offset, ", +", len, ") is outside ", who_, " (", bytes_,
                                                " bytes)"));
    }
    return pool_->Submit(s.slot, dst_ + offset, len, who_, offset);
  }
  void Cancel(const Staging& s) override { pool_->Cancel(s.slot); }
  absl::Status Flush() override { return pool_->Flush(who_); }
  std::string Describe() const override { return who_; }

 private:
  std::shared_ptr<StagingPool> pool_;
  uint8_t* dst_;
  uint64_t bytes_;
  std::string who_;
  std::mutex mirror_mu_;
  uint8_t* mirror_ = nullptr;  // page-locked, only for a NIC writer without GPUDirect
};

// Delta records into one cuda segment: CudaScatter's kernel from page-locked staging; the base check of a range
// without a recorded checksum reads it back (one D2H copy of the range). With a host mirror (a NIC writer without
// GPUDirect) the mirror is what the segment holds until PostProcess settles it onto the device (a copy of the whole
// mirror): records are applied to the mirror (replica::delta::Apply, which checks its bytes against the base) and
// read back from it; the device gets them with the settle.
class DeviceScatter final : public SegmentScatter {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceScatter>> Create(std::shared_ptr<CudaSink> sink) {
    WSYNC_CUDA_RETURN_IF_ERROR(cudaSetDevice(sink->device()), sink->Describe());
    auto s = std::unique_ptr<DeviceScatter>(new DeviceScatter(std::move(sink)));
    WSYNC_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s->stream_, cudaStreamNonBlocking),
                               absl::StrCat("delta scatter stream of ", s->sink_->Describe()));
    WSYNC_ASSIGN_OR_RETURN(s->scatter_, replica::delta::CudaScatter::Create(s->stream_));
    return s;
  }
  ~DeviceScatter() override {
    scatter_.reset();
    if (stream_ != nullptr) {
      cudaSetDevice(sink_->device());
      cudaStreamDestroy(stream_);
    }
  }

  absl::Status ReadBack(uint64_t offset, uint64_t bytes, uint8_t* out) override {
    WSYNC_RETURN_IF_ERROR(InSegment(offset, bytes));
    if (const uint8_t* m = sink_->mirror(); m != nullptr) {
      std::memcpy(out, m + offset, bytes);
      return absl::OkStatus();
    }
    WSYNC_CUDA_RETURN_IF_ERROR(cudaSetDevice(sink_->device()), sink_->Describe());
    return CudaError(cudaMemcpy(out, sink_->device_data() + offset, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy",
                     absl::StrCat("reading back [", offset, ", +", bytes, ") of ", sink_->Describe()));
  }

  absl::StatusOr<replica::delta::Info> Add(uint64_t offset, uint64_t bytes, const uint8_t* enc, uint64_t enc_bytes,
                                           uint64_t base) override {
    WSYNC_ASSIGN_OR_RETURN(replica::delta::Info info,
                           CheckRecord(offset, bytes, sink_->length(), sink_->Describe(), enc, enc_bytes, base));
    if (uint8_t* m = sink_->mirror(); m != nullptr) {
      uint64_t consumed = 0;
      WSYNC_RETURN_IF_ERROR(replica::delta::Apply(m + offset, bytes, enc, enc_bytes, &consumed));
      return info;
    }
    WSYNC_CUDA_RETURN_IF_ERROR(cudaSetDevice(sink_->device()), sink_->Describe());
    return scatter_->Add(sink_->device_data() + offset, bytes, enc, enc_bytes, base);
  }

  absl::Status Flush() override {
    WSYNC_CUDA_RETURN_IF_ERROR(cudaSetDevice(sink_->device()), sink_->Describe());
    return Annotate(scatter_->Flush(replica::delta::ScatterMethod::kKernel),
                    absl::StrCat("delta scatter into ", sink_->Describe()));
  }

 private:
  explicit DeviceScatter(std::shared_ptr<CudaSink> sink) : sink_(std::move(sink)) {}
  absl::Status InSegment(uint64_t offset, uint64_t bytes) const {
    if (offset > sink_->length() || bytes > sink_->length() - offset)
      return absl::InvalidArgumentError(absl::StrCat("range [", offset, ", +", bytes, ") is outside ",
                                                     sink_->Describe(), " (", sink_->length(), " bytes)"));
    return absl::OkStatus();
  }

  std::shared_ptr<CudaSink> sink_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<replica::delta::CudaScatter> scatter_;
};

class ImportedSegment final : public CudaSegment {
 public:
  ImportedSegment(int dev, std::string dev_name, void* base, std::shared_ptr<CudaSink> sink)
      : dev_(dev), dev_name_(std::move(dev_name)), base_(base), sink_(std::move(sink)) {}
  ~ImportedSegment() override {
    scatter_.reset();
    sink_.reset();
    if (base_ == nullptr) return;  // WrapCudaMemory: the caller's own memory
    cudaSetDevice(dev_);
    if (cudaError_t e = cudaIpcCloseMemHandle(base_); e != cudaSuccess)
      spdlog::warn("cudaIpcCloseMemHandle on cuda:{}: {}", dev_, cudaGetErrorString(e));
  }
  std::shared_ptr<transport::RegionSink> sink() const override { return sink_; }
  std::string device() const override { return absl::StrCat("cuda:", dev_, " (", dev_name_, ")"); }
  absl::StatusOr<SegmentScatter*> Scatter() override {
    if (scatter_ == nullptr) {
      WSYNC_ASSIGN_OR_RETURN(scatter_, DeviceScatter::Create(sink_));
    }
    return scatter_.get();
  }

 private:
  int dev_;
  std::string dev_name_;
  void* base_;
  std::shared_ptr<CudaSink> sink_;
  std::unique_ptr<DeviceScatter> scatter_;
};

// Size of the allocation that starts at `base`, through the driver's cuMemGetAddressRange (reached via the
// runtime so the daemon does not link libcuda). 0 when the driver does not offer it.
uint64_t AllocationBytes(void* base) {
  using Fn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  void* fn = DriverEntry("cuMemGetAddressRange");
  if (fn == nullptr) return 0;
  CUdeviceptr b = 0;
  size_t size = 0;
  if (reinterpret_cast<Fn>(fn)(&b, &size, reinterpret_cast<CUdeviceptr>(base)) != CUDA_SUCCESS) return 0;
  return size - (reinterpret_cast<CUdeviceptr>(base) - b);
}

}  // namespace

absl::StatusOr<std::shared_ptr<transport::RegionSink>> MakeCudaSink(void* device_ptr, uint64_t bytes, int device,
                                                                    const std::string& who) {
  WSYNC_ASSIGN_OR_RETURN(auto pool, StagingPool::ForDevice(device));
  return std::shared_ptr<transport::RegionSink>(
      std::make_shared<CudaSink>(std::move(pool), static_cast<uint8_t*>(device_ptr), bytes, who));
}

absl::StatusOr<std::unique_ptr<CudaSegment>> WrapCudaMemory(void* device_ptr, uint64_t bytes, int device,
                                                            const std::string& who) {
  cudaDeviceProp prop{};
  WSYNC_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device), who);
  WSYNC_ASSIGN_OR_RETURN(auto pool, StagingPool::ForDevice(device));
  auto sink = std::make_shared<CudaSink>(std::move(pool), static_cast<uint8_t*>(device_ptr), bytes, who);
  return std::unique_ptr<CudaSegment>(std::make_unique<ImportedSegment>(device, prop.name, nullptr, std::move(sink)));
}

absl::StatusOr<std::unique_ptr<CudaSegment>> ImportCudaSegment(const CudaSegmentDesc& d, const std::string& who) {
  if (d.ipc_handle.size() != sizeof(cudaIpcMemHandle_t))
    return absl::InvalidArgumentError(absl::StrCat(who, ": an IPC handle has ", sizeof(cudaIpcMemHandle_t),
                                                   " bytes, got ", d.ipc_handle.size()));
  int n = 0;
  if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess || n == 0)
    return absl::FailedPreconditionError(absl::StrCat(
        who, ": a cuda segment, but this wsyncd sees no CUDA device (",
        e != cudaSuccess ? cudaGetErrorString(e) : "0 devices", "); run the target daemon on the engine's node "
        "with its GPUs visible"));
  int dev = -1;
  cudaDeviceProp prop{};
  for (int i = 0; i < n && dev < 0; ++i) {
    WSYNC_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, i), absl::StrCat(who, ": properties of device ", i));
    if (d.device_uuid.size() == sizeof(prop.uuid.bytes) &&
        std::memcmp(prop.uuid.bytes, d.device_uuid.data(), sizeof(prop.uuid.bytes)) == 0)
      dev = i;
  }
  if (dev < 0)
    return absl::FailedPreconditionError(absl::StrCat(
        who, ": its memory is on the GPU with UUID ", Hex(d.device_uuid), ", which this wsyncd does not see (", n,
        " devices visible; check CUDA_VISIBLE_DEVICES of the target daemon)"));
  WSYNC_CUDA_RETURN_IF_ERROR(cudaSetDevice(dev), who);
  cudaIpcMemHandle_t h;
  std::memcpy(&h, d.ipc_handle.data(), sizeof(h));
  void* base = nullptr;
  const absl::Time t0 = absl::Now();
  if (cudaError_t e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    return Annotate(CudaError(e, "cudaIpcOpenMemHandle", absl::StrCat(d.bytes, " bytes at offset ", d.offset)),
                    absl::StrCat(who, ": importing its IPC handle (has the engine process exited, or is the memory "
                                      "not a cudaMalloc allocation?)"));
  }
  const uint64_t alloc = AllocationBytes(base);
  if (alloc != 0 && (d.offset > alloc || d.bytes > alloc - d.offset)) {
    cudaIpcCloseMemHandle(base);
    return absl::InvalidArgumentError(absl::StrCat(who, ": segment [", d.offset, ", +", d.bytes,
                                                   ") lies outside its allocation of ", alloc, " bytes"));
  }
  const std::string swho = absl::StrCat(who, " on cuda:", dev);
  auto pool = StagingPool::ForDevice(dev);
  if (!pool.ok()) {
    cudaIpcCloseMemHandle(base);
    return pool.status();
  }
  auto sink = std::make_shared<CudaSink>(*std::move(pool), static_cast<uint8_t*>(base) + d.offset, d.bytes, swho);
  spdlog::info("{}: imported {} bytes (IPC handle, offset {}, allocation {} bytes) in {:.3f}s", swho, d.bytes,
               d.offset, alloc, absl::ToDoubleSeconds(absl::Now() - t0));
  return std::unique_ptr<CudaSegment>(std::make_unique<ImportedSegment>(dev, prop.name, base, std::move(sink)));
}

}  // namespace wsync::daemon
