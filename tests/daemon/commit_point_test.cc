// Past the commit point, against real gRPC peers (docs/operations.md, "Past the commit point"): a coordinator with
// its gRPC peers drives engines and daemons served over loopback gRPC in this process. Once every engine holds the new
// version and its label, an engine that refuses Continue, or whose server is gone (shut down, its port closed: the
// call fails at the socket), leaves the update committed with that engine not resumed; `wsyncctl status` and
// `history` say so, and a retried CommitUpdate or `wsyncctl resume` brings it to the version.
#include <grpcpp/grpcpp.h>
#include <stdio.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/serve.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/coordinator_service.h"
#include "tests/daemon/fake_layouts.h"
#include "wsync/v1/daemon.grpc.pb.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace wsync::daemon {
namespace {

using testing::FillLayout;
using testing::TinyConfigJson;

// A source or target daemon that does what it is told at once (sources write nothing).
class FakeDaemon final : public v1::NodeDaemon::Service {
  grpc::Status ConfigureSource(grpc::ServerContext*, const v1::ConfigureSourceRequest*,
                               v1::ConfigureSourceReply*) override {
    return grpc::Status::OK;
  }
  grpc::Status StartUpdate(grpc::ServerContext*, const v1::StartUpdateRequest*, v1::StartUpdateReply*) override {
    return grpc::Status::OK;
  }
  grpc::Status FinishUpdate(grpc::ServerContext*, const v1::FinishUpdateRequest*, v1::FinishUpdateReply*) override {
    return grpc::Status::OK;
  }
  grpc::Status AbortSourceUpdate(grpc::ServerContext*, const v1::AbortSourceUpdateRequest*,
                                 v1::AbortSourceUpdateReply* r) override {
    r->set_quiescent(true);
    return grpc::Status::OK;
  }
  grpc::Status SetWriteWindow(grpc::ServerContext*, const v1::SetWriteWindowRequest*,
                              v1::SetWriteWindowReply*) override {
    return grpc::Status::OK;
  }
  grpc::Status ApplyDelta(grpc::ServerContext*, const v1::ApplyDeltaRequest*, v1::ApplyDeltaReply*) override {
    return grpc::Status::OK;
  }
};

// An engine that keeps what it was told (paused, the version label), may refuse Continue, and may run a hook when
// its label is set.
class FakeEngine final : public v1::EngineControl::Service {
 public:
  struct Truth {
    bool paused = false;
    std::string version;
    int continues = 0;
  };
  std::function<void()> on_set_version;  // runs in the handler, before it answers

  void RefuseContinue(bool refuse) {
    std::lock_guard<std::mutex> l(mu_);
    refuse_ = refuse;
  }
  Truth truth() {
    std::lock_guard<std::mutex> l(mu_);
    return truth_;
  }
  void set_truth(Truth t) {
    std::lock_guard<std::mutex> l(mu_);
    truth_ = std::move(t);
  }

  grpc::Status GetInfo(grpc::ServerContext*, const v1::GetEngineInfoRequest*, v1::EngineInfo* r) override {
    r->set_model_config_json(TinyConfigJson());
    return grpc::Status::OK;
  }
  grpc::Status Pause(grpc::ServerContext*, const v1::PauseRequest*, v1::EngineReply* r) override {
    std::lock_guard<std::mutex> l(mu_);
    truth_.paused = true;
    r->set_success(true);
    return grpc::Status::OK;
  }
  grpc::Status PostProcess(grpc::ServerContext*, const v1::PostProcessRequest*, v1::EngineReply* r) override {
    r->set_success(true);
    return grpc::Status::OK;
  }
  grpc::Status SetWeightVersion(grpc::ServerContext*, const v1::SetWeightVersionRequest* req,
                                v1::EngineReply* r) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      truth_.version = req->version();
    }
    if (on_set_version) on_set_version();
    r->set_success(true);
    return grpc::Status::OK;
  }
  grpc::Status Continue(grpc::ServerContext*, const v1::ContinueRequest*, v1::EngineReply* r) override {
    std::lock_guard<std::mutex> l(mu_);
    ++truth_.continues;
    if (refuse_) {
      r->set_success(false);
      r->set_message("cannot resume serving: KV cache allocation failed");
      return grpc::Status::OK;
    }
    truth_.paused = false;
    r->set_success(true);
    return grpc::Status::OK;
  }

 private:
  std::mutex mu_;
  bool refuse_ = false;
  Truth truth_;
};

std::unique_ptr<grpc::Server> ServeOn(const std::string& listen, grpc::Service* service, int* port) {
  auto served = Serve(listen, {service}, "");
  REQUIRE(served.ok());
  *port = served->port;
  return std::move(served->server);
}

