#include "tools/cli/verify_command.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "proto/status_convert.h"
#include "proto/tls.h"
#include "wsync/v1/daemon.grpc.pb.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace wsync::tools {
namespace {

// Checksum replies carry one line per range; large models are asked in chunks to stay under message limits.
constexpr int kRangesPerCall = 20000;
constexpr int kMaxReplyBytes = 512 << 20;

struct Range {
  uint64_t offset = 0, length = 0;
  std::string xxh128;  // as the source recorded it
  std::string source;  // who wrote it: "source NODE" or "relay NODE"
};

void SetDeadline(grpc::ClientContext* ctx, absl::Duration d) {
  ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d));
}

// A channel to `address` that connected within `dial` (Unavailable naming `who` otherwise).
absl::StatusOr<std::shared_ptr<grpc::Channel>> Connect(const std::string& address, const std::string& who,
                                                       absl::Duration dial) {
  WSYNC_ASSIGN_OR_RETURN(auto channel, tls::Dial(address, kMaxReplyBytes));
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(dial)))
    return absl::UnavailableError(
        absl::StrCat(who, " at ", address, " could not be reached within ", absl::FormatDuration(dial)));
  return channel;
}

absl::Status Named(const grpc::Status& s, const std::string& what) { return Annotate(FromGrpcStatus(s), what); }

}  // namespace

const char* VerdictName(ParamVerdict v) {
  switch (v) {
    case ParamVerdict::kMatch:
      return "MATCH";
    case ParamVerdict::kMismatch:
      return "MISMATCH";
    case ParamVerdict::kMissing:
      return "MISSING";
  }
  return "?";
}

