#include "base/host_copy.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>

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

int PoolThreads(const CopyPool* pool) { return pool == nullptr ? 1 : pool->threads(); }

// Rows [a, b) of a group of column shards: each source row is read once, left to right, each shard's slice of it
// written to that shard's destination.
void OnePassRows(absl::Span<const PlacedCopy> regions, const std::vector<size_t>& group, const uint8_t* src, int64_t a,
                 int64_t b) {
  for (int64_t i = a; i < b; ++i) {
    const uint64_t row = static_cast<uint64_t>(i);
    for (size_t k : group) {
      const PlacedCopy& r = regions[k];
      std::memcpy(r.dst + row * r.dst_pitch, src + r.src_offset + row * r.src_pitch, r.row_bytes);
    }
  }
}

}  // namespace

CopyPool::CopyPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { Work(); });
}

CopyPool::~CopyPool() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

int CopyPool::TakePart(Batch* b) {
  const int i = b->next++;
  if (b->next >= b->n) queue_.erase(std::find(queue_.begin(), queue_.end(), b));
  return i;
}

void CopyPool::Work() {
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    work_cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and nothing left
    Batch* b = queue_.front();
    const int i = TakePart(b);
    l.unlock();
    (*b->part)(i);
    l.lock();
    // The caller's Batch lives until done == n, which only this notification can complete.
    if (++b->done == b->n) done_cv_.notify_all();
  }
}

void CopyPool::Run(int n, const std::function<void(int)>& part) {
  if (n <= 0) return;
  if (n == 1 || workers_.empty()) {
    for (int i = 0; i < n; ++i) part(i);
    return;
  }
  Batch b{&part, n};
  std::unique_lock<std::mutex> l(mu_);
  queue_.push_back(&b);
  work_cv_.notify_all();
  // The caller works on its own batch too, then waits for the parts the workers took.
  while (b.next < b.n) {
    const int i = TakePart(&b);
    l.unlock();
    part(i);
    l.lock();
    ++b.done;
  }
  done_cv_.wait(l, [&] { return b.done == b.n; });
}

void CopyRect(uint8_t* dst, uint64_t dst_pitch, const uint8_t* src, uint64_t src_pitch, uint64_t row_bytes,
              int64_t rows, CopyPool* pool) {
  if (rows <= 0 || row_bytes == 0) return;
  const uint64_t total = row_bytes * static_cast<uint64_t>(rows);
  const bool contiguous = (dst_pitch == row_bytes && src_pitch == row_bytes) || rows == 1;
  int n = PoolThreads(pool);
  if (total < kParallelCopyMinBytes) n = 1;
  if (!contiguous) n = static_cast<int>(std::min<int64_t>(n, rows));
  if (n <= 1) return Serial(dst, dst_pitch, src, src_pitch, row_bytes, rows);
  if (contiguous) {
    const uint64_t share = (total / n + 4095) / 4096 * 4096;
    pool->Run(n, [&](int i) {
      const uint64_t a = std::min(total, share * i), b = i == n - 1 ? total : std::min(total, share * (i + 1));
      if (a < b) std::memcpy(dst + a, src + a, b - a);
    });
  } else {
    const int64_t share = (rows + n - 1) / n;
    pool->Run(n, [&](int i) {
      const int64_t a = std::min(rows, share * i), b = std::min(rows, share * (i + 1));
      if (a >= b) return;
      Serial(dst + static_cast<uint64_t>(a) * dst_pitch, dst_pitch, src + static_cast<uint64_t>(a) * src_pitch,
             src_pitch, row_bytes, b - a);
    });
  }
}

std::vector<std::vector<size_t>> GroupColumnShards(absl::Span<const PlacedCopy> regions) {
  std::vector<std::vector<size_t>> groups;
  // (src_pitch, rows, first source row) -> its group.
  std::map<std::tuple<uint64_t, int64_t, uint64_t>, size_t> by_rows;
  for (size_t k = 0; k < regions.size(); ++k) {
    const PlacedCopy& r = regions[k];
    const bool strided = r.rows > 1 && r.row_bytes < r.src_pitch;
    if (!strided) {
      groups.push_back({k});
      continue;
    }
    auto [it, fresh] = by_rows.try_emplace({r.src_pitch, r.rows, r.src_offset / r.src_pitch}, groups.size());
    if (fresh) groups.emplace_back();
    groups[it->second].push_back(k);
  }
  for (auto& g : groups)
    std::stable_sort(g.begin(), g.end(), [&](size_t x, size_t y) {
      return regions[x].src_offset % regions[x].src_pitch < regions[y].src_offset % regions[y].src_pitch;
    });
  return groups;
}

void CopyPlaced(absl::Span<const PlacedCopy> regions, const uint8_t* src, CopyPool* pool, PlaceMode mode) {
  if (mode == PlaceMode::kPerRegion) {
    for (const PlacedCopy& r : regions)
      CopyRect(r.dst, r.dst_pitch, src + r.src_offset, r.src_pitch, r.row_bytes, r.rows, pool);
    return;
  }
  for (const std::vector<size_t>& g : GroupColumnShards(regions)) {
    const PlacedCopy& first = regions[g.front()];
    if (g.size() == 1) {
      CopyRect(first.dst, first.dst_pitch, src + first.src_offset, first.src_pitch, first.row_bytes, first.rows, pool);
      continue;
    }
    uint64_t total = 0;
    for (size_t k : g) total += regions[k].row_bytes * static_cast<uint64_t>(regions[k].rows);
    const int64_t rows = first.rows;
    int n = total < kParallelCopyMinBytes ? 1 : static_cast<int>(std::min<int64_t>(PoolThreads(pool), rows));
    if (n <= 1) {
      OnePassRows(regions, g, src, 0, rows);
      continue;
    }
    const int64_t share = (rows + n - 1) / n;
    pool->Run(n, [&](int i) {
      const int64_t a = std::min(rows, share * i), b = std::min(rows, share * (i + 1));
      OnePassRows(regions, g, src, a, b);
    });
  }
}

int HostCopyThreads(int requested, int local_ranks) {
  if (requested > 0) return requested;
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::clamp(hw / std::max(1, local_ranks), 1, 8);
}

}  // namespace wsync
