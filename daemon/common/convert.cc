#include "daemon/common/convert.h"

namespace wsync::daemon {

replica::RankParallelism FromProto(const v1::RankParallelism& p) {
  replica::RankParallelism r;
  // Zero means "not set" in proto3; sizes default to 1.
  auto size = [](int v) { return v > 0 ? v : 1; };
  r.tp_size = size(p.tp_size());
  r.tp_rank = p.tp_rank();
  r.pp_size = size(p.pp_size());
  r.pp_rank = p.pp_rank();
  r.ep_size = size(p.ep_size());
  r.ep_rank = p.ep_rank();
  r.moe_tp_size = p.moe_tp_size() > 0 ? p.moe_tp_size() : r.tp_size / r.ep_size;
  r.moe_tp_rank = p.moe_tp_size() > 0 ? p.moe_tp_rank() : r.tp_rank % r.moe_tp_size;
  r.attn_tp_size = p.attn_tp_size() > 0 ? p.attn_tp_size() : r.tp_size;
  r.attn_tp_rank = p.attn_tp_size() > 0 ? p.attn_tp_rank() : r.tp_rank;
  r.attn_dp_size = size(p.attn_dp_size());
  r.attn_dp_rank = p.attn_dp_rank();
  return r;
}

v1::RankParallelism ToProto(const replica::RankParallelism& r) {
  v1::RankParallelism p;
  p.set_tp_size(r.tp_size);
  p.set_tp_rank(r.tp_rank);
  p.set_pp_size(r.pp_size);
  p.set_pp_rank(r.pp_rank);
  p.set_ep_size(r.ep_size);
  p.set_ep_rank(r.ep_rank);
  p.set_moe_tp_size(r.moe_tp_size);
  p.set_moe_tp_rank(r.moe_tp_rank);
  p.set_attn_tp_size(r.attn_tp_size);
  p.set_attn_tp_rank(r.attn_tp_rank);
  p.set_attn_dp_size(r.attn_dp_size);
  p.set_attn_dp_rank(r.attn_dp_rank);
  return p;
}

replica::WeightSet WeightSetOfLayout(const v1::RankLayout& layout) {
  for (const auto& s : layout.segments())
    if (s.weights() == v1::WEIGHT_SET_DRAFT) return replica::WeightSet::kAll;
  return replica::WeightSet::kTarget;
}

}  // namespace wsync::daemon
