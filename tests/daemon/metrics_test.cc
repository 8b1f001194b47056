// The metrics registry's text exposition, the HTTP endpoint, and the gRPC health service every server exposes.

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <string>

#include "tests/daemon/fake_layouts.h"
#include "absl/strings/match.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/common/metrics.h"
#include "daemon/common/serve.h"
#include "daemon/coordinator/coordinator_service.h"
#include "httplib.h"
#include "wsync/v1/coordinator.grpc.pb.h"

namespace wsync::daemon {
namespace {

TEST_CASE("metrics: counters, gauges and histograms render in the Prometheus text format") {
  Metrics m;
  m.Declare("t_total", "counter", "Things \"done\"\nby kind.");
  m.Declare("t_gauge", "gauge", "A level.");
  m.Declare("t_seconds", "histogram", "Durations.", {0.1, 1});
  m.Add("t_total", {{"kind", "a\"b"}}, 2);
  m.Add("t_total", {{"kind", "a\"b"}}, 3);
  m.Add("t_total", {{"kind", "c"}}, -1);  // counters never go down: ignored
  m.Set("t_gauge", {}, 1.5);
  m.Observe("t_seconds", {{"phase", "push"}}, 0.05);
  m.Observe("t_seconds", {{"phase", "push"}}, 0.5);
  m.Observe("t_seconds", {{"phase", "push"}}, 7);
  m.Add("undeclared_total", {}, 1);  // ignored, no crash
  m.Set("t_total", {}, 9);           // wrong type: ignored
  int collects = 0;
  m.OnCollect([&](Metrics& mm) { mm.Set("t_gauge", {{"from", "collect"}}, ++collects); });
  const std::string text = m.Render();
  INFO(text);
  CHECK(absl::StrContains(text, "# HELP t_total Things \"done\"\\nby kind.\n# TYPE t_total counter\n"));
  CHECK(absl::StrContains(text, "t_total{kind=\"a\\\"b\"} 5\n"));
  CHECK_FALSE(absl::StrContains(text, "t_total{kind=\"c\"}"));
  CHECK_FALSE(absl::StrContains(text, "undeclared_total"));
  CHECK(absl::StrContains(text, "t_gauge 1.5\n"));
  CHECK(absl::StrContains(text, "t_gauge{from=\"collect\"} 1\n"));
  CHECK(absl::StrContains(text, "t_seconds_bucket{phase=\"push\",le=\"0.1\"} 1\n"));
  CHECK(absl::StrContains(text, "t_seconds_bucket{phase=\"push\",le=\"1\"} 2\n"));
  CHECK(absl::StrContains(text, "t_seconds_bucket{phase=\"push\",le=\"+Inf\"} 3\n"));
  CHECK(absl::StrContains(text, "t_seconds_sum{phase=\"push\"} 7.55\n"));
  CHECK(absl::StrContains(text, "t_seconds_count{phase=\"push\"} 3\n"));
  CHECK(m.Value("t_total", {{"kind", "a\"b"}}) == 5);
  m.Render();
  CHECK(collects == 2);
}

TEST_CASE("metrics: preset series are exported at zero and keep counting; undeclared ones are ignored") {
  Metrics m;
  m.Declare("p_total", "counter", "p");
  m.Declare("p_seconds", "histogram", "p", {1});
  m.Preset("p_total", {{{"result", "ok"}}, {{"result", "failed"}}});
  m.Preset("p_seconds");
  m.Preset("undeclared_total");
  m.Add("p_total", {{"result", "ok"}}, 2);
  m.Preset("p_total", {{{"result", "ok"}}});  // never resets a value
  const std::string text = m.Render();
  INFO(text);
  CHECK(absl::StrContains(text, "p_total{result=\"ok\"} 2\n"));
  CHECK(absl::StrContains(text, "p_total{result=\"failed\"} 0\n"));
  CHECK(absl::StrContains(text, "p_seconds_bucket{le=\"1\"} 0\n"));
  CHECK(absl::StrContains(text, "p_seconds_count 0\n"));
  CHECK_FALSE(absl::StrContains(text, "undeclared_total"));
}

TEST_CASE("metrics: the coordinator's update counters are exported at zero before the first update") {
  Coordinator c(CoordinatorOptions(), MakeGrpcPeers());
  PresetCoordinatorSeries(c.metrics());
  const std::string text = c.metrics().Render();
  INFO(text);
  for (const char* series :
       {"wsync_updates_total{result=\"ok\"} 0\n", "wsync_updates_total{result=\"failed\"} 0\n",
        "wsync_updates_total{result=\"aborted\"} 0\n", "wsync_updates_total{result=\"not_resumed\"} 0\n",
        "wsync_update_bytes_total 0\n", "wsync_update_sent_bytes_total 0\n", "wsync_update_seconds_count 0\n",
        "wsync_update_phase_seconds_count{phase=\"push\"} 0\n"})
    CHECK(absl::StrContains(text, series));
}

TEST_CASE("metrics: served over HTTP with /healthz; a bad address is refused") {
  Metrics m;
  m.Declare("x_total", "counter", "x");
  m.Add("x_total", {}, 42);
  auto s = MetricsServer::Start("127.0.0.1:0", &m);
  REQUIRE(s.ok());
  httplib::Client c("127.0.0.1", (*s)->port());
  auto r = c.Get("/metrics");
  REQUIRE(r);
  CHECK(r->status == 200);
  CHECK(absl::StrContains(r->body, "x_total 42\n"));
  CHECK(absl::StartsWith(r->get_header_value("Content-Type"), "text/plain; version=0.0.4"));
  auto h = c.Get("/healthz");
  REQUIRE(h);
  CHECK(h->body == "ok\n");
  CHECK(MetricsServer::Start("no-port", &m).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(MetricsServer::Start(absl::StrCat("127.0.0.1:", (*s)->port()), &m).status().code() ==
        absl::StatusCode::kUnavailable);  // taken
}

TEST_CASE("health: every server answers grpc.health.v1.Health/Check with SERVING") {
  Coordinator coordinator(CoordinatorOptions(), MakeGrpcPeers());
  CoordinatorService service(&coordinator);
  auto served = Serve("127.0.0.1:0", {&service}, "");
  REQUIRE(served.ok());
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", served->port), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  // HealthCheckRequest{service: ""} is the empty message; HealthCheckResponse{status: SERVING (1)} is 08 01.
  grpc::Slice empty("", 0);
  grpc::ByteBuffer req(&empty, 1), resp;
  grpc::Status st;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp, [&](grpc::Status s) {
    std::lock_guard<std::mutex> l(mu);
    st = s;
    done = true;
    cv.notify_all();
  });
  std::unique_lock<std::mutex> l(mu);
  cv.wait(l, [&] { return done; });
  INFO(st.error_message());
  REQUIRE(st.ok());
  std::vector<grpc::Slice> slices;
  REQUIRE(resp.Dump(&slices).ok());
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  CHECK(bytes == std::string("\x08\x01", 2));
  served->server->Shutdown();
}

TEST_CASE("metrics: the coordinator counts updates by result and phase") {
  // Through the real lifecycle with peers that answer at once.
  struct Ok : Peers {
    absl::StatusOr<v1::ConfigureSourceReply> ConfigureSource(const std::string&,
                                                            const v1::ConfigureSourceRequest&) override {
      return v1::ConfigureSourceReply();
    }
    absl::Status StartUpdate(const std::string&, const v1::StartUpdateRequest&) override { return absl::OkStatus(); }
    absl::StatusOr<v1::FinishUpdateReply> FinishUpdate(const std::string&, const v1::FinishUpdateRequest&) override {
      v1::FinishUpdateReply r;
      r.set_bytes_written(1000);
      return r;
    }
    absl::StatusOr<v1::AbortSourceUpdateReply> AbortSourceUpdate(const std::string&,
                                                                 const v1::AbortSourceUpdateRequest&) override {
      return v1::AbortSourceUpdateReply();
    }
    absl::StatusOr<v1::EngineInfo> EngineInfo(const std::string&) override {
      v1::EngineInfo i;
      i.set_model_config_json(testing::TinyConfigJson());
      return i;
    }
    absl::Status Pause(const std::string&, const std::string&) override { return absl::OkStatus(); }
    absl::Status PostProcess(const std::string&, const std::string&) override { return absl::OkStatus(); }
    absl::Status SetWeightVersion(const std::string&, const std::string&) override { return absl::OkStatus(); }
    absl::Status Continue(const std::string&) override { return absl::OkStatus(); }
  };
  Coordinator c(CoordinatorOptions(), std::make_unique<Ok>());
  v1::RegisterNodeRequest src;
  src.set_node_id("s");
  src.set_role("source");
  src.set_address("s:1");
  REQUIRE(c.RegisterNode(src).ok());
  v1::RegisterNodeRequest tgt;
  tgt.set_node_id("t");
  tgt.set_role("target");
  tgt.set_address("t:1");
  auto* e = tgt.add_engines();
  e->set_engine_id("e");
  e->set_control_address("e:2");
  e->set_kind("reference");
  testing::FillLayout(e->add_ranks(), 1, 0);
  REQUIRE(c.RegisterNode(tgt).ok());
  for (int v = 1; v <= 3; ++v) {
    v1::BeginUpdateRequest b;
    b.set_version(v);
    REQUIRE(c.BeginUpdate(b).ok());
    if (v == 2) {
      v1::AbortUpdateRequest a;
      a.set_version(v);
      REQUIRE(c.AbortUpdate(a).ok());
      continue;
    }
    v1::CommitUpdateRequest cm;
    cm.set_version(v);
    REQUIRE(c.CommitUpdate(cm).ok());
  }
  const std::string text = c.metrics().Render();
  INFO(text);
  CHECK(absl::StrContains(text, "wsync_updates_total{result=\"ok\"} 2\n"));
  CHECK(absl::StrContains(text, "wsync_updates_total{result=\"aborted\"} 1\n"));
  CHECK(absl::StrContains(text, "wsync_update_bytes_total 2000\n"));
  CHECK(absl::StrContains(text, "wsync_update_phase_seconds_count{phase=\"push\"} 2\n"));
  CHECK(absl::StrContains(text, "wsync_update_phase_seconds_count{phase=\"abort\"} 1\n"));
  CHECK(absl::StrContains(text, "wsync_current_version 3\n"));
  CHECK(absl::StrContains(text, "wsync_nodes{role=\"source\"} 1\n"));
  CHECK(absl::StrContains(text, "wsync_engines{state=\"serving\"} 1\n"));
  CHECK(absl::StrContains(text, "wsync_update_in_progress 0\n"));
}

}  // namespace
}  // namespace wsync::daemon

