#pragma once
// Consecutive RL-like training steps for delta-update tests and benches: a model of a trainer, not a trainer.
//
// Every checkpoint tensor of a model config keeps an fp32 master copy initialised as the config says (linear and
// embedding weights normal with std initializer_range, norms 1.0, biases 0) and Adam state (m, v). Each step draws a
// gradient per element, g = signal · mu + noise (mu fixed per element, noise fresh per step, both ~N(0, 1); Adam is
// scale invariant so the gradient's absolute scale does not matter), updates m and v, applies
// w -= lr · (m / (sqrt(v) + eps) + weight_decay · w), and casts the master to the tensor's trainer dtype (bf16;
// fp32 tensors such as a router's correction bias stay fp32). Adam's state starts at its stationary distribution
// (m ~ mu·signal + N(0, (1-b1)/(1+b1)), v = signal² mu² + 1, no bias correction), as in the middle of a long run
// rather than at its first step. Everything is a function of (seed, tensor name, element, step): two instances with
// the same options produce the same bytes.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "replica/model_config.h"

namespace wsync::tools {

struct RlStepOptions {
  double lr = 1e-6;
  double signal = 0.3;  // |mean| / std of the per-element gradient: RL policy gradients are mostly noise
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;  // relative to a unit gradient std
  double weight_decay = 0.0;
  uint64_t seed = 1;
  double initializer_range = 0.02;  // from config.json when present there
};

// Which kind of weight a checkpoint tensor is, for the per-kind figures ("embed", "lm_head", "attn", "mlp",
// "experts", "router", "norm", "bias").
std::string TensorKind(absl::string_view name);

class RlStepModel {
 public:
  // `config_path`: a HF config.json. Reads initializer_range from it (the ModelConfig parse keeps only what the
  // layouts need). max_layers / max_vocab > 0 cut the model down (the shapes of what is kept are unchanged).
  static absl::StatusOr<std::unique_ptr<RlStepModel>> Create(const std::string& config_path, RlStepOptions options,
                                                             int64_t max_layers = 0, int64_t max_vocab = 0);

  const replica::ModelConfig& config() const { return config_; }
  const std::vector<replica::TensorSpec>& tensors() const { return tensors_; }
  // The trainer-dtype bytes of tensor i at the current step (bf16 or f32, row-major as in the checkpoint).
  const std::vector<uint8_t>& bytes(size_t i) const { return cast_[i]; }
  int64_t step() const { return step_; }
  uint64_t num_elements() const;

  // One optimizer step over every tensor; bytes() then holds the new version.
  void Step();

 private:
  RlStepModel() = default;
  void InitTensor(size_t i);
  void StepTensor(size_t i);

  replica::ModelConfig config_;
  RlStepOptions options_;
  std::vector<replica::TensorSpec> tensors_;
  std::vector<uint64_t> seeds_;  // per tensor
  std::vector<std::vector<float>> master_, m_, v_;
  std::vector<std::vector<uint8_t>> cast_;
  int64_t step_ = 0;
};

// FP8 block quantization (replica/fp8.h, the engines' convention) of one 2-D bf16 tensor, and how two consecutive
// quantizations differ at the code level.
struct Fp8Tensor {
  int64_t rows = 0, cols = 0;
  int block = 128;
  std::vector<uint8_t> codes;  // rows × cols
  std::vector<float> scales;   // ceil(rows/block) × ceil(cols/block)
};
absl::Status QuantizeBf16Fp8(const uint8_t* bf16, int64_t rows, int64_t cols, int block, Fp8Tensor* out);

struct Fp8Change {
  uint64_t codes = 0, codes_changed = 0;
  uint64_t blocks = 0, blocks_rescaled = 0;                       // blocks whose scale changed
  uint64_t codes_in_rescaled = 0, codes_changed_in_rescaled = 0;  // codes of those blocks
  uint64_t codes_in_kept = 0, codes_changed_in_kept = 0;          // codes of blocks whose scale stayed
  Fp8Change& operator+=(const Fp8Change& o);
};
Fp8Change CompareFp8(const Fp8Tensor& before, const Fp8Tensor& after);

// The tensors an engine block-quantizes to FP8 (the linear weights of the FP8 pass-through checkpoint format).
absl::StatusOr<std::vector<bool>> Fp8Quantized(const replica::ModelConfig& config,
                                               const std::vector<replica::TensorSpec>& tensors);

// Writes tensors with their current bytes as one safetensors file.
absl::Status WriteSafetensors(const std::string& path, const RlStepModel& model);

}  // namespace wsync::tools
