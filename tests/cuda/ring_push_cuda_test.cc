// Pushes of CUDA tensors into a trainer ring (client/device_copy.h, the path TrainerClient::PushDevice takes): the
// ring is page-locked once, every tensor is one asynchronous device-to-host copy into its ring slot ordered after
// the producer's stream, and the consumer (the daemon's side of the ring) reads exactly the bytes that were
// generated on the host and uploaded with a plain synchronous cudaMemcpy — many sizes (0 bytes, odd sizes, a slot
// that ends at the ring's wrap point, tensors larger than a chunk) and dtypes, over several laps of the ring.
// Also: a host pointer and a pointer of the wrong device are refused naming the tensor, before anything is reserved.
// Exit 0 pass, 1 fail, 77 no CUDA device.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "client/ring/ring.h"
#include "client/device_copy.h"
#include "tests/cuda/cuda_check.h"

using namespace wsync;

namespace {

int failures = 0;
#define CHECK(cond, ...)                  \
  do {                                    \
    if (!(cond)) {                        \
      ++failures;                         \
      std::printf("FAIL: " __VA_ARGS__);  \
      std::printf("\n");                  \
    }                                     \
  } while (0)

struct Pushed {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> host;  // the expectation, generated here
  void* dev = nullptr;
  void* upload = nullptr;
};

}  // namespace