absl::StatusOr<VerifyReport> VerifyAgainstSources(client::CoordinatorClient& coordinator, const VerifyOptions& opts) {
  auto status = coordinator.Status();
  if (!status.ok()) return Annotate(status.status(), "asking the coordinator for the cluster");
  VerifyReport rep;
  rep.version = opts.version;
  if (rep.version < 0) {
    if (status->current_version().empty() || !absl::SimpleAtoi(status->current_version(), &rep.version))
      return absl::FailedPreconditionError(absl::StrCat("the coordinator reports no current version (\"",
                                                        status->current_version(),
                                                        "\"): no update has completed yet; give --version"));
  }

  // What the writers wrote: (engine, rank) → parameter → ranges. The writers are the sources and, with relay trees,
  // the target daemons that forwarded into their children (docs/planner.md "The relay data path"): a relayed engine's
  // bytes are checked against what its relay wrote, which the relay had checked against what its own writer sent.
  std::map<std::pair<std::string, int>, std::map<std::string, std::vector<Range>>> written;
  for (const auto& n : status->nodes()) {
    const bool source = n.role() == "source";
    const std::string who = absl::StrCat(source ? "source " : "relay ", n.node_id());
    auto channel = Connect(n.address(), who, opts.dial_timeout);
    if (!channel.ok()) {
      if (source) return channel.status();
      // A target that cannot be reached: its engines' checks say what is missing if it relayed into them.
      rep.notes.push_back(absl::StrCat("target ", n.node_id(), " not asked what it relayed: ",
                                       channel.status().message()));
      continue;
    }
    auto stub = v1::NodeDaemon::NewStub(*channel);
    grpc::ClientContext ctx;
    SetDeadline(&ctx, opts.call_timeout);
    v1::WriteChecksumsRequest req;
    req.set_version(rep.version);
    v1::WriteChecksumsReply out;
    grpc::Status s = stub->GetWriteChecksums(&ctx, req, &out);
    if (!source && (s.error_code() == grpc::StatusCode::NOT_FOUND ||
                    s.error_code() == grpc::StatusCode::FAILED_PRECONDITION))
      continue;  // relayed nothing of this update (or a daemon older than relay records)
    if (!s.ok()) return Named(s, absl::StrCat("asking ", who, " at ", n.address(), " what it wrote"));
    (source ? rep.sources : rep.relays).push_back(n.node_id());
    if (!out.finished())
      rep.notes.push_back(absl::StrCat(who, ": update ", rep.version,
                                       " did not finish there (open, failed or aborted); its checksums cover what "
                                       "it had written"));
    for (const auto& w : out.writes())
      written[{w.engine_id(), w.rank()}][w.param()].push_back({w.offset(), w.length(), w.xxh128(), who});
  }
  if (rep.sources.empty()) return absl::FailedPreconditionError("the coordinator knows no source daemon");

  bool any_engine = false;
  for (const auto& n : status->nodes()) {
    for (const auto& e : n.engine_details()) {
      if (!opts.engine.empty() && opts.engine != e.engine_id() && opts.engine != e.address()) continue;
      any_engine = true;
      WSYNC_ASSIGN_OR_RETURN(auto channel, Connect(e.address(), "engine " + e.engine_id(), opts.dial_timeout));
      auto stub = v1::EngineControl::NewStub(channel);
      for (int r = 0; r < e.ranks(); ++r) {
        const std::string who = absl::StrCat("engine ", e.engine_id(), " rank ", r);
        v1::RankLayout layout;
        {
          grpc::ClientContext ctx;
          SetDeadline(&ctx, opts.call_timeout);
          v1::RankRequest req;
          req.set_rank(r);
          grpc::Status s = stub->GetWeightLayout(&ctx, req, &layout);
          if (!s.ok()) return Named(s, absl::StrCat("asking ", who, " at ", e.address(), " for its layout"));
        }
        auto& mine = written[{e.engine_id(), r}];
        // The engine hashes every recorded range of its own memory.
        std::vector<std::pair<std::string, const Range*>> asked;
        for (const auto& [param, ranges] : mine)
          for (const Range& g : ranges) asked.emplace_back(param, &g);
        std::map<std::tuple<std::string, uint64_t, uint64_t>, std::string> have;
        for (size_t at = 0; at < asked.size(); at += kRangesPerCall) {
          v1::RankRequest req;
          req.set_rank(r);
          for (size_t i = at; i < std::min(asked.size(), at + kRangesPerCall); ++i) {
            auto* q = req.add_ranges();
            q->set_param(asked[i].first);
            q->set_offset(asked[i].second->offset);
            q->set_length(asked[i].second->length);
          }
          grpc::ClientContext ctx;
          SetDeadline(&ctx, opts.call_timeout);
          v1::ChecksumReply out;
          grpc::Status s = stub->GetChecksums(&ctx, req, &out);
          if (!s.ok()) return Named(s, absl::StrCat("asking ", who, " at ", e.address(), " for checksums"));
          for (const auto& c : out.params())
            if (c.range()) have[{c.name(), c.offset(), c.bytes()}] = c.xxh128();
        }
        std::map<std::string, bool> in_layout;
        for (const auto& p : layout.params()) {
          in_layout[p.name()] = true;
          ParamResult res;
          res.engine_id = e.engine_id();
          res.rank = r;
          res.param = p.name();
          res.bytes = p.bytes();
          auto it = mine.find(p.name());
          uint64_t recorded = 0;
          if (it != mine.end()) {
            std::vector<Range> ranges = it->second;
            std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.offset < b.offset; });
            for (const Range& g : ranges) {
              recorded += g.length;
              auto h = have.find({p.name(), g.offset, g.length});
              if (h == have.end()) {
                if (res.verdict == ParamVerdict::kMatch) {
                  res.verdict = ParamVerdict::kMissing;
                  res.detail = absl::StrCat("the engine did not hash bytes [", g.offset, ", +", g.length, ")");
                }
              } else if (h->second != g.xxh128) {
                if (res.verdict != ParamVerdict::kMismatch)
                  res.detail = absl::StrCat("bytes [", g.offset, ", +", g.length, ") differ from what ", g.source,
                                            " wrote (engine ", h->second, ", writer ", g.xxh128, ")");
                res.verdict = ParamVerdict::kMismatch;
              } else {
                rep.bytes_compared += g.length;
              }
            }
          }
          if (res.verdict == ParamVerdict::kMatch && recorded != p.bytes()) {
            res.verdict = ParamVerdict::kMissing;
            res.detail = recorded == 0 ? absl::StrCat("no source or relay recorded writing it in update ", rep.version)
                                       : absl::StrCat("sources and relays recorded ", recorded, " of its ", p.bytes(),
                                                      " bytes in update ", rep.version);
          }
          rep.params.push_back(std::move(res));
        }
        for (const auto& [param, ranges] : mine) {
          if (in_layout.count(param) > 0) continue;
          ParamResult res;
          res.engine_id = e.engine_id();
          res.rank = r;
          res.param = param;
          res.verdict = ParamVerdict::kMissing;
          res.detail = absl::StrCat(ranges.front().source, " wrote it; the engine's layout has no such parameter");
          rep.params.push_back(std::move(res));
        }
      }
    }
  }
  if (!any_engine)
    return absl::InvalidArgumentError(
        opts.engine.empty() ? std::string("the coordinator knows no engine")
                            : absl::StrCat("--engine ", opts.engine, " names no registered engine (id or address)"));
  for (const auto& p : rep.params) {
    if (p.verdict == ParamVerdict::kMatch) ++rep.matched;
    if (p.verdict == ParamVerdict::kMismatch) ++rep.mismatched;
    if (p.verdict == ParamVerdict::kMissing) ++rep.missing;
  }
  return rep;
}

}  // namespace wsync::tools
