#pragma once
// How one engine rank's parameters are assembled from HF tensors: the table plus, for every parameter, the slices of
// HF tensors that fill it. BuildParamTable, CheckpointTensors and the Replica are all derived from this one walk, so
// the names, shapes and slicing cannot disagree.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "replica/model_config.h"
#include "replica/param_table.h"

namespace wsync::replica {

// One rectangular slice of an HF tensor placed into one engine parameter. Tensors are viewed as 2-D row-major
// [rows, cols] (1-D tensors as [n, 1]); stacked expert parameters as [E_local, rows, cols].
struct SliceSource {
  enum class Kind : uint8_t {
    kPlain,        // copy, converting bf16/f16/f32 to the parameter dtype
    kFp8Weight,    // into an fp8 weight: bf16/f16/f32 is quantized (also fills scale_param), fp8 is byte-copied
    kFp8Scale,     // an HF `weight_scale_inv` (fp8 pass-through) into the scale parameter; geometry in blocks
    // A float32 parameter no checkpoint tensor fills, whose value the engine fixes itself when it loads (the FP8
    // KV-cache scales of SGLang's MLA attention, `self_attn.attn_mqa.k_scale` etc.: scalars that are 1.0 after
    // loading a checkpoint without them). `value` is written into every element when `hf_name` (a tensor of the same
    // layer) arrives, so the parameter is ready with it and the planner places it with that tensor.
    kConstant,
  };
  Kind kind = Kind::kPlain;
  std::string hf_name;
  std::vector<int64_t> hf_shape;    // full HF tensor shape in the checkpoint
  DType hf_dtype = DType::kBF16;    // checkpoint dtype (trainer format; fp8 pass-through sends kF8E4M3 instead)
  int param = -1;                   // index in the table
  int scale_param = -1;             // kFp8Weight: the matching weight_scale_inv parameter
  int64_t src_row0 = 0, src_col0 = 0, rows = 0, cols = 0;
  int64_t expert = 0;               // local expert index for stacked parameters
  int64_t dst_row0 = 0, dst_col0 = 0;
  int64_t scale_dst_row0 = 0, scale_dst_col0 = 0;  // kFp8Weight: block coordinates in scale_param
  int64_t scale_src_row0 = 0, scale_src_col0 = 0;  // kFp8Weight: block coordinates of the slice in the HF scale
  float value = 0.0f;                               // kConstant
};

struct LayoutPlan {
  ParamTable table;
  std::vector<SliceSource> sources;  // in checkpoint order
  // Per parameter: how many sources fill it (a scale parameter counts the weight slices it covers).
  std::vector<int> expected;
  // The draft's first parameter (WeightSet kAll: every parameter from here on is the draft's; kDraft: 0); -1 when the
  // table holds no draft.
  int first_draft = -1;
};

struct PlanOptions {
  // false only when listing checkpoint names: skips the checks that apply to a real engine rank (whole FP8 blocks,
  // layouts the engine cannot build).
  bool check_blocks = true;
};

// The engine parameters of one rank and the HF slices that fill them. Errors (InvalidArgument) for parallelism the
// config cannot be split by (heads, experts, vocab, FP8 blocks), naming the parameter.
//
// rank.weights == WeightSet::kDraft plans the rank's next-n draft instead, as SGLang 0.5.23's NextN classes hold it
// (SGLang dialect; DeepSeek-V3, GLM-4.5/4.6 MoE, GLM-4.7-Flash): the checkpoint's layer DraftLayerIndex() renamed
// (DraftParamName) to model.enorm / model.hnorm / model.eh_proj (an unquantized nn.Linear, replicated) /
// model.shared_head.norm and model.decoder.* (the decoder layer, always MoE, sharded and FP8-quantized as a target
// layer is). The draft's model.embed_tokens and lm_head are not in it: SGLang's draft does not load them and
// shares the target's tensors (set_embed_and_head), so they are written once, with the target. A config without
// num_nextn_predict_layers is InvalidArgument naming the model; other families are Unimplemented.
// A config with a separate draft (ModelConfig::separate_draft, vLLM dialect only) plans that draft instead: vLLM 0.32's
// Eagle3LlamaForCausalLM from the draft's own config, its tensors the trainer's `draft.`-prefixed checkpoint names
// (SeparateDraftParamName); EAGLE-1, other draft architectures and options are Unimplemented.
// vLLM dialect (DeepSeek-V3 only): vLLM 0.32's DeepSeekMTP, the same tensors under vLLM's draft names
// (DraftParamName), its embedding and LM head likewise the target's; docs/engines.md, "Speculative drafts".
//
// A config with a lora_adapter section (ModelConfig::lora_adapter) plans the adapter alone: lora_A/lora_B of every
// target module and layer under PEFT's names, whole on every rank (vLLM dialect; dense models). A target module the
// decoder lacks is InvalidArgument naming it.
absl::StatusOr<LayoutPlan> PlanLayout(const ModelConfig& config, const RankParallelism& rank, const QuantSpec& quant,
                                      const PlanOptions& options = {});

// Layer index of "model.layers.<i>.…", or -1.
int64_t LayerIndexOf(absl::string_view hf_name);

// The checkpoint layer holding the next-n draft layer, as SGLang's NextN loaders pick it: num_hidden_layers, or 0 in
// a one-layer checkpoint (a separately published draft). -1 when the config declares no num_nextn_predict_layers.
int64_t DraftLayerIndex(const ModelConfig& config);

// The draft model's name for a tensor of the draft layer, before fusion. SGLang (its NextN load_weights rename):
// model.layers.<d>.{enorm,hnorm,eh_proj,shared_head.norm}… → model.…, anything else of the layer → model.decoder.….
// vLLM (DeepSeekMTP's _rewrite_spec_layer_name): those four keep their name, anything else of the layer →
// model.layers.<d>.mtp_block.…. "" for tensors of other layers and for the layer's embed_tokens and
// shared_head.head, which the draft shares with the target.
std::string DraftParamName(const ModelConfig& config, absl::string_view hf_name,
                           EngineDialect dialect = EngineDialect::kSglang);

// A separate draft checkpoint's parameter name in a rank's table (ModelConfig::separate_draft, vLLM's EAGLE-3
// drafter): the trainer's `draft.<checkpoint name>` becomes `draft.` + the name vLLM's Eagle3LlamaForCausalLM gives it
// (its load_weights renames: midlayer. → model.layers.0., d2t → draft_id_to_target_id, lm_head. kept, anything else
// under model.), before fusion. The `draft.` prefix keeps the draft's names apart from the target's in one table
// (both have model.layers.0.*, model.norm.weight and lm_head.weight); the vLLM backend reports the draft's
// parameters under it. "" for a name without the prefix.
std::string SeparateDraftParamName(absl::string_view hf_name);

}  // namespace wsync::replica
