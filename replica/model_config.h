#pragma once
// HF config.json → the facts the mapper and sharding need. Unknown keys are ignored; missing required keys are errors.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/dtype.h"

namespace wsync::replica {

enum class Family {
  kLlama,         // LlamaForCausalLM
  kQwen2,         // Qwen2ForCausalLM
  kQwen3,         // Qwen3ForCausalLM (q/k norms)
  kQwen3Moe,      // Qwen3MoeForCausalLM
  kGlm4,          // Glm4ForCausalLM (dense)
  kGlm4Moe,       // Glm4MoeForCausalLM
  kDeepseekV2V3,  // DeepseekV2ForCausalLM / DeepseekV3ForCausalLM (Moonlight, DeepSeek-V3, Kimi-K2)
  kGlm4MoeLite,   // Glm4MoeLiteForCausalLM (GLM-4.7-Flash, MLA)
};

struct ModelConfig {
  std::string architecture;  // architectures[0]
  Family family = Family::kLlama;
  DType dtype = DType::kBF16;  // torch_dtype / dtype
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // qkv bias (Qwen2, GLM4)
  // MoE (0 when dense)
  int64_t num_experts = 0;         // routed experts
  int64_t num_shared_experts = 0;
  int64_t moe_intermediate_size = 0;
  int64_t first_k_dense = 0;       // first_k_dense_replace; layers [0, first_k_dense) are dense
  int64_t moe_layer_freq = 1;
  // MLA (0 when not MLA)
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  // Next-n (MTP) layers stored after num_layers: the target skips them, a draft layout (WeightSet::kDraft) holds them.
  int64_t num_nextn_predict_layers = 0;
  // Checkpoint FP8 block quantization as published (quantization_config), empty when none.
  std::vector<int64_t> weight_block_size;
  // Added for the mapper and table builder.
  std::string model_type;
  bool qk_norm = false;                  // per-head q_norm/k_norm (Qwen3; GLM4-MoE with use_qk_norm)
  bool router_bias = false;              // mlp.gate.e_score_correction_bias (noaux_tc routing), float32
  // mlp.gate.weight is float32 in the engine (GLM4-MoE and GLM4-MoE-Lite always; DeepSeek with router_fp32); the
  // checkpoint's gate stays in the model dtype and is widened when loaded.
  bool router_fp32 = false;
  std::vector<int64_t> mlp_only_layers;  // Qwen3-MoE: layers that stay dense
  // An adapter-only model (docs/engines.md, "LoRA adapters"): the config's "lora_adapter" section, which an engine
  // serving a PEFT LoRA adapter over this base model reports ({"r", "target_modules"}). With it, every layout and
  // checkpoint listing of this config is the adapter's tensors alone (lora_A [r, in] and lora_B [out, r] per target
  // module and layer, PEFT names, the model dtype, whole on every rank as vLLM loads adapters); the base weights are
  // the engine's own and never written. Dense Llama/Qwen2/Qwen3 only.
  struct LoraAdapter {
    int64_t rank = 0;
    // short module names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj
    std::vector<std::string> target_modules;
  };
  std::optional<LoraAdapter> lora_adapter;
  // A speculative draft that is a model of its own (EAGLE-3: a checkpoint with its own config.json, vLLM's
  // `--speculative-config '{"method": "eagle3", "model": DIR, …}'`), as a vLLM engine running one reports it beside the
  // target's config: the "speculative_draft" section {"method", "config": the draft's config.json, "own_embed_tokens",
  // "own_lm_head"} (docs/engines.md, "vLLM's EAGLE-3 draft"). A trainer pushes the draft's tensors under its
  // checkpoint names prefixed with `draft.` (kDraftTensorPrefix).
  struct SeparateDraft {
    std::string method;        // vLLM's speculative method: "eagle3" (planned), "eagle" (refused)
    std::string architecture;  // the draft config's architectures[0]
    // The draft's decoder dimensions, parsed as a model of the family its layer is (LlamaForCausalLMEagle3 and
    // Eagle3LlamaForCausalLM: kLlama); dtype is the target's (vLLM builds the draft in the target's dtype).
    std::shared_ptr<const ModelConfig> config;
    int64_t draft_vocab_size = 0;  // lm_head rows (draft_vocab_size, or vocab_size when absent)
    int64_t fc_in = 0;             // fc's input: target_hidden_size × the number of auxiliary hidden states
    // After vLLM's proposer shares what the target already holds (an embedding or LM head absent from the draft
    // checkpoint, or equal to the target's): whether the draft still has its own.
    bool own_embed_tokens = false;
    bool own_lm_head = true;
    // Options of the draft config that change its parameters and have not been compared with vLLM (norm_before_fc,
    // fc_norm, attention_bias, more than one layer, no auxiliary hidden states, a quantization_config): planning
    // refuses the draft naming them.
    std::vector<std::string> unchecked;
  };
  std::optional<SeparateDraft> separate_draft;

  bool is_mla() const { return kv_lora_rank > 0; }
  bool IsMoeLayer(int64_t layer) const;

