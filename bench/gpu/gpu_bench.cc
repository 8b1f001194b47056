// bench_gpu: the GPU data path's mechanisms against the device's own peaks, measured in the same run.
//   ring D2H  : device → a memfd MAP_SHARED mapping (the trainer ring's memory) page-locked once with
//               cudaHostRegister, in 64 MiB chunks on two streams (a push overlapped with the next one)
//   target H2D: the same registered memfd mapping → device (a target's staging ring into engine memory)
//   baseline  : cudaMemcpyAsync D2H / H2D with cudaMallocHost memory (pinned peak)
//   fp8       : GPU FP8 block quantization (bf16 in, 128x128) GB/s of input vs a device-to-device copy of the same
//               bytes (copy GB/s counts the bytes read, as the quantizer's)
//   register  : cudaHostRegister seconds per GiB (paid once per session, never per update)
//   client push: the real client path (client/device_copy.h + client/ring/ring.h, what TrainerClient::PushDevice does) of
//               64 MiB bf16 tensors into a 1 GiB ring, bucket of 8, vs the D2H peak — the JSON line's value
//   gpu_fp8 push: the same tensors quantized on the GPU first (TrainerClient::PushDeviceFp8: codes + scales copied,
//               ~half the bytes), in bf16 GB/s of the tensors pushed, vs the plain client push above
//   target sink: the real staging sink of a cuda segment (daemon/node/target_node_cuda.h) vs the H2D peak
// Ends with one JSON line. Exit 77 without a CUDA device.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <vector>

#include "client/ring/ring.h"
#include "client/device_copy.h"
#include "daemon/node/target_node_cuda.h"
#include "replica/fp8_cuda.h"
#include "tests/cuda/cuda_check.h"

namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// GB/s of `reps` copies of `bytes` in chunks of `chunk` alternating over two streams.
double Copy(void* dst, const void* src, size_t bytes, size_t chunk, cudaMemcpyKind kind, int reps, cudaStream_t s[2]) {
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    WSYNC_CUDA_CHECK(cudaDeviceSynchronize(), "sync");
    const auto t0 = std::chrono::steady_clock::now();
    int i = 0;
    for (size_t off = 0; off < bytes; off += chunk, ++i) {
      const size_t n = std::min(chunk, bytes - off);
      WSYNC_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off, n, kind,
                                       s[i % 2]),
                       std::to_string(n) + " bytes at " + std::to_string(off));
    }
    WSYNC_CUDA_CHECK(cudaDeviceSynchronize(), "sync");
    best = std::max(best, bytes / Seconds(t0) / 1e9);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  RequireCudaDevice("bench_gpu");
  const size_t bytes = (argc > 1 ? std::stoull(argv[1]) : 2048) << 20;  // MiB
  const size_t chunk = 64ull << 20;
  const int reps = 5;
  cudaStream_t s[2];
  for (auto& x : s) WSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking), "stream");
  void* dev;
  WSYNC_CUDA_CHECK(cudaMalloc(&dev, bytes), std::to_string(bytes) + " bytes");
  WSYNC_CUDA_CHECK(cudaMemset(dev, 0x5A, bytes), "memset");

  // Baseline: cudaMallocHost memory, whole-buffer copies on one stream.
  void* pinned;
  WSYNC_CUDA_CHECK(cudaMallocHost(&pinned, bytes), std::to_string(bytes) + " pinned bytes");
  const double d2h_peak = Copy(pinned, dev, bytes, bytes, cudaMemcpyDeviceToHost, reps, s);
  const double h2d_peak = Copy(dev, pinned, bytes, bytes, cudaMemcpyHostToDevice, reps, s);
  cudaFreeHost(pinned);

  // The ring's memory: a memfd mapping, page-locked once.
  const int fd = memfd_create("wsync-bench-ring", 0);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    std::perror("memfd");
    return 1;
  }
  void* ring = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (ring == MAP_FAILED) {
    std::perror("mmap");
    return 1;
  }
  for (size_t off = 0; off < bytes; off += 4096) static_cast<char*>(ring)[off] = 0;  // fault the pages in first
  auto t0 = std::chrono::steady_clock::now();
  WSYNC_CUDA_CHECK(cudaHostRegister(ring, bytes, cudaHostRegisterDefault), std::to_string(bytes) + " memfd bytes");
  const double register_s_per_gib = Seconds(t0) / (bytes / 1073741824.0);
  const double ring_d2h = Copy(ring, dev, bytes, chunk, cudaMemcpyDeviceToHost, reps, s);
  const double target_h2d = Copy(dev, ring, bytes, chunk, cudaMemcpyHostToDevice, reps, s);
  // Bit-exactness of the hand-over: what came back equals what the device holds.
  std::vector<unsigned char> check(1 << 20);
  WSYNC_CUDA_CHECK(cudaMemcpy(check.data(), dev, check.size(), cudaMemcpyDeviceToHost), "check");
  for (size_t i = 0; i < check.size(); ++i)
    if (check[i] != 0x5A || static_cast<unsigned char*>(ring)[i] != 0x5A) {
      std::fprintf(stderr, "bench_gpu: byte %zu differs after the round trip\n", i);
      return 1;
    }
  cudaHostUnregister(ring);
  munmap(ring, bytes);
  close(fd);

  // The real code paths. Client: TrainerClient::PushDevice's steps (reserve a ring slot, one async D2H copy per
  // 64 MiB tensor, Drain and publish every 8 tensors) into a 1 GiB ring the consumer releases at once.
  double push_gbps = 0, push_register_s = 0, fp8_push_gbps = 0;
  {
    auto consumer = wsync::RingConsumer::Create("bench-gpu", 1ull << 30);
    auto producer = wsync::RingProducer::Attach(consumer->fd());
    if (!consumer.ok() || !producer.ok()) {
      std::fprintf(stderr, "bench_gpu: ring\n");
      return 1;
    }
    auto copier = wsync::client::DeviceCopier::Create(producer->data_area(), producer->capacity(), producer->name());
    if (!copier.ok()) {
      std::fprintf(stderr, "bench_gpu: %s\n", copier.status().ToString().c_str());
      return 1;
    }
    push_register_s = (*copier)->register_seconds();
    const int64_t tensor = chunk / 2;  // bf16 elements of a 64 MiB tensor
    // One slot and its copy: from the tensor itself, or (fp8) from the copier's staged codes/scales.
    auto push_one = [&](int64_t elems, uint64_t n, const void* src, bool staged) -> absl::Status {
      const int64_t shape[1] = {elems};
      auto dst = producer->BeginTensor("t", staged ? wsync::DType::kU8 : wsync::DType::kBF16, shape, n,
                                       absl::Seconds(10));
      if (!dst.ok()) return dst.status();
      absl::Status st = staged ? (*copier)->CopyStagedAsync("t", *dst, src, n, 0)
                               : (*copier)->CopyAsync("t", *dst, src, n, 0, 0);
      return st.ok() ? producer->FinishTensor() : st;
    };
    for (int run = 0; run < 2 * reps; ++run) {
      const int fp8 = run / reps;
      const auto t1 = std::chrono::steady_clock::now();
      int in_bucket = 0;
      for (size_t off = 0; off + chunk <= bytes; off += chunk) {
        const void* src = static_cast<char*>(dev) + off;
        absl::Status st;
        if (fp8 == 0) {
          st = push_one(tensor, chunk, src, false);
        } else {
          // TrainerClient::PushDeviceFp8: quantize [4096, tensor/4096] 128x128 on the GPU, copy codes + scales.
          wsync::client::DeviceCopier::Fp8Staged q;
          st = (*copier)->QuantizeFp8Async("t", wsync::DType::kBF16, src, 4096, tensor / 4096, 128, 128, false, 0, 0,
                                          &q);
          if (st.ok()) st = push_one(q.code_bytes, q.code_bytes, q.codes, true);
          if (st.ok()) st = push_one(q.scale_bytes, q.scale_bytes, q.scales, true);
        }
        if (st.ok() && ++in_bucket == 8) {
          st = (*copier)->Drain();
          if (st.ok()) st = producer->CommitBucket().status();
          auto b = st.ok() ? consumer->NextBucket(absl::Seconds(5)) : absl::StatusOr<wsync::BucketView>(st);
          st = b.ok() ? consumer->Release(*b) : b.status();
          in_bucket = 0;
        }
        if (!st.ok()) {
          std::fprintf(stderr, "bench_gpu: ring push: %s\n", st.ToString().c_str());
          return 1;
        }
      }
      if (in_bucket > 0) {
        (void)(*copier)->Drain();
        (void)producer->CommitBucket();
        auto b = consumer->NextBucket(absl::Seconds(5));
        if (b.ok()) (void)consumer->Release(*b);
      }
      double& best = fp8 ? fp8_push_gbps : push_gbps;
      best = std::max(best, (bytes / chunk) * chunk / Seconds(t1) / 1e9);
    }
  }
  // Target: the staging sink a cuda segment is written through (4 MiB chunks, 16 in flight, one Flush at the end:
  // what one batch costs; the socket fills the chunks in the daemon).
  double sink_gbps = 0;
  {
    auto sink = wsync::daemon::MakeCudaSink(dev, bytes, 0, "bench segment");
    if (!sink.ok()) {
      std::fprintf(stderr, "bench_gpu: %s\n", sink.status().ToString().c_str());
      return 1;
    }
    const uint64_t c = (*sink)->chunk_bytes();
    for (int r = 0; r < reps; ++r) {
      const auto t1 = std::chrono::steady_clock::now();
      absl::Status st;
      for (uint64_t off = 0; off < bytes && st.ok(); off += c) {
        auto s1 = (*sink)->Acquire();
        st = s1.ok() ? (*sink)->Submit(*s1, off, std::min<uint64_t>(c, bytes - off)) : s1.status();
      }
      if (st.ok()) st = (*sink)->Flush();
      if (!st.ok()) {
        std::fprintf(stderr, "bench_gpu: staging: %s\n", st.ToString().c_str());
        return 1;
      }
      sink_gbps = std::max(sink_gbps, bytes / Seconds(t1) / 1e9);
    }
  }

  // FP8 quantization of a bf16 [rows, 8192] tensor of `bytes`/2 elements vs a D2D copy of the same bytes; also
  // 64x64 blocks and the same bytes read as float32 [rows, 4096] (text lines and the JSON line's fp8_* fields).
  const int64_t cols = 8192, rows = static_cast<int64_t>(bytes / 2 / cols / 128) * 128;
  const size_t in_bytes = static_cast<size_t>(rows * cols) * 2;
  void *q, *sc, *copy;
  WSYNC_CUDA_CHECK(cudaMalloc(&q, rows * cols), "fp8 codes");
  WSYNC_CUDA_CHECK(cudaMalloc(&sc, (rows / 64) * (cols / 64) * 4), "fp8 scales");
  WSYNC_CUDA_CHECK(cudaMalloc(&copy, in_bytes), "copy target");
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  {  // realistic bf16 weights (random signs, mantissas, exponents 2^-17..2^8) in every byte the quantizer reads
    std::vector<uint16_t> w(chunk / 2);
    uint64_t x = 88172645463325252ull;
    for (auto& v : w) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      v = static_cast<uint16_t>(((x >> 8) & 0x807F) | ((110 + (x & 15) + ((x >> 4) & 7) + ((x >> 7) & 3)) << 7));
    }
    for (size_t off = 0; off < in_bytes; off += chunk)
      WSYNC_CUDA_CHECK(cudaMemcpy(static_cast<uint8_t*>(dev) + off, w.data(), std::min(chunk, in_bytes - off),
                                  cudaMemcpyHostToDevice),
                       "fp8 input");
  }
  auto time_fp8 = [&](wsync::DType dtype, int block) -> float {
    const int64_t c = dtype == wsync::DType::kF32 ? cols / 2 : cols;
    float best = 1e30f;
    for (int r = 0; r < reps; ++r) {
      cudaEventRecord(e0, s[0]);
      auto st = wsync::replica::QuantizeFp8BlockCuda(dtype, dev, rows, c, c, block, block, static_cast<uint8_t*>(q),
                                                     c, static_cast<float*>(sc), c / block,
                                                     wsync::replica::Fp8ScaleFormat::kFloat32, s[0]);
      if (!st.ok()) {
        std::fprintf(stderr, "bench_gpu: %s\n", st.ToString().c_str());
        std::exit(1);
      }
      cudaEventRecord(e1, s[0]);
      if (cudaEventSynchronize(e1) != cudaSuccess) {
        std::fprintf(stderr, "bench_gpu: fp8 kernel failed\n");
        std::exit(1);
      }
      float ms;
      cudaEventElapsedTime(&ms, e0, e1);
      best = std::min(best, ms);
    }
    return best;
  };
  float best_c = 1e30f;
  for (int r = 0; r < reps; ++r) {
    float ms;
    cudaEventRecord(e0, s[0]);
    WSYNC_CUDA_CHECK(cudaMemcpyAsync(copy, dev, in_bytes, cudaMemcpyDeviceToDevice, s[0]), "d2d");
    cudaEventRecord(e1, s[0]);
    WSYNC_CUDA_CHECK(cudaEventSynchronize(e1), "d2d");
    cudaEventElapsedTime(&ms, e0, e1);
    best_c = std::min(best_c, ms);
  }
  const float best_q = time_fp8(wsync::DType::kBF16, 128);
  const float best_q64 = time_fp8(wsync::DType::kBF16, 64);
  const float best_f32 = time_fp8(wsync::DType::kF32, 128);
  const double fp8_gbps = in_bytes / (best_q / 1e3) / 1e9, d2d_gbps = in_bytes / (best_c / 1e3) / 1e9;
  const double fp8_64_gbps = in_bytes / (best_q64 / 1e3) / 1e9, fp8_f32_gbps = in_bytes / (best_f32 / 1e3) / 1e9;

  std::printf("%-34s %10s %10s %7s\n", "path", "GB/s", "baseline", "ratio");
  std::printf("%-34s %10.1f %10.1f %7.3f\n", "ring D2H (memfd, registered once)", ring_d2h, d2h_peak, ring_d2h / d2h_peak);
  std::printf("%-34s %10.1f %10.1f %7.3f\n", "target H2D (memfd staging)", target_h2d, h2d_peak, target_h2d / h2d_peak);
  std::printf("%-34s %10.1f %10.1f %7.3f\n", "fp8 quantize 128x128 (bf16 in)", fp8_gbps, d2d_gbps, fp8_gbps / d2d_gbps);
  std::printf("%-34s %10.1f %10.1f %7.3f\n", "fp8 quantize 64x64 (bf16 in)", fp8_64_gbps, d2d_gbps,
              fp8_64_gbps / d2d_gbps);
  std::printf("%-34s %10.1f %10.1f %7.3f\n", "fp8 quantize 128x128 (f32 in)", fp8_f32_gbps, d2d_gbps,
              fp8_f32_gbps / d2d_gbps);
  std::printf("%-34s %10.1f %10.1f %7.3f\n", "client ring push (PushDevice path)", push_gbps, d2h_peak,
              push_gbps / d2h_peak);
  std::printf("%-34s %10.1f %10.1f %7.3f\n", "client push, gpu_fp8 (bf16 GB/s)", fp8_push_gbps, push_gbps,
              fp8_push_gbps / push_gbps);
  std::printf("%-34s %10.1f %10.1f %7.3f\n", "target staging sink (cuda segment)", sink_gbps, h2d_peak,
              sink_gbps / h2d_peak);
  std::printf("cudaHostRegister: %.3f s per GiB (once per session); the client's 1 GiB ring: %.3f s\n",
              register_s_per_gib, push_register_s);
  std::printf("{\"bench\":\"gpu\",\"value\":%.2f,\"baseline\":%.2f,\"ratio\":%.3f,\"unit\":\"GB/s\","
              "\"what\":\"client ring push of CUDA tensors (PushDevice path) vs cudaMallocHost D2H peak\","
              "\"h2d\":%.2f,\"h2d_peak\":%.2f,\"h2d_ratio\":%.3f,\"fp8_gbps\":%.1f,\"d2d_gbps\":%.1f,"
              "\"fp8_ratio\":%.3f,\"fp8_64_ratio\":%.3f,\"fp8_f32_ratio\":%.3f,\"register_s_per_gib\":%.3f,"
              "\"memfd_d2h\":%.2f,\"memfd_h2d\":%.2f,\"fp8_push_gbps\":%.2f,\"fp8_push_speedup\":%.3f,"
              "\"bytes\":%zu}\n",
              push_gbps, d2h_peak, push_gbps / d2h_peak, sink_gbps, h2d_peak, sink_gbps / h2d_peak, fp8_gbps, d2d_gbps,
              fp8_gbps / d2d_gbps, fp8_64_gbps / d2d_gbps, fp8_f32_gbps / d2d_gbps, register_s_per_gib, ring_d2h,
              target_h2d, fp8_push_gbps, fp8_push_gbps / push_gbps, bytes);
  return 0;
}
