// CopyRect and CopyPlaced against a byte-by-byte reference written here: contiguous and strided rectangles, column
// shards of one tensor copied in one pass, 1 to 16 threads of a pool kept across copies, sizes on both sides of the
// parallel threshold and not multiples of a page; bytes outside the rectangles stay untouched; several threads
// copying through one pool at once.

#include "base/host_copy.h"

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cstddef>
#include <random>
#include <thread>
#include <vector>

namespace {

void Reference(std::vector<uint8_t>& dst, uint64_t dst_pitch, const std::vector<uint8_t>& src, uint64_t src_pitch,
               uint64_t row_bytes, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r)
    for (uint64_t b = 0; b < row_bytes; ++b) dst[r * dst_pitch + b] = src[r * src_pitch + b];
}

// Index of the first byte where a and b differ (a vector comparison would print megabytes); a.size() if none.
size_t FirstDiff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  size_t i = 0;
  while (i < a.size() && a[i] == b[i]) ++i;
  return i;
}

// A tensor of `rows` x `row_bytes` cut into column shards of the given widths (bytes), each shard a strided region
// into its own destination buffer of rows x width (+ pad) bytes; plus the same done byte by byte.
struct ShardCase {
  std::vector<uint8_t> src;
  std::vector<std::vector<uint8_t>> dst, want;
  std::vector<wsync::PlacedCopy> regions;
};

ShardCase MakeShards(std::mt19937_64& rng, int64_t rows, const std::vector<uint64_t>& widths, uint64_t pad,
                     int64_t first_row = 0) {
  ShardCase c;
  uint64_t row_bytes = 0;
  for (uint64_t w : widths) row_bytes += w;
  c.src.resize(row_bytes * static_cast<uint64_t>(rows + first_row));
  for (auto& b : c.src) b = static_cast<uint8_t>(rng());
  uint64_t col = 0;
  for (uint64_t w : widths) {
    const uint64_t pitch = w + pad;
    std::vector<uint8_t> d(pitch * static_cast<uint64_t>(rows));
    for (auto& b : d) b = static_cast<uint8_t>(rng());
    std::vector<uint8_t> want = d;
    Reference(want, pitch,
              std::vector<uint8_t>(c.src.begin() + static_cast<ptrdiff_t>(first_row * row_bytes + col), c.src.end()),
              row_bytes, w, rows);
    c.dst.push_back(std::move(d));
    c.want.push_back(std::move(want));
    col += w;
  }
  col = 0;
  for (size_t k = 0; k < widths.size(); ++k) {
    c.regions.push_back({c.dst[k].data(), widths[k] + pad, static_cast<uint64_t>(first_row) * row_bytes + col,
                         row_bytes, widths[k], rows});
    col += widths[k];
  }
  return c;
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
      wsync::CopyPool pool(threads);
      const uint64_t dp = s.row_bytes + s.dst_pad, sp = s.row_bytes + s.src_pad;
      std::vector<uint8_t> src(sp * s.rows), dst(dp * s.rows), want;
      for (auto& b : src) b = static_cast<uint8_t>(rng());
      for (auto& b : dst) b = static_cast<uint8_t>(rng());
      want = dst;
      Reference(want, dp, src, sp, s.row_bytes, static_cast<int64_t>(s.rows));
      wsync::CopyRect(dst.data(), dp, src.data(), sp, s.row_bytes, static_cast<int64_t>(s.rows), &pool);
      INFO(s.row_bytes << " x " << s.rows << " (pads " << s.dst_pad << "/" << s.src_pad << "), " << threads
                       << " threads");
      CHECK(FirstDiff(dst, want) == dst.size());
    }
  // Without a pool: the calling thread.
  std::vector<uint8_t> src(5000), dst(5000);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  wsync::CopyRect(dst.data(), 50, src.data(), 50, 50, 100, nullptr);
  CHECK(dst == src);
}

TEST_CASE("CopyPool runs every part exactly once, for one caller and for several at once") {
  for (int threads : {1, 2, 5}) {
    wsync::CopyPool pool(threads);
    CHECK(pool.threads() == std::max(1, threads));
    for (int n : {0, 1, 3, 17}) {
      std::vector<std::atomic<int>> hits(n);
      pool.Run(n, [&](int i) { hits[i].fetch_add(1); });
      for (int i = 0; i < n; ++i) CHECK(hits[i].load() == 1);
    }
    std::vector<std::atomic<int>> hits(4 * 64);
    std::vector<std::thread> callers;
    for (int c = 0; c < 4; ++c)
      callers.emplace_back([&, c] {
        for (int round = 0; round < 8; ++round) pool.Run(8, [&](int i) { hits[c * 64 + round * 8 + i].fetch_add(1); });
      });
    for (auto& t : callers) t.join();
    for (auto& h : hits) CHECK(h.load() == 1);
  }
}

