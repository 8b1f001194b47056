#include "synthetic.h"

#include "absl/strings/str_cat.h"

namespace wsync::planner::testing {

PlanInput MakeInput(const SyntheticShape& s) {
  PlanInput in;
  in.cluster.trainer.nodes = s.train_nodes;
  in.cluster.trainer.gpus_per_node = s.gpus_per_node;
  in.cluster.trainer.pp = s.pp;
  in.cluster.engine.instances = s.instances;
  in.cluster.engine.tp = s.engine_tp;
  in.cluster.engine.ep = 1;
  in.cluster.engine.nodes = s.engine_nodes;
  in.cluster.nic.per_node = s.nics;
  in.cluster.nic.gbps = 400;
  in.layouts.resize(s.engine_tp);
  for (int p = 0; p < s.pp; ++p) {
    for (int k = 0; k < s.params_per_stage; ++k) {
      std::vector<int> inputs;
      for (int i = 0; i < s.inputs_per_param; ++i) {
        HfTensorInfo h;
        h.name = absl::StrCat("stage", p, ".t", k, ".", i);
        h.bytes = s.param_bytes * (1 + (k * 7 + i) % 4);
        h.train_bytes = h.bytes * 2;
        h.expert = (k % 2) == 1;
        h.stage = p;
        in.hf_tensors.push_back(h);
        inputs.push_back(static_cast<int>(in.hf_tensors.size()) - 1);
      }
      for (int r = 0; r < s.engine_tp; ++r) {
        ParamInfo pi;
        pi.name = absl::StrCat("stage", p, ".p", k);
        pi.bytes = s.param_bytes * (1 + (k * 5 + p) % 4) + 4096 * (k % 3);
        pi.stage = p;
        pi.inputs = inputs;
        in.layouts[r].params.push_back(pi);
      }
    }
  }
  return in;
}

std::vector<SyntheticShape> CoverageShapes() {
  std::vector<SyntheticShape> v;
  SyntheticShape a;  // 8 sources, 8 targets
  v.push_back(a);
  SyntheticShape b = a;  // 32 sources per stage (pp=4, 16 nodes) -> 2 x 16 targets (the write-up's example)
  b.train_nodes = 16, b.pp = 4, b.instances = 2, b.engine_tp = 16, b.engine_nodes = 4;
  v.push_back(b);
  SyntheticShape c = a;  // 64 sources, 1 x 4 targets
  c.train_nodes = 8, c.engine_tp = 4;
  v.push_back(c);
  SyntheticShape d = a;  // 24 sources, 32 targets, 4 NICs per 8 GPUs
  d.train_nodes = 3, d.engine_tp = 32, d.engine_nodes = 4, d.nics = 4;
  v.push_back(d);
  SyntheticShape e = a;  // 12 sources per stage (pp=2, 3 nodes), 3 instances x 8
  e.train_nodes = 3, e.pp = 2, e.instances = 3, e.engine_nodes = 3;
  v.push_back(e);
  return v;
}

}  // namespace wsync::planner::testing