std::string Run(const std::string& cmd, int* rc) {
  FILE* pipe = popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  const int st = pclose(pipe);
  *rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return out;
}

// Two sources, two targets with one engine each (e0, e1), every peer its own gRPC server on loopback; the
// coordinator with its real gRPC peers, itself served for wsyncctl.
struct Fleet {
  FakeDaemon daemon;
  std::unique_ptr<grpc::Server> daemons;
  int daemon_port = 0;
  FakeEngine e0, e1;
  std::unique_ptr<grpc::Server> s0, s1;
  int p0 = 0, p1 = 0;
  std::unique_ptr<Coordinator> c;
  std::unique_ptr<CoordinatorService> service;
  std::unique_ptr<grpc::Server> coordinator_server;
  int coordinator_port = 0;

  Fleet() {
    daemons = ServeOn("127.0.0.1:0", &daemon, &daemon_port);
    s0 = ServeOn("127.0.0.1:0", &e0, &p0);
    s1 = ServeOn("127.0.0.1:0", &e1, &p1);
    CoordinatorOptions o;
    o.min_source_bytes = 0;
    c = std::make_unique<Coordinator>(o, MakeGrpcPeers());
    service = std::make_unique<CoordinatorService>(c.get());
    coordinator_server = ServeOn("127.0.0.1:0", service.get(), &coordinator_port);
    // Every daemon is the one fake server: the nodes differ by id, the coordinator dials the same address.
    const std::string d = absl::StrCat("127.0.0.1:", daemon_port);
    for (const char* id : {"s0", "s1"}) {
      v1::RegisterNodeRequest r;
      r.set_node_id(id);
      r.set_role("source");
      r.set_address(d);
      r.set_trainer_ranks(1);
      REQUIRE(c->RegisterNode(r).ok());
    }
    for (int t = 0; t < 2; ++t) {
      v1::RegisterNodeRequest r;
      r.set_node_id(absl::StrCat("t", t));
      r.set_role("target");
      r.set_address(d);
      auto* e = r.add_engines();
      e->set_engine_id(absl::StrCat("e", t));
      e->set_control_address(absl::StrCat("127.0.0.1:", t == 0 ? p0 : p1));
      e->set_kind("reference");
      FillLayout(e->add_ranks(), 1, 0);
      REQUIRE(c->RegisterNode(r).ok());
    }
  }
  ~Fleet() {
    if (coordinator_server) coordinator_server->Shutdown();
    if (s0) s0->Shutdown();
    if (s1) s1->Shutdown();
    if (daemons) daemons->Shutdown();
  }
  absl::Status Update(int64_t v) {
    v1::BeginUpdateRequest b;
    b.set_version(v);
    absl::Status st = c->BeginUpdate(b).status();
    return st.ok() ? Commit(v).status() : st;
  }
  absl::StatusOr<v1::CommitUpdateReply> Commit(int64_t v) {
    v1::CommitUpdateRequest r;
    r.set_version(v);
    return c->CommitUpdate(r);
  }
  std::string Ctl(const std::string& args, int* rc) {
    return Run(absl::StrCat(WSYNC_BIN_DIR, "/wsyncctl --endpoints 127.0.0.1:", coordinator_port, " ", args), rc);
  }
  std::string StateOf(const std::string& engine) {
    const v1::ClusterStatus st = c->Status();
    for (const auto& n : st.nodes())
      for (const auto& d : n.engine_details())
        if (d.engine_id() == engine) return absl::StrCat(d.state(), "@", d.weight_version());
    return "";
  }
};

