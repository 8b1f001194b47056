#pragma once
// Synthetic planner inputs: no model, just layouts with parameters of varied sizes.

#include <cstdint>
#include <vector>

#include "planner/plan.h"

namespace wsync::planner::testing {

struct SyntheticShape {
  int train_nodes = 1, gpus_per_node = 8, pp = 1;
  int instances = 1, engine_tp = 8, engine_nodes = 1;
  int nics = 8;
  int params_per_stage = 24;   // per engine rank
  uint64_t param_bytes = 8 << 20;  // base size; sizes vary 1x..4x deterministically
  int inputs_per_param = 2;
};

PlanInput MakeInput(const SyntheticShape& s);

// Shapes covering sources < targets, = targets, > targets, uneven counts, pp > 1, shared NICs.
std::vector<SyntheticShape> CoverageShapes();

}  // namespace wsync::planner::testing
