#pragma once
// The planner's input for a real model: the HF tensors the trainer pushes (with their PP stage) and every engine
// rank's parameters with the HF tensors each is loaded from — all taken from replica/'s own layout walk
// (replica::PlanLayout, replica::CheckpointTensors), so the plan, the CLI's estimate and the bytes a source daemon
// builds come from one model library. Used by the coordinator and by `wsyncctl plan`.
//
// Trainer layers are split over PP stages as evenly as possible (stage p gets layers [floor(pL/pp),
// floor((p+1)L/pp))); tensors outside the layers go to stage 0 (embeddings) or the last stage (final norm, lm_head).

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/cluster.h"
#include "planner/plan.h"
#include "replica/model_config.h"

namespace wsync::planner {

struct ModelInputOptions {
  replica::QuantSpec quant;  // what the engine holds (fp8 block scales or the model's dtype)
  // What the trainer hands over: kTrainer (the model's dtype; the source quantizes when quant says so) or
  // kFp8PassThrough (fp8 weights and their block scales, quantized on the trainer side).
  replica::CheckpointFormat format = replica::CheckpointFormat::kTrainer;
  replica::EngineDialect dialect = replica::EngineDialect::kSglang;
  // What every engine rank holds: its target model, or (kAll) the target and its next-n draft in one table, the
  // draft's parameters more targets of the same plan, loaded from the checkpoint's MTP layer (pushed as well).
  replica::WeightSet weights = replica::WeightSet::kTarget;
};

// The parallelism of engine rank `rank` in an engine of `engine.tp` ranks (expert and attention-DP groups inside tp,
// numbered as SGLang does: ep_rank = rank / (tp/ep), attn_dp_rank = rank / (tp/dp)).
replica::RankParallelism EngineRankParallelism(const EngineSpec& engine, int rank,
                                               replica::EngineDialect dialect = replica::EngineDialect::kSglang);

// Builds the planner input; errors (InvalidArgument) name the parameter or shape the cluster cannot split.
absl::StatusOr<PlanInput> BuildModelInput(const replica::ModelConfig& config, const ClusterSpec& cluster,
                                          const ModelInputOptions& options = {});

// PP stage (0-based) of a checkpoint tensor for a trainer of `pp` stages.
int TrainerStageOf(const replica::ModelConfig& config, const std::string& hf_name, int pp);

}  // namespace wsync::planner
