#pragma once
// The seed write-up's measured results (lmsys blog 2026-04-29, H100 8-GPU nodes over InfiniBand; time from the
// engines' pause returning to continue_generation being issued). Used to check the cost model against reality.

#include <string>
#include <vector>

#include "planner/cluster.h"

namespace wsync::planner {

struct SeedRow {
  std::string family;       // as the write-up names it
  std::string model;        // model name in the write-up
  std::string model_dir;    // "<org>__<name>" directory holding config.json
  std::string total_params;
  TrainerSpec trainer;
  EngineSpec engine;
  int fp8_block = 0;          // > 0: trainer quantizes to FP8 with [b, b] blocks before sending
  double post_process_ms = 0; // engine post-processing the write-up reports separately (0 = not reported)
  double nccl_ms = 0;
  double rdma_ms = 0;
};

// The 8 rows, in the write-up's order. NICs: 8 per node; the write-up does not state the rate (400 Gb/s assumed).
const std::vector<SeedRow>& SeedRows();
NicSpec SeedNic();

}  // namespace wsync::planner
