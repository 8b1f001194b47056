// Per-RPC request size limits (docs/security.md, "Bounded requests"):
//   * the real sizes of the large control messages for Kimi-K2 (FP8, 64x64 blocks) on a 256-GPU trainer and two
//     TP32/EP32 engines, built by the coordinator itself from real engine layouts, fit the plan-sized limit with a
//     margin of 4x, and every other request is far below the control limit;
//   * every RPC of the coordinator and of wsyncd (enumerated from the service descriptors, so a new RPC is covered)
//     refuses a request one byte over its limit with RESOURCE_EXHAUSTED naming the RPC, accepts one just under it
//     past the size check, and the server keeps serving.

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/client_unary_call.h>
#include <grpcpp/impl/codegen/rpc_method.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/coordinator_service.h"
#include "daemon/common/serve.h"
#include "daemon/node/node_services.h"
#include "google/protobuf/descriptor.h"
#include "nlohmann/json.hpp"
#include "tools/testdata/planned_layout.h"
#include "replica/layout_plan.h"
#include "replica/model_config.h"
#include "tests/daemon/idle_peers.h"
#include "tests/daemon/raw_rpc.h"
#include "wsync/v1/coordinator.grpc.pb.h"
#include "wsync/v1/daemon.grpc.pb.h"

namespace wsync::daemon {
namespace {

// The limits as docs/security.md states them, written out here independently of serve.h's table.
constexpr uint64_t kControl = 4 << 20;
constexpr uint64_t kPlan = 64 << 20;
const std::set<std::string> kPlanSized = {"wsync.v1.Coordinator/RegisterNode", "wsync.v1.NodeDaemon/ConfigureSource"};

// Records the size of each source's ConfigureSource; every other call answers at once.
class CapturePeers : public testing::IdlePeers {
 public:
  absl::StatusOr<v1::ConfigureSourceReply> ConfigureSource(const std::string& addr,
                                                           const v1::ConfigureSourceRequest& req) override {
    std::lock_guard<std::mutex> l(mu);
    configure_bytes[addr] = req.ByteSizeLong();
    return v1::ConfigureSourceReply();
  }