TEST_CASE("GroupColumnShards groups strided regions of the same rows, ordered by their column") {
  std::vector<uint8_t> dst(64);
  auto region = [&](uint64_t src_offset, uint64_t src_pitch, uint64_t row_bytes, int64_t rows) {
    return wsync::PlacedCopy{dst.data(), row_bytes, src_offset, src_pitch, row_bytes, rows};
  };
  // Shards 2, 0, 1 of rows 0..9 (pitch 30), a contiguous region, shard 1 of rows 10..19, a strided region of
  // 5 rows starting on row 0.
  const std::vector<wsync::PlacedCopy> regions = {region(20, 30, 10, 10),  region(0, 30, 10, 10),
                                                  region(10, 30, 10, 10),  region(0, 30, 30, 10),
                                                  region(310, 30, 10, 10), region(0, 30, 10, 5)};
  const std::vector<std::vector<size_t>> want = {{1, 2, 0}, {3}, {4}, {5}};
  CHECK(wsync::GroupColumnShards(regions) == want);
}

TEST_CASE("CopyPlaced equals a byte-by-byte copy of every column shard, in one pass and per region") {
  std::mt19937_64 rng(29);
  struct Case {
    int64_t rows;
    std::vector<uint64_t> widths;
    uint64_t pad;
    int64_t first_row;
  };
  const std::vector<Case> cases = {
      {3, {1, 1, 1}, 0, 0},                                    // tiny: serial
      {2049, std::vector<uint64_t>(8, 1024), 0, 0},            // TP 8 column shards of a 2049 x 4096-element bf16
      {4097, {600, 601, 602, 603, 604, 605, 606, 607}, 5, 3},  // uneven widths, padded rows, starting at row 3
      {33, {(1 << 20) + 1, 3}, 0, 0},                          // few rows, wide shards, above the threshold
  };
  for (const Case& k : cases)
    for (wsync::PlaceMode mode : {wsync::PlaceMode::kOnePass, wsync::PlaceMode::kPerRegion})
      for (int threads : {1, 3, 8}) {
        wsync::CopyPool pool(threads);
        ShardCase c = MakeShards(rng, k.rows, k.widths, k.pad, k.first_row);
        // Handed out in reverse order: the grouping, not the order, makes the one pass.
        std::vector<wsync::PlacedCopy> regions(c.regions.rbegin(), c.regions.rend());
        wsync::CopyPlaced(regions, c.src.data(), &pool, mode);
        INFO(k.rows << " rows, " << k.widths.size() << " shards, " << threads << " threads, mode "
                    << static_cast<int>(mode));
        for (size_t s = 0; s < c.dst.size(); ++s) {
          INFO("shard " << s);
          CHECK(FirstDiff(c.dst[s], c.want[s]) == c.dst[s].size());
        }
      }
}

TEST_CASE("Several ranks' copies through one pool at once land whole") {
  std::mt19937_64 rng(31);
  wsync::CopyPool pool(4);
  std::vector<ShardCase> cases;
  for (int r = 0; r < 4; ++r) cases.push_back(MakeShards(rng, 2048, std::vector<uint64_t>(8, 1100 + r), 0));
  std::vector<std::thread> ranks;
  for (int r = 0; r < 4; ++r)
    ranks.emplace_back([&, r] { wsync::CopyPlaced(cases[r].regions, cases[r].src.data(), &pool); });
  for (auto& t : ranks) t.join();
  for (const ShardCase& c : cases)
    for (size_t s = 0; s < c.dst.size(); ++s) CHECK(FirstDiff(c.dst[s], c.want[s]) == c.dst[s].size());
}

TEST_CASE("HostCopyThreads: explicit counts kept, automatic divides the hardware among the ranks") {
  CHECK(wsync::HostCopyThreads(3, 8) == 3);
  CHECK(wsync::HostCopyThreads(0, 1) >= 1);
  CHECK(wsync::HostCopyThreads(0, 1) <= 8);
  CHECK(wsync::HostCopyThreads(0, 100000) == 1);
}
