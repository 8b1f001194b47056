#pragma once
// `wsyncctl plan`: build a transfer plan for a model on a cluster shape and print what it costs, next to the
// NCCL-broadcast baseline. Also the adapter from a model's config.json to the planner's abstract layouts.
//
// Exit codes (as wsyncctl): 0 ok, 1 planning/model error, 2 bad flags.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/cluster.h"
#include "planner/plan.h"

namespace wsync::tools {

// Weight format the trainer sends (and the engine holds).
struct WeightFormat {
  int fp8_block = 0;  // 0: the model's dtype (bf16); > 0: FP8 e4m3 with float32 [b, b] block scales
};

// Parses "bf16" / "none", "fp8" (128 blocks) or "fp8:64".
absl::StatusOr<WeightFormat> ParseWeightFormat(const std::string& text);

// Builds the planner input from an HF config.json: the HF tensors the trainer pushes (with their PP stage) and
// each engine rank's SGLang parameter list (fused qkv / gate_up, stacked experts, TP/EP sharded, vocab padded to
// 64), with which HF tensors each parameter is loaded from.
// Trainer layers are split over PP stages as evenly as possible (stage p gets [floor(pL/pp), floor((p+1)L/pp)));
// embeddings go to stage 0, the final norm and lm_head to the last stage. MTP layers are not sent.
absl::StatusOr<planner::PlanInput> PlanInputFromModel(const std::string& config_path,
                                                      const planner::ClusterSpec& cluster,
                                                      const WeightFormat& format);

// argv[0] == "plan". Prints to stdout, errors to stderr; returns the exit code.
int RunPlanCommand(int argc, char** argv);

}  // namespace wsync::tools
