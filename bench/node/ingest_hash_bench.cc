// What write checksums (wsyncd --write-checksums, docs/operations.md "Verifying real weights") cost a source's
// ingest path: buckets of parameter-sized ranges are loaded into a replica buffer (memcpy, the copy every parameter
// costs when it is ingested) and their XXH3-128 taken either inline after each bucket (as the source did before the
// hash pool) or queued on a HashPool of --threads threads (as it does now). Measured in the same run:
//   copy    ingest alone, no hashing (the baseline);
//   inline  ingest + hash on the same thread;
//   pool    ingest + queue the hashing (the ingest path's time: the figure that limits the next bucket), and
//           pool_total, until the pool is idle (what an update's commit may wait for after its writes).
// Each figure is the best of --reps rounds over --mib MiB. Last line: one JSON object.
//   bench_ingest_hash [--mib N] [--bucket-mib M] [--chunk-kib K] [--threads T] [--reps N]

#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "daemon/node/hash_pool.h"
#include "nlohmann/json.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_ingest_hash: a source's ingest path with write checksums inline vs on the hash pool, next to "
               "the ingest copy alone"};
  int mib = 512, bucket_mib = 64, chunk_kib = 4096, reps = 5;
  int threads = wsync::daemon::HashPool::DefaultThreads();
  app.add_option("--mib", mib, "bytes ingested per round")->check(CLI::Range(1, 1 << 16))->capture_default_str();
  app.add_option("--bucket-mib", bucket_mib, "bytes per bucket (hashing is queued per bucket)")
      ->check(CLI::Range(1, 1 << 16))
      ->capture_default_str();
  app.add_option("--chunk-kib", chunk_kib, "size of one range (a parameter)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--threads", threads, "hash pool threads (default: the daemon's, min(4, hardware threads))")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option("--reps", reps, "rounds; the best counts")->check(CLI::Range(1, 1000))->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  const size_t bytes = static_cast<size_t>(mib) << 20, chunk = static_cast<size_t>(chunk_kib) << 10;
  const size_t bucket = std::max(static_cast<size_t>(bucket_mib) << 20, chunk);
  std::vector<uint8_t> src(bytes), replica(bytes);
  std::mt19937_64 rng(11);
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    const uint64_t v = rng();
    std::memcpy(&src[i], &v, 8);
  }
  std::memset(replica.data(), 1, bytes);  // fault the pages in before timing
  std::vector<XXH128_hash_t> sums((bytes + chunk - 1) / chunk);

  // One bucket's ingest: its ranges copied into the replica.
  auto ingest = [&](size_t b0, size_t b1) {
    for (size_t at = b0; at < b1; at += chunk) std::memcpy(&replica[at], &src[at], std::min(chunk, b1 - at));
  };
  auto hash = [&](size_t b0, size_t b1) {
    for (size_t at = b0; at < b1; at += chunk) sums[at / chunk] = XXH3_128bits(&replica[at], std::min(chunk, b1 - at));
  };
  auto best = [&](auto&& round) {
    double s = 1e30;
    for (int i = 0; i < reps; ++i) s = std::min(s, round());
    return s;
  };

  const double copy_s = best([&] {
    const auto t0 = Clock::now();
    for (size_t b = 0; b < bytes; b += bucket) ingest(b, std::min(b + bucket, bytes));
    return Since(t0);
  });
  const double inline_s = best([&] {
    const auto t0 = Clock::now();
    for (size_t b = 0; b < bytes; b += bucket) {
      ingest(b, std::min(b + bucket, bytes));
      hash(b, std::min(b + bucket, bytes));
    }
    return Since(t0);
  });
  std::vector<XXH128_hash_t> inline_sums = sums;

  wsync::daemon::HashPool pool(threads);
  double pool_total_s = 1e30;
  const double pool_s = best([&] {
    const auto t0 = Clock::now();
    for (size_t b = 0; b < bytes; b += bucket) {
      const size_t end = std::min(b + bucket, bytes);
      ingest(b, end);
      // One job per range: the ranges of a bucket spread over the pool.
      for (size_t at = b; at < end; at += chunk) pool.Submit([&, at, end] { hash(at, std::min(at + chunk, end)); });
    }
    const double ingest_path = Since(t0);
    pool.WaitIdle();
    pool_total_s = std::min(pool_total_s, Since(t0));
    return ingest_path;
  });
  // The pool hashed the same bytes to the same sums (a check that the figures are of real work).
  const bool same = std::equal(sums.begin(), sums.end(), inline_sums.begin(), [](const auto& a, const auto& b) {
    return a.low64 == b.low64 && a.high64 == b.high64;
  });
  if (!same) {
    std::fprintf(stderr, "bench_ingest_hash: pool and inline hashes differ\n");
    return 1;
  }

  const auto gbps = [&](double s) { return bytes / s / 1e9; };
  std::printf("ingest path, %d MiB in %d MiB buckets of %d KiB ranges, best of %d:\n"
              "  copy only (baseline): %.2f GB/s\n  copy + inline hash:   %.2f GB/s (%.2fx)\n"
              "  copy + hash pool(%d): %.2f GB/s (%.2fx); until the pool is idle: %.2f GB/s\n",
              mib, bucket_mib, chunk_kib, reps, gbps(copy_s), gbps(inline_s), copy_s / inline_s, threads,
              gbps(pool_s), copy_s / pool_s, gbps(pool_total_s));
  nlohmann::ordered_json j = {{"bench", "ingest_path_write_checksums_pool_vs_copy"},
                              {"value", gbps(pool_s)},
                              {"baseline", gbps(copy_s)},
                              {"ratio", gbps(pool_s) / gbps(copy_s)},
                              {"unit", "GB/s"},
                              {"inline_gbps", gbps(inline_s)},
                              {"inline_ratio", gbps(inline_s) / gbps(copy_s)},
                              {"pool_total_gbps", gbps(pool_total_s)},
                              {"threads", threads},
                              {"hardware_threads", std::thread::hardware_concurrency()},
                              {"mib", mib},
                              {"bucket_mib", bucket_mib},
                              {"chunk_kib", chunk_kib},
                              {"reps", reps}};
  std::printf("%s\n", j.dump().c_str());
  return 0;
}
