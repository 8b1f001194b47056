#pragma once
// For coordinator tests against fake peers: a real (tiny) model config and the layouts a real engine serving it
// would report, so the coordinator's planner works on real parameter tables.

#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>
#include <string>

#include "replica/param_table.h"
#include "wsync/v1/common.pb.h"

namespace wsync::testing {

inline std::string TinyConfigJson() {
  std::ifstream f(std::string(WSYNC_MODELS_DIR) + "/tiny-qwen3/config.json");
  REQUIRE(f.good());
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Engine rank `rank` of a TP=`ranks` engine: the replica's table for that parallelism, as the engine reports it.
inline void FillLayout(v1::RankLayout* l, int ranks, int rank) {
  auto cfg = replica::ModelConfig::FromJson(TinyConfigJson());
  REQUIRE(cfg.ok());
  auto table = replica::BuildParamTable(*cfg, replica::RankParallelism::ForTp(ranks, rank), replica::QuantSpec());
  REQUIRE(table.ok());
  l->set_rank(rank);
  l->mutable_parallelism()->set_tp_size(ranks);
  l->mutable_parallelism()->set_tp_rank(rank);
  for (const auto& p : table->params()) {
    auto* d = l->add_params();
    d->set_name(p.name);
    d->set_bytes(p.bytes);
    d->set_offset(p.offset);
  }
}

}  // namespace wsync::testing
