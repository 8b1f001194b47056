// wsyncctl: the admin CLI. Exit codes (base/cli.h, shared by every wsync binary): 0 ok, 1 the server reported an
// error, 2 bad usage or input, 3 the endpoint could not be reached in time. Global flags (--endpoints, -w,
// --dial-timeout) may stand anywhere on the line, before or after the command, as in etcdctl.

#include <cstdio>
#include <iostream>
#include <set>

#include <grpcpp/grpcpp.h>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "base/cli.h"
#include "base/logging.h"
#include "client/coordinator_client.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "proto/status_convert.h"
#include "proto/tls.h"
#include "wsync/v1/daemon.grpc.pb.h"
#include "wsync/v1/engine.grpc.pb.h"
#include "tools/cli/plan_command.h"
#include "tools/cli/status_view.h"
#include "tools/cli/verify_command.h"

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

// Proto JSON with every field, default-valued ones included (`rank: 0`, `success: false`), original field names.
std::string ProtoJson(const google::protobuf::Message& m, bool pretty) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = pretty;
  o.preserve_proto_field_names = true;
  o.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

void PrintJson(const google::protobuf::Message& m) { std::cout << ProtoJson(m, true); }

std::string Phases(const v1::UpdateRecord& r) {
  std::string s;
  for (const auto& p : r.phases()) absl::StrAppendFormat(&s, "%s%s=%.3fs", s.empty() ? "" : " ", p.phase(), p.seconds());
  return s;
}

// Global flags that take a value; used to tell a flag's value from the command when scanning argv.
const std::set<std::string>& ValueFlags() {
  static const std::set<std::string> f = {"--endpoints", "-w",      "--write-out", "--dial-timeout",
                                          "--log-level", "--tls-ca", "--tls-cert",  "--tls-key"};
  return f;
}

// Index of the command word in argv (the first argument that is neither a flag nor a global flag's value), or -1.
int CommandIndex(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.empty() || a[0] != '-') return i;
    if (ValueFlags().count(a) > 0) ++i;  // skip its value
  }
  return -1;
}

