// The coordinator's plan and lifecycle against fake peers (no servers): which engine calls happen in which order,
// what a failure leaves behind, and how the seed plan places targets.

#include <catch2/catch.hpp>

#include <map>
#include <mutex>
#include <set>

#include "daemon/coordinator.h"

namespace wsync::daemon {
namespace {

class FakePeers : public Peers {
 public:
  absl::StatusOr<v1::ConfigureSourceReply> ConfigureSource(const std::string& addr,
                                                          const v1::ConfigureSourceRequest& req) override {
    std::lock_guard<std::mutex> l(mu);
    configured[addr] = req;
    return v1::ConfigureSourceReply();
  }
  absl::Status StartUpdate(const std::string& addr, const v1::StartUpdateRequest& req) override {
    Log("start " + addr);
    return absl::OkStatus();
  }
  absl::StatusOr<v1::FinishUpdateReply> FinishUpdate(const std::string& addr,
                                                     const v1::FinishUpdateRequest& req) override {
    Log("finish " + addr);
    if (fail_finish) return absl::DataLossError("write to engine e1 rank 0 failed");
    v1::FinishUpdateReply r;
    r.set_bytes_written(100);
    return r;
  }
  absl::StatusOr<v1::EngineInfo> EngineInfo(const std::string& addr) override {
    v1::EngineInfo i;
    i.set_model_config_json("{}");
    return i;
  }
  absl::Status Pause(const std::string& addr, const std::string& mode) override { return Log("pause " + addr); }
  absl::Status PostProcess(const std::string& addr, const std::string& v) override {
    return Log("post_process " + addr + " " + v);
  }
  absl::Status SetWeightVersion(const std::string& addr, const std::string& v) override {
    return Log("set_version " + addr + " " + v);
  }
  absl::Status Continue(const std::string& addr) override { return Log("continue " + addr); }

  absl::Status Log(const std::string& s) {
    std::lock_guard<std::mutex> l(mu);
    calls.push_back(s);
    return absl::OkStatus();
  }
  int Count(const std::string& prefix) {
    std::lock_guard<std::mutex> l(mu);
    int n = 0;
    for (const auto& c : calls) n += c.rfind(prefix, 0) == 0;
    return n;
  }

