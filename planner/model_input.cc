#include "planner/model_input.h"

#include <algorithm>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
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

namespace {

// Megatron's sharding of an HF tensor (docs/planner.md, "Trainer shards"): column-parallel linears and the
// vocabulary split rows, row-parallel linears split columns, everything else (norms, router, MLA down-projections)
// is replicated. FP8 block scales follow their weight.
void SetTrainerSplit(const replica::ModelConfig& config, const TrainerSpec& trainer, HfTensorInfo* h) {
  absl::string_view n = h->name;
  absl::ConsumeSuffix(&n, "_scale_inv");
  if (absl::StrContains(n, "embed_tokens") || absl::StartsWith(n, "lm_head")) {
    h->split = TrainerSplit::kRows;
    h->split_align = 128;
    return;
  }
  const size_t e = n.find(".mlp.experts.");
  if (e != absl::string_view::npos) {
    absl::string_view rest = n.substr(e + 13);
    int id = 0;
    if (absl::SimpleAtoi(rest.substr(0, rest.find('.')), &id)) h->expert_id = id;
  }
  auto ends = [&](absl::string_view proj) {
    return absl::EndsWith(n, absl::StrCat(".", proj, ".weight")) || absl::EndsWith(n, absl::StrCat(".", proj, ".bias"));
  };
  if (ends("k_proj") || ends("v_proj")) {
    // Megatron needs query groups divisible by TP; fewer KV heads than ranks would be replicated.
    h->split = config.num_kv_heads >= trainer.tp ? TrainerSplit::kRows : TrainerSplit::kReplicated;
  } else if (ends("q_proj") || ends("q_b_proj") || ends("kv_b_proj") || ends("gate_proj") || ends("up_proj")) {
    h->split = TrainerSplit::kRows;
  } else if (ends("gate_up_proj")) {
    h->split = TrainerSplit::kRows;
    h->split_parts = 2;
  } else if (ends("o_proj") || ends("down_proj")) {
    h->split = TrainerSplit::kCols;
  }
}

}  // namespace

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
                                                                options.quant.block_k, options.weights));
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
    // The replica's 2-D view: [rows, cols] row-major, a 1-D tensor [n, 1], a scalar [1, 1].
    h.rows = 1;
    h.cols = s.shape.size() >= 2 ? s.shape.back() : 1;
    for (size_t d = 0; d + (s.shape.size() >= 2 ? 1 : 0) < s.shape.size(); ++d) h.rows *= s.shape[d];
    SetTrainerSplit(config, cluster.trainer, &h);
    index[h.name] = static_cast<int>(in.hf_tensors.size());
    in.hf_tensors.push_back(std::move(h));
  }
  in.layouts.resize(cluster.engine.tp);
  for (int r = 0; r < cluster.engine.tp; ++r) {
    replica::RankParallelism rp = EngineRankParallelism(cluster.engine, r, options.dialect);
    rp.weights = options.weights;
    auto plan = replica::PlanLayout(config, rp, options.quant);
    if (!plan.ok()) return Annotate(plan.status(), absl::StrCat("engine rank ", r));
    std::vector<std::set<int>> inputs(plan->table.params().size());
    std::vector<std::vector<Need>> needs(plan->table.params().size());
    auto add_need = [&](int param, int hf, const Box& b) {
      for (const Need& x : needs[param])
        if (x.hf == hf && x.box == b) return;
      needs[param].push_back({hf, b});
    };
    for (const auto& src : plan->sources) {
      auto it = index.find(src.hf_name);
      if (it != index.end()) {
        Box b{src.src_row0, src.rows, src.src_col0, src.cols};
        if (src.kind == replica::SliceSource::Kind::kConstant) {
          // Filled when its tensor arrives, not from its bytes: it reads what this rank reads of that tensor.
          b = {};
          for (const auto& o : plan->sources)
            if (o.hf_name == src.hf_name && o.kind != replica::SliceSource::Kind::kConstant)
              b = {o.src_row0, o.rows, o.src_col0, o.cols};
        }
        add_need(src.param, it->second, b);
        if (src.scale_param >= 0) add_need(src.scale_param, it->second, b);
      }
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
      info.needs = std::move(needs[p]);
      info.draft = plan->first_draft >= 0 && static_cast<int>(p) >= plan->first_draft;
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
  in.num_experts = static_cast<int>(config.num_experts);
  WSYNC_RETURN_IF_ERROR(in.Validate());
  return in;
}

}  // namespace wsync::planner
