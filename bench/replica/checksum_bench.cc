// What recording write checksums costs a source (wsyncd --write-checksums, docs/operations.md "Verifying real
// weights"): XXH3-128 over buffers of parameter-like sizes, next to memcpy of the same bytes measured in the same run
// (the copy every parameter already costs when it is loaded into the replica). Buffers are larger than the caches
// unless --mib says otherwise; each figure is the best of --reps rounds. Last line: one JSON object.
//   bench_checksum [--mib N] [--chunk-kib K] [--reps N]

#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "CLI/CLI.hpp"
#include "nlohmann/json.hpp"

namespace {

using Clock = std::chrono::steady_clock;

template <typename F>
double BestSeconds(int reps, F&& f) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_checksum: XXH3-128 rate of a source's write checksums next to memcpy of the same bytes"};
  int mib = 512, reps = 5;
  int chunk_kib = 4096;
  app.add_option("--mib", mib, "bytes hashed per round")->check(CLI::Range(1, 1 << 16))->capture_default_str();
  app.add_option("--chunk-kib", chunk_kib, "size of one hashed range (a parameter)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--reps", reps, "rounds; the best counts")->check(CLI::Range(1, 1000))->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  const size_t bytes = static_cast<size_t>(mib) << 20, chunk = static_cast<size_t>(chunk_kib) << 10;
  std::vector<uint8_t> src(bytes), dst(bytes);
  std::mt19937_64 rng(7);
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    const uint64_t v = rng();
    std::memcpy(&src[i], &v, 8);
  }
  std::memset(dst.data(), 1, bytes);  // fault the pages in before timing

  uint64_t sink = 0;
  const double hash_s = BestSeconds(reps, [&] {
    for (size_t at = 0; at < bytes; at += chunk) {
      const XXH128_hash_t h = XXH3_128bits(src.data() + at, std::min(chunk, bytes - at));
      sink ^= h.low64 ^ h.high64;
    }
  });
  const double copy_s = BestSeconds(reps, [&] {
    for (size_t at = 0; at < bytes; at += chunk)
      std::memcpy(dst.data() + at, src.data() + at, std::min(chunk, bytes - at));
    sink ^= dst[bytes / 2];
  });
  const double hash_gbps = bytes / hash_s / 1e9, copy_gbps = bytes / copy_s / 1e9;
  std::printf("XXH3-128: %.2f GB/s   memcpy: %.2f GB/s   (%d MiB in %d KiB ranges, best of %d; sink %llx)\n", hash_gbps,
              copy_gbps, mib, chunk_kib, reps, static_cast<unsigned long long>(sink & 0xff));
  nlohmann::ordered_json j = {{"bench", "checksum_xxh3_128_vs_memcpy"},
                              {"value", hash_gbps},
                              {"baseline", copy_gbps},
                              {"ratio", hash_gbps / copy_gbps},
                              {"unit", "GB/s"},
                              {"mib", mib},
                              {"chunk_kib", chunk_kib},
                              {"reps", reps}};
  std::printf("%s\n", j.dump().c_str());
  return 0;
}
