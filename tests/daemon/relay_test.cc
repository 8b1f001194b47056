// Relay trees end to end (issue 41, docs/planner.md "The relay data path"): one source, three reference engines of
// one layout, the coordinator run with --relay N. The source writes only the tree's root; each target daemon checks
// what landed against the writer's checksums and forwards it into its children. After each classic update every
// engine's own loader (Verify: it computes step v itself) passes bit-exactly, and the source's bytes are one
// instance's, not three. A connection made with the relay's handshake is refused (and counted) writing outside its
// grant (another rank's region) and after the window closed.

#include <catch2/catch.hpp>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "client/coordinator_client.h"
#include "client/trainer_client.h"
#include "daemon/coordinator/state_store.h"
#include "tests/daemon/cluster.h"
#include "tests/daemon/helpers.h"
#include "transport/transport.h"
#include "wsync/v1/daemon.grpc.pb.h"

namespace wsync {
namespace {

using testing::Cluster;
using testing::ClusterOptions;

const char* kBin = WSYNC_BIN_DIR;
const char* kModel = WSYNC_TINY_MODEL;
constexpr int kTp = 2;

std::unique_ptr<v1::NodeDaemon::Stub> Daemon(const std::string& addr) {
  return v1::NodeDaemon::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
}

uint64_t RefusedWrites(const std::string& target) {
  grpc::ClientContext ctx;
  v1::NodeStatus st;
  REQUIRE(Daemon(target)->GetNodeStatus(&ctx, v1::NodeStatusRequest(), &st).ok());
  return st.refused_writes();
}

// One copy of an engine: every parameter byte of every rank, from the engine's own layout.
uint64_t InstanceBytes(const std::string& engine) {
  uint64_t bytes = 0;
  for (int r = 0; r < kTp; ++r) {
    grpc::ClientContext ctx;
    v1::RankRequest req;
    req.set_rank(r);
    v1::RankLayout layout;
    REQUIRE(testing::EngineStub(engine)->GetWeightLayout(&ctx, req, &layout).ok());
    for (const auto& p : layout.params()) bytes += p.bytes();
  }
  return bytes;
}

// Segment 0's region descriptor of every rank of `engine_id`, as its target registered it (the coordinator's store).
std::vector<std::string> Descriptors(const std::string& db, const std::string& engine_id) {
  auto store = daemon::SqliteStateStore::Open(db);
  REQUIRE(store.ok());
  auto st = (*store)->Load();
  REQUIRE(st.ok());
  std::vector<std::string> out;
  for (const auto& n : st->nodes())
    for (const auto& e : n.engines())
      if (e.engine_id() == engine_id)
        for (const auto& r : e.ranks()) out.push_back(r.segments(0).region_descriptor());
  REQUIRE(out.size() == kTp);
  return out;
}

void RunRelay(const std::string& degree) {
  const auto specs = testing::Specs(kModel);
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.tp = kTp;
  o.engines = 3;
  char tmpl[] = "/tmp/wsync-relay-db.XXXXXX";
  const std::string db = std::string(mkdtemp(tmpl)) + "/state.db";
  o.coordinator_args = {"--strategy", "balanced", "--min-source-mib", "0", "--relay", degree, "--state", db};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  auto trainer = testing::ConnectTrainer(cl.trainer_sockets[0]);
  REQUIRE(trainer.ok());
  client::CoordinatorClient coord(cl.coordinator);
  const uint64_t instance = InstanceBytes(cl.engines[0]);
  REQUIRE(instance > 0);

  auto push = [&](int64_t v) -> absl::Status {
    auto names = (*trainer)->BeginPush(v);
    if (!names.ok()) return names.status();
    for (const auto& n : *names) WSYNC_RETURN_IF_ERROR(testing::PushGenerated(**trainer, specs.at(n), v));
    return (*trainer)->EndPush(v);
  };
  auto check_step = [&](int64_t v) {
    for (const auto& e : cl.engines) {
      INFO("engine " << e << " step " << v);
      CHECK(testing::Info(e).weight_version() == std::to_string(v));
      const v1::VerifyReply rep = testing::Verify(e, v);
      CHECK(rep.ok());
      CHECK(rep.ranks() == kTp);
    }
  };

  for (int64_t v = 1; v <= 2; ++v) {
    REQUIRE(coord.BeginUpdate(v, "", "", "off").ok());
    absl::Status pushed = push(v);
    INFO(pushed.ToString());
    REQUIRE(pushed.ok());
    auto rec = coord.CommitUpdate(v, 30);
    INFO(rec.status().ToString() << "\n" << cl.LogTails());
    REQUIRE(rec.ok());
    // The trainer's egress: one instance's bytes, not one per engine.
    CHECK(rec->bytes() == instance);
    check_step(v);
  }

  // A relay-style connection to the last engine's daemon (the ConnectTarget handshake a relay makes, for rank 0)
  // while update 3's window is open: a write into rank 1's region is outside its grant; after the window closed, a
  // write into rank 0's is refused too. Both counted; the update still lands bit-exactly.
  const std::vector<std::string> desc = Descriptors(db, "engine2");
  auto tr = transport::CreateTransport("tcp", {});
  REQUIRE(tr.ok());
  std::vector<uint8_t> junk(1 << 12, 0xA5);
  auto src = (*tr)->RegisterMemory(junk.data(), junk.size());
  REQUIRE(src.ok());
  std::vector<std::unique_ptr<transport::RemoteRegion>> region;
  for (const auto& d : desc) {
    auto rr = (*tr)->ImportRegion(d);
    REQUIRE(rr.ok());
    region.push_back(*std::move(rr));
  }
  auto write_to = [&](transport::Endpoint& ep, int r) {
    transport::WriteRequest w{src->get(), 0, region[r].get(), 0, std::min<uint64_t>(junk.size(), region[r]->length())};
    return ep.Write({&w, 1}, absl::Seconds(10));
  };
  // ConnectTarget to engine2 rank 0 as its relay does; the endpoint connected with the reply's grant.
  auto connect = [&]() -> std::unique_ptr<transport::Endpoint> {
    auto ep = (*tr)->CreateEndpoint();
    REQUIRE(ep.ok());
    v1::ConnectTargetRequest req;
    req.set_engine_id("engine2");
    req.set_rank(0);
    req.set_source_endpoint_info((*ep)->LocalInfo());
    req.set_source_node(degree == "1" ? "infer1" : "infer0");  // engine2's relay: engine1 in the chain, else the root
    v1::ConnectTargetReply rep;
    grpc::ClientContext ctx;
    REQUIRE(Daemon(cl.targets[2])->ConnectTarget(&ctx, req, &rep).ok());
    REQUIRE((*ep)->Connect(rep.target_endpoint_info(), absl::Seconds(10)).ok());
    return *std::move(ep);
  };
  REQUIRE(coord.BeginUpdate(3, "", "", "off").ok());
  auto ep = connect();
  const uint64_t refused0 = RefusedWrites(cl.targets[2]);
  CHECK(!write_to(*ep, 1).ok());
  CHECK(RefusedWrites(cl.targets[2]) == refused0 + 1);
  REQUIRE(push(3).ok());
  auto rec = coord.CommitUpdate(3, 30);
  INFO(rec.status().ToString() << "\n" << cl.LogTails());
  REQUIRE(rec.ok());
  CHECK(rec->bytes() == instance);
  check_step(3);
  // The window closed with the update: the same connection's write into its own rank is refused as well.
  ep = connect();  // a refused batch leaves the endpoint to be re-created (transport.h)
  CHECK(!write_to(*ep, 0).ok());
  CHECK(RefusedWrites(cl.targets[2]) >= refused0 + 2);
  check_step(3);
}

TEST_CASE("relay: a chain (degree 1) of three engines: the source writes one, each forwards to the next") {
  RunRelay("1");
}

TEST_CASE("relay: a root with two children (degree 2)") { RunRelay("2"); }

}  // namespace
}  // namespace wsync
