#include "daemon/node/relay_forwarder.h"

#include <xxhash.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "spdlog/spdlog.h"

namespace wsync::daemon {
namespace {

// What a relay forwards to a child rank in one batch, at most (a longer landed range goes alone): a notice may cover
// many ranges (a parent's notices are batched per round), and the child hears of a batch, and forwards it on, only
// once the whole batch landed, so a level of the tree costs about this much of a copy, not a notice's worth.
constexpr uint64_t kForwardBatchBytes = 4ull << 20;

}  // namespace

absl::Status CheckRelayChild(const std::vector<RelayRankMemory>& ranks, const v1::RelayChild& child) {
  const std::string who = absl::StrCat("relay child engine ", child.engine_id(), " at ", child.target_daemon());
  if (child.layouts_size() != static_cast<int>(ranks.size()))
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": ", child.layouts_size(), " rank layouts, the relaying engine has ", ranks.size()));
  for (size_t r = 0; r < ranks.size(); ++r) {
    const v1::RankLayout& mine = ranks[r].layout;
    const v1::RankLayout& theirs = child.layouts(static_cast<int>(r));
    if (mine.params_size() != theirs.params_size())
      return absl::InvalidArgumentError(absl::StrCat(who, " rank ", r, ": ", theirs.params_size(),
                                                     " parameters, the relaying engine has ", mine.params_size()));
    for (int i = 0; i < mine.params_size(); ++i) {
      const v1::ParamDesc& a = mine.params(i);
      const v1::ParamDesc& b = theirs.params(i);
      if (a.name() != b.name() || a.segment() != b.segment() || a.offset() != b.offset() || a.bytes() != b.bytes())
        return absl::InvalidArgumentError(absl::StrCat(who, " rank ", r, ": parameter ", b.name(),
                                                       " is not where the relaying engine holds ", a.name()));
    }
    for (const auto& seg : theirs.segments())
      if (seg.kind() != "host" && !seg.kind().empty())
        return absl::InvalidArgumentError(absl::StrCat(who, " rank ", r, " segment ", seg.id(), " is ", seg.kind(),
                                                       " memory (relays write host memory only)"));
  }
  return absl::OkStatus();
}

std::vector<std::pair<int, std::vector<v1::LandedRange>>> ForwardBatches(const std::vector<v1::LandedRange>& ranges,
                                                                          uint64_t max_bytes) {
  std::vector<std::pair<int, std::vector<v1::LandedRange>>> out;
  std::map<int, std::pair<size_t, uint64_t>> open;  // rank → its batch being filled, that batch's bytes
  for (const v1::LandedRange& g : ranges) {
    auto batch = open.find(g.rank());
    if (batch == open.end() || batch->second.second + g.length() > max_bytes) {
      batch = open.insert_or_assign(g.rank(), std::make_pair(out.size(), uint64_t{0})).first;
      out.emplace_back(g.rank(), std::vector<v1::LandedRange>{});
    }
    out[batch->second.first].second.push_back(g);
    batch->second.second += g.length();
  }
  return out;
}

RelayForwarder::RelayForwarder(std::string node_id, transport::Transport* transport, Dial dial, Notify notify)
    : node_id_(std::move(node_id)),
      transport_(transport),
      dial_(std::move(dial)),
      notify_(std::move(notify)),
      writes_([this](int64_t generation, const absl::Status& err) {
        MutexLock l(&mu_);
        if (static_cast<uint64_t>(generation) == generation_ && error_.ok()) error_ = err;
        cv_.SignalAll();
      }) {
  notice_thread_ = std::thread([this] { NoticeLoop(); });
}

RelayForwarder::~RelayForwarder() {
  std::shared_ptr<std::vector<Child>> children;
  {
    MutexLock l(&mu_);
    stop_ = true;
    version_ = -1;
    children = std::move(children_);
    cv_.SignalAll();
  }
  notice_thread_.join();
  children.reset();  // writers cancel and join; their callbacks find no update
}

void RelayForwarder::Fail(const absl::Status& st) {
  MutexLock l(&mu_);
  if (error_.ok()) error_ = st;
  cv_.SignalAll();
}

