#include "replica/param_table.h"

#include "base/status.h"
#include "replica/layout_plan.h"

namespace wsync::replica {

namespace {
// Offsets are 64-byte aligned so every parameter starts on a cache line (and any vectorized copy is aligned).
constexpr uint64_t kParamAlign = 64;
}  // namespace

const EngineParam* ParamTable::Find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &params_[it->second];
}

int ParamTable::IndexOf(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? -1 : it->second;
}

void ParamTable::Add(EngineParam p) {
  total_bytes_ = (total_bytes_ + kParamAlign - 1) / kParamAlign * kParamAlign;
  p.offset = total_bytes_;
  total_bytes_ += p.bytes;
  index_.emplace(p.name, static_cast<int>(params_.size()));
  params_.push_back(std::move(p));
}

absl::StatusOr<ParamTable> BuildParamTable(const ModelConfig& config, const RankParallelism& rank,
                                           const QuantSpec& quant) {
  WSYNC_ASSIGN_OR_RETURN(LayoutPlan plan, PlanLayout(config, rank, quant));
  return std::move(plan.table);
}

}  // namespace wsync::replica
