#include "planner/seed_table.h"

namespace wsync::planner {
namespace {

TrainerSpec Train(int tp, int pp, int cp, int ep, int etp, int nodes) {
  TrainerSpec t;
  t.tp = tp, t.pp = pp, t.cp = cp, t.ep = ep, t.etp = etp, t.nodes = nodes, t.gpus_per_node = 8;
  return t;
}

// The write-up gives tp/ep/nodes per engine; every engine node's 8 GPUs are used, so instances = nodes*8/tp.
EngineSpec Infer(int tp, int ep, int nodes) {
  EngineSpec e;
  e.tp = tp, e.ep = ep, e.nodes = nodes, e.instances = nodes * 8 / tp;
  return e;
}

}  // namespace

const std::vector<SeedRow>& SeedRows() {
  static const std::vector<SeedRow>* rows = new std::vector<SeedRow>{
      {"GLM4", "GLM-Z1-9B-0414", "THUDM__GLM-Z1-9B-0414", "9B", Train(2, 1, 2, 1, 1, 1), Infer(4, 1, 1), 0, 0,
       694.6, 707.1},
      {"DeepSeek-V2", "Moonlight-16B-A3B", "moonshotai__Moonlight-16B-A3B", "16B(3B)", Train(2, 1, 1, 8, 1, 1),
       Infer(8, 8, 1), 0, 0, 1482.0, 1073.3},
      {"GLM4-MoE", "GLM-4.7-Flash", "zai-org__GLM-4.7-Flash", "30B(3B)", Train(4, 1, 1, 8, 1, 1), Infer(4, 4, 1), 0,
       0, 2508.6, 4229.0},
      {"Qwen3-MoE", "Qwen3-30B-A3B", "Qwen__Qwen3-30B-A3B", "30B(3B)", Train(4, 1, 1, 8, 1, 2), Infer(8, 8, 2), 0, 0,
       2670.0, 2160.2},
      {"GLM4-MoE", "GLM-4.5-Air", "zai-org__GLM-4.5-Air", "106B(12B)", Train(1, 4, 1, 8, 1, 4), Infer(8, 8, 4), 0, 0,
       5001.1, 2637.2},
      {"Qwen3-MoE", "Qwen3-235B-A22B", "Qwen__Qwen3-235B-A22B", "235B(22B)", Train(4, 4, 2, 16, 1, 8),
       Infer(32, 32, 8), 0, 0, 10753.6, 3162.0},
      {"DeepSeek-V3p2", "GLM-5", "zai-org__GLM-5", "744B(40B)", Train(4, 8, 2, 16, 1, 16), Infer(64, 64, 16), 0, 0,
       58301.5, 8479.7},
      {"DeepSeek-V3", "Kimi-K2 (fp8, 64-block)", "moonshotai__Kimi-K2-Instruct", "1T(64B)", Train(8, 8, 4, 32, 1, 32),
       Infer(32, 32, 32), 64, 884.0, 53279.1, 7227.3},
  };
  return *rows;
}

NicSpec SeedNic() {
  NicSpec n;
  n.per_node = 8;
  n.gbps = 400.0;
  return n;
}

}  // namespace wsync::planner
