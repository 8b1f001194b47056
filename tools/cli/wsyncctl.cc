// wsyncctl: the admin CLI. Exit codes (base/cli.h, shared by every wsync binary): 0 ok, 1 the server reported an
// error, 2 bad usage, input or configuration (a missing client certificate, a foreign CA: retrying will not help),
// 3 the endpoint could not be reached in time. Global flags (every option of the main command: --endpoints, -w/-o,
// --dial-timeout, --log-level, --log-format, --tls-*) may stand anywhere on the line, before or after the command, as
// in etcdctl.

#include <grpc/support/log.h>
#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <cstdlib>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "base/cli.h"
#include "base/logging.h"
#include "client/coordinator_client.h"
#include "nlohmann/json.hpp"
#include "proto/status_convert.h"
#include "proto/tls.h"
#include "wsync/v1/daemon.grpc.pb.h"
#include "wsync/v1/engine.grpc.pb.h"
#include "daemon/coordinator/timeline_svg.h"
#include "tools/cli/engine_health.h"
#include "tools/cli/history_plot.h"
#include "tools/cli/cli_support.h"
#include "tools/cli/plan_command.h"
#include "tools/cli/status_view.h"
#include "tools/cli/verify_command.h"
#include "wsync/v1/daemon.grpc.pb.h"
#include "wsync/v1/engine.grpc.pb.h"

using namespace wsync;

namespace {

constexpr int kExitOk = cli::kExitOk, kExitServer = cli::kExitFailure, kExitUsage = cli::kExitUsage,
              kExitUnreachable = cli::kExitUnavailable;

int ExitFor(const absl::Status& s) {
  if (s.ok()) return kExitOk;
  std::fprintf(stderr, "Error: %s\n", s.ToString().c_str());
  if (s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kDeadlineExceeded)
    return kExitUnreachable;
  if (s.code() == absl::StatusCode::kInvalidArgument) return kExitUsage;
  return kExitServer;
}

// Where the command's calls went, so that a failed connection is explained rather than shown as gRPC's text.
struct Peer {
  std::string endpoint;  // host:port, or a fail-over list
  std::string flag;      // the option that set it
  bool tls = false;      // this client presents a certificate
};

// A failed call to `peer`: the server's own errors as they are; a connection that failed is probed (plaintext,
// TLS, nothing) and explained, with exit 2 for what configuration must fix and 3 for an outage.
int ExitFor(const absl::Status& s, const Peer& peer) {
  if (s.ok() || !tools::IsConnectionFailure(s)) return ExitFor(s);
  const bool one = peer.endpoint.find(',') == std::string::npos;
  const tools::EndpointProbe probe = one ? tools::ProbeEndpoint(peer.endpoint, 2000) : tools::EndpointProbe::kNotProbed;
  const tools::CallError e = tools::DescribeCallError(s, peer.endpoint, peer.tls, peer.flag, probe);
  std::fprintf(stderr, "Error: %s\n", e.message.c_str());
  return e.exit_code;
}

// gRPC's own log lines (a failed handshake, a refused connection) repeat what the error line says: debug only here.
void QuietGrpcLog(gpr_log_func_args* args) { spdlog::debug("grpc: {}", args->message); }

// Every field, default-valued ones included (`rank: 0`, `success: false`), proto field names, numbers as numbers.
void PrintJson(const google::protobuf::Message& m) { std::printf("%s\n", tools::ProtoToJson(m).dump(2).c_str()); }

std::string Phases(const v1::UpdateRecord& r) {
  std::string s;
  for (const auto& p : r.phases()) absl::StrAppendFormat(&s, "%s%s=%.3fs", s.empty() ? "" : " ", p.phase(), p.seconds());
  return s;
}

// The main command's option named by argv word `a` ("--endpoints", "--endpoints=X", "-w"), or null.
const CLI::Option* GlobalOption(const CLI::App& app, const std::string& a) {
  if (a.size() < 2 || a[0] != '-') return nullptr;
  return app.get_option_no_throw(a.substr(0, a.find('=')));
}

// Whether argv word `a` is a global option whose value is the next word (not "--opt=value", not a flag).
bool TakesNextWord(const CLI::App& app, const std::string& a) {
  const CLI::Option* o = GlobalOption(app, a);
  return o != nullptr && a.find('=') == std::string::npos && o->get_items_expected_max() > 0;
}

// Index of the command word in argv (the first argument that is neither an option nor a global option's value), or
// -1. The options are the app's own, so a new global flag needs no second list here.
int CommandIndex(const CLI::App& app, int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.empty() || a[0] != '-') return i;
    if (TakesNextWord(app, a)) ++i;  // skip its value
  }
  return -1;
}

// `plan` is a pure computation with its own flags; it is handed the arguments around the word `plan` except the
// global options (--endpoints, --tls-*: meaningless for a local computation), with -w/-o as its own -w.
int RunPlan(const CLI::App& app, int argc, char** argv, int at) {
  std::vector<std::string> args = {"plan"};
  for (int i = 1; i < argc; ++i) {
    if (i == at) continue;
    const std::string a = argv[i];
    const CLI::Option* o = GlobalOption(app, a);
    const bool after = i > at;
    if (o != nullptr && o->check_name("-w")) {  // -w, -o, --write-out, --output
      const size_t eq = a.find('=');
      args.push_back("-w");
      if (eq != std::string::npos) {
        args.push_back(a.substr(eq + 1));
      } else if (i + 1 < argc) {
        args.push_back(argv[++i]);
      }
    } else if (o != nullptr && !(after && o->check_name("--help"))) {
      if (TakesNextWord(app, a)) ++i;
    } else if (after) {
      args.push_back(a);  // plan's own flags and values
    }
  }
  std::vector<char*> ptrs;
  for (auto& a : args) ptrs.push_back(a.data());
  return wsync::tools::RunPlanCommand(static_cast<int>(ptrs.size()), ptrs.data());
}

