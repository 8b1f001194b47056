// The coordinator's re-plan with speculative drafts (docs/engines.md, "Speculative drafts"): an engine whose ranks
// report a draft segment gets the draft's parameters planned as more targets of the same ranks, every byte of them
// written, and its sources' trainer ranks push the checkpoint's MTP layer; an engine without a draft of the same
// model gets neither. Refused before any write: a draft for a model without a next-n layer, a draft parameter in a
// target segment (or the reverse), ranks of one engine that disagree about having a draft.

#include <catch2/catch.hpp>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "daemon/coordinator/replan.h"
#include "replica/layout_plan.h"
#include "replica/model_config.h"
#include "replica/param_table.h"

namespace wsync::daemon {
namespace {

std::string Read(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// One reference engine of `tp` ranks: each rank's table in segment 0, its draft's (with `draft`) in segment 1 typed
// WEIGHT_SET_DRAFT, as a real engine reports them.
v1::EngineRegistration Engine(const std::string& config_json, const std::string& id, int tp, bool draft,
                              const std::string& kind = "reference") {
  auto cfg = replica::ModelConfig::FromJson(config_json);
  REQUIRE(cfg.ok());
  v1::EngineRegistration e;
  e.set_engine_id(id);
  e.set_control_address(id + ":2");
  e.set_kind(kind);
  for (int r = 0; r < tp; ++r) {
    replica::RankParallelism rp = replica::RankParallelism::ForTp(tp, r);
    rp.dialect = *replica::DialectForEngineKind(kind);
    rp.weights = draft ? replica::WeightSet::kAll : replica::WeightSet::kTarget;
    auto table = replica::BuildParamTable(*cfg, rp, replica::QuantSpec());
    REQUIRE(table.ok());
    CHECK((table->first_draft() >= 0) == draft);
    v1::RankLayout* l = e.add_ranks();
    l->set_rank(r);
    l->mutable_parallelism()->set_tp_size(tp);
    l->mutable_parallelism()->set_tp_rank(r);
    l->mutable_parallelism()->set_moe_tp_size(tp);
    l->mutable_parallelism()->set_moe_tp_rank(r);
    l->mutable_parallelism()->set_attn_tp_size(tp);
    l->mutable_parallelism()->set_attn_tp_rank(r);
    for (int s = 0; s < (draft ? 2 : 1); ++s) {
      auto* seg = l->add_segments();
      seg->set_id(s);
      seg->set_kind("host");
      seg->set_bytes(table->total_bytes());
      if (s == 1) seg->set_weights(v1::WEIGHT_SET_DRAFT);
    }
    for (size_t p = 0; p < table->params().size(); ++p) {
      auto* d = l->add_params();
      d->set_name(table->params()[p].name);
      d->set_bytes(table->params()[p].bytes);
      d->set_offset(table->params()[p].offset);
      d->set_segment(table->IsDraft(p) ? 1 : 0);
    }
  }
  return e;
}

struct Members {
  std::map<std::string, v1::RegisterNodeRequest> nodes;
  std::set<std::string> drained_engines, drained_nodes;
  ReplanInput Input(const std::string& config) {
    ReplanInput in;
    in.nodes = &nodes;
    in.drained_engines = &drained_engines;
    in.drained_nodes = &drained_nodes;
    in.membership_epoch = 1;
    in.model_config_json = config;
    in.options.min_source_bytes = 0;
    return in;
  }
  void AddSource(const std::string& id) {
    v1::RegisterNodeRequest r;
    r.set_node_id(id);
    r.set_role("source");
    r.set_address(id + ":1");
    r.set_trainer_ranks(2);
    nodes[id] = r;
  }
  v1::EngineRegistration* AddTarget(const std::string& id, v1::EngineRegistration e) {
    v1::RegisterNodeRequest r;
    r.set_node_id(id);
    r.set_role("target");
    r.set_address(id + ":1");
    *r.add_engines() = std::move(e);
    nodes[id] = r;
    return nodes[id].mutable_engines(0);
  }
};

TEST_CASE("replan: a draft's parameters are targets of its engine's ranks; the trainer pushes the MTP layer") {
  const std::string config = Read(WSYNC_TINY_MTP_MODEL);
  auto cfg = replica::ModelConfig::FromJson(config);
  REQUIRE(cfg.ok());
  Members m;
  m.AddSource("train0");
  m.AddSource("train1");
  m.AddTarget("infer0", Engine(config, "drafted", 2, true));
  m.AddTarget("infer1", Engine(config, "plain", 2, false));
  auto r = PlanMembership(m.Input(config));
  INFO((r.ok() ? "" : r.status().ToString()));
  REQUIRE(r.ok());
  CHECK(r->groups.size() == 2);  // engines with and without a draft have different layouts
  CHECK(r->groups.count("sglang tp=2 ep=1 dp=1 +draft") == 1);

  // Bytes written per (engine, rank, parameter), over every source writing to it.
  std::map<std::tuple<std::string, int, std::string>, uint64_t> written;
  for (const auto& p : r->plan)
    for (const auto& w : p.assignment->writes())
      written[{p.assignment->engine_id(), p.assignment->rank(), w.param()}] += w.length();
  const auto& regs = m.nodes;
  for (const auto& [node, reg] : regs)
    for (const auto& e : reg.engines())
      for (const auto& rank : e.ranks()) {
        std::set<int> draft_segments;
        for (const auto& s : rank.segments())
          if (s.weights() == v1::WEIGHT_SET_DRAFT) draft_segments.insert(s.id());
        int drafted = 0;
        for (const auto& p : rank.params()) {
          INFO(e.engine_id() << " rank " << rank.rank() << " " << p.name());
          CHECK(written[{e.engine_id(), rank.rank(), p.name()}] == p.bytes());  // every byte, draft ones included
          drafted += draft_segments.count(p.segment()) > 0;
        }
        CHECK((drafted > 10) == (e.engine_id() == "drafted"));
      }

  // The push lists: the checkpoint's MTP layer (less its embed_tokens and shared_head.head, which the draft does not
  // load), each tensor once per node (each node's replica loads what its targets need).
  const std::string mtp = absl::StrCat("model.layers.", cfg->num_layers, ".");
  std::set<std::string> mtp_pushed;
  for (const auto& [node, filters] : r->push_filters) {
    std::multiset<std::string> pushed;
    for (const auto& f : filters)
      for (const auto& n : f.tensor_names()) pushed.insert(n);
    for (const auto& n : pushed) {
      CHECK(pushed.count(n) == 1);
      if (absl::StartsWith(n, mtp)) mtp_pushed.insert(n);
    }
  }
  auto draft_tensors =
      replica::CheckpointTensors(*cfg, replica::CheckpointFormat::kTrainer, 128, 128, replica::WeightSet::kDraft);
  REQUIRE(draft_tensors.ok());
  std::set<std::string> want;
  for (const auto& t : *draft_tensors) want.insert(t.name);
  CHECK(mtp_pushed == want);
  CHECK(mtp_pushed.count(mtp + "eh_proj.weight") == 1);
  CHECK(mtp_pushed.count(mtp + "mlp.experts.7.down_proj.weight") == 1);
  CHECK(mtp_pushed.count(mtp + "embed_tokens.weight") == 0);
  CHECK(mtp_pushed.count(mtp + "shared_head.head.weight") == 0);

  // Without the drafted engine, nothing of the MTP layer is planned or pushed.
  m.drained_engines.insert("drafted");
  auto plain = PlanMembership(m.Input(config));
  REQUIRE(plain.ok());
  for (const auto& [node, filters] : plain->push_filters)
    for (const auto& f : filters)
      for (const auto& n : f.tensor_names()) CHECK_FALSE(absl::StartsWith(n, mtp));
}

// An EAGLE-3 draft of its own checkpoint (docs/engines.md, "vLLM's EAGLE-3 draft"): the vLLM engine reports the
// draft's config in the target's (speculative_draft); its parameters (draft.-prefixed) are written like any other
// and the trainer pushes the draft's tensors under draft. + their checkpoint names, t2d not.
TEST_CASE("replan: an EAGLE-3 draft of its own checkpoint is planned and pushed under draft.") {
  std::string path = WSYNC_TINY_MTP_MODEL;
  path = path.substr(0, path.rfind('/')) + "/qwen3-tiny.json";
  nlohmann::json c = nlohmann::json::parse(Read(path));
  c["speculative_draft"] = {
      {"method", "eagle3"},
      {"config",
       {{"architectures", {"LlamaForCausalLMEagle3"}}, {"hidden_size", 64}, {"head_dim", 16},
        {"intermediate_size", 128}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
        {"num_hidden_layers", 1}, {"vocab_size", 500}, {"draft_vocab_size", 200}}},
      {"own_embed_tokens", false},
      {"own_lm_head", true}};
  const std::string config = c.dump();
  Members m;
  m.AddSource("train0");
  m.AddSource("train1");
  m.AddTarget("infer0", Engine(config, "eagle", 2, true, "vllm"));
  auto r = PlanMembership(m.Input(config));
  INFO((r.ok() ? "" : r.status().ToString()));
  REQUIRE(r.ok());
  CHECK(r->groups.count("vllm tp=2 ep=1 dp=1 +draft") == 1);
  std::map<std::pair<int, std::string>, uint64_t> written;
  for (const auto& p : r->plan)
    for (const auto& w : p.assignment->writes()) written[{p.assignment->rank(), w.param()}] += w.length();
  int drafted = 0;
  for (const auto& rank : m.nodes["infer0"].engines(0).ranks())
    for (const auto& p : rank.params()) {
      INFO("rank " << rank.rank() << " " << p.name());
      CHECK(written[{rank.rank(), p.name()}] == p.bytes());
      drafted += p.segment() == 1;
    }
  CHECK(drafted == 2 * 11);  // qkv, o, gate_up, down, 3 norms, fc, norm, lm_head, draft_id_to_target_id per rank
  std::set<std::string> pushed;
  for (const auto& [node, filters] : r->push_filters)
    for (const auto& f : filters)
      for (const auto& n : f.tensor_names())
        if (absl::StartsWith(n, "draft.")) pushed.insert(n);
  auto cfg = replica::ModelConfig::FromJson(config);
  REQUIRE(cfg.ok());
  auto draft_tensors =
      replica::CheckpointTensors(*cfg, replica::CheckpointFormat::kTrainer, 128, 128, replica::WeightSet::kDraft);
  REQUIRE(draft_tensors.ok());
  std::set<std::string> want;
  for (const auto& t : *draft_tensors) want.insert(t.name);
  CHECK(pushed == want);
  CHECK(pushed.count("draft.midlayer.self_attn.q_proj.weight") == 1);
  CHECK(pushed.count("draft.d2t") == 1);
  CHECK(pushed.count("draft.t2d") == 0);
  CHECK(pushed.count("draft.embed_tokens.weight") == 0);  // the engine shares the target's
}

TEST_CASE("replan: drafts that cannot be planned are refused, naming the engine") {
  const std::string config = Read(WSYNC_TINY_MTP_MODEL);
  Members m;
  m.AddSource("train0");
  SECTION("a draft for a model without a next-n layer") {
    const std::string no_mtp = Read(WSYNC_TINY_MLA_MODEL);
    v1::EngineRegistration e = Engine(no_mtp, "e0", 2, false);
    for (auto& rank : *e.mutable_ranks()) {  // declares a draft segment (empty)
      auto* seg = rank.add_segments();
      seg->set_id(1);
      seg->set_kind("host");
      seg->set_bytes(64);
      seg->set_weights(v1::WEIGHT_SET_DRAFT);
    }
    m.AddTarget("infer0", e);
    auto r = PlanMembership(m.Input(no_mtp));
    REQUIRE(!r.ok());
    CHECK(r.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(absl::StrContains(r.status().message(), "engine e0 declares a speculative draft"));
    CHECK(absl::StrContains(r.status().message(), "declares no next-n / MTP layer"));
  }
  SECTION("a draft parameter in a target segment") {
    v1::EngineRegistration e = Engine(config, "e0", 2, true);
    for (auto& p : *e.mutable_ranks(1)->mutable_params())
      if (p.name() == "model.eh_proj.weight") p.set_segment(0);
    m.AddTarget("infer0", e);
    auto r = PlanMembership(m.Input(config));
    REQUIRE(!r.ok());
    CHECK(r.status().message() ==
          "draft of engine e0 rank 1: parameter model.eh_proj.weight is the draft's but lies in segment 0, a target "
          "segment");
  }
  SECTION("a draft parameter missing") {
    v1::EngineRegistration e = Engine(config, "e0", 2, true);
    auto* params = e.mutable_ranks(0)->mutable_params();
    params->RemoveLast();  // model.shared_head.norm.weight, the draft's last
    m.AddTarget("infer0", e);
    auto r = PlanMembership(m.Input(config));
    REQUIRE(!r.ok());
    CHECK(r.status().message() == "draft of engine e0 rank 0 lacks parameter model.shared_head.norm.weight");
  }
  SECTION("ranks that disagree") {
    v1::EngineRegistration e = Engine(config, "e0", 2, true);
    *e.mutable_ranks(1) = Engine(config, "e0", 2, false).ranks(1);
    m.AddTarget("infer0", e);
    auto r = PlanMembership(m.Input(config));
    REQUIRE(!r.ok());
    CHECK(absl::StrContains(r.status().message(), "engine e0 rank 1 lacks a draft segment that rank 0 has"));
  }
}

}  // namespace
}  // namespace wsync::daemon