absl::Status RelayForwarder::Connect(Child* child, const std::string& relay_node) {
  const v1::RelayChild& c = child->spec;
  for (int r = 0; r < c.layouts_size(); ++r) {
    const std::string who =
        absl::StrCat("engine ", c.engine_id(), " (node ", c.target_node(), ") rank ", r, " at ", c.target_daemon());
    auto ep = transport_->CreateEndpoint();
    if (!ep.ok()) return Annotate(ep.status(), absl::StrCat("relay ", node_id_, ": an endpoint for ", who));
    v1::ConnectTargetRequest req;
    req.set_engine_id(c.engine_id());
    req.set_rank(r);
    req.set_source_endpoint_info((*ep)->LocalInfo());
    req.set_source_node(relay_node);
    auto reply = dial_(c.target_daemon(), req);
    if (!reply.ok()) return Annotate(reply.status(), absl::StrCat("relay ", node_id_, " connecting to ", who));
    WSYNC_RETURN_IF_ERROR_CTX((*ep)->Connect(reply->target_endpoint_info(), absl::Seconds(30)), "relay ", node_id_,
                              " connecting to ", who);
    auto& regions = child->regions.emplace_back();
    auto& by_segment = child->by_segment.emplace_back();
    for (const auto& seg : c.layouts(r).segments()) {
      auto region = transport_->ImportRegion(seg.region_descriptor());
      if (!region.ok())
        return Annotate(region.status(), absl::StrCat("relay ", node_id_, ": ", who, " segment ", seg.id()));
      by_segment[seg.id()] = region->get();
      regions.push_back(*std::move(region));
    }
    child->writers.push_back(std::make_unique<TargetWriter>(
        *std::move(ep), absl::StrCat("relay ", node_id_, " forwarding to ", who), &writes_));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::SetRelayReply> RelayForwarder::Begin(const v1::SetRelayRequest& req,
                                                        std::vector<RelayRankMemory> ranks) {
  for (const auto& c : req.children()) WSYNC_RETURN_IF_ERROR(CheckRelayChild(ranks, c));
  std::shared_ptr<std::vector<Child>> old;
  uint64_t generation = 0;
  {
    MutexLock l(&mu_);
    version_ = -1;  // nothing of any update is taken until the children are connected
    generation = ++generation_;
    old = std::move(children_);
    notices_.clear();
  }
  writes_.Begin(static_cast<int64_t>(generation));
  // Prepare once: a child whose spec is unchanged keeps its connections while every writer of it is usable (the
  // previous update's batches all ended before its drain answered; a straggler's callback finds no update).
  auto children = std::make_shared<std::vector<Child>>();
  int connections = 0, kept = 0;
  for (const auto& c : req.children()) {
    Child* reuse = nullptr;
    if (old)
      for (Child& o : *old) {
        if (o.writers.empty() || o.spec.SerializeAsString() != c.SerializeAsString()) continue;
        bool usable = true;
        for (const auto& w : o.writers) usable = usable && w->broken().ok() && w->busy() == 0;
        if (usable) reuse = &o;
        break;
      }
    if (reuse != nullptr) {
      children->push_back(std::move(*reuse));
      reuse->writers.clear();
      ++kept;
    } else {
      Child& child = children->emplace_back();
      child.spec = c;
      WSYNC_RETURN_IF_ERROR(Connect(&child, req.relay_node()));
    }
    connections += c.layouts_size();
  }
  old.reset();  // connections not kept: their writers cancel and join outside mu_ (their callbacks take it)
  std::vector<ParamIndex> params(ranks.size());
  std::vector<uint64_t> expected(ranks.size(), 0);
  for (size_t r = 0; r < ranks.size(); ++r)
    for (int i = 0; i < ranks[r].layout.params_size(); ++i) {
      params[r][ranks[r].layout.params(i).name()] = i;
      expected[r] += ranks[r].layout.params(i).bytes();
    }
  MutexLock l(&mu_);
  version_ = req.version();
  written_.try_emplace(version_);
  while (written_.size() > kWritesKept) written_.erase(written_.begin());
  engine_id_ = req.engine_id();
  ranks_ = std::move(ranks);
  params_ = std::move(params);
  expected_ = std::move(expected);
  landed_.assign(ranks_.size(), 0);
  seen_.assign(ranks_.size(), {});
  landed_log_.clear();
  children_ = std::move(children);
  pending_ = 0;
  forwarded_ = 0;
  notices_sent_ = 0;
  error_ = absl::OkStatus();
  check_error_ = absl::OkStatus();
  spdlog::info("relay {}: update {} engine {}: {} children ({} rank connections; {} children's kept)", node_id_,
               version_, engine_id_, children_->size(), connections, kept);
  v1::SetRelayReply out;
  out.set_connections(connections);
  return out;
}

absl::StatusOr<v1::SetRelayReply> RelayForwarder::Adopt(const v1::SetRelayRequest& req) {
  std::vector<RelayRankMemory> ranks;
  {
    MutexLock l(&mu_);
    if (req.version() != version_ || req.engine_id() != engine_id_)
      return absl::FailedPreconditionError(absl::StrCat("relay ", node_id_, ": new children for engine ",
                                                        req.engine_id(), " update ", req.version(),
                                                        ", which it does not relay"));
    ranks = ranks_;
  }
  for (const auto& c : req.children()) WSYNC_RETURN_IF_ERROR(CheckRelayChild(ranks, c));
  // Every child connected afresh (a kept child's writers may hold batches of the forwarding that ends here).
  auto children = std::make_shared<std::vector<Child>>();
  int connections = 0;
  for (const auto& c : req.children()) {
    Child& child = children->emplace_back();
    child.spec = c;
    WSYNC_RETURN_IF_ERROR(Connect(&child, req.relay_node()));
    connections += c.layouts_size();
  }
  // One step under the lock: a range that lands from now on goes to the new children; every range before it is in
  // `again`, forwarded to them below.
  std::shared_ptr<std::vector<Child>> old;
  v1::RelayLandedRequest again;
  {
    MutexLock l(&mu_);
    if (req.version() != version_)
      return absl::AbortedError(absl::StrCat("relay ", node_id_, ": update ", req.version(), " ended"));
    const uint64_t generation = ++generation_;
    writes_.Begin(static_cast<int64_t>(generation));  // UpdateWrites never calls out holding its lock
    old = std::move(children_);
    children_ = std::move(children);
    for (auto& g : landed_log_) *again.add_ranges() = std::move(g);
    landed_log_.clear();
    seen_.assign(ranks_.size(), {});
    landed_.assign(ranks_.size(), 0);
    pending_ = 0;
    forwarded_ = 0;
    notices_.clear();
    error_ = check_error_;  // a failure of a child before is not this update's any more; a failed check still is
    written_[version_].writes.clear();  // recorded again as the ranges are forwarded again
    cv_.SignalAll();
  }
  old.reset();  // the earlier children's writers cancel and join outside mu_ (their callbacks take it)
  spdlog::info("relay {}: update {} engine {}: {} children now ({} rank connections), {} landed ranges forwarded again",
               node_id_, req.version(), req.engine_id(), req.children_size(), connections, again.ranges_size());
  again.set_version(req.version());
  again.set_engine_id(req.engine_id());
  again.set_from_node(node_id_);
  WSYNC_RETURN_IF_ERROR(Landed(again));
  v1::SetRelayReply out;
  out.set_connections(connections);
  return out;
}

absl::Status RelayForwarder::Landed(const v1::RelayLandedRequest& req) {
  std::vector<v1::LandedRange> fresh;  // checked, not seen before this update, not empty
  std::vector<std::pair<int, std::vector<v1::LandedRange>>> by_rank;  // the forward batches: rank, ranges
  std::shared_ptr<std::vector<Child>> children;
  uint64_t generation = 0;
  const absl::Time t_in = absl::Now();
  {
    MutexLock l(&mu_);
    if (req.version() != version_ || req.engine_id() != engine_id_)
      return absl::FailedPreconditionError(absl::StrCat(
          "relay ", node_id_, ": landed notice for engine ", req.engine_id(), " update ", req.version(),
          ", but it relays ",
          version_ < 0 ? std::string("no update") : absl::StrCat("engine ", engine_id_, " update ", version_)));
    // A child's failure is not the writer's: the coordinator learns it from the drain (and may give the children to
    // another relay, Adopt), so the ranges are still taken. A failed check is the writer's.
    if (!check_error_.ok()) return check_error_;
    generation = generation_;
    // Once per update: the first bytes reached this engine (an operator's, and a fault test's, sign of progress).
    if (std::all_of(landed_.begin(), landed_.end(), [](uint64_t b) { return b == 0; }) && req.ranges_size() > 0)
      spdlog::info("relay {}: update {} engine {}: first ranges landed from {}", node_id_, version_, engine_id_,
                   req.from_node());
    for (const v1::LandedRange& g : req.ranges()) {
      const std::string what =
          absl::StrCat("relay ", node_id_, ": engine ", engine_id_, " rank ", g.rank(), " ", g.param(), " [",
                       g.offset(), ", +", g.length(), ") landed from ", req.from_node());
      absl::Status bad;
      if (g.rank() < 0 || g.rank() >= static_cast<int>(ranks_.size())) {
        bad = absl::InvalidArgumentError(absl::StrCat(what, ": no such rank"));
      } else if (auto p = params_[g.rank()].find(g.param()); p == params_[g.rank()].end()) {
        bad = absl::InvalidArgumentError(absl::StrCat(what, ": no such parameter"));
      } else {
        const RelayRankMemory& m = ranks_[g.rank()];
        const v1::ParamDesc& d = m.layout.params(p->second);
        auto data = m.data.find(d.segment());
        if (g.offset() > d.bytes() || g.length() > d.bytes() - g.offset()) {
          bad = absl::InvalidArgumentError(absl::StrCat(what, ": outside the parameter's ", d.bytes(), " bytes"));
        } else if (data == m.data.end()) {
          bad = absl::FailedPreconditionError(absl::StrCat(what, ": not in host memory (relays read host memory)"));
        } else {
          const XXH128_hash_t h = XXH3_128bits(data->second + d.offset() + g.offset(), g.length());
          const std::string hex = absl::StrFormat("%016x%016x", h.high64, h.low64);
          if (hex != g.xxh128())
            bad = absl::DataLossError(absl::StrCat(what, ": holds XXH3-128 ", hex, ", the writer sent ", g.xxh128()));
        }
      }
      if (!bad.ok()) {
        if (error_.ok()) error_ = bad;
        if (check_error_.ok()) check_error_ = bad;
        cv_.SignalAll();
        spdlog::error("{}", bad.ToString());
        return bad;
      }
      if (!seen_[g.rank()].insert({g.param(), g.offset()}).second) continue;  // re-sent by a new parent
      landed_[g.rank()] += g.length();
      landed_log_.push_back(g);
      if (g.length() > 0) fresh.push_back(g);
    }
    by_rank = ForwardBatches(fresh, kForwardBatchBytes);
    children = children_;
    pending_ += children->size() * by_rank.size();
    cv_.SignalAll();
  }
  if (spdlog::should_log(spdlog::level::debug)) {  // the sum and the texts only when they are logged
    uint64_t b = 0;
    for (const auto& g : req.ranges()) b += g.length();
    spdlog::debug("relaytime {} landed from {}: {} ranges {} bytes first {} +{} checked {:.2f} ms", node_id_,
                  req.from_node(), req.ranges_size(), b, req.ranges_size() ? req.ranges(0).param() : "",
                  req.ranges_size() ? req.ranges(0).offset() : 0, absl::ToDoubleMilliseconds(absl::Now() - t_in));
  }
  const int64_t version = req.version();
  for (size_t c = 0; c < children->size(); ++c) {
    Child& child = (*children)[c];
    for (auto& [rank, ranges] : by_rank) {
      std::vector<transport::WriteRequest> writes;
      uint64_t bytes = 0;
      {
        MutexLock l(&mu_);
        if (version != version_)
          return absl::AbortedError(absl::StrCat("relay ", node_id_, ": update ", version, " ended"));
        if (generation != generation_) return absl::OkStatus();  // Adopt forwards these ranges to the new children
        const RelayRankMemory& m = ranks_[rank];
        for (const v1::LandedRange& g : ranges) {
          const v1::ParamDesc& d = m.layout.params(params_[rank].at(g.param()));
          transport::WriteRequest w;
          w.src = m.regions.at(d.segment());
          w.src_offset = d.offset() + g.offset();
          w.dst = child.by_segment[rank].at(d.segment());
          w.dst_offset = d.offset() + g.offset();
          w.length = g.length();
          writes.push_back(w);
          bytes += g.length();
        }
      }
      const absl::Time t_post = absl::Now();
      auto done = [this, version, generation, c, rank = rank, ranges = ranges, bytes, t_post](const absl::Status& st) {
        spdlog::debug("relaytime {} forward acked child {} rank {}: {} bytes in {:.2f} ms", node_id_, c, rank, bytes,
                      absl::ToDoubleMilliseconds(absl::Now() - t_post));
        MutexLock l(&mu_);
        if (version != version_ || generation != generation_) return;
        if (!st.ok()) {
          if (error_.ok()) error_ = st;
          if (pending_ > 0) --pending_;
          cv_.SignalAll();
          return;
        }
        forwarded_ += bytes;
        auto& recorded = written_[version].writes;
        for (const v1::LandedRange& g : ranges) {
          v1::WriteChecksum& w = recorded.emplace_back();
          w.set_engine_id((*children_)[c].spec.engine_id());
          w.set_rank(rank);
          w.set_param(g.param());
          w.set_offset(g.offset());
          w.set_length(g.length());
          w.set_xxh128(g.xxh128());
        }
        Notice n;
        n.child = static_cast<int>(c);
        n.generation = generation;
        n.ranges = ranges;
        notices_.emplace_back(version, std::move(n));
        cv_.SignalAll();
      };
      absl::Status st =
          child.writers[rank]->Submit(static_cast<int64_t>(generation), std::move(writes), std::move(done));
      if (!st.ok()) {
        MutexLock l(&mu_);
        if (version == version_ && generation == generation_) {
          if (error_.ok()) error_ = st;
          if (pending_ > 0) --pending_;
        }
        cv_.SignalAll();
        continue;  // the drain reports it; the other children still get the ranges
      }
    }
  }
  return absl::OkStatus();
}

void RelayForwarder::NoticeLoop() {
  mu_.Lock();
  for (;;) {
    while (!stop_ && notices_.empty()) cv_.Wait(&mu_);
    if (stop_) break;
    // One call per child per round, with every range its finished batches covered.
    std::map<int, std::pair<v1::RelayLandedRequest, uint64_t>> calls;
    const int64_t version = notices_.front().first;
    const uint64_t generation = notices_.front().second.generation;
    while (!notices_.empty() && notices_.front().first == version &&
           notices_.front().second.generation == generation) {
      Notice& n = notices_.front().second;
      auto& [req, count] = calls[n.child];
      for (auto& g : n.ranges) *req.add_ranges() = std::move(g);
      ++count;
      notices_.pop_front();
    }
    std::shared_ptr<std::vector<Child>> children = children_;
    if (version != version_ || generation != generation_ || children == nullptr) continue;
    for (auto& [c, call] : calls) {
      v1::RelayLandedRequest& req = call.first;
      req.set_version(version);
      req.set_engine_id((*children)[c].spec.engine_id());
      req.set_from_node(node_id_);
      const std::string daemon = (*children)[c].spec.target_daemon();
      mu_.Unlock();  // no lock across the call
      const absl::Time t_call = absl::Now();
      absl::Status st = notify_(daemon, req);
      spdlog::debug("relaytime {} notice to child {}: {} ranges ({} batches) call {:.2f} ms", node_id_, c,
                    req.ranges_size(), call.second, absl::ToDoubleMilliseconds(absl::Now() - t_call));
      mu_.Lock();
      if (version != version_ || generation != generation_) break;
      if (!st.ok() && error_.ok())
        error_ = Annotate(
            st, absl::StrCat("relay ", node_id_, " telling engine ", req.engine_id(), " at ", daemon, " what landed"));
      ++notices_sent_;
      pending_ -= std::min(pending_, call.second);
      cv_.SignalAll();
    }
  }
  mu_.Unlock();
}

absl::StatusOr<v1::RelayDrainReply> RelayForwarder::Drain(const v1::RelayDrainRequest& req) {
  const absl::Time deadline =
      absl::Now() + (req.timeout_seconds() > 0 ? absl::Seconds(req.timeout_seconds()) : absl::Seconds(60));
  MutexLock l(&mu_);
  if (req.version() != version_ || req.engine_id() != engine_id_)
    return absl::FailedPreconditionError(absl::StrCat("relay ", node_id_, ": drain of engine ", req.engine_id(),
                                                      " update ", req.version(), ", which it does not relay"));
  const auto complete = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (pending_ > 0) return false;
    for (size_t r = 0; r < landed_.size(); ++r)
      if (landed_[r] < expected_[r]) return false;
    return true;
  };
  while (error_.ok() && !complete())
    if (cv_.WaitWithDeadline(&mu_, deadline)) break;
  if (!error_.ok()) return error_;
  if (!complete()) {
    std::string missing;
    for (size_t r = 0; r < landed_.size(); ++r)
      if (landed_[r] < expected_[r])
        absl::StrAppend(&missing, missing.empty() ? "" : ", ", "rank ", r, " ", landed_[r], "/", expected_[r],
                        " bytes");
    return absl::DeadlineExceededError(absl::StrCat(
        "relay ", node_id_, ": engine ", engine_id_, " update ", version_,
        " not drained in time: ", missing.empty() ? std::string("landed, ") : absl::StrCat("landed ", missing, "; "),
        pending_, " forwards or notices to children pending"));
  }
  written_[version_].finished = true;
  v1::RelayDrainReply out;
  for (uint64_t b : landed_) out.set_bytes_landed(out.bytes_landed() + b);
  out.set_bytes_forwarded(forwarded_);
  out.set_notices_sent(notices_sent_);
  return out;
}

absl::StatusOr<RelayForwarder::Written> RelayForwarder::WriteChecksums(int64_t version) const {
  MutexLock l(&mu_);
  auto it = written_.find(version);
  if (it == written_.end())
    return absl::NotFoundError(absl::StrCat("relay ", node_id_, " forwarded nothing of update ", version));
  return it->second;
}

}  // namespace wsync::daemon