int main() {
  RequireCudaDevice("ring_push_cuda_test");
  constexpr uint64_t kCapacity = 64ull << 20;
  auto consumer = RingConsumer::Create("cuda-push-test", kCapacity);
  if (!consumer.ok()) {
    std::printf("FAIL: %s\n", std::string(consumer.status().message()).c_str());
    return 1;
  }
  auto producer = RingProducer::Attach(consumer->fd());
  if (!producer.ok()) {
    std::printf("FAIL: %s\n", std::string(producer.status().message()).c_str());
    return 1;
  }
  auto copier = client::DeviceCopier::Create(producer->data_area(), producer->capacity(), producer->name());
  if (!copier.ok()) {
    std::printf("FAIL: %s\n", std::string(copier.status().message()).c_str());
    return 1;
  }
  std::printf("ring of %llu MiB page-locked in %.3f s\n", static_cast<unsigned long long>(kCapacity >> 20),
              (*copier)->register_seconds());

  // The producer's stream: each tensor's last write is queued there right before its push. A blocking stream, so
  // that write follows the zeroing and the upload (legacy default stream; both may still run when they return).
  cudaStream_t producer_stream;
  WSYNC_CUDA_CHECK(cudaStreamCreate(&producer_stream), "producer stream");

  std::mt19937_64 rng(20261204);
  const DType dtypes[] = {DType::kBF16, DType::kF16, DType::kF32, DType::kF8E4M3, DType::kI64};
  const int64_t sizes[] = {0, 1, 3, 63, 64, 65, 1000, 4095, 4097, 65536 + 7, 1 << 20, (3 << 20) + 5, 2 << 20};
  uint64_t tensors = 0, bytes_total = 0, buckets = 0;
  for (int round = 0; round < 6; ++round) {
    std::vector<Pushed> bucket;
    for (DType dt : dtypes) {
      for (int64_t n : sizes) {
        Pushed p;
        p.name = "r" + std::to_string(round) + "." + std::string(DTypeName(dt)) + "." + std::to_string(n);
        p.dtype = dt;
        const int64_t esz = static_cast<int64_t>(DTypeSize(dt));
        const int64_t elems = n / esz > 0 ? n / esz : (n > 0 ? 1 : 0);
        p.shape = (elems % 2 == 0 && elems > 0) ? std::vector<int64_t>{2, elems / 2} : std::vector<int64_t>{elems};
        p.host.resize(static_cast<size_t>(elems * esz));
        for (auto& b : p.host) b = static_cast<uint8_t>(rng());
        if (!p.host.empty()) {
          // The tensor is zero until the producer's stream fills it: a copy not ordered after that stream reads
          // zeros (or a part of them) instead of the uploaded bytes.
          WSYNC_CUDA_CHECK(cudaMalloc(&p.dev, p.host.size()), p.name);
          WSYNC_CUDA_CHECK(cudaMemset(p.dev, 0, p.host.size()), p.name);
          WSYNC_CUDA_CHECK(cudaMalloc(&p.upload, p.host.size()), p.name);
          WSYNC_CUDA_CHECK(cudaMemcpy(p.upload, p.host.data(), p.host.size(), cudaMemcpyHostToDevice), p.name);
          WSYNC_CUDA_CHECK(cudaMemcpyAsync(p.dev, p.upload, p.host.size(), cudaMemcpyDeviceToDevice, producer_stream),
                           p.name);
        }
        const uint64_t bytes = p.host.size();
        if (!producer->FitsInBucket(p.name.size(), bytes)) {  // cannot happen with these sizes: say so if it does
          CHECK(false, "%s does not fit the bucket", p.name.c_str());
          cudaFree(p.dev);
          cudaFree(p.upload);
          break;
        }
        auto dst = producer->BeginTensor(p.name, dt, p.shape, bytes, absl::Seconds(10));
        CHECK(dst.ok(), "BeginTensor %s: %s", p.name.c_str(), std::string(dst.status().message()).c_str());
        if (!dst.ok()) return 1;
        if (bytes > 0) {
          absl::Status s = (*copier)->Check(p.name, p.dev, bytes, 0);
          CHECK(s.ok(), "check %s: %s", p.name.c_str(), std::string(s.message()).c_str());
          s = (*copier)->CopyAsync(p.name, *dst, p.dev, bytes, 0, reinterpret_cast<uint64_t>(producer_stream));
          CHECK(s.ok(), "copy %s: %s", p.name.c_str(), std::string(s.message()).c_str());
        }
        CHECK(producer->FinishTensor().ok(), "finish %s", p.name.c_str());
        bucket.push_back(std::move(p));
      }
    }
    absl::Status drained = (*copier)->Drain();
    CHECK(drained.ok(), "drain: %s", std::string(drained.message()).c_str());
    auto seq = producer->CommitBucket();
    CHECK(seq.ok(), "commit round %d", round);
    auto view = consumer->NextBucket(absl::Seconds(5));
    CHECK(view.ok(), "consumer round %d: %s", round, std::string(view.status().message()).c_str());
    if (!view.ok()) return 1;
    CHECK(view->tensors.size() == bucket.size(), "round %d: %zu tensors, pushed %zu", round, view->tensors.size(),
          bucket.size());
    for (size_t i = 0; i < bucket.size() && i < view->tensors.size(); ++i) {
      const auto& t = view->tensors[i];
      const auto& p = bucket[i];
      CHECK(t.name == p.name && t.dtype == p.dtype && t.shape == p.shape && t.bytes == p.host.size(),
            "tensor %zu of round %d: header differs (%s)", i, round, p.name.c_str());
      if (t.bytes == p.host.size() && std::memcmp(t.data, p.host.data(), p.host.size()) != 0) {
        size_t first = 0;
        while (t.data[first] == p.host[first]) ++first;
        CHECK(false, "%s: ring bytes differ from the uploaded ones (first at byte %zu of %zu)", p.name.c_str(),
              first, p.host.size());
      }
      ++tensors;
      bytes_total += p.host.size();
    }
    CHECK(consumer->Release(*view).ok(), "release round %d", round);
    ++buckets;
    for (auto& p : bucket) {
      cudaFree(p.dev);
      cudaFree(p.upload);
    }
  }
  std::printf("%llu tensors, %llu bytes in %llu buckets through the ring: every byte as uploaded\n",
              static_cast<unsigned long long>(tensors), static_cast<unsigned long long>(bytes_total),
              static_cast<unsigned long long>(buckets));

  // Bad input is refused before a slot is reserved, naming the tensor.
  std::vector<uint8_t> host(256);
  absl::Status s = (*copier)->Check("host.tensor", host.data(), host.size(), 0);
  CHECK(!s.ok() && std::string(s.message()).find("host.tensor") != std::string::npos &&
            std::string(s.message()).find("not device memory") != std::string::npos,
        "a host pointer is refused naming the tensor: %s", std::string(s.message()).c_str());
  void* dev = nullptr;
  WSYNC_CUDA_CHECK(cudaMalloc(&dev, 256), "256 bytes");
  int n = 0;
  cudaGetDeviceCount(&n);
  s = (*copier)->Check("wrong.device", dev, 256, n);
  CHECK(!s.ok() && std::string(s.message()).find("wrong.device") != std::string::npos,
        "a device the pointer does not belong to is refused: %s", std::string(s.message()).c_str());
  std::printf("refusals: %s\n", std::string(s.message()).c_str());
  cudaFree(dev);
  copier->reset();
  std::printf("ring_push_cuda_test: %s\n", failures == 0 ? "pass" : "FAIL");
  return failures == 0 ? 0 : 1;
}