namespace wsync::daemon {
namespace {

TEST_CASE("limits: an oversized request is refused before parsing, a long name is refused, the server keeps serving") {
  Coordinator coordinator(CoordinatorOptions(), MakeGrpcPeers());
  CoordinatorService service(&coordinator);
  auto served = Serve("127.0.0.1:0", {&service}, "");
  REQUIRE(served.ok());
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(256 << 20);
  auto stub = v1::Coordinator::NewStub(grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", served->port),
                                                                 grpc::InsecureChannelCredentials(), args));
  auto reg = [&](size_t id_bytes) {
    v1::RegisterNodeRequest r;
    r.set_node_id(std::string(id_bytes, 'n'));
    r.set_role("source");
    r.set_address("127.0.0.1:1");
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::RegisterNodeReply out;
    return stub->RegisterNode(&ctx, r, &out);
  };
  CHECK(reg(kMaxControlMessageBytes + 1024).error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(reg(40 << 20).error_code() == grpc::StatusCode::INVALID_ARGUMENT);  // 40 MiB id: within the size limit
  CHECK(reg(300).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(reg(16).ok());
  grpc::ClientContext ctx;
  v1::ClusterStatus st;
  REQUIRE(stub->GetClusterStatus(&ctx, v1::ClusterStatusRequest(), &st).ok());
  CHECK(st.nodes_size() == 1);
  served->server->Shutdown();
}

}  // namespace
}  // namespace wsync::daemon
