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

}  // namespace wsync::planner::testing
