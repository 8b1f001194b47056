// Delta encodings applied to GPU memory (replica/delta_cuda.h), both ways (the scatter kernel from a staging
// buffer, one cudaMemcpyAsync per run), bit-exact against the dense new bytes: bf16 ranges with scattered, clustered
// and long runs, FP8 codes (1-byte elements) and block scales (4-byte), several encodings per flush, an encoding with
// no change, and refusals that write nothing (another base by the recorded checksum, a flipped byte, a wrong
// length). Then the two ways timed on a larger model-sized range at the measured RL-step sparsity (1.4 % of bf16
// elements), against a dense cudaMemcpy of the same range: the figures that choose the way. Exit 77 without a GPU.

#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "replica/delta.h"
#include "replica/delta_cuda.h"
#include "tests/cuda/cuda_check.h"

namespace {

using wsync::replica::delta::CudaScatter;
using wsync::replica::delta::ScatterMethod;
namespace delta = wsync::replica::delta;

int failures = 0;
void Check(bool ok, const std::string& what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAIL", what.c_str());
  if (!ok) ++failures;
}

// A new version of `old`: `fraction` of the elements changed at random places, plus (clustered) a few runs of
// `run` consecutive elements.
std::vector<uint8_t> Mutate(const std::vector<uint8_t>& old, uint32_t es, double fraction, uint64_t runs, uint64_t run,
                            std::mt19937_64& rng) {
  std::vector<uint8_t> neu = old;
  const uint64_t n = old.size() / es;
  auto change = [&](uint64_t i) {
    for (uint32_t k = 0; k < es; ++k) neu[i * es + k] ^= static_cast<uint8_t>(1 + rng() % 255);
  };
  const auto picks = static_cast<uint64_t>(fraction * static_cast<double>(n));
  for (uint64_t k = 0; k < picks; ++k) change(rng() % n);
  for (uint64_t r = 0; r < runs && run <= n; ++r) {
    const uint64_t at = rng() % (n - run + 1);
    for (uint64_t i = at; i < at + run; ++i) change(i);
  }
  return neu;
}

std::vector<uint8_t> Random(uint64_t bytes, std::mt19937_64& rng) {
  std::vector<uint8_t> v(bytes);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

struct Range {
  uint64_t offset;  // in the device buffer
  uint32_t es;
  std::vector<uint8_t> old, neu;
  std::string enc;
};

std::vector<uint8_t> DeviceBytes(const uint8_t* d, uint64_t bytes) {
  std::vector<uint8_t> h(bytes);
  WSYNC_CUDA_CHECK(cudaMemcpy(h.data(), d, bytes, cudaMemcpyDeviceToHost), "D2H of the checked buffer");
  return h;
}

// Correctness: several ranges of a device buffer, both ways.
void CheckWays() {
  std::mt19937_64 rng(7);
  // (bytes, element size, fraction, runs, run length): bf16 at RL-step sparsity and denser, long runs that cross
  // pieces, FP8 codes with rescaled-block clusters, fp32 scales, and a range with no change.
  const struct {
    uint64_t bytes;
    uint32_t es;
    double fraction;
    uint64_t runs, run;
  } specs[] = {{1 << 20, 2, 0.014, 4, 3}, {3 << 18, 2, 0.09, 2, 5000}, {1 << 19, 1, 0.0012, 6, 128},
               {4096, 4, 0.02, 1, 7},     {65536, 2, 0.0, 0, 0},       {257 * 2, 2, 0.3, 1, 200}};
  std::vector<Range> ranges;
  uint64_t total = 0;
  for (const auto& s : specs) {
    Range r{total, s.es, Random(s.bytes, rng), {}, {}};
    r.neu = Mutate(r.old, s.es, s.fraction, s.runs, s.run, rng);
    const auto res = delta::Encode(r.old.data(), r.neu.data(), s.bytes, s.es, ~0ull, &r.enc);
    Check(!res.dense_smaller && res.encoded_bytes == r.enc.size(),
          "encoded " + std::to_string(s.bytes) + " bytes of " + std::to_string(s.es) + "-byte elements: " +
              std::to_string(res.changed_elems) + " changed, " + std::to_string(r.enc.size()) + " bytes");
    total = (total + s.bytes + 255) / 256 * 256;
    ranges.push_back(std::move(r));
  }
  std::vector<uint8_t> base(total, 0xA5), want(total, 0xA5);
  for (const auto& r : ranges) {
    std::memcpy(base.data() + r.offset, r.old.data(), r.old.size());
    std::memcpy(want.data() + r.offset, r.neu.data(), r.neu.size());
  }
  uint8_t* dev = nullptr;
  WSYNC_CUDA_CHECK(cudaMalloc(&dev, total), "device buffer of " + std::to_string(total) + " bytes");
  auto scatter = CudaScatter::Create();
  if (!scatter.ok()) {
    Check(false, "CudaScatter::Create: " + scatter.status().ToString());
    return;
  }
  CudaScatter& cs = **scatter;
  for (ScatterMethod m : {ScatterMethod::kKernel, ScatterMethod::kMemcpyBatch}) {
    const std::string way = m == ScatterMethod::kKernel ? "kernel" : "memcpy per run";
    WSYNC_CUDA_CHECK(cudaMemcpy(dev, base.data(), total, cudaMemcpyHostToDevice), "H2D of the base");
    uint64_t changed = 0;
    for (const auto& r : ranges) {
      auto info = cs.Add(dev + r.offset, r.old.size(), reinterpret_cast<const uint8_t*>(r.enc.data()), r.enc.size(),
                         delta::Checksum(r.old.data(), r.old.size()));
      Check(info.ok(), way + ": staged a range of " + std::to_string(r.old.size()) +
                           " bytes: " + (info.ok() ? "" : info.status().ToString()));
      if (info.ok()) changed += info->changed_elems;
    }
    const uint64_t runs = cs.staged_runs();
    auto st = cs.Flush(m);
    Check(st.ok(), way + ": flush of " + std::to_string(runs) + " runs, " + std::to_string(changed) +
                       " changed elements: " + st.ToString());
    const auto got = DeviceBytes(dev, total);
    uint64_t first_diff = total;
    for (uint64_t i = 0; i < total && first_diff == total; ++i)
      if (got[i] != want[i]) first_diff = i;
    Check(first_diff == total,
          way + ": device bytes equal the dense new bytes" +
              (first_diff == total ? "" : " (first difference at " + std::to_string(first_diff) + ")"));
  }

  // Refusals stage nothing: the device keeps the new bytes after a flush.
  const Range& r = ranges[0];
  auto info = cs.Add(dev + r.offset, r.old.size(), reinterpret_cast<const uint8_t*>(r.enc.data()), r.enc.size(),
                     delta::Checksum(r.neu.data(), r.neu.size()));  // the range holds the new bytes, not the base
  Check(!info.ok() && info.status().code() == absl::StatusCode::kFailedPrecondition,
        "another base (by the recorded checksum) is refused: " + info.status().ToString());
  std::string bad = r.enc;
  bad[bad.size() / 2] ^= 0x10;
  info = cs.Add(dev + r.offset, r.old.size(), reinterpret_cast<const uint8_t*>(bad.data()), bad.size(), std::nullopt);
  Check(!info.ok() && info.status().code() == absl::StatusCode::kInvalidArgument,
        "a flipped byte is refused: " + info.status().ToString());
  info = cs.Add(dev + r.offset, r.old.size() - 2, reinterpret_cast<const uint8_t*>(r.enc.data()), r.enc.size(),
                std::nullopt);
  Check(!info.ok() && info.status().code() == absl::StatusCode::kInvalidArgument,
        "a destination of another length is refused: " + info.status().ToString());
  Check(cs.staged_runs() == 0 && cs.staged_value_bytes() == 0, "the refused encodings staged nothing");
  Check(cs.Flush(ScatterMethod::kKernel).ok() && DeviceBytes(dev, total) == want, "nothing written by the refusals");
  cudaFree(dev);
}

// Timing: one model-sized bf16 range at 1.4 % changed elements (the RL step model at lr 1e-6, docs/delta.md).
void Measure(uint64_t mib) {
  std::mt19937_64 rng(11);
  const uint64_t bytes = mib << 20;
  std::vector<uint8_t> old = Random(bytes, rng);
  std::vector<uint8_t> neu = Mutate(old, 2, 0.0138, 0, 0, rng);
  std::string enc;
  const auto res = delta::Encode(old.data(), neu.data(), bytes, 2, ~0ull, &enc);
  uint8_t* dev = nullptr;
  uint8_t* pinned = nullptr;
  WSYNC_CUDA_CHECK(cudaMalloc(&dev, bytes), "timing buffer");
  WSYNC_CUDA_CHECK(cudaMallocHost(&pinned, bytes), "pinned dense copy");
  std::memcpy(pinned, neu.data(), bytes);
  auto scatter = CudaScatter::Create();
  if (!scatter.ok()) {
    Check(false, "CudaScatter::Create: " + scatter.status().ToString());
    return;
  }
  auto seconds = [](auto t0) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  double best[3] = {1e9, 1e9, 1e9};  // dense, kernel (host staging included), memcpy per run
  for (int rep = 0; rep < 3; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    WSYNC_CUDA_CHECK(cudaMemcpy(dev, pinned, bytes, cudaMemcpyHostToDevice), "dense H2D");
    best[0] = std::min(best[0], seconds(t0));
    for (int m = 0; m < 2; ++m) {
      WSYNC_CUDA_CHECK(cudaMemcpy(dev, old.data(), bytes, cudaMemcpyHostToDevice), "base H2D");
      t0 = std::chrono::steady_clock::now();
      auto info = (*scatter)->Add(dev, bytes, reinterpret_cast<const uint8_t*>(enc.data()), enc.size(), std::nullopt);
      auto st =
          info.ok() ? (*scatter)->Flush(m == 0 ? ScatterMethod::kKernel : ScatterMethod::kMemcpyBatch) : info.status();
      best[1 + m] = std::min(best[1 + m], seconds(t0));
      if (rep == 0)
        Check(st.ok() && DeviceBytes(dev, bytes) == neu,
              std::string("timing range bit-exact by ") + (m == 0 ? "kernel" : "memcpy per run"));
    }
  }
  std::printf(
      "bf16 range of %llu MiB, %llu changed elements (%.2f %%), encoding %.2f MiB:\n"
      "  dense cudaMemcpy H2D from pinned memory: %.3f ms (%.1f GB/s)\n"
      "  delta, staging + scatter kernel:          %.3f ms (%.2f x dense)\n"
      "  delta, staging + one cudaMemcpyAsync per run: %.3f ms (%.2f x dense)\n",
      static_cast<unsigned long long>(mib), static_cast<unsigned long long>(res.changed_elems),
      100.0 * res.changed_elems / (bytes / 2.0), enc.size() / 1048576.0, best[0] * 1e3, bytes / best[0] / 1e9,
      best[1] * 1e3, best[1] / best[0], best[2] * 1e3, best[2] / best[0]);
  std::printf(
      "{\"bench\":\"delta_scatter_cuda\",\"value\":%.4f,\"unit\":\"kernel s / dense s\",\"memcpy_per_run\":%.4f,"
      "\"mib\":%llu}\n",
      best[1] / best[0], best[2] / best[0], static_cast<unsigned long long>(mib));
  cudaFreeHost(pinned);
  cudaFree(dev);
}

}  // namespace

int main(int argc, char** argv) {
  RequireCudaDevice("delta_scatter_cuda_test");
  CheckWays();
  Measure(argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 256);
  std::printf("%s\n", failures == 0 ? "delta_scatter_cuda_test: all passed" : "delta_scatter_cuda_test: FAILED");
  return failures == 0 ? 0 : 1;
}
