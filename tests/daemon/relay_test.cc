// Relay trees end to end (issue 41, docs/planner.md "The relay data path"): one source, three reference engines of
// one layout, the coordinator run with --relay N. The source writes only the tree's root; each target daemon checks
// what landed against the writer's checksums and forwards it into its children. After each classic update every
// engine's own loader (Verify: it computes step v itself) passes bit-exactly, and the source's bytes are one
// instance's, not three. A connection made with the relay's handshake is refused (and counted) writing outside its
// grant (another rank's region) and after the window closed. A relay killed mid-update (kill -9 of its target
// daemon at seeded points of the push) is routed around: its child is re-parented to the root and verified, the dead
// relay named and kept paused; a dead root cannot be routed around: the commit fails naming it, none resumed.
// `wsyncctl verify` checks every relayed engine against what its relay recorded writing, as it does a direct one.
// The chain runs a model whose embedding and LM head exceed a relay chunk (4 MiB per rank): the root records only
// ranges of at most a chunk, tiling every parameter (the source cut the large ones), and ForwardBatches groups a
// notice's ranges per rank into batches of at most a chunk (checked by hand). The chain and grouping cases: ~2 s.

#include <catch2/catch.hpp>
#include <chrono>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/coordinator_client.h"
#include "client/trainer_client.h"
#include "daemon/coordinator/relay_wiring.h"
#include "daemon/coordinator/state_store.h"
#include "daemon/node/relay_forwarder.h"
#include "nlohmann/json.hpp"
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
    const v1::RankLayout layout = testing::Layout(engine, r);  // held: params() of a temporary would dangle
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

// The tiny model with an 80000-token vocabulary: its embedding and LM head hold 4.9 MB per rank at TP 2, more than
// a relay chunk, so the source cuts them inside the parameter (SourceNode::CutRelayPieces).
std::string WideVocabModel() {
  const std::string tiny = kModel;
  return tiny.substr(0, tiny.rfind('/')) + "/qwen3-tiny-wide-vocab.json";
}
constexpr uint64_t kChunk = 4ull << 20;  // the sources' relay piece (SourceNode::kRelayPieceBytes)

// What the root's relay recorded forwarding into engine `child` (serving at `child_engine`) in `version`: every range at most one chunk, and per rank
// every parameter of the child's layout covered exactly once by its ranges; returns how many parameters took more
// than one range.
int CheckRootRecords(const std::string& root_daemon, const std::string& child, const std::string& child_engine,
                     int64_t version) {
  grpc::ClientContext ctx;
  v1::WriteChecksumsRequest req;
  req.set_version(version);
  v1::WriteChecksumsReply rep;
  REQUIRE(Daemon(root_daemon)->GetWriteChecksums(&ctx, req, &rep).ok());
  CHECK(rep.finished());
  std::map<std::pair<int, std::string>, std::map<uint64_t, uint64_t>> got;  // (rank, param) → offset → length
  for (const auto& w : rep.writes()) {
    if (w.engine_id() != child) continue;
    INFO(w.param() << " rank " << w.rank() << " [" << w.offset() << ", +" << w.length() << ")");
    CHECK(w.length() <= kChunk);
    CHECK(got[{w.rank(), w.param()}].emplace(w.offset(), w.length()).second);
  }
  int cut = 0;
  for (int r = 0; r < kTp; ++r) {
    const v1::RankLayout layout = testing::Layout(child_engine, r);
    for (const auto& p : layout.params()) {
      INFO("rank " << r << " " << p.name() << " " << p.bytes() << " bytes");
      const auto& ranges = got[{r, p.name()}];
      uint64_t next = 0;
      for (const auto& [offset, length] : ranges) {
        CHECK(offset == next);
        next = offset + length;
      }
      CHECK(next == p.bytes());
      if (ranges.size() > 1) ++cut;
    }
  }
  return cut;
}

