// The authenticated control plane and the per-connection write grants, attacked through a real local cluster of
// separate processes with mutual TLS on (docs/security.md):
//   * every RPC of every wsync service (enumerated from the service descriptors, so a new RPC without a role check
//     fails here) refuses callers without a certificate, with a certificate of another CA, and with every role the
//     role table does not allow; so does the target daemon's EngineControl facade, with its own table;
//   * a node cannot register or heartbeat under another node's id;
//   * crafted data-port writes are refused outside the write window, without a secret (the transport token alone),
//     with a foreign or expired secret, into a region of another engine rank, and after the plan revoked the grant;
//     the engine's bytes stay unchanged (per-parameter checksums) and the refusals are counted;
//   * an idle-connection flood on the data port is bounded (threads, fds) and the listener keeps serving;
//   * --insecure (or no TLS) on a non-loopback address is refused by every daemon;
//   * every binary refuses to start with a certificate that is not its own identity (role, and id where it has one);
//   * handshakes without a client certificate are counted in /metrics and logged once, not once each;
//   * the demo trainer's driver, holding a trainer certificate, ends a failed update without an admin's call;
// and a complete update through the same cluster still lands bit-exactly (verified by the engine's own loader).

#include <arpa/inet.h>
#include <dirent.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/client_unary_call.h>
#include <grpcpp/impl/codegen/rpc_method.h>
#include <netinet/in.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "daemon/common/serve.h"
#include "daemon/coordinator/state_store.h"
#include "daemon/node/node_services.h"
#include "google/protobuf/descriptor.h"
#include "proto/tls.h"
#include "tests/daemon/cluster.h"
#include "tests/daemon/raw_rpc.h"
#include "tests/daemon/loopback_port.h"
#include "transport/transport.h"
#include "wsync/v1/coordinator.grpc.pb.h"
#include "wsync/v1/daemon.grpc.pb.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace wsync {
namespace {

using testing::Cluster;
using testing::ClusterOptions;
using testing::ReadFile;

const char* kBin = WSYNC_BIN_DIR;
const char* kModel = WSYNC_TINY_MODEL;
const char* kCertsScript = WSYNC_CERTS_SCRIPT;

const std::vector<std::string> kRoles = {"coordinator", "source", "target", "engine", "admin", "trainer"};

// The role table of docs/security.md, written out independently of the servers' code. "*" = any role; "self" =
// a source or target node acting as itself only (an empty request names nobody, so every role is refused);
// "exempt" = the trainer-rank RPCs, left to the local-socket change (any certificate of the CA may call them).
const std::map<std::string, std::set<std::string>>& RoleTable() {
  static const std::map<std::string, std::set<std::string>> t = {
      {"wsync.v1.Coordinator/RegisterNode", {"self"}},
      {"wsync.v1.Coordinator/Heartbeat", {"self"}},
      {"wsync.v1.Coordinator/ReportUpdateFailure", {"self"}},
      {"wsync.v1.Coordinator/GetClusterStatus", {"*"}},
      {"wsync.v1.Coordinator/GetHistory", {"*"}},
      {"wsync.v1.Coordinator/WatchEngines", {"*"}},
      {"wsync.v1.Coordinator/BeginUpdate", {"trainer", "admin"}},
      {"wsync.v1.Coordinator/CommitUpdate", {"trainer", "admin"}},
      {"wsync.v1.Coordinator/AbortUpdate", {"admin"}},
      {"wsync.v1.Coordinator/ResumeEngines", {"admin"}},
      {"wsync.v1.Coordinator/RemoveNode", {"admin"}},
      {"wsync.v1.Coordinator/Drain", {"admin"}},
      {"wsync.v1.Coordinator/Undrain", {"admin"}},
      {"wsync.v1.NodeDaemon/ConfigureSource", {"coordinator"}},
      {"wsync.v1.NodeDaemon/StartUpdate", {"coordinator"}},
      {"wsync.v1.NodeDaemon/FinishUpdate", {"coordinator"}},
      {"wsync.v1.NodeDaemon/AbortSourceUpdate", {"coordinator"}},
      {"wsync.v1.NodeDaemon/SetWriteWindow", {"coordinator"}},
      {"wsync.v1.NodeDaemon/ApplyDelta", {"coordinator"}},
      {"wsync.v1.NodeDaemon/ConnectTarget", {"source", "target"}},
      {"wsync.v1.NodeDaemon/SetRelay", {"coordinator"}},
      {"wsync.v1.NodeDaemon/RelayLanded", {"source", "target"}},
      {"wsync.v1.NodeDaemon/RelayDrain", {"coordinator"}},
      {"wsync.v1.NodeDaemon/GetNodeStatus", {"*"}},
      {"wsync.v1.NodeDaemon/GetWriteChecksums", {"admin", "trainer", "coordinator"}},
      {"wsync.v1.EngineControl/GetInfo", {"*"}},
      {"wsync.v1.EngineControl/GetParallelism", {"*"}},
      {"wsync.v1.EngineControl/GetWeightLayout", {"*"}},
      {"wsync.v1.EngineControl/Pause", {"coordinator", "target"}},
      {"wsync.v1.EngineControl/PostProcess", {"coordinator", "target"}},
      {"wsync.v1.EngineControl/SetWeightVersion", {"coordinator", "target"}},
      {"wsync.v1.EngineControl/Continue", {"coordinator", "target"}},
      {"wsync.v1.EngineControl/Switch", {"coordinator", "target"}},
      {"wsync.v1.EngineControl/PrepareSwitch", {"coordinator", "target"}},
      {"wsync.v1.EngineControl/Attach", {"target"}},
      {"wsync.v1.EngineControl/GetChecksums", {"admin", "trainer", "coordinator"}},
      {"wsync.v1.EngineControl/Verify", {"admin", "trainer"}},
  };
  return t;
}

struct Certs {
  std::string dir, foreign;
};

const Certs& MakeCerts() {
  static Certs c = [] {
    char tmpl[] = "/tmp/wsync-sec-certs.XXXXXX";
    Certs out;
    out.dir = mkdtemp(tmpl);
    out.foreign = out.dir + "/foreign";
    const std::string base = absl::StrCat(kCertsScript, " ", out.dir, " coordinator:main engine:engine0 target:infer0 ",
                                          "source:train0 admin:ops trainer:t0 >/dev/null");
    REQUIRE(std::system(base.c_str()) == 0);
    // One more certificate per role that is not any node's identity, to try every role against every RPC.
    REQUIRE(std::system(absl::StrCat(kCertsScript, " ", out.dir,
                                     " coordinator:x source:x target:x engine:x admin:x trainer:x >/dev/null")
                            .c_str()) == 0);
    // Another source node's identity (a daemon started with it under the wrong --node-id must refuse to start).
    REQUIRE(std::system(absl::StrCat(kCertsScript, " ", out.dir, " source:train1 >/dev/null").c_str()) == 0);
    // The same names under another CA: valid certificates, wrong issuer.
    REQUIRE(std::system(absl::StrCat(kCertsScript, " ", out.foreign, " admin:ops coordinator:main >/dev/null").c_str()) ==
            0);
    return out;
  }();
  return c;
}

// A channel as `cert` ("admin-ops") of the CA in `dir`; `cert` empty: TLS without a client certificate.
std::shared_ptr<grpc::Channel> As(const std::string& addr, const std::string& dir, const std::string& cert,
                                  const std::string& trust_dir = "") {
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = ReadFile((trust_dir.empty() ? dir : trust_dir) + "/ca.pem");
  if (!cert.empty()) {
    o.pem_cert_chain = ReadFile(dir + "/" + cert + ".pem");
    o.pem_private_key = ReadFile(dir + "/" + cert + "-key.pem");
  }
  return grpc::CreateChannel(addr, grpc::SslCredentials(o));
}

// Calls /`method` with an empty request (any content would do: the role check comes first).
grpc::Status CallRaw(const std::shared_ptr<grpc::Channel>& ch, const std::string& method) {
  return testing::CallRaw(ch, method, "", std::chrono::seconds(5));
}
using testing::Methods;

int CountDir(const std::string& path) {
  int n = 0;
  if (DIR* d = opendir(path.c_str())) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

ClusterOptions TlsCluster() {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.engines = 1;
  o.tp = 2;
  o.tls_dir = MakeCerts().dir;
  return o;
}

// One update through the cluster by the demo trainer (trainer certificate), verified by the engine's own loader.
bool DemoUpdate(Cluster& cl, int64_t version) {
  std::vector<std::string> argv = {std::string(kBin) + "/wsync-trainer-demo", "--daemon", cl.trainer_sockets[0], "--model",
                                   kModel, "--updates", "1", "--first-version", std::to_string(version), "--drive",
                                   "--coordinator", cl.coordinator, "--verify-engine", cl.engines[0]};
  for (auto& f : testing::TlsFlags(MakeCerts().dir, "trainer-t0")) argv.push_back(f);
  const int rc = cl.Run(absl::StrCat("demo", version), argv, std::chrono::seconds(120));
  const std::string log = cl.Log(absl::StrCat("demo", version));
  INFO(log);
  return rc == 0 && !absl::StrContains(log, "MISMATCH");
}

// The region descriptors of engine0's ranks as the target registered them, read from the coordinator's state store:
// an attacker who learnt them (from a source's memory, a log, a disk) must still be unable to write with them.
std::vector<std::string> LeakedDescriptors(const std::string& db) {
  auto store = daemon::SqliteStateStore::Open(db);
  REQUIRE(store.ok());
  auto st = (*store)->Load();
  REQUIRE(st.ok());
  std::vector<std::string> out;
  for (const auto& n : st->nodes())
    for (const auto& e : n.engines())
      for (const auto& r : e.ranks()) {
        REQUIRE(r.segments_size() >= 1);
        out.push_back(r.segments(0).region_descriptor());
      }
  REQUIRE(out.size() == 2);
  return out;
}

TEST_CASE("security: every RPC of every service refuses unauthenticated and wrong-role callers") {
  Cluster cl(TlsCluster());
  const Certs& certs = MakeCerts();
  REQUIRE(DemoUpdate(cl, 1));  // the TLS cluster works end to end

  struct Server {
    std::string name, address, service;
  };
  const std::vector<Server> servers = {
      {"coordinator", cl.coordinator, "wsync.v1.Coordinator"},
      {"target daemon", cl.targets[0], "wsync.v1.NodeDaemon"},
      {"source daemon", cl.sources[0], "wsync.v1.NodeDaemon"},
      {"reference engine", cl.engines[0], "wsync.v1.EngineControl"},
  };
  int refused = 0, checked_methods = 0;
  for (const auto& srv : servers) {
    for (const auto& m : Methods(srv.service)) {
      INFO(srv.name << " " << srv.address << " " << m);
      auto row = RoleTable().find(m);
      // A new RPC needs a row here (and a check in its server): this fails until both exist.
      REQUIRE(row != RoleTable().end());
      ++checked_methods;
      // No client certificate, and a certificate of another CA: the handshake fails, nothing reaches the method.
      grpc::Status s = CallRaw(As(srv.address, certs.dir, ""), m);
      CHECK(s.error_code() == grpc::StatusCode::UNAVAILABLE);
      s = CallRaw(As(srv.address, certs.foreign, "admin-ops", certs.dir), m);
      CHECK(s.error_code() == grpc::StatusCode::UNAVAILABLE);
      refused += 2;
      if (row->second.count("exempt")) continue;
      for (const auto& role : kRoles) {
        const bool allowed = row->second.count("*") || row->second.count(role);
        if (allowed) continue;
        INFO("as " << role << ":x");
        s = CallRaw(As(srv.address, certs.dir, role + "-x"), m);
        CHECK(s.error_code() == grpc::StatusCode::PERMISSION_DENIED);
        CHECK(absl::StrContains(s.error_message(), "refused for " + role + ":x"));
        ++refused;
      }
    }
  }
  std::printf("security: %d methods on %zu servers, %d unauthenticated/wrong-role calls refused\n", checked_methods,
              servers.size(), refused);
  // Nothing above changed the cluster: another update lands.
  REQUIRE(DemoUpdate(cl, 2));
}

TEST_CASE("security: a node cannot register or heartbeat as another node") {
  Cluster cl(TlsCluster());
  const Certs& certs = MakeCerts();
  auto as_source = v1::Coordinator::NewStub(As(cl.coordinator, certs.dir, "source-train0"));
  auto as_target = v1::Coordinator::NewStub(As(cl.coordinator, certs.dir, "target-infer0"));
  v1::RegisterNodeRequest hijack;
  hijack.set_node_id("infer0");
  hijack.set_role("target");
  hijack.set_address("127.0.0.1:1");
  {
    grpc::ClientContext ctx;
    v1::RegisterNodeReply r;
    grpc::Status s = as_source->RegisterNode(&ctx, hijack, &r);
    CHECK(s.error_code() == grpc::StatusCode::PERMISSION_DENIED);
    CHECK(absl::StrContains(s.error_message(), "only as itself"));
  }
  {
    // The right id with the wrong role (a target certificate registering a source) is refused too.
    v1::RegisterNodeRequest r2 = hijack;
    r2.set_role("source");
    grpc::ClientContext ctx;
    v1::RegisterNodeReply r;
    CHECK(as_target->RegisterNode(&ctx, r2, &r).error_code() == grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    v1::HeartbeatRequest hb;
    hb.set_node_id("infer0");
    hb.set_address("127.0.0.1:1");
    grpc::ClientContext ctx;
    v1::HeartbeatReply r;
    CHECK(as_source->Heartbeat(&ctx, hb, &r).error_code() == grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    // A failure report comes only from a source, as itself: the target infer0 under its own id and a source naming
    // infer0 are both refused (a forged report would end an open update).
    v1::ReportUpdateFailureRequest rep;
    rep.set_node_id("infer0");
    rep.set_version(1);
    rep.set_error("forged");
    grpc::ClientContext c1, c2;
    v1::ReportUpdateFailureReply r;
    CHECK(as_target->ReportUpdateFailure(&c1, rep, &r).error_code() == grpc::StatusCode::PERMISSION_DENIED);
    CHECK(as_source->ReportUpdateFailure(&c2, rep, &r).error_code() == grpc::StatusCode::PERMISSION_DENIED);
  }
  // infer0 still sits at its own address.
  auto admin = v1::Coordinator::NewStub(As(cl.coordinator, certs.dir, "admin-ops"));
  grpc::ClientContext ctx;
  v1::ClusterStatus st;
  REQUIRE(admin->GetClusterStatus(&ctx, v1::ClusterStatusRequest(), &st).ok());
  bool found = false;
  for (const auto& n : st.nodes())
    if (n.node_id() == "infer0") {
      found = true;
      CHECK(n.address() == cl.targets[0]);
    }
  CHECK(found);
  REQUIRE(DemoUpdate(cl, 1));
}

// GET http://127.0.0.1:`port``path` (HTTP/1.0, the whole answer).
std::string HttpGet(int port, const std::string& path) {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  REQUIRE(::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  const std::string req = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  REQUIRE(::send(s, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size()));
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::recv(s, buf, sizeof(buf), 0)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(s);
  return out;
}

// The value of an unlabelled series in a Prometheus text page; -1 when absent.
double MetricValue(const std::string& page, const std::string& name) {
  for (absl::string_view line : absl::StrSplit(page, '\n'))
    if (absl::StartsWith(line, name + " ")) return std::stod(std::string(line.substr(name.size() + 1)));
  return -1;
}

// The engine's per-parameter checksums of every rank (admin certificate).
std::map<std::string, std::string> EngineSums(Cluster& cl, int ranks) {
  auto stub = v1::EngineControl::NewStub(As(cl.engines[0], MakeCerts().dir, "admin-ops"));
  std::map<std::string, std::string> out;
  for (int r = 0; r < ranks; ++r) {
    grpc::ClientContext ctx;
    v1::RankRequest req;
    req.set_rank(r);
    v1::ChecksumReply rep;
    REQUIRE(stub->GetChecksums(&ctx, req, &rep).ok());
    for (const auto& p : rep.params()) out[absl::StrCat(r, "/", p.name())] = p.xxh128();
  }
  REQUIRE(!out.empty());
  return out;
}

uint64_t RefusedWrites(Cluster& cl) {
  auto stub = v1::NodeDaemon::NewStub(As(cl.targets[0], MakeCerts().dir, "admin-ops"));
  grpc::ClientContext ctx;
  v1::NodeStatus st;
  REQUIRE(stub->GetNodeStatus(&ctx, v1::NodeStatusRequest(), &st).ok());
  return st.refused_writes();
}

TEST_CASE("security: crafted data-port writes are refused and leave the engine's bytes unchanged") {
  ClusterOptions o = TlsCluster();
  const std::string db = MakeCerts().dir + "/coordinator-state.db";
  std::remove(db.c_str());
  o.coordinator_args = {"--state", db};
  const int target_metrics = testing::FreeLoopbackPort();
  o.target_args = {"--metrics-listen", absl::StrCat("127.0.0.1:", target_metrics)};
  Cluster cl(o);
  const Certs& certs = MakeCerts();
  REQUIRE(DemoUpdate(cl, 1));
  const auto before = EngineSums(cl, 2);

  // The attacker holds a valid source certificate ("source:x", assigned nothing by the plan), runs its own tcp
  // transport, and knows the real region descriptors of both ranks.
  auto tr = transport::CreateTransport("tcp", {});
  REQUIRE(tr.ok());
  std::vector<uint8_t> junk(1 << 16, 0xA5);
  auto src = (*tr)->RegisterMemory(junk.data(), junk.size());
  REQUIRE(src.ok());
  std::vector<std::unique_ptr<transport::RemoteRegion>> region;  // segment 0 of rank 0 and of rank 1
  for (const auto& d : LeakedDescriptors(db)) {
    auto rr = (*tr)->ImportRegion(d);
    REQUIRE(rr.ok());
    region.push_back(*std::move(rr));
  }
  const uint64_t n = std::min<uint64_t>(junk.size(), region[1]->length());
  auto write_to = [&](transport::Endpoint& ep, int r) {
    transport::WriteRequest w{src->get(), 0, region[r].get(), 0, std::min<uint64_t>(n, region[r]->length())};
    return ep.Write({&w, 1}, absl::Seconds(10));
  };
  auto daemon = [&](const std::string& cert) { return v1::NodeDaemon::NewStub(As(cl.targets[0], certs.dir, cert)); };
  // ConnectTarget as `cert` for engine0 rank `rank`: the attacker's endpoint, connected with the reply's info.
  auto connect = [&](const std::string& cert, int rank, std::string* info_out) -> std::unique_ptr<transport::Endpoint> {
    auto ep = (*tr)->CreateEndpoint();
    REQUIRE(ep.ok());
    v1::ConnectTargetRequest req;
    req.set_engine_id("engine0");
    req.set_rank(rank);
    req.set_source_endpoint_info((*ep)->LocalInfo());
    v1::ConnectTargetReply rep;
    grpc::ClientContext ctx;
    grpc::Status s = daemon(cert)->ConnectTarget(&ctx, req, &rep);
    INFO(s.error_message());
    REQUIRE(s.ok());
    if (info_out) *info_out = rep.target_endpoint_info();
    REQUIRE((*ep)->Connect(rep.target_endpoint_info(), absl::Seconds(10)).ok());
    return *std::move(ep);
  };
  auto set_window = [&](bool open, std::vector<std::tuple<std::string, std::string, int>> assigned, bool given) {
    v1::SetWriteWindowRequest req;
    req.set_open(open);
    req.set_version(99);
    req.set_assignments_given(given);
    for (const auto& [s, e, r] : assigned) {
      auto* a = req.add_assignments();
      a->set_source_node(s);
      a->set_engine_id(e);
      a->set_rank(r);
    }
    v1::SetWriteWindowReply rep;
    grpc::ClientContext ctx;
    REQUIRE(daemon("coordinator-main")->SetWriteWindow(&ctx, req, &rep).ok());
    return rep;
  };
  const uint64_t refused0 = RefusedWrites(cl);

  // Only a source may ask for a connection.
  {
    v1::ConnectTargetRequest req;
    req.set_engine_id("engine0");
    v1::ConnectTargetReply rep;
    grpc::ClientContext ctx;
    CHECK(daemon("admin-ops")->ConnectTarget(&ctx, req, &rep).error_code() == grpc::StatusCode::PERMISSION_DENIED);
  }
  std::string info0;
  auto ep0 = connect("source-x", 0, &info0);
  const std::vector<std::string> parts = absl::StrSplit(info0, ' ');
  REQUIRE(parts.size() == 5);  // "wsync-tcp/1 host port token secret"

  // 1. Outside a window, even with a live secret for the rank.
  absl::Status st = write_to(*ep0, 0);
  CHECK(absl::IsPermissionDenied(st));
  CHECK(absl::StrContains(st.message(), "window is closed"));

  set_window(true, {}, false);  // the window alone, grants not narrowed: each check below is the only one failing
  // 2. The transport token without a secret (the old, transport-wide authorization).
  {
    auto ep = (*tr)->CreateEndpoint();
    REQUIRE(ep.ok());
    REQUIRE((*ep)->Connect(absl::StrCat(parts[0], " ", parts[1], " ", parts[2], " ", parts[3]), absl::Seconds(10)).ok());
    st = write_to(**ep, 0);
    CHECK(absl::IsPermissionDenied(st));
    CHECK(absl::StrContains(st.message(), "write secret"));
  }
  // 3. A foreign (made-up) secret: refused at the hello.
  {
    auto ep = (*tr)->CreateEndpoint();
    REQUIRE(ep.ok());
    st = (*ep)->Connect(absl::StrCat(parts[0], " ", parts[1], " ", parts[2], " ", parts[3], " ",
                                     "0123456789abcdef0123456789abcdef"),
                        absl::Seconds(10));
    CHECK(absl::IsPermissionDenied(st));
  }
  // 4. Into another rank's region over rank 0's connection. While the source's connection is live, its repeat
  //    ConnectTarget gets the same grant (docs/operations.md, "A source's connection to an engine rank").
  std::string info_old, info_again;
  auto ep_old = connect("source-x", 0, &info_old);
  auto ep0b = connect("source-x", 0, &info_again);
  CHECK(info_again == info_old);
  st = write_to(*ep0b, 1);
  CHECK(absl::IsPermissionDenied(st));
  CHECK(absl::StrContains(st.message(), "not covered by this connection's write grant"));
  // 5. Once its connections closed, the next ConnectTarget replaces the grant: the expired secret is refused at the
  //    hello. (An open connection whose grant is revoked is refused at its next frame: 6.)
  ep_old.reset();
  ep0b.reset();
  std::string info_new = info_old;
  for (int i = 0; i < 100 && info_new == info_old; ++i) {
    absl::SleepFor(absl::Milliseconds(50));  // until the target saw the connections close
    auto probe = (*tr)->CreateEndpoint();
    REQUIRE(probe.ok());
    v1::ConnectTargetRequest req;
    req.set_engine_id("engine0");
    req.set_rank(0);
    req.set_source_endpoint_info((*probe)->LocalInfo());
    v1::ConnectTargetReply rep;
    grpc::ClientContext ctx;
    REQUIRE(daemon("source-x")->ConnectTarget(&ctx, req, &rep).ok());
    info_new = rep.target_endpoint_info();
  }
  CHECK(info_new != info_old);
  {
    auto ep = (*tr)->CreateEndpoint();
    REQUIRE(ep.ok());
    CHECK(absl::IsPermissionDenied((*ep)->Connect(info_old, absl::Seconds(10))));
  }
  // 6. The plan assigns rank 0 to train0, not to source:x: opening the window for it revokes x's grant.
  auto ep0c = connect("source-x", 0, nullptr);
  set_window(false, {}, false);
  auto rep = set_window(true, {{"train0", "engine0", 0}, {"train0", "engine0", 1}}, true);
  CHECK(rep.grants_revoked() >= 1);
  st = write_to(*ep0c, 0);
  CHECK(absl::IsPermissionDenied(st));
  CHECK(absl::StrContains(st.message(), "revoked"));
  // ... and while it is open, x cannot get a new grant for a rank the plan gives another source.
  {
    auto ep = (*tr)->CreateEndpoint();
    REQUIRE(ep.ok());
    v1::ConnectTargetRequest req;
    req.set_engine_id("engine0");
    req.set_rank(0);
    req.set_source_endpoint_info((*ep)->LocalInfo());
    v1::ConnectTargetReply r;
    grpc::ClientContext ctx;
    CHECK(daemon("source-x")->ConnectTarget(&ctx, req, &r).error_code() == grpc::StatusCode::PERMISSION_DENIED);
  }
  set_window(false, {}, false);

  const uint64_t refused1 = RefusedWrites(cl);
  std::printf("security: refused_writes %llu -> %llu\n", static_cast<unsigned long long>(refused0),
              static_cast<unsigned long long>(refused1));
  CHECK(refused1 >= refused0 + 6);
  // Prometheus has the same count.
  CHECK(MetricValue(HttpGet(target_metrics, "/metrics"), "wsync_refused_writes_total") ==
        static_cast<double>(RefusedWrites(cl)));
  // Not one byte changed: every parameter's checksum on every rank is what it was after update 1.
  CHECK(EngineSums(cl, 2) == before);
  ep0.reset();
  ep_old.reset();
  ep0b.reset();
  ep0c.reset();
  // The legitimate source still writes: the next update lands, verified by the engine.
  REQUIRE(DemoUpdate(cl, 2));
  CHECK(EngineSums(cl, 2) != before);
}

TEST_CASE("security: an idle-connection flood on the data port is bounded and the listener keeps serving") {
  Cluster cl(TlsCluster());
  const Certs& certs = MakeCerts();
  REQUIRE(DemoUpdate(cl, 1));
  // The data port, from a ConnectTarget reply (any source certificate).
  std::string port;
  {
    v1::ConnectTargetRequest req;
    req.set_engine_id("engine0");
    auto tr = transport::CreateTransport("tcp", {});
    REQUIRE(tr.ok());
    auto ep = (*tr)->CreateEndpoint();
    req.set_source_endpoint_info((*ep)->LocalInfo());
    v1::ConnectTargetReply rep;
    grpc::ClientContext ctx;
    REQUIRE(v1::NodeDaemon::NewStub(As(cl.targets[0], certs.dir, "source-x"))->ConnectTarget(&ctx, req, &rep).ok());
    std::vector<std::string> parts = absl::StrSplit(rep.target_endpoint_info(), ' ');
    port = parts[2];
  }
  const pid_t pid = cl.target_pids[0];
  const std::string task = absl::StrCat("/proc/", pid, "/task"), fds = absl::StrCat("/proc/", pid, "/fd");
  const int threads0 = CountDir(task), fds0 = CountDir(fds);
  constexpr int kFlood = 2000;
  std::vector<int> socks;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(port)));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kFlood; ++i) {
    int s = ::socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0) break;
    if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      ::close(s);
      continue;
    }
    socks.push_back(s);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const int threads1 = CountDir(task), fds1 = CountDir(fds);
  // Connections closed by the daemon at once (over the per-peer cap) read EOF.
  int closed_now = 0;
  for (int s : socks) {
    char c;
    closed_now += ::recv(s, &c, 1, MSG_DONTWAIT) == 0;
  }
  std::printf("security: flood of %zu idle connections: daemon threads %d -> %d, fds %d -> %d, %d closed at once "
              "(%.2f s)\n",
              socks.size(), threads0, threads1, fds0, fds1, closed_now,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  CHECK(threads1 <= threads0 + 2);       // no thread per idle socket
  CHECK(fds1 <= fds0 + 64 + 8);          // the per-peer cap (64 pending) bounds the fds held
  CHECK(closed_now >= static_cast<int>(socks.size()) - 64 - 8);
  // Past the hello deadline (5 s) the rest are closed too.
  std::this_thread::sleep_for(std::chrono::seconds(6));
  int closed_later = 0;
  for (int s : socks) {
    char c;
    closed_later += ::recv(s, &c, 1, MSG_DONTWAIT) == 0;
  }
  CHECK(closed_later == static_cast<int>(socks.size()));
  CHECK(CountDir(fds) <= fds0 + 8);
  for (int s : socks) ::close(s);
  // The listener keeps serving: an update lands.
  REQUIRE(DemoUpdate(cl, 2));
}

TEST_CASE("security: without TLS, non-loopback addresses are refused; bad TLS flags are usage errors") {
  const Certs& certs = MakeCerts();
  char tmpl[] = "/tmp/wsync-sec-cli.XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  auto run = [&](const std::string& name, std::vector<std::string> argv) {
    testing::Process p(argv, dir + "/" + name + ".log");
    int rc = p.Wait(std::chrono::seconds(20));
    if (rc == -1) p.Stop();
    return rc;
  };
  auto log = [&](const std::string& name) { return ReadFile(dir + "/" + name + ".log"); };
  const std::string coord = std::string(kBin) + "/wsync-coordinator", wsyncd = std::string(kBin) + "/wsyncd";
  CHECK(run("c1", {coord, "--insecure", "--listen", "0.0.0.0:0"}) == 2);
  CHECK(absl::StrContains(log("c1"), "not loopback"));
  CHECK(run("c2", {coord, "--listen", "0.0.0.0:0"}) == 2);  // no TLS files: insecure by default, loopback only
  CHECK(run("d1", {wsyncd, "--insecure", "--role", "source", "--listen", "0.0.0.0:0", "--advertise", "10.1.2.3",
                   "--coordinator", "127.0.0.1:1"}) == 2);
  CHECK(absl::StrContains(log("d1"), "not loopback"));
  CHECK(run("d2", {wsyncd, "--insecure", "--role", "source", "--listen", "127.0.0.1:0", "--coordinator",
                   "10.1.2.3:7600"}) == 2);
  CHECK(run("e1", {std::string(kBin) + "/wsync-engine-ref", "--insecure", "--model", kModel, "--listen",
                   "0.0.0.0:0"}) == 2);
  CHECK(run("x1", {std::string(kBin) + "/wsyncctl", "--insecure", "--endpoints", "10.1.2.3:7600", "status"}) == 2);
  // Partial TLS flags, --insecure with TLS files.
  CHECK(run("c3", {coord, "--listen", "127.0.0.1:0", "--tls-ca", certs.dir + "/ca.pem"}) == 2);
  CHECK(absl::StrContains(log("c3"), "all three"));
  CHECK(run("c4", {coord, "--insecure", "--listen", "127.0.0.1:0", "--tls-ca", certs.dir + "/ca.pem", "--tls-cert",
                   certs.dir + "/coordinator-main.pem", "--tls-key", certs.dir + "/coordinator-main-key.pem"}) == 2);
  if (std::getenv("WSYNC_TEST_KEEP") == nullptr) std::system(("rm -rf " + dir).c_str());
}

// One TLS handshake with the gRPC server at 127.0.0.1:`port` as a client without a certificate (as a port scanner or
// a misconfigured client would); true when the server refused it.
bool CertlessHandshake(int port, const std::string& ca) {
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_client_method()), SSL_CTX_free);
  REQUIRE(ctx != nullptr);
  REQUIRE(SSL_CTX_load_verify_locations(ctx.get(), ca.c_str(), nullptr) == 1);
  static const unsigned char kAlpn[] = {2, 'h', '2'};  // as a gRPC client offers
  SSL_CTX_set_alpn_protos(ctx.get(), kAlpn, sizeof(kAlpn));
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{5, 0};
  ::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  REQUIRE(::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  SSL* ssl = SSL_new(ctx.get());
  SSL_set_fd(ssl, s);
  int rc = SSL_connect(ssl);
  // TLS 1.3: the client's side of the handshake may complete before the server has checked for a certificate; the
  // server's refusal (an alert, then the close) arrives at the first read.
  char c;
  if (rc == 1) rc = SSL_read(ssl, &c, 1);
  SSL_free(ssl);
  ::close(s);
  return rc <= 0;
}

