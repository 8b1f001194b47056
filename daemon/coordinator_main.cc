// wsync-coordinator: membership, transfer plans and the update lifecycle. Deployable on its own (one per cluster).

#include <pthread.h>

#include <csignal>

#include "CLI/CLI.hpp"
#include "base/cli.h"
#include "base/logging.h"
#include "daemon/coordinator.h"
#include "proto/tls.h"
#include "daemon/serve.h"
#include "daemon/services.h"
#include "spdlog/spdlog.h"

using namespace wsync;

int main(int argc, char** argv) {
  daemon::BlockTerminationSignals();

  CLI::App app{"wsync-coordinator: membership, transfer plans and the weight-update lifecycle"};
  std::string listen = "127.0.0.1:7600", port_file, log_level;
  cli::AddCommonFlags(app, "wsync-coordinator", &log_level);
  daemon::CoordinatorOptions opts;
  app.add_option("--listen", listen, "host:port to serve on (port 0 = any free port)");
  app.add_option("--port-file", port_file, "write the bound port here once serving");
  app.add_option("--strategy", opts.strategy,
                 "transfer-plan strategy: balanced (bytes balanced over sources and NICs, parameters split into byte "
                 "ranges where that balances better) or seed (whole layouts per source, as the seed write-up)")
      ->check(CLI::IsMember({"seed", "balanced"}))
      ->capture_default_str();
  uint64_t min_source_mib = opts.min_source_bytes >> 20;
  app.add_option("--min-source-mib", min_source_mib,
                 "balanced: give a source work only if it gets at least this many MiB per engine copy (0: use every "
                 "source)")
      ->capture_default_str();
  uint64_t snap_kib = opts.snap_bytes >> 10;
  app.add_option("--snap-kib", snap_kib,
                 "balanced: a byte-range cut this close (KiB) to a parameter boundary moves to the boundary (0: split "
                 "parameters anywhere, 4 KiB aligned)")
      ->capture_default_str();
  app.add_option("--history", opts.history_limit, "updates kept in the history");
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
  std::string metrics_listen, state_path;
  app.add_option("--state", state_path,
                 "SQLite file holding membership, versions, engine states and history across restarts (created if "
                 "missing; default: memory only, a restarted coordinator relies on daemons registering again)");
  app.add_option("--metrics-listen", metrics_listen,
                 "host:port serving Prometheus /metrics and /healthz over HTTP (default: off; port 9600 by convention)");
  tls::Options tls_opts;
  tls::AddFlags(app, &tls_opts);
  if (int rc = cli::Parse(app, argc, argv); rc >= 0) return rc;
  InitLogging("coordinator", log_level);
  if (auto st = tls::Configure(tls_opts, {listen, metrics_listen}); !st.ok()) {
    spdlog::error("{}", st.ToString());
    return 2;
  }
  opts.min_source_bytes = min_source_mib << 20;
  opts.snap_bytes = snap_kib << 10;

  daemon::Coordinator coordinator(opts, daemon::MakeGrpcPeers(deadlines));
  if (!state_path.empty()) {
    auto store = daemon::StateStore::Open(state_path);
    absl::Status st = store.ok() ? coordinator.UseStateStore(*std::move(store)) : store.status();
    if (!st.ok()) {
      spdlog::error("--state {}: {}", state_path, st.ToString());
      return 1;
    }
  }
  daemon::CoordinatorService service(&coordinator);
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
      return m.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
    }
    metrics = *std::move(m);
  }
  spdlog::info("coordinator serving on port {} (strategy {})", served->port, opts.strategy);
  daemon::WaitForTermination();
  spdlog::info("coordinator shutting down");
  served->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}