// One sample of `wsyncctl watch`: the coordinator's state plus every source's progress.
struct WatchSample {
  v1::ClusterStatus cluster;
  std::vector<std::pair<std::string, v1::NodeStatus>> sources;  // node id → status (missing when unreachable)
  uint64_t bytes = 0, expected = 0;
};

absl::StatusOr<WatchSample> SampleWatch(client::CoordinatorClient& c, absl::Duration dt,
                                        std::map<std::string, std::unique_ptr<v1::NodeDaemon::Stub>>& stubs) {
  WatchSample w;
  auto s = c.Status();
  if (!s.ok()) return s.status();
  w.cluster = *s;
  for (const auto& n : s->nodes()) {
    if (n.role() != "source") continue;
    auto& stub = stubs[n.address()];
    if (!stub) {
      auto channel = tls::Dial(n.address());
      if (!channel.ok()) return channel.status();
      stub = v1::NodeDaemon::NewStub(*std::move(channel));
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(dt));
    v1::NodeStatus ns;
    if (!stub->GetNodeStatus(&ctx, v1::NodeStatusRequest(), &ns).ok()) {
      ns.set_node_id(n.node_id());
      ns.set_state("unreachable");
    }
    if (ns.open_version() >= 0) {
      w.bytes += ns.bytes_written();
      w.expected += ns.bytes_expected();
    }
    w.sources.emplace_back(n.node_id(), std::move(ns));
  }
  return w;
}

// Every target node's own status (how writes reach its CUDA segments), asked of the node; an unreachable node is
// listed as such, not an error of the whole command.
std::vector<tools::TargetPath> QueryTargets(const v1::ClusterStatus& cs, absl::Duration dt) {
  std::vector<tools::TargetPath> out;
  for (const auto& n : cs.nodes()) {
    if (n.role() != "target") continue;
    tools::TargetPath t;
    t.node_id = n.node_id();
    auto channel = tls::Dial(n.address());
    if (!channel.ok()) {
      t.error = std::string(channel.status().message());
    } else {
      auto stub = v1::NodeDaemon::NewStub(*std::move(channel));
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(dt));
      const grpc::Status st = stub->GetNodeStatus(&ctx, v1::NodeStatusRequest(), &t.status);
      t.reachable = st.ok();
      if (!st.ok()) t.error = st.error_message();
    }
    out.push_back(std::move(t));
  }
  return out;
}

bool UpdateRunning(const std::string& state) {
  return state == "beginning" || state == "updating" || state == "committing" || state == "aborting";
}