  std::mutex mu;
  std::map<std::string, uint64_t> configure_bytes;
};

// Kimi-K2's config.json with the 64x64 FP8 blocks its TP32 engines need.
std::string KimiConfig() {
  std::ifstream in(std::string(WSYNC_MODELS_DIR) + "/moonshotai__Kimi-K2-Instruct/config.json");
  REQUIRE(in.good());
  std::stringstream ss;
  ss << in.rdbuf();
  auto j = nlohmann::json::parse(ss.str());
  j["quantization_config"]["weight_block_size"] = {64, 64};
  return j.dump();
}

// A target registering one engine of `tp` ranks, each rank's layout as the engine would report it.
v1::RegisterNodeRequest KimiTarget(const replica::ModelConfig& cfg, const std::string& id, int tp) {
  v1::RegisterNodeRequest r;
  r.set_node_id(id);
  r.set_role("target");
  r.set_address(id + ".cluster.internal:7701");
  r.set_transport("verbs");
  auto* e = r.add_engines();
  e->set_engine_id("kimi-" + id);
  e->set_control_address(id + ".cluster.internal:30000");
  e->set_kind("reference");
  replica::QuantSpec q;
  q.mode = replica::QuantSpec::Mode::kFp8Block;
  q.block_n = q.block_k = 64;
  for (int rank = 0; rank < tp; ++rank) {
    const replica::RankParallelism par = replica::RankParallelism::ForTp(tp, rank, tp);
    auto planned = testdata::PlannedRankLayout(cfg, par, q);
    INFO(planned.status().ToString());
    REQUIRE(planned.ok());
    auto* l = e->add_ranks();
    *l = *std::move(planned);
    auto* seg = l->add_segments();
    seg->set_id(0);
    seg->set_kind("cuda");
    seg->set_bytes(l->region_bytes());
    // A verbs descriptor of a multi-GiB region on 8 NICs: base, length, chunk size and one rkey per chunk and NIC.
    seg->set_region_descriptor(std::string(512, 'd'));
  }
  return r;
}

TEST_CASE("limits: Kimi-K2's largest control messages fit the plan-sized limit with a 4x margin") {
  auto peers = std::make_unique<CapturePeers>();
  CapturePeers* cp = peers.get();
  cp->config_json = KimiConfig();
  auto cfg = replica::ModelConfig::FromJson(cp->config_json);
  REQUIRE(cfg.ok());
  CoordinatorOptions o;  // balanced, as deployed
  Coordinator c(o, std::move(peers));
  uint64_t max_register = 0;
  for (int t = 0; t < 2; ++t) {
    v1::RegisterNodeRequest r = KimiTarget(*cfg, "infer" + std::to_string(t), 32);
    max_register = std::max<uint64_t>(max_register, r.ByteSizeLong());
    auto st = c.RegisterNode(r);
    INFO(st.status().ToString());
    REQUIRE(st.ok());
  }
  for (int s = 0; s < 32; ++s) {
    v1::RegisterNodeRequest r;
    r.set_node_id("train" + std::to_string(s));
    r.set_role("source");
    r.set_address(r.node_id() + ".cluster.internal:7700");
    r.set_transport("verbs");
    r.set_trainer_ranks(8);
    REQUIRE(c.RegisterNode(r).ok());
  }
  v1::BeginUpdateRequest b;
  b.set_version(1);
  auto begun = c.BeginUpdate(b);
  INFO(begun.status().ToString());
  REQUIRE(begun.ok());
  uint64_t max_configure = 0, total_configure = 0;
  for (const auto& [addr, n] : cp->configure_bytes) {
    max_configure = std::max(max_configure, n);
    total_configure += n;
  }
  REQUIRE(cp->configure_bytes.size() == 32);
  const uint64_t status_bytes = c.Status().ByteSizeLong();
  std::printf(
      "limits: Kimi-K2 fp8 64x64, 32 source nodes x 8 ranks, 2 engines TP32/EP32: RegisterNode (one engine's 32 "
      "ranks) %llu bytes, ConfigureSource max %llu bytes (%llu over 32 sources), GetClusterStatus reply %llu bytes; "
      "limits: plan-sized %llu, control %llu\n",
      static_cast<unsigned long long>(max_register), static_cast<unsigned long long>(max_configure),
      static_cast<unsigned long long>(total_configure), static_cast<unsigned long long>(status_bytes),
      static_cast<unsigned long long>(kPlan), static_cast<unsigned long long>(kControl));
  CHECK(max_register * 4 <= kPlan);
  CHECK(max_configure * 4 <= kPlan);
  CHECK(status_bytes * 4 <= kControl);
  CHECK(kMaxControlRequestBytes == kControl);
  CHECK(kMaxPlanRequestBytes == kPlan);
}

// A request of exactly `bytes` bytes for any message type: one unknown length-delimited field (number 1000), which
// every proto3 message keeps and counts.
std::string Padded(uint64_t bytes) {
  // tag (1000 << 3 | 2) = 8002 → 2 varint bytes; then the length varint; then the payload.
  auto varint_len = [](uint64_t v) {
    int n = 1;
    while (v >= 128) v >>= 7, ++n;
    return n;
  };
  uint64_t payload = bytes - 2 - 1;
  while (2 + varint_len(payload) + payload > bytes) --payload;
  std::string out;
  uint64_t tag = (1000u << 3) | 2;
  for (uint64_t v : {tag, payload}) {
    while (v >= 128) out.push_back(static_cast<char>((v & 127) | 128)), v >>= 7;
    out.push_back(static_cast<char>(v));
  }
  out.append(payload, 'x');
  REQUIRE(out.size() == bytes);
  return out;
}

grpc::Status CallRaw(const std::shared_ptr<grpc::Channel>& ch, const std::string& method, const std::string& body) {
  return testing::CallRaw(ch, method, body, std::chrono::seconds(20));
}
using testing::Methods;

TEST_CASE("limits: every RPC refuses a request over its limit with RESOURCE_EXHAUSTED; the server keeps serving") {
  auto peers = std::make_unique<CapturePeers>();
  Coordinator coordinator(CoordinatorOptions(), std::move(peers));
  CoordinatorService coordinator_svc(&coordinator);
  NodeDaemonService daemon_svc(nullptr, nullptr);  // a target still attaching: every RPC past its checks is refused
  auto served = Serve("127.0.0.1:0", {&coordinator_svc, &daemon_svc}, "");
  REQUIRE(served.ok());
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(256 << 20);
  auto ch =
      grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", served->port), grpc::InsecureChannelCredentials(), args);
  int refused = 0;
  for (const std::string service : {"wsync.v1.Coordinator", "wsync.v1.NodeDaemon"}) {
    for (const auto& m : Methods(service)) {
      const uint64_t limit = kPlanSized.count(m) ? kPlan : kControl;
      INFO(m << " limit " << limit);
      grpc::Status over = CallRaw(ch, m, Padded(limit + 1));
      INFO(over.error_message());
      CHECK(over.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
      if (limit == kControl) {  // plan-sized requests hit gRPC's own cap, which names no RPC
        CHECK(absl::StrContains(over.error_message(), m.substr(m.find('/') + 1)));
        CHECK(absl::StrContains(over.error_message(), std::to_string(limit)));
      }
      ++refused;
      grpc::Status under = CallRaw(ch, m, Padded(limit - (64 << 10)));
      INFO("under: " << under.error_message());
      CHECK(under.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED);
      // Past the size check, the handler answered (a transport failure would be UNAVAILABLE with gRPC's message).
      if (under.error_code() == grpc::StatusCode::UNAVAILABLE)
        CHECK(absl::StrContains(under.error_message(), "still attaching its engines"));
    }
  }
  // Still serving: a normal call succeeds.
  auto stub = v1::Coordinator::NewStub(ch);
  grpc::ClientContext ctx;
  v1::ClusterStatus st;
  CHECK(stub->GetClusterStatus(&ctx, v1::ClusterStatusRequest(), &st).ok());
  std::printf("limits: %d oversized requests refused\n", refused);
  served->server->Shutdown();
}

}  // namespace
}  // namespace wsync::daemon
