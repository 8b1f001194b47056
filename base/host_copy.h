#pragma once
// Host-memory copies of a rectangle (rows x row_bytes, each side with its own pitch) on several threads. One thread's
// memcpy reaches a fraction of a many-core host's memory bandwidth (on the 16-core GPU host: 9.8 GB/s on one thread,
// ~60 GB/s on all of them), so a trainer rank copying its share of a node's bytes into the replica alone leaves most
// of it unused when the node has fewer busy ranks than cores.

#include <cstdint>

namespace wsync {

// Below this many bytes a copy stays on the calling thread (starting threads would cost more than it saves).
inline constexpr uint64_t kParallelCopyMinBytes = 16ull << 20;

// Copies `rows` rows of `row_bytes` from src (rows `src_pitch` apart) to dst (rows `dst_pitch` apart) on up to
// `threads` threads (the caller's included): a contiguous rectangle is cut into byte ranges of whole 4 KiB pages, a
// strided one into row ranges. threads <= 1 or fewer than kParallelCopyMinBytes bytes: one memcpy per row (one for a
// contiguous rectangle) on the calling thread. The two sides must not overlap.
void CopyRect(uint8_t* dst, uint64_t dst_pitch, const uint8_t* src, uint64_t src_pitch, uint64_t row_bytes,
              int64_t rows, int threads);

// How many threads a rank's host copies use when asked for `requested` (0: automatic): automatic is the host's
// hardware threads divided among the node's `local_ranks` copying at once, at least 1, at most 8.
int HostCopyThreads(int requested, int local_ranks);

}  // namespace wsync