  std::mutex mu;
  std::vector<std::string> calls;
  std::map<std::string, v1::ConfigureSourceRequest> configured;
  bool fail_finish = false;
};

v1::RegisterNodeRequest Source(const std::string& id) {
  v1::RegisterNodeRequest r;
  r.set_node_id(id);
  r.set_role("source");
  r.set_address(id + ":1");
  r.set_trainer_ranks(1);
  return r;
}

v1::RegisterNodeRequest Target(const std::string& id, const std::string& engine, int ranks) {
  v1::RegisterNodeRequest r;
  r.set_node_id(id);
  r.set_role("target");
  r.set_address(id + ":1");
  auto* e = r.add_engines();
  e->set_engine_id(engine);
  e->set_control_address(engine + ":2");
  for (int i = 0; i < ranks; ++i) {
    auto* l = e->add_ranks();
    l->set_rank(i);
    auto* p = l->add_params();
    p->set_name("w");
    p->set_bytes(10);
  }
  return r;
}

struct Fixture {
  FakePeers* peers;
  std::unique_ptr<Coordinator> c;
  Fixture(int sources, int engines, int ranks) {
    auto p = std::make_unique<FakePeers>();
    peers = p.get();
    c = std::make_unique<Coordinator>(CoordinatorOptions(), std::move(p));
    for (int s = 0; s < sources; ++s) REQUIRE(c->RegisterNode(Source("s" + std::to_string(s))).ok());
    for (int e = 0; e < engines; ++e)
      REQUIRE(c->RegisterNode(Target("t" + std::to_string(e), "e" + std::to_string(e), ranks)).ok());
  }
  absl::Status Begin(int64_t v) {
    v1::BeginUpdateRequest r;
    r.set_version(v);
    return c->BeginUpdate(r).status();
  }
  absl::StatusOr<v1::CommitUpdateReply> Commit(int64_t v) {
    v1::CommitUpdateRequest r;
    r.set_version(v);
    return c->CommitUpdate(r);
  }
};

TEST_CASE("coordinator: seed plan keeps identical engine ranks on the source that already serves them") {
  Fixture f(2, 3, 2);  // 2 sources, 3 engines x 2 ranks
  REQUIRE(f.Begin(1).ok());
  std::map<std::string, std::set<int>> ranks_by_source;
  int targets = 0;
  for (const auto& [addr, req] : f.peers->configured) {
    for (const auto& t : req.targets()) {
      ranks_by_source[addr].insert(t.rank());
      ++targets;
    }
  }
  CHECK(targets == 6);                      // every (engine, rank) exactly once
  CHECK(ranks_by_source.size() == 2);
  for (const auto& [addr, ranks] : ranks_by_source) CHECK(ranks.size() == 1);  // one replica layout per source
}

TEST_CASE("coordinator: lifecycle order, history and version checks") {
  Fixture f(1, 2, 1);
  CHECK(f.Commit(1).status().code() == absl::StatusCode::kFailedPrecondition);  // nothing open
  REQUIRE(f.Begin(1).ok());
  CHECK(f.Begin(2).code() == absl::StatusCode::kFailedPrecondition);            // one update at a time
  CHECK(f.peers->Count("pause ") == 2);
  CHECK(f.peers->Count("start ") == 1);
  auto rec = f.Commit(1);
  REQUIRE(rec.ok());
  CHECK(rec->record().success());
  CHECK(rec->record().bytes() == 100);
  CHECK(f.peers->Count("post_process ") == 2);
  CHECK(f.peers->Count("set_version ") == 2);
  CHECK(f.peers->Count("continue ") == 2);
  std::vector<std::string> phases;
  for (const auto& p : rec->record().phases()) phases.push_back(p.phase());
  CHECK(phases == std::vector<std::string>{"pause", "configure", "push", "post_process", "set_version", "continue"});
  CHECK(f.Begin(1).code() == absl::StatusCode::kFailedPrecondition);  // not newer than the current version
  REQUIRE(f.Begin(2).ok());
  REQUIRE(f.Commit(2).ok());
  CHECK(f.peers->configured.size() == 1);  // membership unchanged: configured once
  CHECK(f.c->Status().current_version() == "2");
  CHECK(f.c->History(v1::HistoryRequest()).records_size() == 2);
}

TEST_CASE("coordinator: a failed source leaves the engines paused at their old version") {
  Fixture f(1, 2, 1);
  REQUIRE(f.Begin(1).ok());
  REQUIRE(f.Commit(1).ok());
  f.peers->fail_finish = true;
  REQUIRE(f.Begin(2).ok());
  auto rec = f.Commit(2);
  CHECK(rec.status().code() == absl::StatusCode::kAborted);
  CHECK(std::string(rec.status().message()).find("engine e1 rank 0") != std::string::npos);
  CHECK(f.peers->Count("set_version ") == 2);  // only from update 1
  CHECK(f.peers->Count("continue ") == 2);
  auto st = f.c->Status();
  CHECK(st.current_version() == "1");
  CHECK(st.state() == "failed");
  auto h = f.c->History(v1::HistoryRequest());
  REQUIRE(h.records_size() == 2);
  CHECK_FALSE(h.records(1).success());
  f.peers->fail_finish = false;
  REQUIRE(f.Begin(3).ok());  // a failed update does not block the next one
  REQUIRE(f.Commit(3).ok());
  CHECK(f.c->Status().current_version() == "3");
}

TEST_CASE("coordinator: registration is validated and membership changes trigger a new plan") {
  Fixture f(1, 1, 1);
  v1::RegisterNodeRequest bad = Source("");
  CHECK(f.c->RegisterNode(bad).status().code() == absl::StatusCode::kInvalidArgument);
  bad = Source("x");
  bad.set_role("router");
  CHECK(f.c->RegisterNode(bad).status().code() == absl::StatusCode::kInvalidArgument);
  // The same engine served by two nodes is refused.
  CHECK(f.c->RegisterNode(Target("t9", "e0", 1)).status().code() == absl::StatusCode::kAlreadyExists);
  REQUIRE(f.Begin(1).ok());
  REQUIRE(f.Commit(1).ok());
  REQUIRE(f.c->RegisterNode(Target("t1", "e1", 1)).ok());
  REQUIRE(f.Begin(2).ok());
  REQUIRE(f.Commit(2).ok());
  int targets = 0;
  for (const auto& [a, req] : f.peers->configured) targets += req.targets_size();
  CHECK(targets == 2);  // reconfigured with the new engine
}

}  // namespace
}  // namespace wsync::daemon