TEST_CASE("security: every binary refuses to start with a certificate that is not its identity") {
  const Certs& certs = MakeCerts();
  char tmpl[] = "/tmp/wsync-sec-ids.XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  auto run = [&](const std::string& name, std::vector<std::string> argv, const std::string& cert) {
    for (auto& f : testing::TlsFlags(certs.dir, cert)) argv.push_back(f);
    testing::Process p(argv, dir + "/" + name + ".log");
    int rc = p.Wait(std::chrono::seconds(20));
    if (rc == -1) p.Stop();
    return rc;
  };
  auto log = [&](const std::string& name) { return ReadFile(dir + "/" + name + ".log"); };
  // The refusal names the certificate file and the CN found in it.
  auto names = [&](const std::string& name, const std::string& cert, const std::string& cn) {
    INFO(log(name));
    CHECK(absl::StrContains(log(name), absl::StrCat("--tls-cert ", certs.dir, "/", cert, ".pem")));
    CHECK(absl::StrContains(log(name), absl::StrCat("CN is \"", cn, "\"")));
  };
  const std::string bin = kBin;
  const std::string coord = bin + "/wsync-coordinator", wsyncd = bin + "/wsyncd", engine = bin + "/wsync-engine-ref";

  // A coordinator with a trainer's certificate.
  CHECK(run("coord", {coord, "--listen", "127.0.0.1:0"}, "trainer-t0") == 2);
  names("coord", "trainer-t0", "trainer:t0");
  // A source daemon whose --node-id is not its certificate's id, and one whose --role is not its certificate's role.
  const std::vector<std::string> src = {wsyncd,        "--role",           "source",
                                        "--listen",    "127.0.0.1:0",      "--coordinator",
                                        "127.0.0.1:1", "--trainer-socket", dir + "/s.sock"};
  auto with = [](std::vector<std::string> v, std::initializer_list<std::string> more) {
    v.insert(v.end(), more);
    return v;
  };
  CHECK(run("src-id", with(src, {"--node-id", "train0"}), "source-train1") == 2);
  names("src-id", "source-train1", "source:train1");
  CHECK(run("tgt-role",
            {wsyncd, "--role", "target", "--node-id", "train0", "--listen", "127.0.0.1:0", "--coordinator",
             "127.0.0.1:1", "--engine", "127.0.0.1:1"},
            "source-train0") == 2);
  names("tgt-role", "source-train0", "source:train0");
  CHECK(absl::StrContains(log("tgt-role"), "\"target:train0\""));  // and the CN it needed
  // A reference engine with another engine's certificate, and with a target's.
  CHECK(run("eng-id", {engine, "--id", "engine0", "--model", kModel, "--listen", "127.0.0.1:0"}, "engine-x") == 2);
  names("eng-id", "engine-x", "engine:x");
  CHECK(run("eng-role", {engine, "--id", "infer0", "--model", kModel, "--listen", "127.0.0.1:0"}, "target-infer0") ==
        2);
  names("eng-role", "target-infer0", "target:infer0");
  // wsyncctl: a command that changes state needs an admin certificate; verify an admin's or a trainer's.
  CHECK(run("ctl-abort", {bin + "/wsyncctl", "--endpoints", "127.0.0.1:1", "abort", "1"}, "trainer-t0") ==
        2);
  names("ctl-abort", "trainer-t0", "trainer:t0");
  CHECK(run("ctl-verify", {bin + "/wsyncctl", "--endpoints", "127.0.0.1:1", "verify"}, "coordinator-main") == 2);
  names("ctl-verify", "coordinator-main", "coordinator:main");
  // The demo trainer with an admin's certificate.
  CHECK(run("demo", {bin + "/wsync-trainer-demo", "--daemon", dir + "/s.sock", "--model", kModel}, "admin-ops") == 2);
  names("demo", "admin-ops", "admin:ops");

  // Matching certificates start: a coordinator (any name), a source daemon without --node-id, which takes its
  // certificate's id, and read-only wsyncctl commands with any role's certificate.
  testing::Process c(
      {coord, "--listen", "127.0.0.1:0", "--port-file", dir + "/c.port", "--tls-ca", certs.dir + "/ca.pem",
       "--tls-cert", certs.dir + "/coordinator-x.pem", "--tls-key", certs.dir + "/coordinator-x-key.pem"},
      dir + "/c.log");
  std::string port;
  for (int i = 0; i < 400 && (port.empty() || port.back() != '\n'); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    port = ReadFile(dir + "/c.port");
  }
  REQUIRE(!port.empty());
  const std::string coordinator = "127.0.0.1:" + port.substr(0, port.size() - 1);
  std::vector<std::string> src_args = {wsyncd,          "--role",        "source",       "--listen",
                                       "127.0.0.1:0",   "--coordinator", coordinator,    "--trainer-socket",
                                       dir + "/s.sock", "--port-file",   dir + "/s.port"};
  for (auto& f : testing::TlsFlags(certs.dir, "source-train1")) src_args.push_back(f);
  testing::Process s(src_args, dir + "/s.log");
  std::string node;
  for (int i = 0; i < 400 && node.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    grpc::ClientContext ctx;
    v1::ClusterStatus st;
    if (v1::Coordinator::NewStub(As(coordinator, certs.dir, "trainer-t0"))
            ->GetClusterStatus(&ctx, v1::ClusterStatusRequest(), &st)
            .ok())
      for (const auto& n : st.nodes()) node = n.node_id();
  }
  INFO(ReadFile(dir + "/s.log"));
  CHECK(node == "train1");
  CHECK(run("ctl-status", {bin + "/wsyncctl", "--endpoints", coordinator, "status"}, "trainer-t0") == 0);
  if (std::getenv("WSYNC_TEST_KEEP") == nullptr) std::system(("rm -rf " + dir).c_str());
}