  static absl::StatusOr<ModelConfig> FromJson(absl::string_view json_text);
  static absl::StatusOr<ModelConfig> FromFile(const std::string& path);
};

// The prefix under which a trainer pushes the tensors of a separate draft checkpoint (ModelConfig::separate_draft):
// `draft.midlayer.self_attn.q_proj.weight`, `draft.fc.weight`, `draft.lm_head.weight`, `draft.d2t`, … (the draft's
// own names collide with the target's: both have `lm_head.weight`).
inline constexpr absl::string_view kDraftTensorPrefix = "draft.";

// Whether the model has a speculative draft to update: a next-n / MTP layer in its checkpoint
// (num_nextn_predict_layers) or a separate draft checkpoint (separate_draft).
bool HasDraft(const ModelConfig& config);

// Whose parameter table a layout reproduces. The engines agree on fusion and sharding but differ in names (vLLM's
// routed experts sit under `experts.routed_experts.`) and in what they support; the engine kind a target reports
// picks the dialect, and every family/option a dialect has not been checked against its engine is a configure error.
enum class EngineDialect { kSglang, kVllm };
// "" | "reference" | "sglang" → kSglang (the reference engine mirrors SGLang's layout); "vllm" → kVllm.
absl::StatusOr<EngineDialect> DialectForEngineKind(absl::string_view kind);
absl::string_view DialectName(EngineDialect d);

// Which of an engine rank's models a layout reproduces: the target model, or its speculative draft as SGLang's
// next-n classes hold it (DeepseekV3ForCausalLMNextN, Glm4MoeForCausalLMNextN, Glm4MoeLiteForCausalLMNextN: the
// checkpoint's MTP layer; layout_plan.h), or both in one table (kAll: the target's parameters, then the draft's, as an
// engine rank running speculative decoding is updated: one set of targets, one commit). The names are SGLang's
// begin_weight_update selectors.
enum class WeightSet : uint8_t { kTarget, kDraft, kAll };
absl::string_view WeightSetName(WeightSet w);  // "target" | "draft" | "all"
// Whether a layout of weight set `w` holds the target's / the draft's parameters.
inline bool HoldsTarget(WeightSet w) { return w != WeightSet::kDraft; }
inline bool HoldsDraft(WeightSet w) { return w != WeightSet::kTarget; }

// One engine rank's parallelism, field names as SGLang's RankParallelismConfig, plus the engine dialect and the weight
// set (two ranks with equal parallelism but different dialects, or a rank's target and its draft, need different
// layouts).
struct RankParallelism {
  int tp_size = 1, tp_rank = 0;
  int pp_size = 1, pp_rank = 0;
  int ep_size = 1, ep_rank = 0;
  int moe_tp_size = 1, moe_tp_rank = 0;     // tp / ep (moe_dp = 1)
  int attn_tp_size = 1, attn_tp_rank = 0;   // == tp unless DP-attention
  int attn_dp_size = 1, attn_dp_rank = 0;
  EngineDialect dialect = EngineDialect::kSglang;
  WeightSet weights = WeightSet::kTarget;
  // Shared-expert fusion, an engine choice rather than an HF fact: SGLang (unless --disable-shared-experts-fusion, and
  // only where its model allows it) stores the n_shared_experts shared experts as experts n_routed.. of every MoE
  // layer's experts.w13/w2 (E/ep + n_shared local experts) and has no shared_experts.* parameters. 0 keeps them a
  // separate MLP. Set from what the engine reports (SharedExpertsFusionFromParams), never guessed.
  int num_fused_shared_experts = 0;
  bool operator==(const RankParallelism& o) const;
  // Fills moe_tp_* and attn_tp_* from tp/ep (no DP-attention) when they are left at their defaults.
  static RankParallelism ForTp(int tp_size, int tp_rank, int ep_size = 1);
};

// The shared-expert fusion an engine uses, from the names of the parameters it reports (SGLang's bootstrap answer
// lists names with sizes): 0 when the config has no shared experts or any `.mlp.shared_experts.` parameter is
// present; n_shared_experts (SGLang fuses exactly one) when MoE layers' `.mlp.experts.w13_weight` are present without
// any shared_experts. InvalidArgument when the list fits neither layout. The stacked size (E/ep + 1 experts) is then
// checked parameter by parameter against the table built with the result.
absl::StatusOr<int> SharedExpertsFusionFromParams(const ModelConfig& config,
                                                  const std::vector<std::string>& engine_param_names);

// Quantization applied at the source when loading into the replica.
struct QuantSpec {
  enum class Mode { kNone, kFp8Block };
  Mode mode = Mode::kNone;
  int block_n = 128;
  int block_k = 128;
  bool ue8m0 = false;  // scales rounded up to powers of two (replica/fp8.h, Fp8ScaleFormat::kUe8m0)
};

// One tensor of the HF checkpoint (what trainers push).
struct TensorSpec {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  uint64_t bytes() const;
};

// Every tensor a trainer pushes for this model in the given weight dtype (bf16 unless fp8 pass-through), in
// checkpoint order; excludes names skipped by rule (MTP layers, rotary inv_freq, lm_head when tied).
// This one-argument form is the trainer format: every weight in config.dtype (bf16), no `weight_scale_inv`;
// router `e_score_correction_bias` is float32 as in the released checkpoints.
absl::StatusOr<std::vector<TensorSpec>> CheckpointTensors(const ModelConfig& config);

// FP8 pass-through format (what a published FP8 checkpoint such as DeepSeek-V3 holds): the linear weights SGLang
// block-quantizes are float8_e4m3fn and each is followed by its float32 `<name>_scale_inv`
// [ceil(N/block_n), ceil(K/block_k)]; everything else as in the trainer format.
// `weights` kDraft: the tensors a next-n draft loads (the checkpoint's MTP layer less its embed_tokens and
// shared_head.head, layout_plan.h), under the same formats; eh_proj stays in the model dtype (not block-quantized).
enum class CheckpointFormat { kTrainer, kFp8PassThrough };
absl::StatusOr<std::vector<TensorSpec>> CheckpointTensors(const ModelConfig& config, CheckpointFormat format,
                                                          int block_n = 128, int block_k = 128,
                                                          WeightSet weights = WeightSet::kTarget);

}  // namespace wsync::replica
