// WeightSet::kAll (an engine rank's target and its next-n draft in one table, docs/engines.md "Speculative drafts"):
// the target's table followed by the draft's, unchanged; the checkpoint tensors of both; one push fills both, byte
// for byte what the separate target and draft layouts hold (the layouts replica_sglang_oracle_test compares with
// SGLang's own classes).

#include <catch2/catch.hpp>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "replica/layout_plan.h"
#include "replica/param_table.h"
#include "replica/replica.h"

namespace wsync::replica {
namespace {

ModelConfig MtpConfig() {
  auto cfg = ModelConfig::FromFile(std::string(WSYNC_MODELS_DIR) + "/../tiny/deepseek-v3-mtp-tiny.json");
  REQUIRE(cfg.ok());
  REQUIRE(cfg->num_nextn_predict_layers == 1);
  return *cfg;
}

RankParallelism Rank(int tp, int rank, int ep, WeightSet w) {
  RankParallelism r = RankParallelism::ForTp(tp, rank, ep);
  r.weights = w;
  return r;
}

TEST_CASE("draft: a kAll table is the target's table followed by the draft's") {
  const ModelConfig cfg = MtpConfig();
  for (int rank = 0; rank < 2; ++rank) {
    auto target = BuildParamTable(cfg, Rank(2, rank, 2, WeightSet::kTarget), QuantSpec());
    auto draft = BuildParamTable(cfg, Rank(2, rank, 2, WeightSet::kDraft), QuantSpec());
    auto all = BuildParamTable(cfg, Rank(2, rank, 2, WeightSet::kAll), QuantSpec());
    REQUIRE(target.ok());
    REQUIRE(draft.ok());
    REQUIRE(all.ok());
    CHECK(target->first_draft() == -1);
    CHECK(draft->first_draft() == 0);
    REQUIRE(all->first_draft() == static_cast<int>(target->params().size()));
    REQUIRE(all->params().size() == target->params().size() + draft->params().size());
    for (size_t i = 0; i < all->params().size(); ++i) {
      const bool d = i >= target->params().size();
      const EngineParam& want = d ? draft->params()[i - target->params().size()] : target->params()[i];
      const EngineParam& have = all->params()[i];
      INFO(have.name);
      CHECK(all->IsDraft(i) == d);
      CHECK(have.name == want.name);
      CHECK(have.dtype == want.dtype);
      CHECK(have.shape == want.shape);
      CHECK(have.bytes == want.bytes);
    }
  }
  // A model without a next-n layer has no draft to plan.
  ModelConfig plain = cfg;
  plain.num_nextn_predict_layers = 0;
  auto none = BuildParamTable(plain, Rank(2, 0, 2, WeightSet::kAll), QuantSpec());
  REQUIRE(!none.ok());
  CHECK(none.status().message().find("has no draft to update") != std::string::npos);
}

TEST_CASE("draft: one push fills a kAll layout's target and draft as the separate layouts") {
  const ModelConfig cfg = MtpConfig();
  auto all_specs = CheckpointTensors(cfg, CheckpointFormat::kTrainer, 128, 128, WeightSet::kAll);
  auto target_specs = CheckpointTensors(cfg, CheckpointFormat::kTrainer, 128, 128, WeightSet::kTarget);
  auto draft_specs = CheckpointTensors(cfg, CheckpointFormat::kTrainer, 128, 128, WeightSet::kDraft);
  REQUIRE(all_specs.ok());
  REQUIRE(target_specs.ok());
  REQUIRE(draft_specs.ok());
  std::set<std::string> all_names, parts;
  for (const auto& s : *all_specs) all_names.insert(s.name);
  for (const auto& s : *target_specs) parts.insert(s.name);
  for (const auto& s : *draft_specs) CHECK(parts.insert(s.name).second);  // disjoint
  CHECK(all_names == parts);

  const RankParallelism all = Rank(2, 1, 2, WeightSet::kAll);
  auto joint = Replica::Create(cfg, {all}, QuantSpec());
  auto apart = Replica::Create(cfg, {Rank(2, 1, 2, WeightSet::kTarget), Rank(2, 1, 2, WeightSet::kDraft)}, QuantSpec());
  REQUIRE(joint.ok());
  REQUIRE(apart.ok());
  (*joint)->BeginUpdate();
  (*apart)->BeginUpdate();
  const std::string mtp = absl::StrCat("model.layers.", cfg.num_layers, ".");
  int mtp_needed = 0;
  for (const auto& s : *all_specs) {
    INFO(s.name);
    CHECK((*joint)->Needs(s.name) == (*apart)->Needs(s.name));  // rank 1 of ep 2: experts 4..7 of each MoE layer
    mtp_needed += s.name.rfind(mtp, 0) == 0 && (*joint)->Needs(s.name);
    std::vector<uint8_t> data(s.bytes());
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7 + s.name.size() * 13 + (i >> 8));
    HfTensor t;
    t.name = s.name;
    t.dtype = s.dtype;
    t.shape = s.shape;
    t.data = data.data();
    t.bytes = data.size();
    REQUIRE((*joint)->Ingest(t).ok());
    REQUIRE((*apart)->Ingest(t).ok());
  }
  CHECK(mtp_needed > 10);
  REQUIRE((*joint)->FinishUpdate().ok());
  REQUIRE((*apart)->FinishUpdate().ok());
  const ParamTable& table = (*joint)->table(0);
  const int first = table.first_draft();
  for (size_t i = 0; i < table.params().size(); ++i) {
    const EngineParam& p = table.params()[i];
    const int from = table.IsDraft(i) ? 1 : 0;
    const EngineParam* q = (*apart)->table(from).Find(p.name);
    INFO(p.name);
    REQUIRE(q != nullptr);
    CHECK(static_cast<int>(i) - (from ? first : 0) == (*apart)->table(from).IndexOf(p.name));
    CHECK(std::memcmp((*joint)->data(0) + p.offset, (*apart)->data(from) + q->offset, p.bytes) == 0);
  }
  // The layer's embed_tokens and shared_head.head are accepted and dropped (the draft serves the target's).
  for (const char* shared : {"embed_tokens.weight", "shared_head.head.weight"}) {
    std::vector<uint8_t> data(static_cast<size_t>(cfg.vocab_size * cfg.hidden_size) * 2, 1);
    HfTensor t;
    const std::string name = mtp + shared;
    const std::vector<int64_t> shape = {cfg.vocab_size, cfg.hidden_size};
    t.name = name;
    t.dtype = DType::kBF16;
    t.shape = shape;
    t.data = data.data();
    t.bytes = data.size();
    auto r = (*joint)->Ingest(t);
    INFO(name << ": " << r.status().ToString());
    CHECK(r.ok());
    CHECK_FALSE((*joint)->Needs(name));
  }
}

}  // namespace
}  // namespace wsync::replica
