// wsyncd: the per-node daemon. role=source on trainer nodes (trainer sessions, CPU replica, writes to engines);
// role=target on inference nodes (maps and registers engine weight memory, accepts source connections).

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <functional>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/cli.h"
#include "base/logging.h"
#include "base/status.h"
#include "client/coordinator_client.h"
#include "daemon/common/engine_adapter.h"
#include "daemon/common/serve.h"
#include "daemon/node/connect_target_client.h"
#include "daemon/node/coordinator_link.h"
#include "daemon/node/node_services.h"
#include "daemon/node/trainer_socket.h"
#include "proto/status_convert.h"
#include "proto/tls.h"
#include "spdlog/spdlog.h"
#include "transport/fault/fault_transport.h"
#include "transport/registry.h"
#include "wsync/v1/coordinator.grpc.pb.h"

using namespace wsync;

namespace {

// A malformed --engine address is a usage error (exit 2), like any bad flag.
bool adapter_usage_error(const absl::Status& st) {
  return st.code() == absl::StatusCode::kInvalidArgument && absl::StrContains(st.message(), "engine address");
}

}  // namespace

int main(int argc, char** argv) {
  // Signals are taken synchronously by WaitForTermination; block them before any thread starts.
  daemon::BlockTerminationSignals();

  CLI::App app{"wsyncd: wsync node daemon (role source on trainer nodes, target on inference nodes)"};
  std::string role, node_id, listen = "127.0.0.1:7601", coordinator, advertise, port_file, transport_name = "tcp", log_level;
  cli::AddCommonFlags(app, "wsyncd", &log_level);
  std::string data_host;  // default: the host this node is reached at (--advertise, else --listen)
  std::vector<std::string> engines;
  std::string engine_socket;
  std::vector<uint32_t> engine_uids;
  double attach_timeout_s = 120, engine_timeout_s = 300;
  double tcp_progress_timeout_s = absl::ToDoubleSeconds(transport::TransportOptions().send_progress_timeout);
  int trainer_ranks = 1;
  uint64_t ring_mib = 512;
  app.add_option("--role", role, "source | target")->required()->check(CLI::IsMember({"source", "target"}));
  app.add_option("--node-id", node_id,
                 "unique node name; under TLS it must be the certificate's id (default: that id; without TLS "
                 "hostname-role-pid)");
  app.add_option("--listen", listen,
                 "host:port of the daemon API (port 0 = any free port); its host is the address registered with the "
                 "coordinator unless --advertise is given");
  app.add_option("--advertise", advertise,
                 "host the coordinator and other daemons dial (needed when --listen binds a wildcard such as 0.0.0.0)");
  app.add_option("--coordinator", coordinator,
                 "host:port of the coordinator, or a comma-separated list of the coordinators sharing one etcd state "
                 "store (the daemon reports to whichever leads, and follows a fail-over)")
      ->envname("WSYNC_COORDINATOR")
      ->required();
  app.add_option("--port-file", port_file, "write the bound port here once serving");
  app.add_option("--transport", transport_name,
                 "data-path transport: tcp | verbs | fabric, or an ordered fallback list such as verbs,tcp or "
                 "fabric,tcp (the first one viable on this host is used; a single transport that is not viable is an "
                 "error)")
      ->capture_default_str()
      ->check([](const std::string& v) -> std::string {
        for (absl::string_view n : absl::StrSplit(v, ',', absl::SkipWhitespace())) {
          n = absl::StripAsciiWhitespace(n);
          const transport::TransportEntry* e = transport::FindTransport(n);
          if (e == nullptr || !e->daemon_selectable)
            return absl::StrCat("unknown transport '", n, "' (want one of ", transport::KnownTransports(true), ")");
        }
        return "";
      });
  app.add_option("--data-host", data_host,
                 "tcp transport: the address its data listener binds and the sources dial (default: the host of "
                 "--advertise, else of --listen; a loopback one is refused when those are not loopback)");
  std::string fabric_provider;
  app.add_option("--fabric-provider", fabric_provider,
                 "fabric transport: the libfabric provider (efa on AWS, verbs;ofi_rxm, tcp;ofi_rxm); default: "
                 "libfabric's pick, which honours FI_PROVIDER");
  app.add_option("--engine", engines,
                 "target: an engine on this node, KIND+SCHEME://HOST:PORT (reference+grpc://H:P, a bare H:P means "
                 "the same; vllm+http://H:P[?mode=staged|direct]; sglang+http://H:P?config=PATH[&bootstrap=H:P]"
                 "[&id=ID]); repeatable");
  app.add_option("--engine-socket", engine_socket,
                 "target: Unix socket engine ranks attach their memory to (default /run/wsync/target-<port>.sock, "
                 "else under $XDG_RUNTIME_DIR/wsync or /tmp/wsync-<uid>)");
  app.add_option("--engine-uid", engine_uids, "target: a further uid allowed to attach (repeatable; the daemon's own "
                 "uid always is)");
  app.add_option("--attach-timeout", attach_timeout_s, "target: seconds to wait for every rank of an engine to attach")
      ->check(CLI::PositiveNumber);
  app.add_option("--engine-timeout", engine_timeout_s, "target: seconds one engine control call may take")
      ->check(CLI::PositiveNumber);
  app.add_option("--tcp-progress-timeout", tcp_progress_timeout_s,
                 "tcp transport: seconds a connection's sent bytes may stay unacknowledged (a pulled link, a peer host "
                 "gone) before its writes fail, naming the target node and engine ranks")
      ->check(CLI::Range(0.5, 600.0));
  app.add_option("--trainer-ranks", trainer_ranks, "source: trainer ranks on this node")->check(CLI::Range(1, 1024));
  int pp_stage = 0;
  app.add_option("--pp-stage", pp_stage,
                 "source: the trainer pipeline stage this node's ranks hold (0-based; every stage needs the same "
                 "number of source nodes)")
      ->check(CLI::Range(0, 1023))
      ->capture_default_str();
  std::string metrics_listen;
  app.add_option("--metrics-listen", metrics_listen,
                 "host:port serving Prometheus /metrics and /healthz over HTTP (default: off; 9601 by convention)");
  double rank_grace_s = 5;
  app.add_option("--rank-grace", rank_grace_s,
                 "source: seconds a trainer rank whose process exited mid-update has to reconnect before the update "
                 "fails, naming the rank")
      ->check(CLI::PositiveNumber);
  bool write_checksums = true;
  app.add_option("--write-checksums", write_checksums,
                 "source: record the XXH3-128 of every byte range written into engines (wsyncctl verify)")
      ->capture_default_str();
  int write_checksum_threads = 0;
  app.add_option("--write-checksum-threads", write_checksum_threads,
                 "source: threads hashing the ranges written (--write-checksums), off the ingest thread; 0: "
                 "min(4, hardware threads)")
      ->check(CLI::Range(0, 256))
      ->capture_default_str();
  bool placement = true;
  app.add_option("--placement", placement,
                 "source: offer trainer ranks zero-copy placement (they copy tensors needing no conversion straight "
                 "into the replica; docs/operations.md)")
      ->capture_default_str();
  std::string trainer_socket;
  std::vector<uint32_t> trainer_uids, trainer_gids;
  app.add_option("--trainer-socket", trainer_socket,
                 "source: Unix socket trainer ranks open their sessions on (SO_PEERCRED checked, the ring handed over "
                 "with SCM_RIGHTS); their RPCs are served on PATH.rpc, never on --listen (default "
                 "/run/wsync/wsyncd.sock, else $XDG_RUNTIME_DIR/wsync/wsyncd.sock, else /tmp/wsync-<uid>/wsyncd.sock)");
  app.add_option("--trainer-uid", trainer_uids,
                 "source: a further uid whose processes may open trainer sessions (repeatable; the daemon's own uid "
                 "always may; with one, the sockets are mode 0666 and SO_PEERCRED decides, else 0660)");
  app.add_option("--trainer-gid", trainer_gids,
                 "source: a gid whose processes may open trainer sessions (repeatable; the socket's group becomes the "
                 "first)");
  app.add_option("--ring-mib", ring_mib, "source: shared-memory ring size per trainer rank, MiB")
      ->check(CLI::Range(1, 1 << 20));
  bool delta_base = true;
  app.add_option("--delta-base", delta_base,
                 "source: keep a copy of what was last written (one more replica's memory) so that updates send "
                 "engine ranks only what changed (docs/delta.md); false: every update is dense");
  double delta_staging_fraction = daemon::TargetOptions{}.delta_staging_fraction;
  app.add_option("--delta-staging-fraction", delta_staging_fraction,
                 "target: host staging for delta records per source connection, as a fraction of the bytes it "
                 "writes to the engine rank (default 0.25; 0: no deltas into this node's engines)")
      ->check(CLI::Range(0.0, 1.0));
  tls::Options tls_opts;
  tls::AddFlags(app, &tls_opts);
  app.footer(
      "exit codes: 0 ok, 1 failure, 2 bad usage, 3 endpoint unavailable\n"
      "TLS: with --tls-ca/--tls-cert/--tls-key every gRPC channel is mutual TLS and the certificate's CN must be\n"
      "  \"<role>:<node-id>\" (source or target); without them only loopback addresses are accepted.\n"
      "Environment:\n"
      "  WSYNC_FAULTS   testing aid, never for production: inject data-path faults, e.g.\n"
      "                 WSYNC_FAULTS=fail_post=3,fail_wait=5,delay_ms=10 fails the Post of this daemon's 3rd\n"
      "                 batch, the Wait of its 5th, and holds every batch 10 ms in its endpoint before it is\n"
      "                 sent (Post itself returns at once). Batches are counted from 1\n"
      "                 across all endpoints. delay_peer=TEXT limits the delay to the endpoints whose peer\n"
      "                 name contains TEXT; jitter_ms=J[,seed=S] adds a random extra of up to J ms to each\n"
      "                 batch's hold (repeatable with the same seed). A malformed spec exits 2.\n"
      "  WSYNC_DAEMON_FAULTS_FILE=PATH\n"
      "                 testing aid, never for production: the coordinator's calls fail or hang on demand.\n"
      "                 PATH is read at each ConfigureSource, StartUpdate, FinishUpdate, SetWriteWindow\n"
      "                 (opening) and ApplyDelta; a line \"NODE PHASE error|hang [TAG]\" (NODE this --node-id or\n"
      "                 *, PHASE configure, start, finish, open_windows or apply_delta) fails that call, or\n"
      "                 blocks it until the caller gives up (at most 10 min) and then fails it; a rule fires\n"
      "                 once per content of the file and logs \"daemon_fault: node NODE reached PHASE\".\n");
  if (int rc = cli::Parse(app, argc, argv); rc >= 0) return rc;
  InitLogging(role == "source" ? "wsyncd-src" : "wsyncd-tgt", log_level);
  const std::string listen_host = listen.substr(0, listen.rfind(':'));
  if (advertise.empty() && daemon::IsWildcardHost(listen_host)) {
    spdlog::error("--listen {} binds a wildcard address, which nobody can dial: give --advertise HOST (this node's "
                  "reachable address)", listen);
    return 2;
  }
  if (!advertise.empty() && daemon::IsWildcardHost(advertise)) {
    spdlog::error("--advertise {} is not a reachable address", advertise);
    return 2;
  }
  const std::string host = advertise.empty() ? listen_host : advertise;
  // A multi-host node whose data listener sat on loopback would register fine and fail only at the first update.
  if (data_host.empty()) {
    data_host = host;
  } else if (tls::IsLoopback(data_host) && !tls::IsLoopback(host)) {
    spdlog::error("--data-host {} is a loopback address while this node is reached at {}: sources on other hosts "
                  "could not reach its data listener; give --data-host this node's address (or leave it out: it "
                  "follows --advertise, else --listen)", data_host, host);
    return 2;
  }
  {
    // Every address this daemon listens on or dials that is known now; without TLS each must be loopback.
    std::vector<std::string> addresses = {listen, host, data_host, metrics_listen};
    for (const auto& c : client::SplitEndpoints(coordinator)) addresses.push_back(c);
    for (const auto& e : engines) {
      std::string a = e;
      if (const size_t p = a.find("://"); p != std::string::npos) a = a.substr(p + 3);
      if (const size_t q = a.find_first_of("?/"); q != std::string::npos) a = a.substr(0, q);
      addresses.push_back(a);
    }
    // The certificate must be this node's: CN "<--role>:<--node-id>" (without --node-id, its id becomes the node id).
    const tls::Identity self{
        absl::StrCat("wsyncd --role ", role, node_id.empty() ? "" : " --node-id " + node_id), {role}, node_id};
    if (auto st = tls::Configure(tls_opts, addresses, self); !st.ok()) {
      spdlog::error("{}", st.ToString());
      return 2;
    }
    if (node_id.empty() && tls::Enabled()) {
      node_id = tls::Self().id;
      spdlog::info("node id {}: the id of this node's certificate (no --node-id given)", node_id);
    }
  }
  if (role == "target" && engines.empty()) {
    spdlog::error("--role target needs at least one --engine");
    return 2;
  }

  transport::TransportOptions topts;
  topts.bind_host = data_host;
  topts.send_progress_timeout = absl::Seconds(tcp_progress_timeout_s);
  topts.fabric_provider = fabric_provider;
  auto tr = transport::CreateFirstViableTransport(transport_name, topts);
  if (!tr.ok()) {
    spdlog::error("--transport {}: {}{}", transport_name, std::string(tr.status().message()),
                  absl::StrContains(tr.status().message(), "bind ")
                      ? absl::StrCat(" (the tcp data listener binds --data-host ", data_host, ": an address of this host)")
                      : "");
    return tr.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::unique_ptr<transport::Transport> transport = *std::move(tr);
  // Testing aid: WSYNC_FAULTS wraps the data path in the fault-injecting decorator (see --help), so tests can make
  // writes fail in a real daemon. Loud on purpose: a production node must never run with it.
  if (const char* faults = std::getenv("WSYNC_FAULTS"); faults != nullptr) {
    auto spec = transport::ParseFaultSpec(faults);
    if (!spec.ok()) {
      spdlog::error("WSYNC_FAULTS: {}", spec.status().ToString());
      return 2;
    }
    spdlog::warn("!!! WSYNC_FAULTS is set: injecting transport faults ({}); for tests only, writes WILL fail !!!",
                 spec->empty() ? "empty spec, pass-through" : spec->ToString());
    transport = transport::WrapWithFaults(std::move(transport), *spec);
  }

  if (node_id.empty()) {
    char hostname[256] = {0};
    gethostname(hostname, sizeof(hostname) - 1);
    node_id = absl::StrCat(hostname, "-", role, "-", getpid());
  }
  // Declared before the source, so it outlives the source's threads that may report through it.
  std::unique_ptr<daemon::FailureReporter> failure_reporter;
  std::unique_ptr<daemon::SourceNode> source;
  std::unique_ptr<daemon::TargetNode> target;
  v1::RegisterNodeRequest reg;
  reg.set_node_id(node_id);
  reg.set_role(role);
  reg.set_transport(transport->name());
  if (role == "source") {
    failure_reporter = std::make_unique<daemon::FailureReporter>(coordinator, node_id);
    daemon::SourceOptions o;
    o.on_update_failed = [r = failure_reporter.get()](int64_t v, const absl::Status& err) { r->Report(v, err); };
    o.node_id = node_id;
    o.trainer_ranks = trainer_ranks;
    o.ring_bytes = ring_mib << 20;
    o.rank_grace = absl::Seconds(rank_grace_s);
    o.write_checksums = write_checksums;
    o.write_checksum_threads = write_checksum_threads;
    o.delta_base = delta_base;
    o.placement = placement;
    source = std::make_unique<daemon::SourceNode>(o, transport.get(),
                                                  daemon::ConnectTargetByFn(daemon::DialConnectTargetBy));
    reg.set_trainer_ranks(trainer_ranks);
    reg.set_pp_stage(pp_stage);
  }
  // The target's engines attach through its socket, whose default name carries the API port: serve first (ConnectTarget
  // answers NotFound until the engines are there; nobody dials before the node registered).
  daemon::NodeDaemonService service(source.get(), nullptr, node_id);
  auto served = daemon::Serve(listen, {&service}, "");
  if (!served.ok()) {
    spdlog::error("{}", served.status().ToString());
    return 1;
  }
  reg.set_address(absl::StrCat(host, ":", served->port));
  // Trainer ranks: a hand-over socket plus a gRPC server of their own, both local Unix sockets.
  std::unique_ptr<daemon::TrainerIngestService> ingest;
  std::unique_ptr<grpc::Server> trainer_rpc;
  std::unique_ptr<daemon::TrainerSocket> trainer_sock;
  std::string trainer_rpc_path;
  if (source) {
    daemon::TrainerSocketOptions to;
    to.path = trainer_socket.empty() ? daemon::DefaultTrainerSocket() : trainer_socket;
    to.uids = trainer_uids;
    to.gids = trainer_gids;
    trainer_rpc_path = to.path + ".rpc";
    ingest = std::make_unique<daemon::TrainerIngestService>(source.get());
    absl::Status st = daemon::TrainerSocket::ClaimPath(to.path);
    if (st.ok()) {
      const size_t slash = to.path.rfind('/');
      if (slash != std::string::npos && slash > 0) st = daemon::MakeDirs(to.path.substr(0, slash), 0711);
    }
    if (st.ok()) {
      auto rpc = daemon::ServeUnix(trainer_rpc_path, {ingest.get()}, daemon::TrainerSocket::SocketMode(to));
      if (rpc.ok()) trainer_rpc = *std::move(rpc); else st = rpc.status();
    }
    if (st.ok()) {
      auto ts = daemon::TrainerSocket::Start(to, source.get(), "unix:" + trainer_rpc_path);
      if (ts.ok()) trainer_sock = *std::move(ts); else st = ts.status();
    }
    if (!st.ok()) {
      spdlog::error("trainer socket: {}", st.ToString());
      if (trainer_rpc) trainer_rpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
      served->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
      return st.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
    }
  }
  // Stops the trainer side (sockets first, then the sessions' RPCs) and removes its socket files.
  auto stop_trainers = [&] {
    trainer_sock.reset();
    if (trainer_rpc) {
      trainer_rpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
      trainer_rpc.reset();
      unlink(trainer_rpc_path.c_str());
    }
  };
  if (role == "target") {
    daemon::TargetOptions o;
    o.node_id = node_id;
    o.engine_socket = engine_socket.empty() ? daemon::DefaultEngineSocket(served->port) : engine_socket;
    o.engine_uids.assign(engine_uids.begin(), engine_uids.end());
    o.attach_timeout = absl::Seconds(attach_timeout_s);
    o.facade_host = host;
    o.delta_staging_fraction = delta_staging_fraction;
    target = std::make_unique<daemon::TargetNode>(o, transport.get());
    absl::Status st = target->Start();
    for (size_t i = 0; st.ok() && i < engines.size(); ++i) {
      auto adapter = daemon::MakeEngineAdapter(engines[i], absl::Seconds(engine_timeout_s));
      st = adapter.ok() ? target->AddEngine(*std::move(adapter)) : adapter.status();
      if (!st.ok()) st = Annotate(st, absl::StrCat("--engine ", engines[i]));
    }
    if (!st.ok()) {
      spdlog::error("{}", st.ToString());
      served->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
      return adapter_usage_error(st) ? 2 : 1;
    }
    service.set_target(target.get());
    for (auto& r : target->Registrations()) *reg.add_engines() = std::move(r);
  }
  // Target metrics are read from the node at scrape time; a source keeps its own counters.
  daemon::Metrics target_metrics;
  std::unique_ptr<daemon::MetricsServer> metrics_server;
  if (!metrics_listen.empty()) {
    daemon::Metrics* m = source ? &source->metrics() : &target_metrics;
    transport::Transport* tr = transport.get();
    daemon::ExportRefusalCounters(*m, [tr] { return tr->refused_writes(); });
    if (target) {
      target_metrics.Declare("wsync_target_engines", "gauge", "Engine instances served by this target daemon.");
      target_metrics.Declare("wsync_target_engine_ranks", "gauge", "Engine ranks whose memory is registered here.");
      target_metrics.Declare("wsync_target_registered_bytes", "gauge", "Engine weight bytes registered here.");
      daemon::TargetNode* t = target.get();
      target_metrics.OnCollect([t](daemon::Metrics& mm) {
        double engines = 0, ranks = 0, bytes = 0;
        for (const auto& e : t->Registrations()) {
          ++engines;
          ranks += e.ranks_size();
          for (const auto& r : e.ranks())
            for (const auto& s : r.segments()) bytes += static_cast<double>(s.bytes());
        }
        mm.Set("wsync_target_engines", {}, engines);
        mm.Set("wsync_target_engine_ranks", {}, ranks);
        mm.Set("wsync_target_registered_bytes", {}, bytes);
      });
    }
    auto ms = daemon::MetricsServer::Start(metrics_listen, m);
    if (!ms.ok()) {
      spdlog::error("--metrics-listen: {}", ms.status().ToString());
      served->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
      return ms.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
    }
    metrics_server = *std::move(ms);
  }
  spdlog::info("wsyncd {} ({}) serving on {} with transport {}", node_id, role, reg.address(), transport->name());
  daemon::Coordinators coordinators(coordinator);
  if (!coordinators.dial_status().ok()) {
    spdlog::error("--coordinator {}: {}", coordinator, coordinators.dial_status().ToString());
    stop_trainers();
    served->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    return 2;
  }
  if (auto st = daemon::Register(coordinators, reg, 200); !st.ok()) {
    stop_trainers();
    if (absl::IsCancelled(st)) {
      spdlog::info("wsyncd {} stopped before it registered: {}", node_id, std::string(st.message()));
      served->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
      return 0;
    }
    spdlog::error("cannot register with coordinator {}: {}", coordinator, st.ToString());
    served->server->Shutdown();
    return 1;
  }
  // Publish the port only once registered, so whoever waits for it can rely on the node being known.
  if (!port_file.empty()) {
    const std::string tmp = port_file + ".tmp";
    std::ofstream(tmp) << served->port << "\n";
    std::rename(tmp.c_str(), port_file.c_str());
  }
  daemon::TargetNode* tn = target.get();
  daemon::SourceNode* sn = source.get();
  daemon::HoldLease(
      coordinators, reg,
      [&reg, tn] {
        v1::RegisterNodeRequest r = reg;
        if (tn != nullptr) {
          r.clear_engines();
          for (auto& e : tn->Registrations()) *r.add_engines() = std::move(e);
        }
        return r;
      },
      [sn](v1::HeartbeatRequest* hb) {
        if (sn == nullptr) return;
        // The configuration this source holds: the coordinator configures it again when it is not the planned one.
        auto [epoch, digest] = sn->AppliedConfig();
        hb->set_plan_epoch(epoch);
        hb->set_config_digest(digest);
      });
  spdlog::info("wsyncd {} shutting down", node_id);
  stop_trainers();
  served->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  metrics_server.reset();  // its collect callback reads the target
  target.reset();  // stops the engine socket loop, removes the socket, shuts the facades down
  return 0;
}
