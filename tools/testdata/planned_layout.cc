#include "tools/testdata/planned_layout.h"

#include <string>
#include <utility>

#include "base/dtype.h"

namespace wsync::testdata {

absl::StatusOr<v1::RankLayout> PlannedRankLayout(const replica::ModelConfig& cfg, const replica::RankParallelism& par,
                                                 const replica::QuantSpec& quant) {
  auto plan = replica::PlanLayout(cfg, par, quant);
  if (!plan.ok()) return plan.status();
  v1::RankLayout l;
  l.set_rank(par.tp_rank);
  auto* p = l.mutable_parallelism();
  p->set_tp_size(par.tp_size), p->set_tp_rank(par.tp_rank), p->set_ep_size(par.ep_size), p->set_ep_rank(par.ep_rank);
  p->set_moe_tp_size(par.moe_tp_size), p->set_moe_tp_rank(par.moe_tp_rank);
  p->set_attn_tp_size(par.attn_tp_size), p->set_attn_tp_rank(par.attn_tp_rank);
  p->set_pp_size(1), p->set_attn_dp_size(1);
  for (const auto& ep : plan->table.params()) {
    auto* d = l.add_params();
    d->set_name(ep.name);
    d->set_dtype(std::string(DTypeName(ep.dtype)));
    for (int64_t s : ep.shape) d->add_shape(s);
    d->set_bytes(ep.bytes);
    d->set_offset(ep.offset);
    d->set_segment(0);
  }
  l.set_region_bytes(plan->table.total_bytes());
  if (quant.mode == replica::QuantSpec::Mode::kFp8Block) {  // reported, as an engine holding FP8 blocks does
    l.mutable_quantization()->set_method("fp8_block");
    l.mutable_quantization()->add_block_size(quant.block_n);
    l.mutable_quantization()->add_block_size(quant.block_k);
    if (quant.ue8m0) l.mutable_quantization()->set_scale_format("ue8m0");
  }
  return l;
}

}  // namespace wsync::testdata