TEST_CASE("commit point: an engine refusing Continue leaves the update committed; a retried commit resumes it") {
  Fleet f;
  REQUIRE(f.Update(1).ok());
  f.e1.RefuseContinue(true);
  v1::BeginUpdateRequest b;
  b.set_version(2);
  REQUIRE(f.c->BeginUpdate(b).ok());
  auto r = f.Commit(2);
  INFO(r.status().ToString());
  REQUIRE(r.status().code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(r.status().message(),
                          "update 2 committed: the fleet is on version 2; 1 of 2 engines not "
                          "resumed (e1)"));
  CHECK(absl::StrContains(r.status().message(), "KV cache allocation failed"));
  // Both engines hold version 2; e0 serves it, e1 is paused at it.
  CHECK(f.e0.truth().version == "2");
  CHECK_FALSE(f.e0.truth().paused);
  CHECK(f.e1.truth().version == "2");
  CHECK(f.e1.truth().paused);
  const v1::ClusterStatus st = f.c->Status();
  CHECK(st.current_version() == "2");
  CHECK(st.state() == "idle");
  CHECK_FALSE(st.engines_hold_partial_writes());
  REQUIRE(st.not_resumed_size() == 1);
  CHECK(st.not_resumed(0) == "e1");
  CHECK(f.StateOf("e1") == "failed: continue@2");
  int rc = -1;
  std::string out = f.Ctl("status", &rc);
  INFO(out);
  CHECK(rc == 0);
  CHECK(absl::StrContains(out, "committed, 1 engines not resumed at version 2 (e1)"));
  out = f.Ctl("history", &rc);
  CHECK(rc == 0);
  CHECK(absl::StrContains(out, "PARTIAL"));
  CHECK(absl::StrContains(out, "committed, 1 engines not resumed (e1)"));

  // The engine recovers; the trainer's retry of the commit continues it (only it), and the commit answers OK.
  f.e1.RefuseContinue(false);
  const int e0_continues = f.e0.truth().continues;
  auto again = f.Commit(2);
  INFO(again.status().ToString());
  REQUIRE(again.ok());
  CHECK(again->record().success());
  CHECK(again->record().not_resumed_size() == 0);
  CHECK_FALSE(f.e1.truth().paused);
  CHECK(f.e0.truth().continues == e0_continues);
  CHECK(f.StateOf("e1") == "serving@2");
  CHECK(f.c->Status().not_resumed_size() == 0);
  out = f.Ctl("history", &rc);
  CHECK_FALSE(absl::StrContains(out, "PARTIAL"));
  REQUIRE(f.Update(3).ok());
  CHECK(f.e1.truth().version == "3");
}

TEST_CASE("commit point: an engine whose server is gone after its label was set; wsyncctl resume brings it back") {
  Fleet f;
  REQUIRE(f.Update(1).ok());
  // e1's server goes away once its SetWeightVersion(2) was answered and before any Continue: e0's SetWeightVersion
  // (the continue phase starts only when it has returned) shuts e1's server down, as a killed engine's port closes.
  std::mutex mu;
  std::condition_variable cv;
  bool e1_labelled = false;
  f.e1.on_set_version = [&] {
    std::lock_guard<std::mutex> l(mu);
    e1_labelled = true;
    cv.notify_all();
  };
  f.e0.on_set_version = [&] {
    std::unique_lock<std::mutex> l(mu);  // (no assertion here: a gRPC thread; the checks below fail instead)
    cv.wait_for(l, std::chrono::seconds(10), [&] { return e1_labelled; });
    l.unlock();
    f.s1->Shutdown();  // waits for e1's SetWeightVersion to be answered
  };
  v1::BeginUpdateRequest b;
  b.set_version(2);
  REQUIRE(f.c->BeginUpdate(b).ok());
  const absl::Time t0 = absl::Now();
  auto r = f.Commit(2);
  INFO(r.status().ToString());
  REQUIRE(r.status().code() == absl::StatusCode::kUnavailable);
  CHECK(absl::Now() - t0 < absl::Seconds(20));
  CHECK(absl::StrContains(r.status().message(), "1 of 2 engines not resumed (e1)"));
  CHECK(absl::StrContains(r.status().message(), "continue engine e1"));
  CHECK(f.c->Status().current_version() == "2");
  CHECK(f.StateOf("e1") == "failed: continue@2");
  CHECK(f.StateOf("e0") == "serving@2");
  f.e0.on_set_version = nullptr;
  f.e1.on_set_version = nullptr;

  // While e1 is still gone, resume fails and says so; e1 stays listed.
  int rc = -1;
  std::string out = f.Ctl("resume", &rc);
  INFO(out);
  CHECK(rc != 0);
  CHECK(f.c->Status().not_resumed_size() == 1);

  // The engine comes back on its port (its memory is the target daemon's, so it holds version 2); the operator resumes.
  f.s1 = ServeOn(absl::StrCat("127.0.0.1:", f.p1), &f.e1, &f.p1);
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  do {  // the coordinator's channel may still be in its reconnect backoff
    out = f.Ctl("resume", &rc);
  } while (rc != 0 && absl::Now() < deadline && (absl::SleepFor(absl::Milliseconds(200)), true));
  INFO(out);
  REQUIRE(rc == 0);
  CHECK(absl::StrContains(out, "resumed 2 engines at version 2"));
  CHECK_FALSE(f.e1.truth().paused);
  CHECK(f.StateOf("e1") == "serving@2");
  const v1::ClusterStatus st = f.c->Status();
  CHECK(st.not_resumed_size() == 0);
  auto rec = f.Commit(2);  // the recorded answer is the committed record now
  REQUIRE(rec.ok());
  CHECK(rec->record().not_resumed_size() == 0);
  REQUIRE(f.Update(3).ok());
  CHECK(f.e1.truth().version == "3");
}

}  // namespace
}  // namespace wsync::daemon
