#include "replica/mapper.h"

#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "replica/layout_plan.h"

namespace wsync::replica {

absl::string_view SkipRuleName(SkipRule r) {
  switch (r) {
    case SkipRule::kNone: return "none";
    case SkipRule::kMtpLayer: return "mtp-layer";
    case SkipRule::kRotary: return "rotary-buffer";
    case SkipRule::kTiedHead: return "tied-lm-head";
    case SkipRule::kTargetOnly: return "target-only";
    case SkipRule::kSharedWithTarget: return "shared-with-target";
  }
  return "?";
}

absl::StatusOr<ParamMapper> ParamMapper::Create(const ModelConfig& config, int ep_size,
                                                int num_fused_shared_experts, WeightSet weights) {
  if (ep_size <= 0 || (config.num_experts > 0 && config.num_experts % ep_size != 0)) {
    return absl::InvalidArgumentError(absl::StrCat("ep_size ", ep_size, " does not divide n_routed_experts ",
                                                   config.num_experts));
  }
  ParamMapper m;
  m.config_ = config;
  m.ep_size_ = ep_size;
  m.num_fused_shared_experts_ = num_fused_shared_experts;
  m.weights_ = weights;
  PlanOptions o;
  o.check_blocks = false;
  QuantSpec fp8;
  fp8.mode = QuantSpec::Mode::kFp8Block;
  for (const WeightSet w : {WeightSet::kTarget, WeightSet::kDraft}) {
    if (w == WeightSet::kDraft && !HoldsDraft(weights)) break;
    for (const QuantSpec& q : {QuantSpec{}, fp8}) {
      RankParallelism r = RankParallelism::ForTp(1, 0, 1);
      r.num_fused_shared_experts = num_fused_shared_experts;
      r.weights = w;
      WSYNC_ASSIGN_OR_RETURN(LayoutPlan plan, PlanLayout(config, r, q, o));
      for (const EngineParam& p : plan.table.params()) {
        (w == WeightSet::kDraft ? m.draft_names_ : m.engine_names_).insert(p.name);
      }
    }
  }
  return m;
}

absl::StatusOr<HfMapping> ParamMapper::Map(absl::string_view name) const {
  if (HoldsDraft(weights_) && LayerIndexOf(name) == DraftLayerIndex(config_)) {
    if (absl::StrContains(name, ".rotary_emb.")) {
      HfMapping r;
      r.skip = SkipRule::kRotary;
      return r;
    }
    const std::string draft = DraftParamName(config_, name);
    if (draft.empty()) {
      HfMapping r;
      r.skip = SkipRule::kSharedWithTarget;
      return r;
    }
    return Resolve(name, draft, draft_names_);
  }
  WSYNC_ASSIGN_OR_RETURN(HfMapping r, MapTarget(name));
  if (weights_ == WeightSet::kDraft && r.skip == SkipRule::kNone) {
    r = HfMapping{};
    r.skip = SkipRule::kTargetOnly;
  }
  return r;
}

absl::StatusOr<HfMapping> ParamMapper::MapTarget(absl::string_view name) const {
  HfMapping r;
  if (name == "lm_head.weight" && config_.tie_word_embeddings) {
    r.skip = SkipRule::kTiedHead;
    return r;
  }
  if (absl::StrContains(name, ".rotary_emb.")) {
    r.skip = SkipRule::kRotary;
    return r;
  }
  const int64_t layer = LayerIndexOf(name);
  if (layer >= config_.num_layers) {
    r.skip = SkipRule::kMtpLayer;
    return r;
  }
  return Resolve(name, name, engine_names_);
}

absl::StatusOr<HfMapping> ParamMapper::Resolve(absl::string_view hf_name, absl::string_view name,
                                               const absl::flat_hash_set<std::string>& names) const {
  HfMapping r;
  auto unknown = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("unknown tensor '", hf_name, "' for ", config_.architecture,
                                                   weights_ == WeightSet::kDraft ? " (draft)" : "", ": ", why));
  };
  std::vector<std::string> parts = absl::StrSplit(name, '.');
  r.engine_name = std::string(name);
  // Experts: …mlp.experts.<e>.{gate,up,down}_proj.<suffix> → …mlp.experts.w13_<suffix> / w2_<suffix>.
  // With shared-expert fusion, …mlp.shared_experts.<proj>.<suffix> is expert n_routed.
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    const bool routed = parts[i] == "experts" && i + 3 < parts.size() && i > 0 && parts[i - 1] == "mlp";
    const bool shared = parts[i] == "shared_experts" && num_fused_shared_experts_ > 0 && i + 2 < parts.size();
    if (!routed && !shared) continue;
    int64_t e = config_.num_experts;
    size_t proj = i + 1;
    if (routed) {
      if (!absl::SimpleAtoi(parts[i + 1], &e)) return unknown("expert index is not a number");
      if (e < 0 || e >= config_.num_experts) {
        return absl::OutOfRangeError(absl::StrCat("tensor '", hf_name, "': expert id ", e, " out of range [0, ",
                                                  config_.num_experts, ")"));
      }
      proj = i + 2;
    }
    std::string w;
    if (parts[proj] == "gate_proj") {
      w = "w13_", r.shard_id = "w1", r.num_shards = 2;
    } else if (parts[proj] == "up_proj") {
      w = "w13_", r.shard_id = "w3", r.num_shards = 2;
    } else if (parts[proj] == "down_proj") {
      w = "w2_", r.shard_id = "w2", r.num_shards = 1;
    } else {
      return unknown("not an expert projection");
    }
    std::string engine;
    for (size_t k = 0; k < i; ++k) absl::StrAppend(&engine, parts[k], ".");
    absl::StrAppend(&engine, "experts.", w);
    for (size_t k = proj + 1; k < parts.size(); ++k) absl::StrAppend(&engine, k == proj + 1 ? "" : ".", parts[k]);
    r.engine_name = engine;
    r.expert_id = e;
    r.num_local_experts = config_.num_experts / ep_size_ + num_fused_shared_experts_;
    break;
  }
  if (r.expert_id < 0) {
    // Stacked parameters: replace one path component.
    const bool mla = config_.is_mla();
    for (size_t i = 0; i < parts.size(); ++i) {
      const std::string& p = parts[i];
      const bool in_attn = i > 0 && parts[i - 1] == "self_attn";
      std::string repl;
      if (!mla && in_attn && (p == "q_proj" || p == "k_proj" || p == "v_proj")) {
        repl = "qkv_proj", r.shard_id = p.substr(0, 1), r.num_shards = 3;
      } else if (p == "gate_proj" || p == "up_proj") {
        repl = "gate_up_proj", r.shard_id = p == "gate_proj" ? "0" : "1", r.num_shards = 2;
      } else if (mla && config_.q_lora_rank > 0 && in_attn && (p == "q_a_proj" || p == "kv_a_proj_with_mqa")) {
        repl = "fused_qkv_a_proj_with_mqa", r.shard_id = p == "q_a_proj" ? "0" : "1", r.num_shards = 2;
      }
      if (!repl.empty()) {
        parts[i] = repl;
        r.engine_name = absl::StrJoin(parts, ".");
        break;
      }
    }
  }
  if (!names.contains(r.engine_name)) {
    return unknown(absl::StrCat("no engine parameter '", r.engine_name, "'"));
  }
  return r;
}

}  // namespace wsync::replica
