#include "base/host_copy.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

namespace wsync {

namespace {

void Serial(uint8_t* dst, uint64_t dst_pitch, const uint8_t* src, uint64_t src_pitch, uint64_t row_bytes,
            int64_t rows) {
  if (rows <= 0 || row_bytes == 0) return;
  if (dst_pitch == row_bytes && src_pitch == row_bytes) {
    std::memcpy(dst, src, row_bytes * static_cast<uint64_t>(rows));
    return;
  }
  for (int64_t i = 0; i < rows; ++i)
    std::memcpy(dst + static_cast<uint64_t>(i) * dst_pitch, src + static_cast<uint64_t>(i) * src_pitch, row_bytes);
}

}  // namespace

void CopyRect(uint8_t* dst, uint64_t dst_pitch, const uint8_t* src, uint64_t src_pitch, uint64_t row_bytes,
              int64_t rows, int threads) {
  if (rows <= 0 || row_bytes == 0) return;
  const uint64_t total = row_bytes * static_cast<uint64_t>(rows);
  const bool contiguous = (dst_pitch == row_bytes && src_pitch == row_bytes) || rows == 1;
  int n = std::max(1, threads);
  if (total < kParallelCopyMinBytes) n = 1;
  if (!contiguous) n = static_cast<int>(std::min<int64_t>(n, rows));
  if (n <= 1) return Serial(dst, dst_pitch, src, src_pitch, row_bytes, rows);
  // Each part runs on its own thread but the last, which the caller copies.
  std::vector<std::thread> pool;
  pool.reserve(n - 1);
  if (contiguous) {
    const uint64_t share = (total / n + 4095) / 4096 * 4096;
    for (int i = 0; i < n; ++i) {
      const uint64_t a = std::min(total, share * i), b = i == n - 1 ? total : std::min(total, share * (i + 1));
      if (a >= b) continue;
      if (i == n - 1)
        std::memcpy(dst + a, src + a, b - a);
      else
        pool.emplace_back([=] { std::memcpy(dst + a, src + a, b - a); });
    }
  } else {
    const int64_t share = (rows + n - 1) / n;
    for (int i = 0; i < n; ++i) {
      const int64_t a = std::min(rows, share * i), b = std::min(rows, share * (i + 1));
      if (a >= b) continue;
      uint8_t* d = dst + static_cast<uint64_t>(a) * dst_pitch;
      const uint8_t* s = src + static_cast<uint64_t>(a) * src_pitch;
      if (i == n - 1)
        Serial(d, dst_pitch, s, src_pitch, row_bytes, b - a);
      else
        pool.emplace_back([=] { Serial(d, dst_pitch, s, src_pitch, row_bytes, b - a); });
    }
  }
  for (auto& t : pool) t.join();
}

int HostCopyThreads(int requested, int local_ranks) {
  if (requested > 0) return requested;
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::clamp(hw / std::max(1, local_ranks), 1, 8);
}

}  // namespace wsync
