#pragma once
// HF tensor name → SGLang parameter (what SGLang's ParameterMapper / load_weights would pick), or a documented skip.
// A mapper maps to one weight set: the target model (default) or its next-n draft (WeightSet::kDraft, SGLang's
// NextN classes, layout_plan.h) or both (WeightSet::kAll: the draft layer's tensors map to the draft, every other
// tensor to the target), so a target mapper behaves exactly as before drafts existed.
//
// Skip rules (the tensor is accepted and dropped, never an error):
//   kMtpLayer   target: "model.layers.<i>.*" with i >= num_hidden_layers: MTP / next-n draft layers (DeepSeek-V3,
//               GLM-4.5, GLM-4.7-Flash) that the target model does not load (a draft mapper maps them).
//   kRotary     "*.rotary_emb.*" (inv_freq, cos/sin caches): buffers the engine recomputes (Kimi-K2 stores them).
//   kTiedHead   "lm_head.weight" when tie_word_embeddings: SGLang reuses embed_tokens (Qwen3-0.6B stores it anyway).
//   kTargetOnly draft: a tensor of the target model (it must map there, or it is an error as for a target mapper).
//   kSharedWithTarget  draft: the draft layer's embed_tokens and shared_head.head, which SGLang's draft does not load
//               (it uses the target's embedding and lm_head).
// Anything else that does not resolve to a parameter of the model is an error naming the tensor.

#include <cstdint>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "replica/model_config.h"

namespace wsync::replica {

enum class SkipRule { kNone, kMtpLayer, kRotary, kTiedHead, kTargetOnly, kSharedWithTarget };
absl::string_view SkipRuleName(SkipRule r);

struct HfMapping {
  SkipRule skip = SkipRule::kNone;
  std::string engine_name;     // e.g. "model.layers.3.mlp.experts.w13_weight" (a draft's: "model.decoder.…")
  std::string shard_id;        // "" (whole), "q"/"k"/"v", "0"/"1" (gate_up, fused_qkv_a), "w1"/"w2"/"w3" (experts)
  int num_shards = 1;          // qkv 3, gate_up 2, fused_qkv_a 2, w13 2, w2 1
  int64_t expert_id = -1;      // global expert id, -1 when not an expert
  int64_t num_local_experts = 0;  // experts per EP rank (+ fused shared), 0 when not an expert
};

class ParamMapper {
 public:
  // `ep_size` only affects num_local_experts; with `num_fused_shared_experts` > 0 (RankParallelism) the shared
  // experts' tensors map to experts n_routed.. of experts.w13/w2. kDraft fails as PlanLayout does for a model
  // without a draft (InvalidArgument naming it) or one whose draft layout is not supported.
  static absl::StatusOr<ParamMapper> Create(const ModelConfig& config, int ep_size = 1,
                                            int num_fused_shared_experts = 0,
                                            WeightSet weights = WeightSet::kTarget);

  // InvalidArgument naming the tensor for unknown names, OutOfRange for an expert id >= n_routed_experts.
  absl::StatusOr<HfMapping> Map(absl::string_view hf_name) const;

 private:
  absl::StatusOr<HfMapping> MapTarget(absl::string_view hf_name) const;
  // Experts and stacked parameters of `name` (the target's name, or the draft's after DraftParamName), checked
  // against `names`; errors name `hf_name`.
  absl::StatusOr<HfMapping> Resolve(absl::string_view hf_name, absl::string_view name,
                                    const absl::flat_hash_set<std::string>& names) const;

  ModelConfig config_;
  int ep_size_ = 1;
  int num_fused_shared_experts_ = 0;
  WeightSet weights_ = WeightSet::kTarget;
  absl::flat_hash_set<std::string> engine_names_;  // every target parameter name at tp=1, bf16 and fp8
  absl::flat_hash_set<std::string> draft_names_;   // the same for the draft (kDraft only)
};

}  // namespace wsync::replica
