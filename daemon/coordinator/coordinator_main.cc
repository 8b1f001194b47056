// wsync-coordinator: membership, transfer plans and the update lifecycle. Deployable on its own (one per cluster).

#include <cstdio>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <mutex>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/cli.h"
#include "base/logging.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/etcd_store.h"
#include "daemon/coordinator/fanout.h"
#include "daemon/coordinator/phase_table.h"
#include "planner/plan.h"
#include "proto/tls.h"
#include "daemon/common/serve.h"
#include "daemon/coordinator/coordinator_service.h"
#include "daemon/coordinator/status_page.h"
#include "spdlog/spdlog.h"

using namespace wsync;

namespace {

// High availability: only the elected leader serves, and only once it has loaded the state.
class EtcdLeaderGate final : public daemon::LeaderGate {
 public:
  // Called once, before the election starts.
  void Set(daemon::EtcdStateStore* store, const std::string& self) {
    std::lock_guard<std::mutex> l(mu_);
    store_ = store;
    self_ = self;
  }
  void set_ready() { ready_.store(true); }
  absl::Status Check() const override {
    std::lock_guard<std::mutex> l(mu_);
    if (store_ == nullptr) return absl::UnavailableError("not the leader: this coordinator is starting");
    if (ready_.load() && store_->leader()) return absl::OkStatus();
    const std::string leader = store_->LeaderAddress(false);
    return absl::UnavailableError(
        absl::StrCat("not the leader: coordinator ", self_,
                     store_->leader() ? " was just elected and is loading the state" : " is a standby",
                     "; current leader: ", leader.empty() || leader == self_ ? std::string("(electing)") : leader));
  }

 private:
  mutable std::mutex mu_;
  daemon::EtcdStateStore* store_ = nullptr;
  std::string self_;
  std::atomic<bool> ready_{false};
};

}  // namespace