void RunRelay(const std::string& degree, const std::string& model = kModel) {
  const auto specs = testing::Specs(model);
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = model;
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

  auto check_step = [&](int64_t v) {
    for (const auto& e : cl.engines) {
      INFO("engine " << e << " step " << v);
      CHECK(testing::Info(e).weight_version() == std::to_string(v));
      const v1::VerifyReply rep = testing::Verify(e, v);
      CHECK(rep.ok());
      CHECK(rep.ranks() == kTp);
    }
  };

  // A staged update would have relays write their children's live copies: refused at begin, nothing paused.
  auto staged = coord.BeginUpdate(1, "", "staged", "off");
  REQUIRE_FALSE(staged.ok());
  CHECK(absl::StrContains(staged.status().message(), "relay"));
  for (const auto& e : cl.engines) CHECK_FALSE(testing::Info(e).paused());

  for (int64_t v = 1; v <= 2; ++v) {
    REQUIRE(coord.BeginUpdate(v, "", "", "off").ok());
    absl::Status pushed = testing::PushStep(**trainer, specs, v);
    INFO(pushed.ToString());
    REQUIRE(pushed.ok());
    auto rec = coord.CommitUpdate(v, 30);
    INFO(rec.status().ToString() << "\n" << cl.LogTails());
    REQUIRE(rec.ok());
    // The trainer's egress: one instance's bytes, not one per engine.
    CHECK(rec->bytes() == instance);
    check_step(v);
  }
  // The root's relay forwarded what the source's pieces said landed: chunks, the large parameters cut inside.
  if (model != kModel) CHECK(CheckRootRecords(cl.targets[0], "engine1", cl.engines[1], 2) >= 2 * kTp);

  // `wsyncctl verify` covers relayed engines as direct ones: every engine's memory hashed by the engine and compared
  // with what its writer recorded (the source for the root, the parent relay for the others).
  {
    const std::string name = "verify-relay" + degree;
    REQUIRE(cl.Run(name, {std::string(kBin) + "/wsyncctl", "--endpoints", cl.coordinator, "verify", "-o", "json"},
                   std::chrono::seconds(60)) == 0);
    const std::string log = cl.Log(name);
    INFO(log);
    const nlohmann::json j = nlohmann::json::parse(log.substr(log.find('{')));
    CHECK(j["ok"] == true);
    CHECK(j["version"] == 2);
    CHECK(j["mismatched"] == 0);
    CHECK(j["missing"] == 0);
    // All three instances compared in full; the relays are the tree's inner nodes.
    CHECK(j["bytes_compared"] == 3 * instance);
    CHECK(j["relays"] == (degree == "1" ? nlohmann::json({"infer0", "infer1"}) : nlohmann::json({"infer0"})));
    for (const auto& p : j["params"]) CHECK(p["result"] == "MATCH");
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
  REQUIRE(testing::PushStep(**trainer, specs, 3).ok());
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
  // Parameters larger than a chunk, so the root's pieces are cut inside them and forwarded chunk by chunk.
  RunRelay("1", WideVocabModel());
}

TEST_CASE("relay: landed ranges are forwarded in batches of about a chunk per rank, in order") {
  auto range = [](int rank, const std::string& param, uint64_t offset, uint64_t length) {
    v1::LandedRange g;
    g.set_rank(rank);
    g.set_param(param);
    g.set_offset(offset);
    g.set_length(length);
    return g;
  };
  const uint64_t mib = 1 << 20;
  // One notice of two ranks' ranges, interleaved (a parent's notices cover several of its batches).
  const std::vector<v1::LandedRange> in = {range(0, "a", 0, 3 * mib), range(1, "a", 0, mib),
                                           range(0, "b", 0, 2 * mib), range(1, "b", 0, mib),
                                           range(0, "c", 0, mib),     range(0, "d", 0, 5 * mib),
                                           range(1, "c", 0, 2 * mib), range(0, "e", 0, mib)};
  const auto out = daemon::ForwardBatches(in, 4 * mib);
  // Expected: per rank, greedily, in arrival order: rank 0 {a}, {b, c}, {d}, {e}; rank 1 {a, b, c}.
  std::vector<std::pair<int, std::vector<std::string>>> got;
  for (const auto& [rank, ranges] : out) {
    auto& g = got.emplace_back(rank, std::vector<std::string>{});
    for (const auto& r : ranges) g.second.push_back(r.param());
  }
  const std::vector<std::pair<int, std::vector<std::string>>> want = {
      {0, {"a"}}, {1, {"a", "b", "c"}}, {0, {"b", "c"}}, {0, {"d"}}, {0, {"e"}}};
  CHECK(got == want);
}

TEST_CASE("relay: a root with two children (degree 2)") { RunRelay("2"); }

// Waits until `log` (a cluster process's log) holds `line`, or 30 s.
bool WaitForLog(const Cluster& cl, const std::string& log, const std::string& line) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (cl.Log(log).find(line) == std::string::npos) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// RerouteRelays (pure): a tree of degree 2 over seven members, 0 → {1, 2}, 1 → {3, 4}, 2 → {5, 6}, as WireRelays
// wires it (each child's spec in its parent's request). Expectations written out by hand.
daemon::RelayWiring Tree7() {
  daemon::RelayWiring w;
  const std::vector<std::string> parent = {"", "e0", "e0", "e1", "e1", "e2", "e2"};
  for (int i = 0; i < 7; ++i) {
    daemon::RelayMember m;
    m.engine_id = absl::StrCat("e", i);
    m.node_id = absl::StrCat("n", i);
    m.address = absl::StrCat("a", i);
    m.parent = parent[i];
    m.request.set_engine_id(m.engine_id);
    m.request.set_relay_node(m.node_id);
    for (int c : {2 * i + 1, 2 * i + 2})
      if (c < 7) m.request.add_children()->set_engine_id(absl::StrCat("e", c));
    w.members.push_back(std::move(m));
  }
  return w;
}

std::vector<std::string> ChildrenOf(const daemon::RelayWiring& w, const std::string& id) {
  std::vector<std::string> out;
  for (const auto& m : w.members)
    if (m.engine_id == id)
      for (const auto& c : m.request.children()) out.push_back(c.engine_id());
  return out;
}

TEST_CASE("relay: RerouteRelays re-parents a dead relay's children to the nearest live ancestor") {
  using V = std::vector<std::string>;
  {  // e1 dead: e3 and e4 go to the root, after its own live child e2
    const daemon::RelayReroute r = daemon::RerouteRelays(Tree7(), {"e1"});
    CHECK(r.impossible.empty());
    CHECK(r.wiring.members.size() == 6);
    CHECK(r.adopted == std::map<std::string, std::string>{{"e3", "e0"}, {"e4", "e0"}});
    CHECK(ChildrenOf(r.wiring, "e0") == V{"e2", "e3", "e4"});
    CHECK(r.changed == V{"e0"});
  }
  {  // e1 and e3 dead: e4 to the root; a dead leaf's parent (e2 losing e6) drops it
    const daemon::RelayReroute r = daemon::RerouteRelays(Tree7(), {"e1", "e3", "e6"});
    CHECK(r.impossible.empty());
    CHECK(r.adopted == std::map<std::string, std::string>{{"e4", "e0"}});
    CHECK(ChildrenOf(r.wiring, "e0") == V{"e2", "e4"});
    CHECK(ChildrenOf(r.wiring, "e2") == V{"e5"});
    CHECK(r.changed == V{"e0", "e2"});
  }
  {  // the root dead: its children have no live relay above them
    const daemon::RelayReroute r = daemon::RerouteRelays(Tree7(), {"e0"});
    CHECK(absl::StrContains(r.impossible, "relay engine e0 on node n0"));
    CHECK(absl::StrContains(r.impossible, "root"));
  }
  {  // nothing dead: nothing changes
    const daemon::RelayReroute r = daemon::RerouteRelays(Tree7(), {});
    CHECK(r.adopted.empty());
    CHECK(r.changed.empty());
  }
}

// Pushes step `step` like testing::PushStep, calling `midway` once `share` of the tensors the daemon asks for were
// pushed (rounded down; 1: after the push ended).
absl::Status PushStepWith(client::TrainerClient& c, const std::map<std::string, replica::TensorSpec>& specs,
                          int64_t step, double share, const std::function<void()>& midway) {
  auto names = c.BeginPush(step);
  if (!names.ok()) return names.status();
  const size_t at = static_cast<size_t>(share * static_cast<double>(names->size()));
  for (size_t i = 0; i < names->size(); ++i) {
    if (i == at) midway();
    auto it = specs.find((*names)[i]);
    if (it == specs.end()) return absl::NotFoundError("the daemon asked for " + (*names)[i] + ", which the model lacks");
    if (absl::Status st = testing::PushGenerated(c, it->second, step); !st.ok()) return st;
  }
  absl::Status st = c.EndPush(step);
  if (at >= names->size()) midway();
  return st;
}

// The middle of a chain (engine1 on infer1) dies, kill -9 of its target daemon while the trainer pushes update v
// (once `share` of the tensors were pushed; 1: after the push, once its first forwarded ranges landed). The update completes: engine2 is
// re-parented to the root (engine0), which forwards it everything from the start; engine0 and engine2 hold step v
// bit-exactly by their own loaders, engine1 is dropped (named in the record, kept paused at its old label, stale).
// Its daemon restarted, update v+1 lands on all three.
void KillMiddleRelay(Cluster& cl, client::TrainerClient& trainer, client::CoordinatorClient& coord,
                     const std::map<std::string, replica::TensorSpec>& specs, int64_t v, double share,
                     uint64_t instance, const std::string& relay_log) {
  INFO("update " << v << ": infer1 killed once " << share << " of the tensors were pushed");
  REQUIRE(coord.BeginUpdate(v, "", "", "off").ok());
  absl::Status pushed = PushStepWith(trainer, specs, v, share, [&] {
    if (share >= 1)
      REQUIRE(WaitForLog(cl, relay_log, absl::StrCat("relay infer1: update ", v,
                                                     " engine engine1: first ranges landed from infer0")));
    cl.KillTarget(1);
  });
  REQUIRE(pushed.ok());
  auto rec = coord.CommitUpdate(v, 30);
  INFO(rec.status().ToString() << "\n" << cl.LogTails());
  REQUIRE(rec.ok());
  CHECK(rec->bytes() == instance);  // the sources wrote the root only
  REQUIRE(rec->dropped_size() == 1);
  CHECK(absl::StrContains(rec->dropped(0), "engine1"));
  CHECK(absl::StrContains(rec->dropped(0), "infer1"));
  for (int e : {0, 2}) {
    INFO("engine " << cl.engines[e] << " step " << v);
    CHECK(testing::Info(cl.engines[e]).weight_version() == std::to_string(v));
    CHECK(testing::Verify(cl.engines[e], v).ok());
    CHECK_FALSE(testing::Info(cl.engines[e]).paused());
  }
  const v1::EngineInfo dropped = testing::Info(cl.engines[1]);
  CHECK(dropped.paused());
  CHECK(dropped.weight_version() == std::to_string(v - 1));
  auto st = coord.Status();
  REQUIRE(st.ok());
  for (const auto& n : st->nodes())
    for (const auto& e : n.engine_details())
      if (e.engine_id() == "engine1") CHECK(e.state() == "failed: relay_drain");

  const int64_t epoch = st->membership_epoch();
  cl.RestartTarget(1);
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (bool back = false; !back;) {  // its registration moves the membership epoch
    REQUIRE(std::chrono::steady_clock::now() < end);
    auto s = coord.Status();
    REQUIRE(s.ok());
    back = s->membership_epoch() > epoch;
    if (!back) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  REQUIRE(coord.BeginUpdate(v + 1, "", "", "off").ok());
  REQUIRE(testing::PushStep(trainer, specs, v + 1).ok());
  auto next = coord.CommitUpdate(v + 1, 30);
  INFO(next.status().ToString() << "\n" << cl.LogTails());
  REQUIRE(next.ok());
  CHECK(next->dropped_size() == 0);
  for (const auto& e : cl.engines) {
    INFO("engine " << e << " step " << v + 1);
    CHECK(testing::Info(e).weight_version() == std::to_string(v + 1));
    CHECK(testing::Verify(e, v + 1).ok());
  }
}

// A chain of three instances (relay degree 1) of the tiny model at kTp, each its own target node.
ClusterOptions ChainOfThree() {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.tp = kTp;
  o.engines = 3;
  o.coordinator_args = {"--strategy", "balanced", "--min-source-mib", "0", "--relay", "1"};
  return o;
}

// Update 1 (dense), committed: every engine holds step 1 before the faulted update.
void CommitFirst(Cluster& cl, client::TrainerClient& trainer, client::CoordinatorClient& coord,
                 const std::map<std::string, replica::TensorSpec>& specs) {
  REQUIRE(coord.BeginUpdate(1, "", "", "off").ok());
  REQUIRE(testing::PushStep(trainer, specs, 1).ok());
  auto first = coord.CommitUpdate(1, 30);
  INFO(first.status().ToString() << "\n" << cl.LogTails());
  REQUIRE(first.ok());
}

// Issue 41 item 4: a relay that dies mid-update is routed around within the update (docs/planner.md, "A relay that
// dies"), at seeded points of the push: before anything was pushed, after a seeded number of tensors, and once its
// first forwarded ranges landed.
TEST_CASE("relay: the middle of a chain killed mid-update is routed around; its children verified, it is named") {
  const auto specs = testing::Specs(kModel);
  Cluster cl(ChainOfThree());
  INFO("cluster logs in " << cl.dir());
  auto trainer = testing::ConnectTrainer(cl.trainer_sockets[0]);
  REQUIRE(trainer.ok());
  client::CoordinatorClient coord(cl.coordinator);
  const uint64_t instance = InstanceBytes(cl.engines[0]);
  CommitFirst(cl, **trainer, coord, specs);
  const uint32_t seed = Catch::rngSeed() != 0 ? Catch::rngSeed() : 41;
  std::mt19937 rng(seed);
  INFO("seed " << seed << " (--rng-seed)");
  int64_t v = 2;
  int restarts = 0;  // infer1's daemon is restarted after each kill (Cluster::RestartTarget names its log)
  for (double share : {0.0, std::uniform_real_distribution<double>(0.05, 0.95)(rng), 1.0}) {
    KillMiddleRelay(cl, **trainer, coord, specs, v, share, instance,
                    restarts == 0 ? "target1" : absl::StrCat("target1-restarted", restarts));
    ++restarts;
    v += 2;
  }
}

// The case that cannot be routed around: the root of the chain (engine0 on infer0) dies mid-update. Its children have
// no live relay above them and the sources write only the root: the commit fails naming it, and no engine resumes
// (those below it may hold a mix), each at its old label.
TEST_CASE("relay: the root of a chain killed mid-update fails the commit naming it; no engine resumes") {
  const auto specs = testing::Specs(kModel);
  Cluster cl(ChainOfThree());
  INFO("cluster logs in " << cl.dir());
  auto trainer = testing::ConnectTrainer(cl.trainer_sockets[0]);
  REQUIRE(trainer.ok());
  client::CoordinatorClient coord(cl.coordinator);
  CommitFirst(cl, **trainer, coord, specs);

  REQUIRE(coord.BeginUpdate(2, "", "", "off").ok());
  // Once bytes of update 2 landed in the root (before, a source that fails at once resumes every engine: resume old
  // if nothing was written), wherever the push and the forwarding are then.
  absl::Status pushed = PushStepWith(**trainer, specs, 2, 1, [&] {
    REQUIRE(WaitForLog(cl, "target0", "relay infer0: update 2 engine engine0: first ranges landed from train0"));
    cl.KillTarget(0);
  });
  INFO(pushed.ToString());
  auto rec = coord.CommitUpdate(2, 30);
  INFO(rec.status().ToString() << "\n" << cl.LogTails());
  REQUIRE(!rec.ok());
  const std::string why(rec.status().message());
  CHECK((why.find("engine0") != std::string::npos && why.find("infer0") != std::string::npos));
  auto st = coord.Status();
  REQUIRE(st.ok());
  CHECK(st->state() == "failed");
  CHECK(st->engines_hold_partial_writes());
  for (const auto& e : cl.engines) {  // each engine's own view: paused, at its old label
    const v1::EngineInfo info = testing::Info(e);
    INFO("engine " << e);
    CHECK(info.paused());
    CHECK(info.weight_version() == "1");
  }
  CHECK(!coord.ResumeEngines().ok());  // they may hold a mix: only a successful update resumes them
}

}  // namespace
}  // namespace wsync
