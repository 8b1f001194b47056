// wsyncctl: the admin CLI. Exit codes: 0 ok, 1 the server reported an error, 2 bad usage or input,
// 3 the endpoint could not be reached in time.

#include <cstdio>
#include <iostream>

#include <grpcpp/grpcpp.h>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "client/coordinator_client.h"
#include "google/protobuf/util/json_util.h"
#include "proto/status_convert.h"
#include "wsync/v1/engine.grpc.pb.h"
#ifdef WSYNC_HAVE_PLAN_COMMAND
#include "tools/plan_command.h"
#endif

using namespace wsync;

namespace {

constexpr int kExitOk = 0, kExitServer = 1, kExitUsage = 2, kExitUnreachable = 3;

int ExitFor(const absl::Status& s) {
  if (s.ok()) return kExitOk;
  std::fprintf(stderr, "Error: %s\n", s.ToString().c_str());
  if (s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kDeadlineExceeded)
    return kExitUnreachable;
  if (s.code() == absl::StatusCode::kInvalidArgument) return kExitUsage;
  return kExitServer;
}

void PrintJson(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  std::cout << out;
}

std::string Phases(const v1::UpdateRecord& r) {
  std::string s;
  for (const auto& p : r.phases()) absl::StrAppendFormat(&s, "%s%s=%.3fs", s.empty() ? "" : " ", p.phase(), p.seconds());
  return s;
}

}  // namespace

int main(int argc, char** argv) {
#ifdef WSYNC_HAVE_PLAN_COMMAND
  // `plan` is a pure computation with its own flags; hand it over whole.
  if (argc >= 2 && std::string(argv[1]) == "plan") return wsync::tools::RunPlanCommand(argc - 1, argv + 1);
#endif
  CLI::App app{"wsyncctl: administer a wsync cluster\n"
               "exit codes: 0 ok, 1 server error, 2 bad usage, 3 endpoint unreachable"};
  app.require_subcommand(1);
  std::string endpoint = "127.0.0.1:7600", output = "table";
  double dial_timeout = 5;
  app.add_option("--endpoints", endpoint, "coordinator host:port")->envname("WSYNC_ENDPOINTS");
  app.add_option("-w,--write-out", output, "output format")->check(CLI::IsMember({"table", "json"}));
  app.add_option("--dial-timeout", dial_timeout, "seconds to wait for an endpoint")->check(CLI::PositiveNumber);

  auto* status = app.add_subcommand("status", "cluster membership, plan and current version");
  auto* history = app.add_subcommand("history", "past updates with per-phase timings");
  int limit = 20;
  history->add_option("-n,--limit", limit, "most recent N updates");
  auto* verify = app.add_subcommand("verify", "ask a reference engine to verify its weights against a step");
  std::string engine;
  int64_t step = 0;
  verify->add_option("--engine", engine, "engine control address")->required();
  verify->add_option("--step", step, "generation step the weights should equal")->required();
  auto* checksums = app.add_subcommand("checksums", "per-parameter checksums of one engine rank");
  int rank = 0;
  checksums->add_option("--engine", engine, "engine control address")->required();
  checksums->add_option("--rank", rank, "engine rank");
#ifdef WSYNC_HAVE_PLAN_COMMAND
  app.add_subcommand("plan", "compute a transfer plan and its predicted time (see: wsyncctl plan --help)");
#endif
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : kExitUsage;
  }
  const absl::Duration dt = absl::Seconds(dial_timeout);
  const bool json = output == "json";

  if (*status || *history) {
    client::CoordinatorClient c(endpoint, dt);
    if (*status) {
      auto s = c.Status();
      if (!s.ok()) return ExitFor(s.status());
      if (json) {
        PrintJson(*s);
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
    std::printf("%-8s %-7s %-9s %-10s %-6s %s\n", "VERSION", "OK", "TOTAL_S", "MiB", "RANKS", "PHASES / ERROR");
    for (const auto& r : h->records())
      std::printf("%-8lld %-7s %-9.3f %-10.1f %-6d %s\n", static_cast<long long>(r.version()),
                  r.success() ? "yes" : "FAILED", r.total_seconds(), r.bytes() / 1048576.0, r.engine_ranks(),
                  r.success() ? Phases(r).c_str() : r.error().c_str());
    return kExitOk;
  }

  auto stub = v1::EngineControl::NewStub(grpc::CreateChannel(engine, grpc::InsecureChannelCredentials()));
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
