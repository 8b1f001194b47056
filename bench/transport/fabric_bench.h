#pragma once
// The fabric transport next to a raw-libfabric baseline (fi_rma_bw-like) measured in the same run.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "bench/transport/tcp_bench.h"

namespace wsync::bench {

struct RawFabricOptions {
  std::string provider;  // empty: libfabric's pick
  std::vector<uint64_t> sizes;
  absl::Duration per_size = absl::Milliseconds(500);
  uint32_t window = 64;  // writes outstanding (capped by the provider's tx_attr->size)
  // How the receiver's thread progresses its endpoint: 0 = fi_cq_read without pause (fabtests' way, best where a
  // core is free), else a pause of this many microseconds between reads (the transport's way).
  int progress_pause_us = 0;
};

// One RDM endpoint pair in this process, written with plain fi_* calls (libfabric loaded at run time, like the
// transport): for each size, a window of fi_writemsg's kept full (delivery-complete where the provider offers it,
// as the transport asks) for `per_size`; the receiver's endpoint progressed by a thread that polls its completion
// queue (without pause, or with progress_pause_us between reads). The provider used is returned in `provider`.
absl::StatusOr<std::vector<SizePoint>> RunRawFabricSweep(const RawFabricOptions& opts, std::string* provider);

}  // namespace wsync::bench
