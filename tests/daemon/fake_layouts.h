#pragma once
// For coordinator tests against fake peers: a real (tiny) model config and the layouts a real engine serving it
// would report, so the coordinator's planner works on real parameter tables.

#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>
#include <string>

#include "replica/param_table.h"
#include "wsync/v1/common.pb.h"
#include "wsync/v1/coordinator.pb.h"

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

// A source node's registration: `id` at address "<id>:1".
inline v1::RegisterNodeRequest SourceRegistration(const std::string& id, int trainer_ranks = 1, int pp_stage = 0) {
  v1::RegisterNodeRequest r;
  r.set_node_id(id);
  r.set_role("source");
  r.set_address(id + ":1");
  r.set_trainer_ranks(trainer_ranks);
  r.set_pp_stage(pp_stage);
  return r;
}

// A target node's registration (address "<id>:1") serving one reference engine of `ranks` TP ranks (control address
// "<engine>:2"), each with its FillLayout table.
inline v1::RegisterNodeRequest TargetRegistration(const std::string& id, const std::string& engine, int ranks) {
  v1::RegisterNodeRequest r;
  r.set_node_id(id);
  r.set_role("target");
  r.set_address(id + ":1");
  auto* e = r.add_engines();
  e->set_engine_id(engine);
  e->set_control_address(engine + ":2");
  e->set_kind("reference");
  for (int i = 0; i < ranks; ++i) FillLayout(e->add_ranks(), ranks, i);
  return r;
}

}  // namespace wsync::testing