// Prints samples until the update that runs (or the next one) has ended: every sample while one runs; while idle the
// first sample, each change of state or version, and one line every `idle_every` seconds so a silent terminal still
// says the coordinator answers. JSON: one line per sample.
int RunWatch(const std::string& endpoint, const Peer& peer, absl::Duration dt, bool json, double interval,
             double watch_for, bool once, double idle_every) {
  client::CoordinatorClient c(endpoint, dt);
  std::map<std::string, std::unique_ptr<v1::NodeDaemon::Stub>> stubs;
  const absl::Time start = absl::Now();
  absl::Time prev_t = start, last_print = absl::InfinitePast();
  uint64_t prev_bytes = 0;
  bool saw_running = false;
  std::string first_version, last_key;
  bool first = true;
  for (;;) {
    auto w = SampleWatch(c, dt, stubs);
    if (!w.ok()) return ExitFor(w.status(), peer);
    const absl::Time now = absl::Now();
    const v1::ClusterStatus& cs = w->cluster;
    const std::string& state = cs.state();
    const bool running = UpdateRunning(state);
    saw_running |= running;
    if (first) first_version = cs.current_version();
    // An update shorter than one interval is never seen running; the version moving says it ended.
    const bool ended = !running && (saw_running || cs.current_version() != first_version);
    const double dts = absl::ToDoubleSeconds(now - prev_t);
    const double rate = dts > 0 && w->bytes >= prev_bytes ? (w->bytes - prev_bytes) / dts : 0;  // bytes/s
    const double eta = rate > 0 && w->expected > w->bytes ? (w->expected - w->bytes) / rate : -1;
    const std::string key = absl::StrCat(state, "|", cs.current_version(), "|", cs.failed_version());
    const bool print =
        json || first || running || ended || key != last_key || absl::ToDoubleSeconds(now - last_print) >= idle_every;
    first = false;
    last_key = key;
    if (print && json) {
      nlohmann::json j;
      j["t"] = absl::ToDoubleSeconds(now - start);
      j["state"] = state;
      j["current_version"] = cs.current_version();
      j["open_version"] = cs.open_version();
      j["failed_version"] = cs.failed_version();
      j["failure"] = cs.failure();
      j["bytes_written"] = w->bytes;
      j["bytes_expected"] = w->expected;
      j["gbps"] = rate / 1e9;
      j["eta_seconds"] = eta;
      j["engines_hold_partial_writes"] = cs.engines_hold_partial_writes();
      j["sources"] = nlohmann::json::array();
      for (const auto& [id, ns] : w->sources)
        j["sources"].push_back({{"node_id", id}, {"state", ns.state()}, {"open_version", ns.open_version()},
                                {"bytes_written", ns.bytes_written()}, {"bytes_expected", ns.bytes_expected()},
                                {"tensors_received", ns.tensors_received()},
                                {"tensors_expected", ns.tensors_expected()}, {"ranks_ended", ns.ranks_ended()},
                                {"trainer_ranks", ns.trainer_ranks()}});
      std::printf("%s\n", j.dump().c_str());
    } else if (print) {
      const std::string serving = cs.current_version().empty() ? "-" : cs.current_version();
      std::string line = absl::StrFormat("%7.1fs  %-10s ", absl::ToDoubleSeconds(now - start), state);
      if (running && cs.open_version() >= 0) {
        absl::StrAppendFormat(&line, "update %d (serving %s)", cs.open_version(), serving);
      } else {
        absl::StrAppendFormat(&line, "version %-6s", serving);
      }
      if (running && w->expected > 0)
        absl::StrAppendFormat(&line, "  %5.1f%% %.1f/%.1f MiB  %.2f GB/s  ETA %s", 100.0 * w->bytes / w->expected,
                              w->bytes / 1048576.0, w->expected / 1048576.0, rate / 1e9,
                              eta >= 0 ? absl::StrFormat("%.1fs", eta) : std::string("-"));
      for (const auto& [id, ns] : w->sources) {
        if (ns.open_version() < 0) continue;
        absl::StrAppendFormat(&line, "  | %s %s %.0f%% ranks %d/%d", id, ns.state(),
                              ns.bytes_expected() ? 100.0 * ns.bytes_written() / ns.bytes_expected() : 0.0,
                              ns.ranks_ended(), ns.trainer_ranks());
      }
      if (!running && cs.failed_version() >= 0)
        absl::StrAppendFormat(&line, "  update %d failed: %s", cs.failed_version(), cs.failure());
      if (cs.engines_hold_partial_writes()) line += "  [engines hold partial writes]";
      if (!running && !ended && !saw_running && !once) line += "  (waiting for an update)";
      std::printf("%s\n", line.c_str());
      last_print = now;
    }
    std::fflush(stdout);
    if (once || ended || (watch_for > 0 && absl::ToDoubleSeconds(now - start) >= watch_for)) return kExitOk;
    prev_t = now;
    prev_bytes = w->bytes;
    absl::SleepFor(absl::Seconds(interval));
  }
}