int main(int argc, char** argv) {
  daemon::LimitMallocArenas();  // before any thread (fanout.h)
  daemon::BlockTerminationSignals();

  CLI::App app{"wsync-coordinator: membership, transfer plans and the weight-update lifecycle"};
  std::string listen = "127.0.0.1:7600", port_file, log_level;
  cli::AddCommonFlags(app, "wsync-coordinator", &log_level);
  daemon::CoordinatorOptions opts;
  app.add_option("--listen", listen, "host:port to serve on (port 0 = any free port)");
  app.add_option("--port-file", port_file, "write the bound port here once serving");
  app.add_option("--strategy", opts.strategy,
                 "transfer-plan strategy: balanced (bytes balanced over sources and NICs, parameters split into byte "
                 "ranges where that balances better), seed (whole layouts per source, as the seed write-up) or local "
                 "(each trainer rank pushes the slices it already holds; needs --trainer-parallelism)")
      ->check(CLI::IsMember({"seed", "balanced", "local"}))
      ->capture_default_str();
  app.add_option("--relay", opts.relay,
                 "relay trees (docs/planner.md, \"The relay data path\"): off (the sources write every engine), a degree N "
                 "(the sources write one engine per layout group, whose target daemons forward to the rest), or auto "
                 "(per group the degree, or direct, that the link-rate model predicts fastest from --nic, the "
                 "source nodes and one copy's bytes: planner/relay_shape.h)")
      ->check([](const std::string& v) {
        auto r = planner::ParseRelayMode(v);
        return r.ok() ? std::string() : std::string(r.status().message());
      })
      ->capture_default_str();
  app.add_option("--trainer-parallelism", opts.trainer_parallelism,
                 "local: the trainer's parallelism within a PP stage, Megatron rank order tp-cp-ep-dp-pp, e.g. "
                 "tp=2,ep=2[,cp=1][,etp=1] (pp and nodes come from the registered source daemons)");
  std::string min_source_mib = planner::FormatMinSourceMib(opts.min_source_bytes);
  app.add_option("--min-source-mib", min_source_mib,
                 "balanced: auto (as many sources per stage as the planner's cost model predicts fastest: a source "
                 "is left out only when its share is too small to pay for its sessions) or N: give a source work "
                 "only if it gets at least N MiB per engine copy (0: use every source)")
      ->capture_default_str();
  app.add_option("--nic", opts.nic,
                 "balanced, --min-source-mib auto: every node's NICs as COUNTxRATE (e.g. 1x100Gbps), the link rate "
                 "the planner's cost model chooses the number of sources with")
      ->capture_default_str();
  uint64_t snap_kib = opts.snap_bytes >> 10;
  app.add_option("--snap-kib", snap_kib,
                 "balanced: a byte-range cut this close (KiB) to a parameter boundary moves to the boundary (0: split "
                 "parameters anywhere, 4 KiB aligned)")
      ->capture_default_str();
  app.add_option("--history", opts.history_limit, "updates kept in the history");
  app.add_option("--delta-anchor-every", opts.delta_anchor_every,
                 "with delta=auto, every Nth update since the last dense one is sent dense (0: never; docs/delta.md)")
      ->check(CLI::NonNegativeNumber);
  daemon::EngineDeadlines deadlines;
  app.add_option("--pause-timeout", deadlines.pause,
                 "seconds an engine may take to pause before the update fails naming it (at most 120)")
      ->check(CLI::Range(1.0, daemon::PeerDeadlines::kPause))
      ->capture_default_str();
  app.add_option("--post-process-timeout", deadlines.post_process,
                 "seconds an engine may take to post-process new weights before the update fails naming it (at most "
                 "300)")
      ->check(CLI::Range(1.0, daemon::PeerDeadlines::kPostProcess))
      ->capture_default_str();
  double test_phase_deadline = 0;
  app.add_option("--test-phase-deadline", test_phase_deadline,
                 "testing only: cap every phase's deadline (and the pause and post-process timeouts) at this many "
                 "seconds, so that a hung peer fails its phase quickly (0: the phase tables' deadlines)")
      ->check(CLI::Range(0.0, 600.0));
  std::string metrics_listen, state_path, advertise;
  double lease_ttl = 3;
  app.add_option("--state", state_path,
                 "where membership, versions, engine states and history live across restarts: sqlite:PATH or PATH (a "
                 "SQLite file, created if missing), or etcd://HOST:PORT[,HOST:PORT...]/PREFIX (shared by several "
                 "coordinators: one leads, the others stand by and take over when its lease expires). Default: memory "
                 "only, a restarted coordinator relies on daemons registering again");
  app.add_option("--advertise", advertise,
                 "etcd: host:port clients and daemons dial to reach this coordinator, published while it leads "
                 "(default: --listen with the bound port; required when --listen binds a wildcard)");
  app.add_option("--lease-ttl", lease_ttl,
                 "etcd: seconds of the leader's lease; a dead leader is replaced within about this")
      ->check(CLI::Range(1.0, 60.0))
      ->capture_default_str();
  app.add_option("--metrics-listen", metrics_listen,
                 "host:port serving Prometheus /metrics and /healthz over HTTP (default: off; port 9600 by convention)");
  std::string http_listen;
  app.add_option("--http-listen", http_listen,
                 "host:port serving the read-only status page (membership, engine versions and states, a timeline of "
                 "the last updates): HTTPS requiring a client certificate of the cluster CA under TLS, plain HTTP "
                 "only without TLS (loopback). Default: off; port 7680 by convention");
  bool failure_table = false;
  app.add_flag("--failure-table", failure_table,
               "print what a failure means at each phase of each update mode (the phase tables the coordinator "
               "applies, as Markdown) and exit");
  tls::Options tls_opts;
  tls::AddFlags(app, &tls_opts);
  if (int rc = cli::Parse(app, argc, argv); rc >= 0) return rc;
  if (failure_table) {
    std::fputs(daemon::PhaseTableMarkdown().c_str(), stdout);
    return 0;
  }
  InitLogging("coordinator", log_level);
  // A coordinator's certificate names the role only that matters here (CN "coordinator:<name>", any name).
  if (auto st = tls::Configure(tls_opts, {listen, metrics_listen, advertise, http_listen},
                               {"wsync-coordinator", {tls::kCoordinator}, ""});
      !st.ok()) {
    spdlog::error("{}", st.ToString());
    return 2;
  }
  if (auto n = planner::ParseNicSpec(opts.nic); !n.ok()) {
    spdlog::error("--nic: {}", std::string(n.status().message()));
    return 2;
  }
  if (auto m = planner::ParseMinSourceMib(min_source_mib); m.ok()) {
    opts.min_source_bytes = *m;
  } else {
    spdlog::error("{}", std::string(m.status().message()));
    return 2;
  }
  opts.snap_bytes = snap_kib << 10;

  daemon::StateSpec spec;
  if (!state_path.empty()) {
    auto parsed = daemon::ParseStateSpec(state_path);
    if (!parsed.ok()) {
      spdlog::error("{}", std::string(parsed.status().message()));
      return 2;
    }
    spec = *parsed;
  }
  const bool ha = !state_path.empty() && spec.kind == daemon::StateSpec::Kind::kEtcd;
  const std::string listen_host = listen.substr(0, listen.rfind(':'));
  if (ha && advertise.empty() && daemon::IsWildcardHost(listen_host)) {
    spdlog::error(
        "--listen {} binds a wildcard address: give --advertise HOST:PORT, the address this coordinator is "
        "reached at when it leads",
        listen);
    return 2;
  }

  if (test_phase_deadline > 0) {
    spdlog::warn("!!! --test-phase-deadline {} s: every phase deadline is capped; for tests only !!!",
                 test_phase_deadline);
    daemon::CapDeadlinesForTesting(test_phase_deadline);
    deadlines.pause = std::min(deadlines.pause, std::max(1.0, test_phase_deadline));
    deadlines.post_process = std::min(deadlines.post_process, std::max(1.0, test_phase_deadline));
  }
  daemon::Coordinator coordinator(opts, daemon::MakeGrpcPeers(deadlines));
  if (!state_path.empty() && !ha) {
    auto store = daemon::SqliteStateStore::Open(spec.path);
    absl::Status st = store.ok() ? coordinator.UseStateStore(*std::move(store)) : store.status();
    if (!st.ok()) {
      spdlog::error("--state {}: {}", state_path, st.ToString());
      return 1;
    }
  }
  // With etcd the server starts first (it answers Unavailable, naming the leader, until this one leads and has
  // loaded the state), so that the advertised address carries the bound port; then the election runs.
  EtcdLeaderGate gate;
  daemon::CoordinatorService service(&coordinator, ha ? &gate : nullptr);
  auto served = daemon::Serve(listen, {&service}, port_file);
  if (!served.ok()) {
    spdlog::error("{}", served.status().ToString());
    return 1;
  }
  std::unique_ptr<daemon::MetricsServer> metrics;
  if (!metrics_listen.empty()) {
    auto m = daemon::MetricsServer::Start(metrics_listen, &coordinator.metrics());
    if (!m.ok()) {
      spdlog::error("--metrics-listen: {}", m.status().ToString());
      served->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
      return m.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
    }
    metrics = *std::move(m);
  }
  std::unique_ptr<daemon::StatusPageServer> status_page;
  if (!http_listen.empty()) {
    daemon::StatusPageSource src;
    if (ha) src.ready = [&gate] { return gate.Check(); };
    src.status = [&coordinator] { return coordinator.Status(); };
    src.history = [&coordinator](int n) {
      v1::HistoryRequest req;
      req.set_limit(n);
      return coordinator.History(req);
    };
    auto p = daemon::StatusPageServer::Start(http_listen, std::move(src));
    if (!p.ok()) {
      spdlog::error("--http-listen: {}", p.status().ToString());
      served->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
      return p.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
    }
    status_page = *std::move(p);
  }
  // High availability: `wsync_coordinator_leader` and the health status of service "wsync.v1.Coordinator" say
  // which coordinator leads (a readiness probe on that service routes clients to the leader only); "" stays SERVING.
  coordinator.metrics().Declare("wsync_coordinator_leader", "gauge",
                                "1 while this coordinator leads (always 1 without a shared etcd state store).");
  coordinator.metrics().Set("wsync_coordinator_leader", {}, ha ? 0 : 1);
  daemon::ExportRefusalCounters(coordinator.metrics());
  daemon::PresetCoordinatorSeries(coordinator.metrics());
  grpc::HealthCheckServiceInterface* health = served->server->GetHealthCheckService();
  if (health != nullptr) health->SetServingStatus("wsync.v1.Coordinator", !ha);
  daemon::EtcdStateStore* etcd = nullptr;  // owned by the coordinator once elected, else by etcd_owned
  std::unique_ptr<daemon::EtcdStateStore> etcd_owned;
  if (ha) {
    daemon::EtcdOptions eo;
    eo.endpoints = spec.endpoints;
    eo.prefix = spec.prefix;
    eo.lease_ttl_seconds = lease_ttl;
    eo.advertise = advertise.empty() ? absl::StrCat(listen_host, ":", served->port) : advertise;
    auto store = daemon::EtcdStateStore::Open(eo);
    if (!store.ok()) {
      spdlog::error("--state {}: {}", state_path, store.status().ToString());
      served->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
      return 1;
    }
    etcd_owned = *std::move(store);
    etcd = etcd_owned.get();
    gate.Set(etcd, eo.advertise);
    std::mutex m;
    std::condition_variable cv;
    bool elected = false;
    etcd->StartElection(
        [&] {
          std::lock_guard<std::mutex> l(m);
          elected = true;
          cv.notify_all();
        },
        [](const absl::Status& why) {
          // A deposed leader must not act any more (its peers may be driven by the new leader already): it stops
          // at once, without finishing calls in flight. Restarted, it stands by.
          spdlog::critical("stopping: this coordinator is no longer the leader ({})", why.ToString());
          spdlog::default_logger()->flush();
          std::_Exit(1);
        });
    spdlog::info("coordinator serving on port {} as a candidate at {}", served->port, etcd->path());
    for (;;) {
      std::unique_lock<std::mutex> l(m);
      if (cv.wait_for(l, std::chrono::milliseconds(200), [&] { return elected; })) break;
      l.unlock();
      if (daemon::TerminationRequested(0)) {
        spdlog::info("coordinator shutting down (standby)");
        etcd->Resign();
        served->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
        return 0;
      }
    }
    // Restores the state and ends an update the previous leader died during (sources told to abort it, engines
    // stay paused), exactly as a restart with a SQLite store does.
    const absl::Time t0 = absl::Now();
    if (absl::Status st = coordinator.UseStateStore(std::move(etcd_owned)); !st.ok()) {
      spdlog::error("--state {}: {}", state_path, st.ToString());
      etcd->Resign();
      return 1;
    }
    gate.set_ready();
    coordinator.metrics().Set("wsync_coordinator_leader", {}, 1);
    if (health != nullptr) health->SetServingStatus("wsync.v1.Coordinator", true);
    spdlog::info("leading: state loaded from {} in {:.3f}s", etcd->path(), absl::ToDoubleSeconds(absl::Now() - t0));
  }
  // Only the leader gets here: a standby waits above until it is elected.
  coordinator.StartLeaseWatch();
  spdlog::info("coordinator serving on port {} (strategy {})", served->port, opts.strategy);
  daemon::WaitForTermination();
  spdlog::info("coordinator shutting down");
  served->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  // After the calls in flight have ended: a standby takes over at once instead of after the lease's TTL.
  if (etcd != nullptr) etcd->Resign();
  return 0;
}
