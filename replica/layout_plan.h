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
};

struct PlanOptions {
  // false only when listing checkpoint names: skips the checks that apply to a real engine rank (whole FP8 blocks,
  // layouts the engine cannot build).
  bool check_blocks = true;
};

// The engine parameters of one rank and the HF slices that fill them. Errors (InvalidArgument) for parallelism the
// config cannot be split by (heads, experts, vocab, FP8 blocks), naming the parameter.
absl::StatusOr<LayoutPlan> PlanLayout(const ModelConfig& config, const RankParallelism& rank, const QuantSpec& quant,
                                      const PlanOptions& options = {});

// Layer index of "model.layers.<i>.…", or -1.
int64_t LayerIndexOf(absl::string_view hf_name);

}  // namespace wsync::replica
