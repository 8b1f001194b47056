// CopyRect against a byte-by-byte reference written here: contiguous and strided rectangles, 1 to 16 threads, sizes
// on both sides of the parallel threshold and not multiples of a page; bytes outside the rectangle stay untouched.

#include <catch2/catch.hpp>

#include <cstddef>
#include <random>
#include <vector>

#include "base/host_copy.h"

namespace {

void Reference(std::vector<uint8_t>& dst, uint64_t dst_pitch, const std::vector<uint8_t>& src, uint64_t src_pitch,
               uint64_t row_bytes, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r)
    for (uint64_t b = 0; b < row_bytes; ++b) dst[r * dst_pitch + b] = src[r * src_pitch + b];
}

}  // namespace

TEST_CASE("CopyRect equals a byte-by-byte copy for every shape and thread count") {
  std::mt19937_64 rng(11);
  struct Shape {
    uint64_t row_bytes, rows, dst_pad, src_pad;
  };
  const std::vector<Shape> shapes = {
      {1, 1, 0, 0},
      {4099, 3, 0, 0},                  // small, contiguous: serial
      {(17ull << 20) + 13, 1, 0, 0},    // one row above the threshold, odd size
      {(1 << 20) + 5, 20, 0, 0},        // contiguous, 20 MiB + 100 B
      {8192, 3000, 64, 0},              // strided destination (a column shard's rows)
      {6000, 3001, 0, 128},             // strided source
      {3, 7, 5, 9},                     // tiny strided, fewer rows than threads
  };
  for (const Shape& s : shapes)
    for (int threads : {1, 2, 3, 8, 16}) {
      const uint64_t dp = s.row_bytes + s.dst_pad, sp = s.row_bytes + s.src_pad;
      std::vector<uint8_t> src(sp * s.rows), dst(dp * s.rows), want;
      for (auto& b : src) b = static_cast<uint8_t>(rng());
      for (auto& b : dst) b = static_cast<uint8_t>(rng());
      want = dst;
      Reference(want, dp, src, sp, s.row_bytes, static_cast<int64_t>(s.rows));
      wsync::CopyRect(dst.data(), dp, src.data(), sp, s.row_bytes, static_cast<int64_t>(s.rows), threads);
      INFO(s.row_bytes << " x " << s.rows << " (pads " << s.dst_pad << "/" << s.src_pad << "), " << threads
                       << " threads");
      size_t first = 0;  // the first differing byte (a vector comparison would print megabytes)
      while (first < dst.size() && dst[first] == want[first]) ++first;
      CHECK(first == dst.size());
    }
}

TEST_CASE("HostCopyThreads: explicit counts kept, automatic divides the hardware among the ranks") {
  CHECK(wsync::HostCopyThreads(3, 8) == 3);
  CHECK(wsync::HostCopyThreads(0, 1) >= 1);
  CHECK(wsync::HostCopyThreads(0, 1) <= 8);
  CHECK(wsync::HostCopyThreads(0, 100000) == 1);
}
