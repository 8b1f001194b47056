#pragma once
// Host-memory copies of rectangles (rows x row_bytes, each side with its own pitch) on several threads. One thread's
// memcpy reaches a fraction of a many-core host's memory bandwidth (on the 16-core GPU host: 9.8 GB/s on one thread,
// ~60 GB/s on all of them), so a trainer rank copying its share of a node's bytes into the replica alone leaves most
// of it unused when the node has fewer busy ranks than cores.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/types/span.h"

namespace wsync {

// Below this many bytes a copy stays on the calling thread (handing parts to other threads would cost more than it
// saves).
inline constexpr uint64_t kParallelCopyMinBytes = 16ull << 20;

// Threads started once (per trainer client, per bench rank) and kept for every copy after: a copy hands its parts
// to them instead of starting threads each time. Thread-safe: several threads may call Run at once (their parts
// queue up). Destruction joins the workers; no Run may be in progress then.
class CopyPool {
 public:
  // `threads` counts the calling thread: threads - 1 workers are started (none for threads <= 1).
  explicit CopyPool(int threads);
  ~CopyPool();
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  // How many threads a copy may use, the caller's included.
  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  // Runs part(0) .. part(n - 1) on the workers and the calling thread; returns when every part has returned.
  void Run(int n, const std::function<void(int)>& part);

 private:
  struct Batch {
    const std::function<void(int)>* part;
    int n, next = 0, done = 0;
  };
  // Takes the next part of `b` (mu_ held); removes `b` from the queue once its last part is taken.
  int TakePart(Batch* b);
  void Work();

  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Batch*> queue_;  // batches with parts not yet taken
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

// Copies `rows` rows of `row_bytes` from src (rows `src_pitch` apart) to dst (rows `dst_pitch` apart) on the pool's
// threads (the caller's included): a contiguous rectangle is cut into byte ranges of whole 4 KiB pages, a strided one
// into row ranges. pool == nullptr, a one-thread pool or fewer than kParallelCopyMinBytes bytes: one memcpy per row
// (one for a contiguous rectangle) on the calling thread. The two sides must not overlap.
void CopyRect(uint8_t* dst, uint64_t dst_pitch, const uint8_t* src, uint64_t src_pitch, uint64_t row_bytes,
              int64_t rows, CopyPool* pool);

// One rectangle of a tensor placed into destination memory: row i goes from tensor byte src_offset + i * src_pitch
// to dst + i * dst_pitch (a v1::PlacedRegion, resolved to an address).
struct PlacedCopy {
  uint8_t* dst = nullptr;
  uint64_t dst_pitch = 0;
  uint64_t src_offset = 0, src_pitch = 0;
  uint64_t row_bytes = 0;
  int64_t rows = 0;
};

enum class PlaceMode {
  kPerRegion,  // one CopyRect per region: column shards read the tensor once per shard, strided
  kOnePass,    // column shards of the same rows copied together: one sequential read, every shard written from it
};

// Which regions are column shards of the same rows, to be copied in one pass (pure; the copy is CopyPlaced).
// Regions are grouped when they are strided (rows > 1, row_bytes < src_pitch), have the same rows and src_pitch and
// start on the same source row; each group lists region indices by their offset within the row, a lone region is a
// group of one. Groups are in the order of their first region.
std::vector<std::vector<size_t>> GroupColumnShards(absl::Span<const PlacedCopy> regions);

// Copies every region from the tensor at `src` (kOnePass: a group of column shards as one pass over its rows, the
// rows cut into ranges across the pool; kPerRegion: CopyRect per region). Regions must not overlap each other's
// destinations or the source.
void CopyPlaced(absl::Span<const PlacedCopy> regions, const uint8_t* src, CopyPool* pool,
                PlaceMode mode = PlaceMode::kOnePass);

// How many threads a rank's host copies use when asked for `requested` (0: automatic): automatic is the host's
// hardware threads divided among the node's `local_ranks` copying at once, at least 1, at most 8.
int HostCopyThreads(int requested, int local_ranks);

}  // namespace wsync
