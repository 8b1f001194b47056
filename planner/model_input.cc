#include "planner/model_input.h"

#include <algorithm>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "replica/layout_plan.h"

namespace wsync::planner {

replica::RankParallelism EngineRankParallelism(const EngineSpec& engine, int rank, replica::EngineDialect dialect) {
  replica::RankParallelism r = replica::RankParallelism::ForTp(engine.tp, rank, engine.ep);
  const int dp = std::max(engine.dp_attention, 1);
  if (dp > 1 && engine.tp % dp == 0) {
    r.attn_tp_size = engine.tp / dp;
    r.attn_tp_rank = rank % r.attn_tp_size;
    r.attn_dp_size = dp;
    r.attn_dp_rank = rank / r.attn_tp_size;
  }
  r.dialect = dialect;
  return r;
}

int TrainerStageOf(const replica::ModelConfig& config, const std::string& hf_name, int pp) {
  if (pp <= 1) return 0;
  const int64_t layer = replica::LayerIndexOf(hf_name);
  if (layer < 0) return absl::StrContains(hf_name, "embed_tokens") ? 0 : pp - 1;
  const int64_t layers = std::max<int64_t>(config.num_layers, 1);
  for (int p = 0; p < pp; ++p)
    if (layer < (p + 1) * layers / pp) return p;
  return pp - 1;
}

absl::StatusOr<PlanInput> BuildModelInput(const replica::ModelConfig& config, const ClusterSpec& cluster,
                                          const ModelInputOptions& options) {
  WSYNC_RETURN_IF_ERROR(cluster.Validate());
  PlanInput in;
  in.cluster = cluster;
  WSYNC_ASSIGN_OR_RETURN(auto specs, replica::CheckpointTensors(config, options.format, options.quant.block_n,
                                                                options.quant.block_k));
  absl::flat_hash_map<std::string, int> index;
  for (const auto& s : specs) {
    HfTensorInfo h;
    h.name = s.name;
    h.bytes = s.bytes();
    h.stage = TrainerStageOf(config, s.name, cluster.trainer.pp);
    h.expert = absl::StrContains(s.name, ".mlp.experts.");
    // The trainer gathers its own dtype (bf16 weights) and quantizes afterwards: scales are not gathered.
    const bool scale = absl::EndsWith(s.name, "_scale_inv");
    if (!scale) {
      uint64_t numel = 1;
      for (int64_t d : s.shape) numel *= static_cast<uint64_t>(d);
      h.train_bytes = s.dtype == DType::kF8E4M3 ? numel * DTypeSize(config.dtype) : h.bytes;
    }
    index[h.name] = static_cast<int>(in.hf_tensors.size());
    in.hf_tensors.push_back(std::move(h));
  }
  in.layouts.resize(cluster.engine.tp);
  for (int r = 0; r < cluster.engine.tp; ++r) {
    const replica::RankParallelism rp = EngineRankParallelism(cluster.engine, r, options.dialect);
    auto plan = replica::PlanLayout(config, rp, options.quant);
    if (!plan.ok()) return Annotate(plan.status(), absl::StrCat("engine rank ", r));
    std::vector<std::set<int>> inputs(plan->table.params().size());
    for (const auto& src : plan->sources) {
      auto it = index.find(src.hf_name);
      // A trainer-format checkpoint has no `weight_scale_inv`: the source quantizes and computes the scales.
      if (it == index.end() && src.kind == replica::SliceSource::Kind::kFp8Scale) continue;
      if (it == index.end())
        return absl::InternalError(absl::StrCat("engine rank ", r, ": parameter ",
                                                plan->table.params()[src.param].name, " is loaded from ", src.hf_name,
                                                ", which the checkpoint does not list"));
      inputs[src.param].insert(it->second);
      if (src.scale_param >= 0) inputs[src.scale_param].insert(it->second);
    }
    LayoutInfo& layout = in.layouts[r];
    for (size_t p = 0; p < plan->table.params().size(); ++p) {
      const auto& ep = plan->table.params()[p];
      ParamInfo info;
      info.name = ep.name;
      info.bytes = ep.bytes;
      info.inputs.assign(inputs[p].begin(), inputs[p].end());
      if (info.inputs.empty())
        return absl::InternalError(absl::StrCat("engine rank ", r, ": parameter ", ep.name,
                                                " is loaded from no checkpoint tensor"));
      info.stage = in.hf_tensors[info.inputs.front()].stage;
      for (int i : info.inputs)
        if (in.hf_tensors[i].stage != info.stage)
          return absl::InvalidArgumentError(absl::StrCat("parameter ", ep.name, " is loaded from tensors of two trainer "
                                                         "PP stages (", in.hf_tensors[i].name, ")"));
      layout.params.push_back(std::move(info));
    }
  }
  WSYNC_RETURN_IF_ERROR(in.Validate());
  return in;
}

}  // namespace wsync::planner