// `plan` is a pure computation with its own flags; it is handed the arguments after the word `plan`, plus the
// output format when -w/--write-out was given before the command.
int RunPlan(int argc, char** argv, int at) {
  std::vector<std::string> args = {"plan"};
  for (int i = 1; i < at; ++i) {
    const std::string a = argv[i];
    if ((a == "-w" || a == "--write-out") && i + 1 < at) {
      args.push_back("-w");
      args.push_back(argv[++i]);
    } else if (a.rfind("--write-out=", 0) == 0) {
      args.push_back("-w");
      args.push_back(a.substr(12));
    } else if (ValueFlags().count(a) > 0) {
      ++i;  // --endpoints etc.: meaningless for a local computation
    }
  }
  for (int i = at + 1; i < argc; ++i) args.push_back(argv[i]);
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

int RunWatch(const std::string& endpoint, absl::Duration dt, bool json, double interval, double watch_for,
             bool once) {
  client::CoordinatorClient c(endpoint, dt);
  std::map<std::string, std::unique_ptr<v1::NodeDaemon::Stub>> stubs;
  const absl::Time start = absl::Now();
  absl::Time prev_t = start;
  uint64_t prev_bytes = 0;
  bool saw_running = false;
  std::string first_version;
  bool first = true;
  for (;;) {
    auto w = SampleWatch(c, dt, stubs);
    if (!w.ok()) return ExitFor(w.status());
    const absl::Time now = absl::Now();
    const std::string& state = w->cluster.state();
    const bool running = UpdateRunning(state);
    saw_running |= running;
    if (first) first_version = w->cluster.current_version();
    // An update shorter than one interval is never seen running; the version moving says it ended.
    const bool ended = !running && (saw_running || w->cluster.current_version() != first_version);
    first = false;
    const double dts = absl::ToDoubleSeconds(now - prev_t);
    const double rate = dts > 0 && w->bytes >= prev_bytes ? (w->bytes - prev_bytes) / dts : 0;  // bytes/s
    const double eta = rate > 0 && w->expected > w->bytes ? (w->expected - w->bytes) / rate : -1;
    const bool quiet = !json && !running && !saw_running && absl::ToDoubleSeconds(now - start) > 0;
    if (quiet) {
      // Waiting for an update to start: the idle line was printed once.
    } else if (json) {
      nlohmann::json j;
      j["t"] = absl::ToDoubleSeconds(now - start);
      j["state"] = state;
      j["current_version"] = w->cluster.current_version();
      j["bytes_written"] = w->bytes;
      j["bytes_expected"] = w->expected;
      j["gbps"] = rate / 1e9;
      j["eta_seconds"] = eta;
      j["engines_hold_partial_writes"] = w->cluster.engines_hold_partial_writes();
      j["sources"] = nlohmann::json::array();
      for (const auto& [id, ns] : w->sources)
        j["sources"].push_back({{"node_id", id}, {"state", ns.state()}, {"open_version", ns.open_version()},
                                {"bytes_written", ns.bytes_written()}, {"bytes_expected", ns.bytes_expected()},
                                {"tensors_received", ns.tensors_received()},
                                {"tensors_expected", ns.tensors_expected()}, {"ranks_ended", ns.ranks_ended()},
                                {"trainer_ranks", ns.trainer_ranks()}});
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::string line = absl::StrFormat("%7.1fs  %-10s version %-6s", absl::ToDoubleSeconds(now - start), state,
                                         w->cluster.current_version().empty() ? "-" : w->cluster.current_version());
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
      if (w->cluster.engines_hold_partial_writes()) line += "  [engines hold partial writes]";
      std::printf("%s\n", line.c_str());
    }
    std::fflush(stdout);
    if (once || ended ||
        (watch_for > 0 && absl::ToDoubleSeconds(now - start) >= watch_for))
      return kExitOk;
    prev_t = now;
    prev_bytes = w->bytes;
    absl::SleepFor(absl::Seconds(interval));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> commands = {"status", "nodes", "engines", "history", "verify", "checksums",
                                             "version", "plan", "abort", "resume", "watch", "remove", "drain",
                                             "undrain"};
  const int at = CommandIndex(argc, argv);
  if (at > 0) {
    const std::string cmd = argv[at];
    if (cmd == "plan") return RunPlan(argc, argv, at);
    if (std::find(commands.begin(), commands.end(), cmd) == commands.end()) {
      std::fprintf(stderr, "Error: unknown command \"%s\" (commands: %s; see wsyncctl --help)\n", cmd.c_str(),
                   absl::StrJoin(commands, ", ").c_str());
      return kExitUsage;
    }
  }
  CLI::App app{"wsyncctl: administer a wsync cluster"};
  std::string log_level = "warn";
  cli::AddCommonFlags(app, "wsyncctl", &log_level);
  app.require_subcommand(1);
  app.fallthrough();  // global flags are accepted after the command too
  std::string endpoint = "127.0.0.1:7600", output = "table";
  double dial_timeout = 5;
  app.add_option("--endpoints", endpoint,
                 "coordinator host:port, or a comma-separated list of the coordinators sharing one etcd state store "
                 "(the command goes to the leader)")->envname("WSYNC_ENDPOINTS");
  app.add_option("-w,--write-out", output, "output format: table|json")->check(CLI::IsMember({"table", "json"}));
  app.add_option("--dial-timeout", dial_timeout, "seconds to wait for an endpoint")->check(CLI::PositiveNumber);
  tls::Options tls_opts;  // an admin certificate (CN "admin:NAME") for every command that changes state
  tls::AddFlags(app, &tls_opts);

  auto* status = app.add_subcommand("status", "cluster membership, plan and current version");
  auto* nodes = app.add_subcommand("nodes", "registered nodes: role, address, transport, engines");
  auto* engines_cmd = app.add_subcommand("engines", "engines: kind, ranks, control address, node, state");
  auto* version = app.add_subcommand("version", "client and coordinator versions");
  auto* history = app.add_subcommand("history", "past updates with per-phase timings");
  int limit = 20;
  history->add_option("-n,--limit", limit, "most recent N updates");
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
  checksums->add_option("--engine", engine, "engine control address")->required();
  checksums->add_option("--rank", rank, "engine rank");
  auto* abort_cmd = app.add_subcommand("abort", "close the open update without committing it (engines stay paused)");
  int64_t abort_version = -1;
  std::string reason;
  abort_cmd->add_option("--version,version", abort_version, "the open update's version")->required();
  abort_cmd->add_option("--reason", reason, "recorded in the history");
  auto* watch = app.add_subcommand(
      "watch", "live progress of the current (or next) update: phase, bytes per source, rate, ETA; ends with it");
  double interval = 0.5, watch_for = 0;
  bool once = false;
  watch->add_option("--interval", interval, "seconds between samples")->check(CLI::Range(0.01, 60.0));
  watch->add_option("--for", watch_for, "stop after this many seconds (0: when the update has ended)");
  watch->add_flag("--once", once, "print one sample and exit");
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
  }
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
    return s.ok() ? kExitOk : ExitFor(s.status());
  }
  if (*nodes || *engines_cmd) {
    client::CoordinatorClient c(endpoint, dt);
    auto s = c.Status();
    if (!s.ok()) return ExitFor(s.status());
    if (*nodes) {
      if (json) {
        v1::ClusterStatus only;
        *only.mutable_nodes() = s->nodes();
        PrintJson(only);
        return kExitOk;
      }
      std::printf("%-28s %-7s %-22s %-6s %-9s %s\n", "NODE", "ROLE", "ADDRESS", "XPORT", "REACHABLE", "ENGINES");
      for (const auto& n : s->nodes())
        std::printf("%-28s %-7s %-22s %-6s %-9s %s\n", n.node_id().c_str(), n.role().c_str(), n.address().c_str(),
                    n.transport().c_str(), n.reachable() ? "yes" : "NO",
                    n.engines_size() ? absl::StrJoin(n.engines(), ",").c_str() : "-");
      return kExitOk;
    }
    if (json) {
      nlohmann::json arr = nlohmann::json::array();
      for (const auto& n : s->nodes())
        for (const auto& e : n.engine_details()) {
          nlohmann::json j = nlohmann::json::parse(ProtoJson(e, false));
          j["node_id"] = n.node_id();
          arr.push_back(std::move(j));
        }
      std::printf("%s\n", arr.dump(2).c_str());
      return kExitOk;
    }
    std::printf("%-16s %-10s %-6s %-22s %-28s %s\n", "ENGINE", "KIND", "RANKS", "ADDRESS", "NODE", "STATE");
    for (const auto& n : s->nodes())
      for (const auto& e : n.engine_details())
        std::printf("%-16s %-10s %-6d %-22s %-28s %s\n", e.engine_id().c_str(), e.kind().empty() ? "-" : e.kind().c_str(),
                    e.ranks(), e.address().c_str(), n.node_id().c_str(), e.state().c_str());
    return kExitOk;
  }
  if (*watch) return RunWatch(endpoint, dt, json, interval, watch_for, once);
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
    if (!r.ok()) return ExitFor(r.status());
    if (json) {
      nlohmann::json j;
      j["version"] = r->version;
      j["ok"] = r->ok();
      j["sources"] = r->sources;
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
                  "checksums from %zu sources)\n",
                  r->ok() ? "verified" : "FAILED", static_cast<long long>(r->version),
                  static_cast<long long>(r->matched), static_cast<long long>(r->mismatched),
                  static_cast<long long>(r->missing), r->bytes_compared / 1048576.0, r->sources.size());
    }
    return r->ok() ? kExitOk : kExitServer;
  }

  if (*remove) {
    client::CoordinatorClient c(endpoint, dt);
    auto r = c.RemoveNode(remove_id);
    if (!r.ok()) return ExitFor(r.status());
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
    if (!s.ok()) return ExitFor(s.status());
    bool is_engine = false, is_node = false;
    for (const auto& n : s->nodes()) {
      is_node |= n.node_id() == drain_name;
      for (const auto& e : n.engines()) is_engine |= e == drain_name;
    }
    if (!is_engine && !is_node)
      return ExitFor(absl::NotFoundError(absl::StrCat("no engine or node '", drain_name, "' is registered")));
    auto r = c.Drain(is_engine ? drain_name : "", is_engine ? "" : drain_name, static_cast<bool>(*drain));
    if (!r.ok()) return ExitFor(r.status());
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
      auto r = c.AbortUpdate(abort_version, reason);
      if (!r.ok()) return ExitFor(r.status());
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
    if (!r.ok()) return ExitFor(r.status());
    if (json) {
      PrintJson(*r);
      return kExitOk;
    }
    std::printf("resumed %d engines at version %s: %s\n", r->engines_size(),
                r->version().empty() ? "-" : r->version().c_str(), absl::StrJoin(r->engines(), ", ").c_str());
    return kExitOk;
  }
  if (*status || *history) {
    client::CoordinatorClient c(endpoint, dt);
    if (*status) {
      auto s = c.Status();
      if (!s.ok()) return ExitFor(s.status());
      const std::vector<tools::TargetPath> targets = QueryTargets(*s, dt);
      if (json) {
        nlohmann::json j = nlohmann::json::parse(ProtoJson(*s, false));
        j["target_nodes"] = tools::TargetPathsJson(targets);
        std::printf("%s\n", j.dump(2).c_str());
        return kExitOk;
      }
      std::printf("state: %s   version: %s   membership epoch: %lld   plan epoch: %lld\n", s->state().c_str(),
                  s->current_version().empty() ? "-" : s->current_version().c_str(),
                  static_cast<long long>(s->membership_epoch()), static_cast<long long>(s->plan_epoch()));
      std::printf("%-28s %-7s %-22s %-6s %s\n", "NODE", "ROLE", "ADDRESS", "XPORT", "ENGINES");
      for (const auto& n : s->nodes()) {
        std::string engines;
        for (const auto& e : n.engines()) engines += (engines.empty() ? "" : ",") + e;
        std::printf("%-28s %-7s %-22s %-6s %s\n", n.node_id().c_str(), n.role().c_str(), n.address().c_str(),
                    n.transport().c_str(), engines.empty() ? "-" : engines.c_str());
      }
      bool any_engine = false;
      for (const auto& n : s->nodes()) any_engine |= n.engine_details_size() > 0;
      if (any_engine) {
        std::printf("\n%-16s %-10s %-6s %-22s %-28s %s\n", "ENGINE", "KIND", "RANKS", "ADDRESS", "NODE", "STATE");
        for (const auto& n : s->nodes())
          for (const auto& e : n.engine_details())
            std::printf("%-16s %-10s %-6d %-22s %-28s %s\n", e.engine_id().c_str(),
                        e.kind().empty() ? "-" : e.kind().c_str(), e.ranks(), e.address().c_str(),
                        n.node_id().c_str(), e.state().c_str());
      }
      if (!targets.empty()) std::printf("\n%s", tools::FormatTargetPaths(targets).c_str());
      if (s->plan_size() > 0) {
        std::printf("\n%-28s %-12s %-5s %s\n", "SOURCE", "ENGINE", "RANK", "MiB");
        for (const auto& t : s->plan())
          std::printf("%-28s %-12s %-5d %.1f\n", t.source_node().c_str(), t.engine_id().c_str(), t.rank(),
                      t.bytes() / 1048576.0);
      }
      return kExitOk;
    }
    auto h = c.History(limit);
    if (!h.ok()) return ExitFor(h.status());
    if (json) {
      PrintJson(*h);
      return kExitOk;
    }
    std::printf("%-8s %-7s %-9s %-10s %-10s %-6s %-7s %s\n", "VERSION", "OK", "TOTAL_S", "MiB", "SENT_MiB", "RANKS",
                "DELTA", "PHASES / ERROR");
    for (const auto& r : h->records()) {
      // DELTA: engine ranks that took deltas / ranks written ("-" for an update that recorded none).
      const int written = r.delta_ranks_size() + r.fallbacks_size();
      const std::string delta = written == 0 ? "-" : absl::StrCat(r.delta_ranks_size(), "/", written);
      std::printf("%-8lld %-7s %-9.3f %-10.1f %-10.1f %-6d %-7s %s\n", static_cast<long long>(r.version()),
                  r.success() ? "yes" : (r.aborted() ? "ABORTED" : "FAILED"), r.total_seconds(), r.bytes() / 1048576.0,
                  r.sent_bytes() / 1048576.0, r.engine_ranks(), delta.c_str(),
                  r.success() ? Phases(r).c_str() : r.error().c_str());
      // Why ranks got dense writes, when deltas were asked for (not for a dense update asked or an anchor).
      if (r.delta_mode() != "off" && r.delta_mode() != "anchor")
        for (const auto& f : r.fallbacks())
          std::printf("         dense %s: %s\n", f.rank().c_str(), f.reason().c_str());
    }
    return kExitOk;
  }

  auto channel = tls::Dial(engine);
  if (!channel.ok()) return ExitFor(channel.status());
  auto stub = v1::EngineControl::NewStub(*std::move(channel));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(600));
  if (*verify) {
    v1::VerifyRequest req;
    req.set_step(step);
    v1::VerifyReply rep;
    absl::Status s = FromGrpcStatus(stub->Verify(&ctx, req, &rep));
    if (!s.ok()) return ExitFor(s);
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
  if (!s.ok()) return ExitFor(s);
  if (json) {
    PrintJson(rep);
  } else {
    for (const auto& p : rep.params()) std::printf("%s  %12llu  %s\n", p.xxh128().c_str(),
                                                   static_cast<unsigned long long>(p.bytes()), p.name().c_str());
  }
  return kExitOk;
}