// `wsyncctl engines --watch`: prints the engines' states at every change, optionally serving them to a router.
int RunEnginesWatch(const std::string& endpoint, const Peer& peer, absl::Duration dt, bool json, double seconds,
                    const std::string& health_listen) {
  std::unique_ptr<tools::EngineHealthServer> health;
  if (!health_listen.empty()) {
    const size_t colon = health_listen.rfind(':');
    int port = -1;
    if (colon == std::string::npos || !absl::SimpleAtoi(health_listen.substr(colon + 1), &port) || port < 0) {
      std::fprintf(stderr, "Error: --health-listen %s is not HOST:PORT\n", health_listen.c_str());
      return kExitUsage;
    }
    auto h = tools::EngineHealthServer::Start(health_listen.substr(0, colon), port);
    if (!h.ok()) {
      std::fprintf(stderr, "Error: %s\n", std::string(h.status().message()).c_str());
      return kExitUnreachable;
    }
    health = *std::move(h);
    std::printf("health endpoint on %s:%d\n", health_listen.substr(0, colon).c_str(), health->port());
    std::fflush(stdout);
  }
  client::CoordinatorClient c(endpoint, dt);
  // The stream sends a state only when it changes, and an empty cluster's never does: say so at once.
  auto first = c.Status();
  if (!first.ok()) return ExitFor(first.status(), peer);
  bool any_engine = false;
  for (const auto& n : first->nodes()) any_engine |= n.engine_details_size() > 0;
  if (!any_engine) {
    if (json) {
      v1::EngineStates none;
      none.set_current_version(first->current_version());
      std::printf("%s\n", tools::ProtoToJson(none).dump().c_str());
    } else {
      std::printf("current version %s\n  %s\n", first->current_version().empty() ? "-" : first->current_version().c_str(),
                  tools::kNoEnginesHint);
    }
    std::fflush(stdout);
  }
  absl::Status st = c.WatchEngines(
      [&](const v1::EngineStates& s) {
        if (health) health->Update(s);
        if (json) {
          std::printf("%s\n", tools::ProtoToJson(s).dump().c_str());
        } else {
          std::printf("current version %s\n", s.current_version().empty() ? "-" : s.current_version().c_str());
          for (const auto& e : s.engines())
            std::printf("  %-16s %-8s version %-8s staged %-8s %s\n", e.engine_id().c_str(),
                        e.ready() ? "ready" : (e.stale() ? "stale" : (e.paused() ? "paused" : "not-ready")),
                        e.weight_version().empty() ? "-" : e.weight_version().c_str(),
                        e.staged_version().empty() ? "-" : e.staged_version().c_str(), e.state().c_str());
        }
        std::fflush(stdout);
        return true;
      },
      0.2, absl::Seconds(seconds));
  return ExitFor(st, peer);  // prints the error
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> commands = {"status", "nodes", "engines", "history", "verify", "checksums", "version",
                                             "plan",   "abort", "resume",  "watch",   "remove", "drain",     "undrain"};
  CLI::App app{"wsyncctl: administer a wsync cluster"};
  std::string log_level = "warn";
  cli::AddCommonFlags(app, "wsyncctl", &log_level);
  app.require_subcommand(1);
  app.fallthrough();  // global flags are accepted after the command too
  std::string endpoint = "127.0.0.1:7600", output = "table";
  double dial_timeout = 5;
  app.add_option("--endpoints", endpoint,
                 "coordinator host:port, or a comma-separated list of the coordinators sharing one etcd state store "
                 "(the command goes to the leader)")->envname("WSYNC_COORDINATOR");
  app.add_option("-w,--write-out,-o,--output", output, "output format: table|json")
      ->check(CLI::IsMember({"table", "json"}));
  app.add_option("--dial-timeout", dial_timeout, "seconds to wait for an endpoint")->check(CLI::PositiveNumber);
  tls::Options tls_opts;  // an admin certificate (CN "admin:NAME") for every command that changes state
  tls::AddFlags(app, &tls_opts);

  auto* status = app.add_subcommand("status", "cluster membership, plan and current version");
  auto* nodes = app.add_subcommand("nodes", "registered nodes: role, address, transport, engines");
  auto* engines_cmd = app.add_subcommand("engines", "engines: kind, ranks, control address, node, state");
  bool engines_watch = false;
  double engines_for = 0;
  std::string health_listen;
  engines_cmd->add_flag("--watch", engines_watch,
                        "follow the engines' readiness (version served, staged version, ready/stale/paused): one "
                        "line per engine, or one JSON object, at every change");
  engines_cmd->add_option("--for", engines_for, "with --watch: stop after S seconds (default: until interrupted)");
  engines_cmd->add_option("--health-listen", health_listen,
                          "with --watch: serve GET /engines/<id>/ready on HOST:PORT (200 ready, 503 stale or paused) "
                          "for a router's health checks; port 0 = any (printed)");
  auto* version = app.add_subcommand("version", "client and coordinator versions");
  auto* history = app.add_subcommand("history", "past updates with per-phase timings");
  int limit = 20;
  history->add_option("-n,--limit", limit, "most recent N updates");
  std::string plot;
  std::vector<int64_t> history_versions;
  history->add_option("--plot", plot,
                      "write the updates' timeline (phases per engine and per source, bytes and rates) to FILE: .svg, "
                      "or .png through rsvg-convert (librsvg2-bin); the same drawing as the status page");
  history->add_option("--version", history_versions, "only these updates (repeat, or V1,V2)")->delimiter(',');
  auto* verify = app.add_subcommand(
      "verify",
      "compare every engine rank's parameters with the checksums the sources recorded writing them (real weights; "
      "exit 0 all MATCH, 1 any MISMATCH or MISSING); --synthetic: a reference engine regenerates a step's weights");
  std::string engine;
  int64_t step = -1, verify_version = -1;
  bool synthetic = false, verify_all = false;
  verify->add_option("--engine", engine,
                     "engine id or control address (checksums: only this engine; --synthetic: required)");
  verify->add_option("--version", verify_version, "the update to check (default: the coordinator's current version)");
  verify->add_option("--step", step, "with --synthetic: the generation step the weights should equal");
  verify->add_flag("--synthetic", synthetic, "ask the reference engine to regenerate synthetic weights (wsync-"
                   "trainer-demo's) and compare (implied by --step)");
  verify->add_flag("--all", verify_all, "table: list matching parameters too (mismatches and missing ones always)");
  auto* checksums = app.add_subcommand("checksums", "per-parameter checksums of one engine rank");
  int rank = 0;
  checksums->add_option("--engine", engine, "engine id (looked up at the coordinator) or control address host:port")
      ->required();
  checksums->add_option("--rank", rank, "engine rank");
  auto* abort_cmd = app.add_subcommand("abort", "close the open update without committing it (engines stay paused)");
  int64_t abort_version = -1;
  std::string reason;
  abort_cmd->add_option("version", abort_version, "the open update's version (`wsyncctl abort 42`)")->required();
  abort_cmd->add_option("--reason", reason, "recorded in the history");
  auto* watch = app.add_subcommand(
      "watch",
      "the current state at once, then live progress of the current (or next) update: phase, bytes per "
      "source, rate, ETA; ends with it");
  double interval = 0.5, watch_for = 0;
  bool once = false;
  watch->add_option("--interval", interval, "seconds between samples")->check(CLI::Range(0.01, 60.0));
  watch->add_option("--for", watch_for, "stop after this many seconds (0: when the update has ended)");
  watch->add_flag("--once", once, "print one sample (the current state) and exit");
  double idle_every = 10;
  watch->add_option("--idle-every", idle_every, "while no update runs, print a line at least this often (seconds)")
      ->check(CLI::PositiveNumber);
  auto* remove = app.add_subcommand("remove", "deregister a node and its engines between updates (stop its daemon "
                                               "first, or it registers again)");
  std::string remove_id;
  remove->add_option("node_id", remove_id, "the node to remove")->required();
  auto* drain = app.add_subcommand(
      "drain", "between updates, take an engine, or every engine of a target node, out of the next plans (it keeps "
               "serving its current version and is not paused or updated); a source node only if the others can push "
               "every tensor without it");
  std::string drain_name;
  drain->add_option("name", drain_name, "engine id or node id")->required();
  auto* undrain = app.add_subcommand("undrain", "re-include a drained engine or node: the next update writes and "
                                                "resumes it (until then it serves the version it had)");
  undrain->add_option("name", drain_name, "engine id or node id")->required();
  auto* resume = app.add_subcommand(
      "resume", "resume paused engines at their current version (only when no byte of a failed update reached them)");
  app.add_subcommand("plan", "compute a transfer plan and its predicted time (see: wsyncctl plan --help)");
  app.footer(
      "exit codes: 0 ok, 1 failure, 2 bad usage or configuration (e.g. no client certificate for an mTLS "
      "coordinator), 3 endpoint unavailable\n"
      "global flags may stand anywhere on the line; the coordinator's address: --endpoints or WSYNC_COORDINATOR "
      "(default 127.0.0.1:7600)\n\n"
      "examples:\n"
      "  wsyncctl status                                   state, open update, last failure, nodes, engines\n"
      "  wsyncctl watch                                    live progress of updates (Ctrl-C ends it)\n"
      "  wsyncctl watch --once -o json                     one snapshot as JSON\n"
      "  wsyncctl --endpoints 10.0.0.1:7600 history -n 5   the last five updates with their phases\n"
      "  wsyncctl history -n 3 --plot updates.svg          their timeline as SVG (.png: PNG, via rsvg-convert)\n"
      "  wsyncctl engines -w json                          engines with their served version\n"
      "  wsyncctl abort 42 --reason \"bad batch\"            close open update 42 (admin certificate)\n"
      "  wsyncctl verify                                   check every engine rank against the sources' checksums\n"
      "  wsyncctl plan --model config.json --train tp=8,nodes=2 --infer instances=4,tp=8\n"
      "  WSYNC_TLS_CA=ca.pem WSYNC_TLS_CERT=admin.pem WSYNC_TLS_KEY=admin-key.pem wsyncctl resume\n");
  // WSYNC_COORDINATOR names the coordinator everywhere (docs, deploy files, the Python client's examples); the
  // name wsyncctl once read alone is still taken, with a warning.
  if (const char* old = std::getenv("WSYNC_ENDPOINTS"); old != nullptr && *old != '\0') {
    const char* now = std::getenv("WSYNC_COORDINATOR");
    if (now == nullptr || *now == '\0') {
      std::fprintf(stderr, "wsyncctl: WSYNC_ENDPOINTS is deprecated: set WSYNC_COORDINATOR (using %s)\n", old);
      setenv("WSYNC_COORDINATOR", old, 1);
    } else if (std::string(now) != old) {
      std::fprintf(stderr, "wsyncctl: WSYNC_ENDPOINTS (deprecated) is ignored: WSYNC_COORDINATOR=%s is set\n", now);
    }
  }
  // A bare --version (no value after it) is wsyncctl's own flag wherever it stands, also after `history` or `verify`,
  // whose --version V selects updates.
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--version" && (i + 1 == argc || argv[i + 1][0] == '-')) {
      std::printf("%s\n", cli::VersionString("wsyncctl").c_str());
      return kExitOk;
    }
  }
  const int at = CommandIndex(app, argc, argv);
  if (at > 0) {
    const std::string cmd = argv[at];
    // `abort --version V` (once its form) would now print wsyncctl's version and abort nothing: refuse it.
    for (int i = at + 1; cmd == "abort" && i + 1 < argc; ++i) {
      int64_t v = 0;
      if (std::string(argv[i]) == "--version" && absl::SimpleAtoi(argv[i + 1], &v)) {
        std::fprintf(stderr, "Error: give the update's version without a flag: wsyncctl abort %s (--version prints "
                     "wsyncctl's version)\n", argv[i + 1]);
        return kExitUsage;
      }
    }
    if (cmd == "plan") return RunPlan(app, argc, argv, at);
    if (std::find(commands.begin(), commands.end(), cmd) == commands.end()) {
      std::fprintf(stderr, "Error: unknown command \"%s\" (commands: %s; see wsyncctl --help)\n", cmd.c_str(),
                   absl::StrJoin(commands, ", ").c_str());
      return kExitUsage;
    }
  }
  if (int rc = cli::Parse(app, argc, argv); rc >= 0) return rc;
  InitLogging("wsyncctl", log_level);
  {
    // The certificate's role must be one the command's RPCs allow (docs/security.md, "Roles"), so a wrong one is a
    // usage error here rather than a PERMISSION_DENIED half-way through.
    tls::Identity self{"wsyncctl", tls::AllRoles(), ""};
    for (const CLI::App* cmd : {abort_cmd, remove, drain, undrain, resume})
      if (*cmd) self = {absl::StrCat("wsyncctl ", cmd->get_name()), {tls::kAdmin}, ""};
    for (const CLI::App* cmd : {verify, checksums})
      if (*cmd) self = {absl::StrCat("wsyncctl ", cmd->get_name()), {tls::kAdmin, tls::kTrainer}, ""};
    if (auto st = tls::Configure(tls_opts, client::SplitEndpoints(endpoint), self); !st.ok()) return ExitFor(st);
    gpr_set_log_function(&QuietGrpcLog);  // after Configure, which routes gRPC's log to spdlog for the daemons
  }
  const Peer coordinator{endpoint, "--endpoints", !tls_opts.cert.empty()};
  const absl::Duration dt = absl::Seconds(dial_timeout);
  const bool json = output == "json";

  if (*version) {
    client::CoordinatorClient c(endpoint, dt);
    auto s = c.Status();
    if (json) {
      std::printf("{\n  \"client_version\": \"%s\",\n  \"server_version\": \"%s\"\n}\n",
                  cli::VersionString("wsyncctl").c_str(), s.ok() ? s->server_version().c_str() : "");
    } else {
      std::printf("client: %s\nserver: %s\n", cli::VersionString("wsyncctl").c_str(),
                  s.ok() ? (s->server_version().empty() ? "(older than 0.1.0: no version reported)"
                                                        : s->server_version().c_str())
                         : ("unreachable at " + endpoint).c_str());
    }
    return s.ok() ? kExitOk : ExitFor(s.status(), coordinator);
  }
  if (*engines_cmd && engines_watch) return RunEnginesWatch(endpoint, coordinator, dt, json, engines_for, health_listen);
  if (*nodes || *engines_cmd) {
    client::CoordinatorClient c(endpoint, dt);
    auto s = c.Status();
    if (!s.ok()) return ExitFor(s.status(), coordinator);
    if (*nodes) {
      if (json) {
        // Only the nodes: a ClusterStatus holding them would print its other fields at their defaults
        // (open_version 0 where `status` says -1).
        nlohmann::json j = {{"nodes", tools::ProtoToJson(*s)["nodes"]}};
        std::printf("%s\n", j.dump(2).c_str());
        return kExitOk;
      }
      std::printf("%-28s %-7s %-22s %-6s %-9s %s\n", "NODE", "ROLE", "ADDRESS", "XPORT", "REACHABLE", "ENGINES");
      for (const auto& n : s->nodes())
        std::printf("%-28s %-7s %-22s %-6s %-9s %s\n", n.node_id().c_str(), n.role().c_str(), n.address().c_str(),
                    n.transport().c_str(), n.reachable() ? "yes" : "NO",
                    n.engines_size() ? absl::StrJoin(n.engines(), ",").c_str() : "-");
      if (s->nodes_size() == 0) std::printf("%s\n", tools::kNoNodesHint);
      return kExitOk;
    }
    if (json) {
      nlohmann::json arr = nlohmann::json::array();
      for (const auto& n : s->nodes())
        for (const auto& e : n.engine_details()) {
          nlohmann::json j = tools::ProtoToJson(e);
          j["node_id"] = n.node_id();
          arr.push_back(std::move(j));
        }
      std::printf("%s\n", arr.dump(2).c_str());
      return kExitOk;
    }
    std::printf("%s", tools::FormatEngines(*s).c_str());
    bool any_engine = false;
    for (const auto& n : s->nodes()) any_engine |= n.engine_details_size() > 0;
    if (!any_engine) std::printf("%s\n", tools::kNoEnginesHint);
    return kExitOk;
  }
  if (*watch) return RunWatch(endpoint, coordinator, dt, json, interval, watch_for, once, idle_every);
  if (*verify && (synthetic || step >= 0)) {
    if (engine.empty() || step < 0) {
      std::fprintf(stderr, "Error: verify --synthetic needs --engine ADDRESS and --step N\n");
      return kExitUsage;
    }
  } else if (*verify) {
    client::CoordinatorClient c(endpoint, dt);
    tools::VerifyOptions vo;
    vo.version = verify_version;
    vo.engine = engine;
    vo.dial_timeout = dt;
    auto r = tools::VerifyAgainstSources(c, vo);
    if (!r.ok()) return ExitFor(r.status(), coordinator);
    if (json) {
      nlohmann::json j;
      j["version"] = r->version;
      j["ok"] = r->ok();
      j["sources"] = r->sources;
      j["relays"] = r->relays;
      j["notes"] = r->notes;
      j["matched"] = r->matched;
      j["mismatched"] = r->mismatched;
      j["missing"] = r->missing;
      j["bytes_compared"] = r->bytes_compared;
      j["params"] = nlohmann::json::array();
      for (const auto& p : r->params)
        j["params"].push_back({{"engine_id", p.engine_id}, {"rank", p.rank}, {"param", p.param},
                               {"result", tools::VerdictName(p.verdict)}, {"bytes", p.bytes}, {"detail", p.detail}});
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      for (const auto& n : r->notes) std::printf("note: %s\n", n.c_str());
      std::printf("%-16s %-5s %-9s %-12s %s\n", "ENGINE", "RANK", "RESULT", "BYTES", "PARAMETER");
      for (const auto& p : r->params) {
        if (p.verdict == tools::ParamVerdict::kMatch && !verify_all) continue;
        std::printf("%-16s %-5d %-9s %-12llu %s%s%s\n", p.engine_id.c_str(), p.rank, tools::VerdictName(p.verdict),
                    static_cast<unsigned long long>(p.bytes), p.param.c_str(), p.detail.empty() ? "" : ": ",
                    p.detail.c_str());
      }
      std::printf("%s: update %lld, %lld parameters MATCH, %lld MISMATCH, %lld MISSING (%.1f MiB compared; "
                  "checksums from %zu sources, %zu relays)\n",
                  r->ok() ? "verified" : "FAILED", static_cast<long long>(r->version),
                  static_cast<long long>(r->matched), static_cast<long long>(r->mismatched),
                  static_cast<long long>(r->missing), r->bytes_compared / 1048576.0, r->sources.size(),
                  r->relays.size());
    }
    return r->ok() ? kExitOk : kExitServer;
  }

  if (*remove) {
    client::CoordinatorClient c(endpoint, dt);
    auto r = c.RemoveNode(remove_id);
    if (!r.ok()) return ExitFor(r.status(), coordinator);
    if (json) {
      PrintJson(*r);
      return kExitOk;
    }
    std::printf("node %s removed (engines: %s); membership epoch %lld\n", remove_id.c_str(),
                r->engines_size() ? absl::StrJoin(r->engines(), ", ").c_str() : "none",
                static_cast<long long>(r->membership_epoch()));
    return kExitOk;
  }
  if (*drain || *undrain) {
    client::CoordinatorClient c(endpoint, dt);
    auto s = c.Status();
    if (!s.ok()) return ExitFor(s.status(), coordinator);
    bool is_engine = false, is_node = false;
    for (const auto& n : s->nodes()) {
      is_node |= n.node_id() == drain_name;
      for (const auto& e : n.engines()) is_engine |= e == drain_name;
    }
    if (!is_engine && !is_node)
      return ExitFor(absl::NotFoundError(absl::StrCat("no engine or node '", drain_name, "' is registered")));
    auto r = c.Drain(is_engine ? drain_name : "", is_engine ? "" : drain_name, static_cast<bool>(*drain));
    if (!r.ok()) return ExitFor(r.status(), coordinator);
    if (json) {
      PrintJson(*r);
      return kExitOk;
    }
    std::printf("%s %s %s (engines changed: %s); membership epoch %lld: the next update re-plans\n",
                is_engine ? "engine" : "node", drain_name.c_str(), *drain ? "drained" : "undrained",
                r->engines_size() ? absl::StrJoin(r->engines(), ", ").c_str() : "none",
                static_cast<long long>(r->membership_epoch()));
    return kExitOk;
  }
  if (*abort_cmd || *resume) {
    client::CoordinatorClient c(endpoint, dt);
    if (*abort_cmd) {
      auto r = c.AbortUpdate(abort_version, reason, "operator (wsyncctl abort)");
      if (!r.ok()) return ExitFor(r.status(), coordinator);
      if (json) {
        PrintJson(*r);
        return kExitOk;
      }
      std::printf("update %lld aborted: %.1f MiB of it had reached the engines; %s\n",
                  static_cast<long long>(abort_version), r->bytes_written() / 1048576.0,
                  r->engines_resumable()
                      ? "the engines hold their old version untouched: `wsyncctl resume` resumes them"
                      : "the engines may hold partial writes and stay paused until an update succeeds");
      return kExitOk;
    }
    auto r = c.ResumeEngines();
    if (!r.ok()) return ExitFor(r.status(), coordinator);
    if (json) {
      PrintJson(*r);
      return kExitOk;
    }
    std::printf("%s\n", tools::FormatResumed(*r).c_str());
    return kExitOk;
  }
  if (*status || *history) {
    client::CoordinatorClient c(endpoint, dt);
    if (*status) {
      auto s = c.Status();
      if (!s.ok()) return ExitFor(s.status(), coordinator);
      const std::vector<tools::TargetPath> targets = QueryTargets(*s, dt);
      if (json) {
        nlohmann::json j = tools::ProtoToJson(*s);
        j["target_nodes"] = tools::TargetPathsJson(targets);
        std::printf("%s\n", j.dump(2).c_str());
        return kExitOk;
      }
      std::printf("%s", tools::FormatClusterHeadline(*s).c_str());
      std::printf("%-28s %-7s %-22s %-6s %s\n", "NODE", "ROLE", "ADDRESS", "XPORT", "ENGINES");
      for (const auto& n : s->nodes()) {
        std::string engines;
        for (const auto& e : n.engines()) engines += (engines.empty() ? "" : ",") + e;
        std::printf("%-28s %-7s %-22s %-6s %s\n", n.node_id().c_str(), n.role().c_str(), n.address().c_str(),
                    n.transport().c_str(), engines.empty() ? "-" : engines.c_str());
      }
      bool any_engine = false;
      for (const auto& n : s->nodes()) any_engine |= n.engine_details_size() > 0;
      if (any_engine) std::printf("\n%s", tools::FormatEngines(*s).c_str());
      if (s->nodes_size() == 0) std::printf("%s\n", tools::kNoNodesHint);
      if (!targets.empty()) std::printf("\n%s", tools::FormatTargetPaths(targets).c_str());
      if (s->plan_size() > 0) {
        std::printf("\n%-28s %-12s %-5s %s\n", "SOURCE", "ENGINE", "RANK", "MiB");
        for (const auto& t : s->plan())
          std::printf("%-28s %-12s %-5d %.1f\n", t.source_node().c_str(), t.engine_id().c_str(), t.rank(),
                      t.bytes() / 1048576.0);
      }
      return kExitOk;
    }
    // Versions asked by number are looked up in the whole history (they need not be among the last `limit`).
    auto h = c.History(history_versions.empty() ? limit : 0);
    if (!h.ok()) return ExitFor(h.status(), coordinator);
    auto selected = tools::SelectRecords(*h, history_versions, history_versions.empty() ? limit : 0);
    if (!selected.ok()) return ExitFor(selected.status());
    if (!plot.empty()) {
      auto format = tools::PlotFormatOf(plot);
      if (!format.ok()) return ExitFor(format.status());
      if (absl::Status w = tools::WritePlot(plot, *format, daemon::TimelineSvg(*selected)); !w.ok()) return ExitFor(w);
      std::fprintf(stderr, "wrote the timeline of %zu updates to %s\n", selected->size(), plot.c_str());
      return kExitOk;
    }
    h->clear_records();
    for (auto& r : *selected) *h->add_records() = std::move(r);
    if (json) {
      PrintJson(*h);
      return kExitOk;
    }
    std::printf("%-8s %-20s %-7s %-9s %-10s %-10s %-6s %-7s %s\n", "VERSION", "STARTED (UTC)", "OK", "TOTAL_S", "MiB",
                "SENT_MiB", "RANKS", "DELTA", "PHASES / ERROR");
    for (const auto& r : h->records()) {
      // DELTA: engine ranks that took deltas / ranks written ("-" for an update that recorded none).
      const int written = r.delta_ranks_size() + r.fallbacks_size();
      const std::string delta = written == 0 ? "-" : absl::StrCat(r.delta_ranks_size(), "/", written);
      const std::string started =
          r.started_unix_ms() > 0
              ? absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixMillis(r.started_unix_ms()), absl::UTCTimeZone())
              : "-";
      // Committed past its commit point with engines not resumed: "PARTIAL", and which ones.
      const std::string detail = r.not_resumed_size() > 0
                                     ? absl::StrCat("committed, ", r.not_resumed_size(), " engines not resumed (",
                                                    absl::StrJoin(r.not_resumed(), ", "), "); ", Phases(r))
                                     : (r.success() ? Phases(r) : r.error());
      std::printf("%-8lld %-20s %-7s %-9.3f %-10.1f %-10.1f %-6d %-7s %s\n", static_cast<long long>(r.version()),
                  started.c_str(),
                  r.success() ? (r.not_resumed_size() > 0 ? "PARTIAL" : "yes") : (r.aborted() ? "ABORTED" : "FAILED"),
                  r.total_seconds(), r.bytes() / 1048576.0, r.sent_bytes() / 1048576.0, r.engine_ranks(), delta.c_str(),
                  detail.c_str());
      // Why ranks got dense writes, when deltas were asked for (not for a dense update asked or an anchor).
      if (r.delta_mode() != "off" && r.delta_mode() != "anchor")
        for (const auto& f : r.fallbacks())
          std::printf("         dense %s: %s\n", f.rank().c_str(), f.reason().c_str());
    }
    return kExitOk;
  }

  // --engine takes an engine id as well as a control address: an id is looked up in the coordinator's membership.
  std::string engine_addr = engine;
  if (engine.find(':') == std::string::npos) {
    client::CoordinatorClient c(endpoint, dt);
    auto st = c.Status();
    if (!st.ok()) return ExitFor(st.status(), coordinator);
    engine_addr.clear();
    for (const auto& n : st->nodes())
      for (const auto& e : n.engine_details())
        if (e.engine_id() == engine) engine_addr = e.address();
    if (engine_addr.empty())
      return ExitFor(absl::InvalidArgumentError(
          absl::StrCat("--engine ", engine, ": no engine of that id is registered with the coordinator at ", endpoint,
                       " (give an engine id from `wsyncctl engines`, or its control address host:port)")));
  }
  const Peer engine_peer{engine_addr, "--engine", coordinator.tls};
  auto channel = tls::Dial(engine_addr);
  if (!channel.ok()) return ExitFor(channel.status());
  auto stub = v1::EngineControl::NewStub(*std::move(channel));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(600));
  if (*verify) {
    v1::VerifyRequest req;
    req.set_step(step);
    v1::VerifyReply rep;
    absl::Status s = FromGrpcStatus(stub->Verify(&ctx, req, &rep));
    if (!s.ok()) return ExitFor(s, engine_peer);
    if (json) {
      PrintJson(rep);
    } else {
      std::printf("%s: %lld params, %.1f MiB on %d ranks\n", rep.ok() ? "verified" : "MISMATCH",
                  static_cast<long long>(rep.params_checked()), rep.bytes_checked() / 1048576.0, rep.ranks());
      for (const auto& m : rep.mismatches()) std::printf("  %s\n", m.c_str());
    }
    return rep.ok() ? kExitOk : kExitServer;
  }
  v1::RankRequest req;
  req.set_rank(rank);
  v1::ChecksumReply rep;
  absl::Status s = FromGrpcStatus(stub->GetChecksums(&ctx, req, &rep));
  if (!s.ok()) return ExitFor(s, engine_peer);
  if (json) {
    PrintJson(rep);
  } else {
    for (const auto& p : rep.params()) std::printf("%s  %12llu  %s\n", p.xxh128().c_str(),
                                                   static_cast<unsigned long long>(p.bytes()), p.name().c_str());
  }
  return kExitOk;
}
