// GPU side of delta updates (replica/delta_cuda.h). The host decodes the index section (varints, bitmaps: branchy,
// sequential work the CPU does well) into pieces {device address, offset in the staged values, bytes}; the device
// gets the pieces and the values in two copies and one kernel writes them, a thread per piece. Pieces are at most
// kMaxPieceBytes so that a long run does not leave one thread copying while the rest of its warp idles.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "replica/delta_cuda.h"

namespace wsync::replica::delta {
namespace {

static_assert(sizeof(CudaScatter::Piece) == 16, "the kernel reads pieces as 16-byte records");
static_assert(CudaScatter::kMaxPieceBytes < (1u << 24), "a piece's byte count has 24 bits");

absl::Status CudaError(cudaError_t e, const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

template <typename T>
__device__ __forceinline__ void CopyElems(uint8_t* d, const uint8_t* s, uint32_t bytes) {
  for (uint32_t k = 0; k < bytes / sizeof(T); ++k) reinterpret_cast<T*>(d)[k] = reinterpret_cast<const T*>(s)[k];
}

__global__ void ScatterKernel(const CudaScatter::Piece* pieces, uint64_t n, const uint8_t* values) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const CudaScatter::Piece p = pieces[i];
    const uint32_t bytes = p.bytes_size & 0xFFFFFFu, es = p.bytes_size >> 24;
    uint8_t* d = reinterpret_cast<uint8_t*>(p.dst);
    const uint8_t* s = values + p.src;
    if (es == 4) {
      CopyElems<uint32_t>(d, s, bytes);
    } else if (es == 2) {
      CopyElems<uint16_t>(d, s, bytes);
    } else {
      CopyElems<uint8_t>(d, s, bytes);
    }
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaScatter>> CudaScatter::Create(void* stream) {
  std::unique_ptr<CudaScatter> s(new CudaScatter());
  s->stream_ = stream;
  WSYNC_RETURN_IF_ERROR(s->Reserve(1 << 16, 1 << 20));
  return s;
}

CudaScatter::~CudaScatter() {
  if (host_values_ != nullptr) cudaFreeHost(host_values_);
  if (host_pieces_ != nullptr) cudaFreeHost(host_pieces_);
  if (dev_values_ != nullptr) cudaFree(dev_values_);
  if (dev_pieces_ != nullptr) cudaFree(dev_pieces_);
}

// Grows the page-locked staging (keeping what is staged) and the device buffers (whose content Flush rewrites).
absl::Status CudaScatter::Reserve(uint64_t pieces, uint64_t value_bytes) {
  if (value_bytes > UINT32_MAX)
    return absl::ResourceExhaustedError(
        absl::StrCat("delta scatter: ", value_bytes, " staged value bytes exceed one flush's 4 GiB"));
  if (pieces > pieces_cap_) {
    const uint64_t cap = std::max(pieces, pieces_cap_ * 2);
    Piece* h = nullptr;
    Piece* d = nullptr;
    if (cudaError_t e = cudaMallocHost(&h, cap * sizeof(Piece)); e != cudaSuccess)
      return CudaError(e, absl::StrCat("cudaMallocHost of ", cap * sizeof(Piece), " bytes of delta pieces"));
    if (cudaError_t e = cudaMalloc(&d, cap * sizeof(Piece)); e != cudaSuccess) {
      cudaFreeHost(h);
      return CudaError(e, absl::StrCat("cudaMalloc of ", cap * sizeof(Piece), " bytes of delta pieces"));
    }
    if (pieces_ > 0) std::memcpy(h, host_pieces_, pieces_ * sizeof(Piece));
    if (host_pieces_ != nullptr) cudaFreeHost(host_pieces_);
    if (dev_pieces_ != nullptr) cudaFree(dev_pieces_);
    host_pieces_ = h, dev_pieces_ = d, pieces_cap_ = cap;
  }
  if (value_bytes > values_cap_) {
    const uint64_t cap = std::min<uint64_t>(std::max(value_bytes, values_cap_ * 2), UINT32_MAX);
    uint8_t* h = nullptr;
    uint8_t* d = nullptr;
    if (cudaError_t e = cudaMallocHost(&h, cap); e != cudaSuccess)
      return CudaError(e, absl::StrCat("cudaMallocHost of ", cap, " bytes of delta values"));
    if (cudaError_t e = cudaMalloc(&d, cap); e != cudaSuccess) {
      cudaFreeHost(h);
      return CudaError(e, absl::StrCat("cudaMalloc of ", cap, " bytes of delta values"));
    }
    if (value_bytes_ > 0) std::memcpy(h, host_values_, value_bytes_);
    if (host_values_ != nullptr) cudaFreeHost(host_values_);
    if (dev_values_ != nullptr) cudaFree(dev_values_);
    host_values_ = h, dev_values_ = d, values_cap_ = cap;
  }
  return absl::OkStatus();
}

absl::StatusOr<Info> CudaScatter::Add(uint8_t* dst, uint64_t dst_bytes, const uint8_t* enc, uint64_t enc_bytes,
                                      std::optional<uint64_t> recorded_base) {
  WSYNC_ASSIGN_OR_RETURN(Info info, Inspect(enc, enc_bytes));
  if (info.range_bytes != dst_bytes)
    return absl::InvalidArgumentError(
        absl::StrCat("delta covers ", info.range_bytes, " bytes, the destination has ", dst_bytes));
  if (reinterpret_cast<uintptr_t>(dst) % info.elem_size != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("delta destination is not aligned to its ", info.elem_size, "-byte elements"));
  if (recorded_base.has_value() && *recorded_base != info.base_checksum)
    return absl::FailedPreconditionError(
        "delta base mismatch: the destination does not hold the delta's base (by the checksum recorded when it was "
        "last written)");
  const uint64_t changed_bytes = info.changed_elems * info.elem_size;
  const uint64_t start = (value_bytes_ + 7) / 8 * 8;  // every encoding's values 8-aligned: element-aligned loads
  WSYNC_RETURN_IF_ERROR(
      Reserve(pieces_ + info.changed_elems + changed_bytes / kMaxPieceBytes + 1, start + changed_bytes));
  const uint64_t es = info.elem_size;
  uint64_t at = start, pieces = pieces_, runs = 0;
  // Inspect passed, so ForEachRun decodes without error and never writes past what was reserved above.
  WSYNC_RETURN_IF_ERROR(ForEachRun(enc, enc_bytes, [&](uint64_t first, uint64_t count, const uint8_t* values) {
    const uint64_t bytes = count * es;
    std::memcpy(host_values_ + at, values, bytes);
    const uint64_t max_piece = kMaxPieceBytes / es * es;
    for (uint64_t off = 0; off < bytes; off += max_piece) {
      const uint64_t n = std::min(max_piece, bytes - off);
      host_pieces_[pieces++] = Piece{reinterpret_cast<uint64_t>(dst) + first * es + off,
                                     static_cast<uint32_t>(at + off), static_cast<uint32_t>(n | (es << 24))};
    }
    at += bytes;
    ++runs;
  }));
  pieces_ = pieces;
  value_bytes_ = at;
  runs_ += runs;
  return info;
}

absl::Status CudaScatter::Flush(ScatterMethod method) {
  auto* stream = static_cast<cudaStream_t>(stream_);
  const uint64_t n = pieces_, values = value_bytes_;
  pieces_ = value_bytes_ = runs_ = 0;
  if (n == 0) return absl::OkStatus();
  if (method == ScatterMethod::kKernel) {
    if (cudaError_t e = cudaMemcpyAsync(dev_values_, host_values_, values, cudaMemcpyHostToDevice, stream);
        e != cudaSuccess)
      return CudaError(e, absl::StrCat("delta scatter: copying ", values, " value bytes to the device"));
    if (cudaError_t e = cudaMemcpyAsync(dev_pieces_, host_pieces_, n * sizeof(Piece), cudaMemcpyHostToDevice, stream);
        e != cudaSuccess)
      return CudaError(e, absl::StrCat("delta scatter: copying ", n, " pieces to the device"));
    const unsigned threads = 256;
    const unsigned blocks = static_cast<unsigned>(std::min<uint64_t>((n + threads - 1) / threads, 8192));
    ScatterKernel<<<blocks, threads, 0, stream>>>(dev_pieces_, n, dev_values_);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
      return CudaError(e, absl::StrCat("delta scatter kernel over ", n, " pieces"));
  } else {
    // One copy per run: pieces of one run are contiguous on both sides, so they merge back.
    for (uint64_t i = 0; i < n;) {
      const Piece& p = host_pieces_[i];
      uint64_t bytes = p.bytes_size & 0xFFFFFFu;
      uint64_t j = i + 1;
      for (; j < n; ++j) {
        const Piece& q = host_pieces_[j];
        if (q.dst != p.dst + bytes || q.src != p.src + bytes) break;
        bytes += q.bytes_size & 0xFFFFFFu;
      }
      if (cudaError_t e = cudaMemcpyAsync(reinterpret_cast<void*>(p.dst), host_values_ + p.src, bytes,
                                          cudaMemcpyHostToDevice, stream);
          e != cudaSuccess)
        return CudaError(e, absl::StrCat("delta scatter: copying a run of ", bytes, " bytes"));
      i = j;
    }
  }
  if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess)
    return CudaError(e, absl::StrCat("delta scatter of ", n, " pieces (", values, " value bytes)"));
  return absl::OkStatus();
}

}  // namespace wsync::replica::delta
