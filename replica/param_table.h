#pragma once
// One engine rank's parameter table: what the replica allocates and what targets are checked against.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "replica/model_config.h"

namespace wsync::replica {

struct EngineParam {
  std::string name;  // SGLang parameter name, e.g. "model.layers.0.self_attn.qkv_proj.weight"
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  uint64_t offset = 0;  // in the replica buffer; 64-byte aligned
};

class ParamTable {
 public:
  const std::vector<EngineParam>& params() const { return params_; }
  const EngineParam* Find(const std::string& name) const;
  int IndexOf(const std::string& name) const;  // -1 if absent
  uint64_t total_bytes() const { return total_bytes_; }
  void Add(EngineParam p);  // assigns offset
  // Parameters from `first_draft` on are the rank's speculative draft's (WeightSet kAll / kDraft); -1: none.
  int first_draft() const { return first_draft_; }
  bool IsDraft(size_t param) const { return first_draft_ >= 0 && param >= static_cast<size_t>(first_draft_); }
  void set_first_draft(int first) { first_draft_ = first; }

 private:
  std::vector<EngineParam> params_;
  absl::flat_hash_map<std::string, int> index_;
  uint64_t total_bytes_ = 0;
  int first_draft_ = -1;
};

// SGLang's named_parameters() for one rank (tied lm_head absent when tied; expert params stacked per rank).
absl::StatusOr<ParamTable> BuildParamTable(const ModelConfig& config, const RankParallelism& rank, const QuantSpec& quant);

}  // namespace wsync::replica
