// Producer -> consumer throughput through the shared-memory ring, two threads: the producer copies each tensor
// from its source buffer into the ring (the trainer's one copy), the consumer takes buckets in place and releases
// them (with --consumer-copy 1 it also copies every tensor out, as the daemon's replica load would). Baseline,
// same run: memcpy of the same bytes from the same source into a ring-sized private buffer, cycling like the
// ring does. Each is run --reps times, alternating; the best of each is reported. Last line: one JSON object.
//   bench_ring [--total-mib N] [--tensor-kib N] [--capacity-mib N] [--consumer-copy 0|1] [--reps N]

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/ring/ring.h"

namespace {

uint64_t Arg(int argc, char** argv, const std::string& flag, uint64_t def) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (flag == argv[i]) return std::strtoull(argv[i + 1], nullptr, 10);
  }
  return def;
}

struct Config {
  uint64_t tensor_bytes;
  uint64_t tensors;
  uint64_t per_bucket;
  bool consumer_copy;
};

// Seconds to move cfg.tensors tensors through the ring, or an error.
absl::StatusOr<double> RunRing(wsync::RingConsumer& consumer, const Config& cfg, const std::vector<uint8_t>& src,
                               std::vector<uint8_t>& sink) {
  std::string err;
  const absl::Time t0 = absl::Now();
  std::thread producer_thread([&] {
    auto p = wsync::RingProducer::Attach(consumer.fd());
    if (!p.ok()) {
      err = p.status().ToString();
      return;
    }
    const int64_t n = static_cast<int64_t>(cfg.tensor_bytes);
    for (uint64_t t = 0; t < cfg.tensors; ++t) {
      auto d = p->BeginTensor(absl::StrCat("model.layers.", t, ".mlp.down_proj.weight"), wsync::DType::kU8, {n},
                              cfg.tensor_bytes, absl::Seconds(30));
      if (!d.ok()) {
        err = d.status().ToString();
        return;
      }
      std::memcpy(*d, src.data(), cfg.tensor_bytes);
      (void)p->FinishTensor();
      if ((t + 1) % cfg.per_bucket == 0 || t + 1 == cfg.tensors) {
        auto s = p->CommitBucket();
        if (!s.ok()) {
          err = s.status().ToString();
          return;
        }
      }
    }
  });
  uint64_t got = 0;
  absl::Status status;
  while (got < cfg.tensors) {
    auto b = consumer.NextBucket(absl::Seconds(30));
    if (!b.ok()) {
      status = b.status();
      break;
    }
    for (const auto& tv : b->tensors) {
      if (cfg.consumer_copy) std::memcpy(sink.data(), tv.data, tv.bytes);
      ++got;
    }
    (void)consumer.Release(*b);
  }
  producer_thread.join();
  if (!err.empty()) return absl::InternalError(absl::StrCat("producer: ", err));
  if (!status.ok()) return status;
  return absl::ToDoubleSeconds(absl::Now() - t0);
}

double RunMemcpy(const Config& cfg, const std::vector<uint8_t>& src, std::vector<uint8_t>& region) {
  const uint64_t slots = region.size() / cfg.tensor_bytes;
  const absl::Time t0 = absl::Now();
  for (uint64_t t = 0; t < cfg.tensors; ++t) {
    uint8_t* d = region.data() + (t % slots) * cfg.tensor_bytes;
    std::memcpy(d, src.data(), cfg.tensor_bytes);
    asm volatile("" : : "r"(d) : "memory");
  }
  return absl::ToDoubleSeconds(absl::Now() - t0);
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t total = Arg(argc, argv, "--total-mib", 1024) << 20;
  const uint64_t capacity = Arg(argc, argv, "--capacity-mib", 256) << 20;
  const int reps = static_cast<int>(std::max<uint64_t>(1, Arg(argc, argv, "--reps", 3)));
  Config cfg;
  cfg.tensor_bytes = Arg(argc, argv, "--tensor-kib", 4096) << 10;
  cfg.tensors = std::max<uint64_t>(1, total / cfg.tensor_bytes);
  cfg.per_bucket = std::max<uint64_t>(1, capacity / 8 / cfg.tensor_bytes);
  cfg.consumer_copy = Arg(argc, argv, "--consumer-copy", 0) != 0;

  std::vector<uint8_t> src(cfg.tensor_bytes), sink(cfg.tensor_bytes);
  for (uint64_t i = 0; i < cfg.tensor_bytes; ++i) src[i] = static_cast<uint8_t>(i * 131);
  std::vector<uint8_t> region(capacity, 1);  // allocated and faulted in before timing, as the ring is

  auto consumer = wsync::RingConsumer::Create("bench", capacity);
  if (!consumer.ok()) {
    std::fprintf(stderr, "%s\n", consumer.status().ToString().c_str());
    return 1;
  }
  double ring_s = 1e30, copy_s = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto s = RunRing(*consumer, cfg, src, sink);
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.status().ToString().c_str());
      return 1;
    }
    ring_s = std::min(ring_s, *s);
    copy_s = std::min(copy_s, RunMemcpy(cfg, src, region));
  }
  if (cfg.consumer_copy && sink.back() != src.back()) {
    std::fprintf(stderr, "consumer saw wrong bytes\n");
    return 1;
  }

  const double bytes = static_cast<double>(cfg.tensors * cfg.tensor_bytes);
  const double ring_gbs = bytes / ring_s / 1e9, copy_gbs = bytes / copy_s / 1e9;
  std::printf("ring: %.2f GB/s (%.0f MiB in %llu KiB tensors, %llu per bucket, %llu MiB ring, consumer %s, best of %d)\n",
              ring_gbs, bytes / (1 << 20), static_cast<unsigned long long>(cfg.tensor_bytes >> 10),
              static_cast<unsigned long long>(cfg.per_bucket), static_cast<unsigned long long>(capacity >> 20),
              cfg.consumer_copy ? "copies out" : "reads in place", reps);
  std::printf("memcpy: %.2f GB/s (same bytes into a %llu MiB private buffer)\n", copy_gbs,
              static_cast<unsigned long long>(capacity >> 20));
  std::printf("{\"bench\":\"ring\",\"value\":%.3f,\"baseline\":%.3f,\"ratio\":%.3f}\n", ring_gbs, copy_gbs,
              ring_gbs / copy_gbs);
  return 0;
}