TEST_CASE("security: handshakes without a client certificate are counted in /metrics and logged once") {
  ClusterOptions o = TlsCluster();
  const int metrics_port = testing::FreeLoopbackPort();
  o.coordinator_args = {"--metrics-listen", absl::StrCat("127.0.0.1:", metrics_port)};
  Cluster cl(o);
  const int port = std::stoi(cl.coordinator.substr(cl.coordinator.rfind(':') + 1));
  const double before = MetricValue(HttpGet(metrics_port, "/metrics"), "wsync_tls_handshake_failures_total");
  REQUIRE(before >= 0);
  constexpr int kBad = 40;
  int refused = 0;
  for (int i = 0; i < kBad; ++i) refused += CertlessHandshake(port, MakeCerts().dir + "/ca.pem");
  CHECK(refused == kBad);
  // The server logs (and counts) each failure as its handshake ends: wait for the count to settle.
  double after = before;
  for (int i = 0; i < 100 && after < before + kBad; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    after = MetricValue(HttpGet(metrics_port, "/metrics"), "wsync_tls_handshake_failures_total");
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  after = MetricValue(HttpGet(metrics_port, "/metrics"), "wsync_tls_handshake_failures_total");
  const std::string log = cl.Log("coordinator");
  int lines = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n')) lines += absl::StrContains(line, "andshake failed");
  std::printf("security: %d handshakes without a client certificate: counter %.0f -> %.0f, %d log line(s)\n", kBad,
              before, after, lines);
  INFO(log);
  CHECK(after == before + kBad);
  CHECK(lines >= 1);
  CHECK(lines <= 2);
  // The coordinator still serves certified callers.
  grpc::ClientContext ctx;
  v1::ClusterStatus st;
  CHECK(v1::Coordinator::NewStub(As(cl.coordinator, MakeCerts().dir, "admin-ops"))
            ->GetClusterStatus(&ctx, v1::ClusterStatusRequest(), &st)
            .ok());
}

TEST_CASE("security: the demo's driver (a trainer certificate) ends a failed update without AbortUpdate") {
  Cluster cl(TlsCluster());
  const Certs& certs = MakeCerts();
  REQUIRE(DemoUpdate(cl, 1));
  // A real failure on the trainer's side: it was asked to push FP8 pre-quantized tensors, and the model has none.
  std::vector<std::string> argv = {std::string(kBin) + "/wsync-trainer-demo",
                                   "--daemon",
                                   cl.trainer_sockets[0],
                                   "--model",
                                   kModel,
                                   "--updates",
                                   "1",
                                   "--first-version",
                                   "2",
                                   "--drive",
                                   "--coordinator",
                                   cl.coordinator,
                                   "--prequantize",
                                   "host"};
  for (auto& f : testing::TlsFlags(certs.dir, "trainer-t0")) argv.push_back(f);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(cl.Run("demo-fail", argv, std::chrono::seconds(120)) == 1);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string log = cl.Log("demo-fail");
  INFO(log);
  std::printf("security: the driver's failed update 2 ended in %.1f s\n", took);
  CHECK(absl::StrContains(log, "wsync demo: update 2 FAILED"));
  CHECK(absl::StrContains(log, "offers no tensor for FP8"));
  CHECK_FALSE(absl::StrContains(log, "PERMISSION_DENIED"));  // it made no call its role may not make
  // The coordinator recorded update 2 as failed (not left open), and the next update lands.
  grpc::ClientContext ctx;
  v1::HistoryRequest hreq;
  hreq.set_limit(10);
  v1::HistoryReply hist;
  REQUIRE(v1::Coordinator::NewStub(As(cl.coordinator, certs.dir, "admin-ops"))->GetHistory(&ctx, hreq, &hist).ok());
  bool recorded = false;
  for (const auto& r : hist.records())
    if (r.version() == 2) {
      recorded = true;
      CHECK_FALSE(r.success());
    }
  CHECK(recorded);
  REQUIRE(DemoUpdate(cl, 3));
}

// The role table of the target daemon's EngineControl facade (served for engines that attach through the engine
// socket, e.g. vLLM): as the reference engine's, except that only the coordinator drives the lifecycle.
std::map<std::string, std::set<std::string>> FacadeRoleTable() {
  std::map<std::string, std::set<std::string>> t;
  for (const auto& [m, roles] : RoleTable())
    if (absl::StartsWith(m, "wsync.v1.EngineControl/")) t[m] = roles;
  for (const char* m : {"Pause", "PostProcess", "SetWeightVersion", "Continue", "Switch", "PrepareSwitch"})
    t[absl::StrCat("wsync.v1.EngineControl/", m)] = {"coordinator"};
  return t;
}

// Last in this file: it configures this process's TLS (as a target daemon) to serve the facade.
TEST_CASE("security: the target's engine facade refuses unauthenticated and wrong-role callers") {
  const Certs& certs = MakeCerts();
  tls::Options o;
  o.ca = certs.dir + "/ca.pem";
  o.cert = certs.dir + "/target-infer0.pem";
  o.key = certs.dir + "/target-infer0-key.pem";
  REQUIRE(tls::Configure(o, {"127.0.0.1:0"}).ok());
  // No target behind it: every call the table refuses must be refused before the facade looks at its target.
  std::unique_ptr<grpc::Service> facade = daemon::MakeEngineFacade(nullptr, "facade0");
  auto served = daemon::Serve("127.0.0.1:0", {facade.get()}, "");
  REQUIRE(served.ok());
  const std::string addr = absl::StrCat("127.0.0.1:", served->port);
  const auto table = FacadeRoleTable();
  int refused = 0;
  for (const auto& m : Methods("wsync.v1.EngineControl")) {
    INFO("facade " << m);
    auto row = table.find(m);
    REQUIRE(row != table.end());  // a new RPC needs a row (and a check in the facade)
    CHECK(CallRaw(As(addr, certs.dir, ""), m).error_code() == grpc::StatusCode::UNAVAILABLE);
    CHECK(CallRaw(As(addr, certs.foreign, "admin-ops", certs.dir), m).error_code() == grpc::StatusCode::UNAVAILABLE);
    refused += 2;
    for (const auto& role : kRoles) {
      if (row->second.count("*") || row->second.count(role)) continue;
      INFO("as " << role << ":x");
      grpc::Status s = CallRaw(As(addr, certs.dir, role + "-x"), m);
      CHECK(s.error_code() == grpc::StatusCode::PERMISSION_DENIED);
      CHECK(absl::StrContains(s.error_message(), "refused for " + role + ":x"));
      ++refused;
    }
  }
  std::printf("security: target facade: %zu methods, %d unauthenticated/wrong-role calls refused\n",
              Methods("wsync.v1.EngineControl").size(), refused);
  served->server->Shutdown();
}

}  // namespace
}  // namespace wsync
