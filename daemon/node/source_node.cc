#include "daemon/node/source_node.h"

#include <signal.h>
#include <sys/random.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <optional>
#include <set>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/checked_size.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/config_digest.h"
#include "daemon/common/convert.h"
#include "daemon/node/push_split.h"
#include "replica/slice_assembly.h"
#include "spdlog/spdlog.h"
#include "transport/registry.h"

namespace wsync::daemon {
namespace {

double Seconds(absl::Time since) { return absl::ToDoubleSeconds(absl::Now() - since); }

std::string ShapeStr(absl::Span<const int64_t> s) { return absl::StrCat("[", absl::StrJoin(s, ","), "]"); }

}  // namespace

namespace {

// True while process `pid` runs (a zombie, exited but not reaped, counts as gone).
bool ProcessAlive(int64_t pid) {
  if (pid <= 0) return true;  // unknown: not watched
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM) return false;
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return true;  // no procfs view of it: trust kill()
  const size_t paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() || line[paren + 2] != 'Z';
}

// A session id: 128 bits from the kernel's CSPRNG, hex. Whoever holds it may push into the session's ring, so it is
// never logged (sessions are named by their label).
absl::StatusOr<std::string> RandomSessionId() {
  uint8_t bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, "getrandom for a session id");
    got += static_cast<size_t>(n);
  }
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (uint8_t b : bytes) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 0xf]);
  }
  return out;
}

}  // namespace

SourceNode::SourceNode(SourceOptions opts, transport::Transport* transport, ConnectTargetFn connect)
    : SourceNode(std::move(opts), transport,
                 [connect = std::move(connect)](const std::string& daemon, const v1::ConnectTargetRequest& req)
                     -> absl::StatusOr<v1::ConnectTargetReply> {
                   WSYNC_ASSIGN_OR_RETURN(std::string info, connect(daemon, req));
                   v1::ConnectTargetReply out;
                   out.set_target_endpoint_info(std::move(info));
                   return out;
                 }) {}

SourceNode::SourceNode(SourceOptions opts, transport::Transport* transport, ConnectTargetReplyFn connect)
    : SourceNode(std::move(opts), transport,
                 ConnectTargetByFn([connect = std::move(connect)](const std::string& daemon,
                                                                  const v1::ConnectTargetRequest& req,
                                                                  absl::Time) { return connect(daemon, req); })) {}

SourceNode::SourceNode(SourceOptions opts, transport::Transport* transport, ConnectTargetByFn connect)
    : opts_(std::move(opts)), transport_(transport), connect_(std::move(connect)) {
  metrics_.Declare("wsync_source_bytes_written_total", "counter", "Bytes posted to targets (engine memory).");
  metrics_.Declare("wsync_source_params_written_total", "counter", "Engine parameters posted to targets.");
  metrics_.Declare("wsync_source_bytes_sent_total", "counter",
                   "Bytes actually posted to targets: dense ranges plus delta records (docs/delta.md).");
  metrics_.Declare("wsync_source_tensors_received_total", "counter", "HF tensors received from trainer ranks.");
  metrics_.Declare("wsync_source_buckets_total", "counter", "Buckets committed by trainer ranks, by result.");
  metrics_.Declare("wsync_source_sliced_tensors_total", "counter",
                   "Tensors pushed in slices and completed, by path: direct (slices landed in the replica) or staged "
                   "(assembled whole first: a conversion needs the whole tensor).");
  metrics_.Declare("wsync_source_placements_total", "counter",
                   "CommitPlaced calls of trainer ranks (tensors copied straight into the replica), by result.");
  metrics_.Declare("wsync_source_placed_bytes_total", "counter",
                   "Bytes of tensors trainer ranks placed straight into the replica (committed and accepted).");
  metrics_.Declare("wsync_source_updates_total", "counter", "Updates ended on this source, by result.");
  metrics_.Declare("wsync_source_bucket_ingest_seconds", "histogram", "Replica load time of one bucket.");
  metrics_.Declare("wsync_source_bucket_write_seconds", "histogram", "Time to post one bucket's finished params.");
  metrics_.Declare("wsync_source_update_write_bytes_per_second", "gauge",
                   "Bytes written by the last successful update divided by its write time.");
  metrics_.Declare("wsync_source_sessions", "gauge", "Open trainer sessions (one ring each).");
  metrics_.Declare("wsync_source_ring_bytes", "gauge", "Shared-memory ring bytes mapped for trainer sessions.");
  metrics_.Declare("wsync_source_replica_bytes", "gauge", "Bytes of the CPU replica (all layouts).");
  metrics_.Declare("wsync_source_update_open", "gauge", "Version of the open update (-1: none).");
  metrics_.Declare("wsync_source_trainer_ranks_lost", "gauge", "Trainer ranks lost during the open update.");
  metrics_.Declare("wsync_source_checksum_bytes_total", "counter",
                   "Bytes hashed for write checksums (once per replica layout), on the hash pool.");
  metrics_.Declare("wsync_source_checksum_wait_seconds", "histogram",
                   "Time an update's commit waited for the hash pool after its writes had drained.");
  // Counters and histograms at zero from the start, every label set this file counts under.
  const auto by = [](const char* key, std::initializer_list<const char*> values) {
    std::vector<Labels> sets;
    for (const char* v : values) sets.push_back({{key, v}});
    return sets;
  };
  metrics_.Preset("wsync_source_buckets_total", by("result", {"ok", "rejected", "write_failed"}));
  metrics_.Preset("wsync_source_placements_total", by("result", {"ok", "rejected", "write_failed"}));
  metrics_.Preset("wsync_source_updates_total", by("result", {"ok", "failed", "aborted"}));
  metrics_.Preset("wsync_source_sliced_tensors_total", by("path", {"direct", "staged"}));
  for (const char* name :
       {"wsync_source_bytes_written_total", "wsync_source_params_written_total", "wsync_source_bytes_sent_total",
        "wsync_source_tensors_received_total", "wsync_source_placed_bytes_total", "wsync_source_checksum_bytes_total",
        "wsync_source_bucket_ingest_seconds", "wsync_source_bucket_write_seconds",
        "wsync_source_checksum_wait_seconds"})
    metrics_.Preset(name);
  metrics_.OnCollect([this](Metrics& m) {
    std::lock_guard<std::mutex> l(mu_);
    uint64_t ring = 0, replica = 0;
    for (const auto& [id, s] : sessions_) ring += s->ring ? s->ring->capacity() : 0;
    if (replica_)
      for (int i = 0; i < replica_->num_layouts(); ++i) replica += replica_->table(i).total_bytes();
    m.Set("wsync_source_sessions", {}, static_cast<double>(sessions_.size()));
    m.Set("wsync_source_ring_bytes", {}, static_cast<double>(ring));
    m.Set("wsync_source_replica_bytes", {}, static_cast<double>(replica));
    m.Set("wsync_source_update_open", {}, static_cast<double>(version_));
    m.Set("wsync_source_trainer_ranks_lost", {}, static_cast<double>(lost_ranks_.size()));
  });
  if (opts_.write_checksums)
    hasher_ = std::make_unique<HashPool>(opts_.write_checksum_threads > 0 ? opts_.write_checksum_threads
                                                                          : HashPool::DefaultThreads());
  watcher_ = std::thread([this] { WatchRanks(); });
}

void SourceNode::WatchRanks() {
  std::unique_lock<std::mutex> l(mu_);
  while (!stopping_) {
    watch_cv_.wait_for(l, absl::ToChronoMilliseconds(opts_.liveness_poll), [&] { return stopping_; });
    if (!stopping_) CheckRanks();
  }
}

void SourceNode::CheckRanks() {
  const absl::Time now = absl::Now();
  for (auto& [id, s] : sessions_) {
    if (s->dead || s->pid <= 0 || ProcessAlive(s->pid)) continue;
    spdlog::warn("trainer rank {} (pid {}, session {}) exited", s->local_rank, s->pid, s->label);
    MarkDead(s.get(), absl::StrCat("exited (pid ", s->pid, ", session ", s->label, ")"));
  }
  if (version_ == -1 || !update_error_.ok()) return;
  for (const auto& [rank, lost] : lost_ranks_) {
    if (ended_ranks_.count(rank) || now - lost.since < opts_.rank_grace) continue;
    const std::string what = lost.pid > 0 && !ProcessAlive(lost.pid)
                                 ? absl::StrCat("exited (pid ", lost.pid, ", session ", lost.label, ")")
                                 : lost.what;
    FailUpdate(absl::UnavailableError(absl::StrCat(
        "update ", version_, ": trainer rank ", rank, " on node ", opts_.node_id, " ", what,
        " before it finished pushing, and did not reconnect within ", absl::FormatDuration(opts_.rank_grace))));
    return;
  }
}

SourceNode::~SourceNode() {
  hasher_.reset();  // its queued jobs read the replica and record into checksums_
  {
    std::lock_guard<std::mutex> l(mu_);
    stopping_ = true;
  }
  watch_cv_.notify_all();
  if (watcher_.joinable()) watcher_.join();
  // Endpoints and regions go before the replica memory they point into.
  targets_.clear();
  replica_regions_.clear();
  extra_regions_.clear();
  replica_.reset();
}

SourceNode::Session* SourceNode::FindSession(const std::string& id) {
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : it->second.get();
}

absl::Status SourceNode::UnknownSession() {
  return absl::PermissionDeniedError(
      "unknown session id: no open session has it (closed, replaced by a newer session of the same rank, or never "
      "handed out); open a session through the daemon's trainer socket");
}

absl::StatusOr<OpenedSession> SourceNode::OpenSession(const SessionRequest& req) {
  if (req.local_rank < 0 || req.local_rank >= opts_.trainer_ranks)
    return absl::InvalidArgumentError(absl::StrCat("local_rank ", req.local_rank, " out of range: this node expects ",
                                                   opts_.trainer_ranks, " trainer ranks"));
  WSYNC_ASSIGN_OR_RETURN(std::string id, RandomSessionId());
  auto s = std::make_unique<Session>();
  s->id = std::move(id);
  {
    std::lock_guard<std::mutex> l(mu_);
    s->label = absl::StrCat(opts_.node_id, "-s", next_session_++);
  }
  s->local_rank = req.local_rank;
  s->pid = req.pid;
  // The ring (a pre-faulted memfd of ring_bytes, 256 MiB by default) is made without mu_: status, commits and other
  // ranks' sessions do not wait for its pages.
  WSYNC_ASSIGN_OR_RETURN(RingConsumer ring, RingConsumer::Create(s->label, opts_.ring_bytes));
  s->ring = std::make_shared<RingConsumer>(std::move(ring));
  // Sessions this one replaces are unmapped after mu_ is released (declared before the lock).
  std::vector<std::unique_ptr<Session>> replaced;
  std::lock_guard<std::mutex> l(mu_);
  // A rank that reconnects (e.g. after its process died mid-bucket) replaces its old session and ring, so nothing
  // it left uncommitted can ever be consumed.
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (it->second->local_rank == req.local_rank) {
      spdlog::warn("trainer rank {} reconnected (pid {}); dropping its previous session {}", req.local_rank, req.pid,
                   it->second->label);
      if (TakeoverFailsUpdate(*it->second, req.pid)) FailTakenOver(*it->second, req);
      replaced.push_back(std::move(it->second));
      it = sessions_.erase(it);
    } else {
      ++it;
    }
  }
  if (lost_ranks_.erase(req.local_rank)) spdlog::info("trainer rank {} is back (pid {})", req.local_rank, req.pid);
  OpenedSession out;
  WSYNC_ASSIGN_OR_RETURN(out.ring_fd, DupFd(s->ring->fd()));
  out.id = s->id;
  out.label = s->label;
  out.ring_bytes = s->ring->capacity();
  out.num_local_ranks = opts_.trainer_ranks;
  spdlog::info("session {} opened: trainer rank {} (global {}, pid {}, uid {}), ring {} MiB", s->label, req.local_rank,
               req.global_rank, req.pid, req.uid, s->ring->capacity() >> 20);
  sessions_[s->id] = std::move(s);
  return out;
}

bool SourceNode::TakeoverFailsUpdate(const Session& old, int64_t new_pid) const {
  // The same process opening a new session replaces its own (a client object made again, e.g. after an error): it
  // is the one trainer of the rank, so that is a reconnect. Another live process is a second trainer for the rank.
  return version_ != -1 && update_error_.ok() && !ended_ranks_.count(old.local_rank) && !old.dead &&
         old.pid != new_pid && ProcessAlive(old.pid);
}

void SourceNode::FailTakenOver(const Session& old, const SessionRequest& req) {
  // Two live processes claimed the rank: what the update got from it is of either, so it cannot commit. No grace:
  // the old process is not coming back to this session.
  FailUpdate(absl::AbortedError(absl::StrCat("update ", version_, ": trainer rank ", old.local_rank, " on node ",
                                             opts_.node_id, " was taken over by a new session (pid ", req.pid,
                                             ") while its session ", old.label, " (pid ", old.pid,
                                             ") was live and had not finished pushing")));
}

void SourceNode::MarkDead(Session* s, const std::string& what) {
  if (s->dead) return;
  s->dead = true;
  if (version_ != -1 && !ended_ranks_.count(s->local_rank) && !lost_ranks_.count(s->local_rank))
    lost_ranks_[s->local_rank] = {absl::Now(), what, s->pid, s->label};
}

void SourceNode::SessionDisconnected(const std::string& session_id, const std::string& why) {
  std::lock_guard<std::mutex> l(mu_);
  Session* s = FindSession(session_id);
  if (s == nullptr || s->dead) return;
  // The usual reason is the process's exit (the kernel closed its socket): say so when it is gone.
  const std::string what = s->pid > 0 && !ProcessAlive(s->pid) ? std::string("exited") : why;
  spdlog::warn("trainer rank {} (pid {}, session {}): {}", s->local_rank, s->pid, s->label, what);
  MarkDead(s, absl::StrCat(what, " (pid ", s->pid, ", session ", s->label, ")"));
}

absl::Status SourceNode::CloseSession(const std::string& session_id) {
  std::unique_ptr<Session> closed;  // its ring is unmapped after mu_ is released (declared before the lock)
  std::lock_guard<std::mutex> l(mu_);
  Session* s = FindSession(session_id);
  if (s == nullptr) return UnknownSession();
  if (version_ != -1 && !ended_ranks_.count(s->local_rank) && !lost_ranks_.count(s->local_rank))
    lost_ranks_[s->local_rank] = {absl::Now(), absl::StrCat("closed its session ", s->label)};
  spdlog::info("session {} closed", s->label);
  closed = std::move(sessions_[session_id]);
  sessions_.erase(session_id);
  cv_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<v1::ConfigureSourceReply> SourceNode::Configure(const v1::ConfigureSourceRequest& req,
                                                               absl::Time deadline) {
  std::lock_guard<std::shared_mutex> ingest(ingest_mu_);
  {
    std::lock_guard<std::mutex> l(mu_);
    if (version_ != -1)
      return absl::FailedPreconditionError(absl::StrCat("cannot reconfigure while update ", version_, " is open"));
  }
  // Decide everything before touching the current plan: a refused ConfigureSource leaves the plan in use working.
  SourcePlanOptions popts;
  popts.trainer_ranks = opts_.trainer_ranks;
  popts.node_transport = transport_->Query();
  WSYNC_ASSIGN_OR_RETURN(SourcePlan plan, PlanSourceConfiguration(req, popts));

  // Tear down the previous plan's state (endpoints before the memory they reference); under mu_ as well, since
  // Status() and the metrics read them. From here on a failure (memory, network) leaves the source unconfigured.
  // Hashes still queued read the replica about to be freed: they finish first.
  WaitForChecksums();
  const std::string base_shape = DeltaBaseShape(req);
  std::unique_ptr<replica::Replica> old_replica;
  std::vector<std::unique_ptr<transport::LocalRegion>> old_regions;
  std::map<std::string, std::vector<std::unique_ptr<transport::LocalRegion>>> old_extra;
  std::vector<std::unique_ptr<Target>> old_targets;
  {
    std::lock_guard<std::mutex> l(mu_);
    kept_delta_base_.clear();
    kept_delta_base_version_ = -1;
    if (KeepsDeltaBase(delta_base_shape_, delta_base_version_, base_shape)) {
      kept_delta_base_ = std::move(delta_base_);
      kept_delta_base_version_ = delta_base_version_;
    }
    delta_base_.clear();
    delta_base_version_ = -1;
    delta_base_shape_.clear();
    // Destroyed below, outside mu_ (a writer's thread may be reporting into it), endpoints before the regions and the
    // replica memory they point into.
    old_replica = std::move(replica_);
    old_regions = std::move(replica_regions_);
    old_extra = std::move(extra_regions_);
    old_targets = std::move(targets_);
    targets_.clear();
    targets_by_layout_.clear();
    replica_regions_.clear();
    extra_regions_.clear();
    configured_ = false;
    config_digest_.clear();
  }
  old_targets.clear();
  old_regions.clear();
  old_extra.clear();
  old_replica.reset();
  v1::ConfigureSourceReply out;
  WSYNC_RETURN_IF_ERROR(ApplyPlan(plan, req, deadline, &out));
  return out;
}

absl::StatusOr<transport::Transport*> SourceNode::ExtraTransport(const std::string& name) {
  auto it = extra_transports_.find(name);
  if (it != extra_transports_.end()) return it->second.get();
  const transport::TransportEntry* e = transport::FindTransport(name);
  if (e == nullptr) return absl::InternalError(absl::StrCat("no registered transport ", name));
  WSYNC_ASSIGN_OR_RETURN(auto t, e->create(transport::TransportOptions{}));
  transport::Transport* raw = t.get();
  extra_transports_[name] = std::move(t);
  return raw;
}

absl::Status SourceNode::ApplyPlan(const SourcePlan& plan, const v1::ConfigureSourceRequest& req, absl::Time deadline,
                                   v1::ConfigureSourceReply* out) {
  absl::Time t0 = absl::Now();
  // The replica builds the same tables the plan checked the layouts against. A node the plan gives no work has none
  // (its ranks' push filters are empty).
  std::unique_ptr<replica::Replica> replica;
  if (!plan.layouts.empty()) {
    WSYNC_ASSIGN_OR_RETURN(replica, replica::Replica::Create(plan.config, plan.layouts, plan.quant));
  }
  const int num_layouts = replica ? replica->num_layouts() : 0;
  // The replica in the node's transport and in every other one some target is written with.
  auto register_replica = [&](transport::Transport* tr, bool source_only,
                              std::vector<std::unique_ptr<transport::LocalRegion>>* regions) -> absl::Status {
    for (int l = 0; l < num_layouts; ++l) {
      const uint64_t n = std::max<uint64_t>(replica->table(l).total_bytes(), 1);
      auto region =
          source_only ? tr->RegisterSourceMemory(replica->data(l), n) : tr->RegisterMemory(replica->data(l), n);
      if (!region.ok()) return Annotate(region.status(), absl::StrCat("registering the replica with ", tr->name()));
      regions->push_back(*std::move(region));
    }
    return absl::OkStatus();
  };
  std::vector<std::unique_ptr<transport::LocalRegion>> regions;
  WSYNC_RETURN_IF_ERROR(register_replica(transport_, true, &regions));
  std::map<std::string, std::vector<std::unique_ptr<transport::LocalRegion>>> extra_regions;
  for (const std::string& name : plan.transports) {
    WSYNC_ASSIGN_OR_RETURN(transport::Transport * tr, ExtraTransport(name));
    // A backend with no receiving side in wsync gives peers no access to what it registers anyway.
    WSYNC_RETURN_IF_ERROR(register_replica(tr, !tr->Query().one_sided_only, &extra_regions[name]));
  }
  uint64_t total = 0;
  for (int l = 0; l < num_layouts; ++l) total += replica->table(l).total_bytes();
  out->set_register_seconds(Seconds(t0));
  out->set_replica_bytes(total);
  out->set_layouts(num_layouts);

  absl::Time t1 = absl::Now();
  std::vector<std::unique_ptr<Target>> targets;
  std::vector<std::vector<Target*>> by_layout(num_layouts);
  for (const PlannedTarget& pt : plan.targets) {
    const auto& a = req.targets(pt.index);
    auto t = std::make_unique<Target>();
    t->assignment = a;
    t->layout = pt.layout;
    t->caps = pt.caps;
    t->peer = pt.peer;
    if (pt.transport.empty()) {
      t->transport = transport_;
    } else {
      WSYNC_ASSIGN_OR_RETURN(t->transport, ExtraTransport(pt.transport));
    }
    std::map<int, const transport::RemoteRegion*> by_segment;
    for (const auto& seg : a.layout().segments()) {
      auto region = t->transport->ImportRegion(seg.region_descriptor());
      if (!region.ok()) return Annotate(region.status(), absl::StrCat("importing segment ", seg.id(), " of ", Who(*t)));
      by_segment[seg.id()] = region->get();
      t->regions.push_back(*std::move(region));
    }
    for (int seg : pt.segment) t->dst_region.push_back(by_segment.at(seg));
    t->dst_segment = pt.segment;
    t->by_segment = std::move(by_segment);
    t->dst_offset = pt.dst_offset;
    t->layout_index = pt.layout_index;
    t->host_param = pt.host_param;
    t->ranges = pt.ranges;
    t->delta_write_bytes = pt.delta_write_bytes;
    by_layout[t->layout].push_back(t.get());
    targets.push_back(std::move(t));
  }
  // The connects point at regions that are swapped in only at the end: every endpoint's writes are posted only after
  // that, under the same exclusive lock.
  {
    std::vector<Target*> all;
    for (auto& t : targets) {
      t->affected = NodeRanksIn(*t, targets);
      all.push_back(t.get());
    }
    WSYNC_RETURN_IF_ERROR(ConnectTargets(all, deadline));
  }
  out->set_connect_seconds(Seconds(t1));

  // Push filter: the plan's per-rank lists, else every checkpoint tensor some layout needs (non-expert tensors
  // first, then experts), dealt out over the local ranks by bytes (push_split.h: the ranks copy in parallel, the
  // heaviest one sets the hand-over time).
  std::map<int, std::vector<std::string>> rank_push = plan.rank_push;
  std::vector<std::string> names;
  if (!rank_push.empty()) {
    for (const auto& [r, list] : rank_push) names.insert(names.end(), list.begin(), list.end());
  } else {
    WSYNC_ASSIGN_OR_RETURN(auto specs, PlanCheckpointTensors(plan));
    std::vector<PushItem> items, experts;
    for (const auto& s : specs) {
      if (!replica || !replica->Needs(s.name)) continue;
      (replica::IsExpertTensor(s.name) ? experts : items).push_back({s.name, s.bytes()});
    }
    items.insert(items.end(), experts.begin(), experts.end());
    for (const auto& it : items) names.push_back(it.name);
    rank_push = SplitPushByBytes(items, opts_.trainer_ranks);
  }

  // Tensors a trainer rank may push already quantized (float8_e4m3fn + `<name>_scale_inv`): those every layout reads
  // as a whole-block FP8 weight it would quantize here. The replica takes either form (pass-through slices the
  // published codes and scales in whole blocks, which the layouts guarantee).
  v1::Fp8PushHint hint;
  if (plan.quant.mode == replica::QuantSpec::Mode::kFp8Block && replica) {
    hint.set_block_n(plan.quant.block_n);
    hint.set_block_k(plan.quant.block_k);
    hint.set_ue8m0(plan.quant.ue8m0);
    for (const auto& n : names) {
      const std::vector<replica::TensorRead> reads = replica->Reads(n);
      if (!reads.empty() && std::all_of(reads.begin(), reads.end(),
                                        [](const replica::TensorRead& r) { return r.scale_param >= 0 && !r.constant; }))
        hint.add_tensor_names(n);
    }
  }

  // The delta base: a fresh plan holds no version yet (its first update is dense everywhere), unless Configure kept
  // the previous plan's (same shape: only descriptors changed).
  std::vector<std::unique_ptr<uint8_t[]>> bases;
  int64_t base_version = -1;
  if (opts_.delta_base && kept_delta_base_version_ >= 0 &&
      kept_delta_base_.size() == static_cast<size_t>(num_layouts)) {
    bases = std::move(kept_delta_base_);
    base_version = kept_delta_base_version_;
    spdlog::info("plan {}: only where targets' memory is changed; the delta base keeps version {}", req.plan_epoch(),
                 base_version);
  } else if (opts_.delta_base) {
    for (int l = 0; l < num_layouts; ++l) bases.emplace_back(new uint8_t[replica->table(l).total_bytes() + 1]());
  }
  kept_delta_base_.clear();
  kept_delta_base_version_ = -1;
  RankOffers offers = replica ? PlanPlacements(*replica, rank_push, hint) : RankOffers{};

  std::lock_guard<std::mutex> l(mu_);
  delta_base_ = std::move(bases);
  delta_base_version_ = base_version;
  delta_base_shape_ = DeltaBaseShape(req);
  push_slices_ = 0;
  rank_offers_ = std::move(offers);
  ++replica_generation_;  // ranks' mappings of the previous replica are stale now
  fp8_hint_ = std::move(hint);
  replica_ = std::move(replica);
  replica_regions_ = std::move(regions);
  extra_regions_ = std::move(extra_regions);
  targets_ = std::move(targets);
  // What writes to a target read: the replica's regions in the transport it is written with (set once they are in
  // place, as the plan's targets are in order).
  for (size_t i = 0; i < targets_.size(); ++i) {
    const std::string& name = plan.targets[i].transport;
    targets_[i]->src_regions = name.empty() ? &replica_regions_ : &extra_regions_.at(name);
  }
  targets_by_layout_ = std::move(by_layout);
  push_names_ = std::move(names);
  for (const auto& [r, list] : plan.rank_slices) push_slices_ += list.size();
  rank_push_ = std::move(rank_push);
  rank_slices_ = plan.rank_slices;
  completed_.assign(plan.required.size(), {});
  for (size_t l = 0; l < plan.required.size(); ++l) completed_[l].assign(plan.required[l].size(), 0);
  required_ = plan.required;
  plan_epoch_ = req.plan_epoch();
  configured_ = true;
  config_digest_ = ConfigureSourceDigest(req);
  spdlog::info(
      "configured plan {}: {} targets, {} layouts, replica {:.1f} MiB registered in {:.3f}s, connected in "
      "{:.3f}s, {} tensors to push",
      plan_epoch_, targets_.size(), num_layouts, total / 1048576.0, out->register_seconds(), out->connect_seconds(),
      push_names_.size());
  return absl::OkStatus();
}

std::pair<int64_t, std::string> SourceNode::AppliedConfig() const {
  std::lock_guard<std::mutex> l(mu_);
  if (!configured_) return {-1, ""};
  return {plan_epoch_, config_digest_};
}

std::string SourceNode::Who(const Target& t) {
  return absl::StrCat("engine ", t.assignment.engine_id(), " rank ", t.assignment.rank(),
                      t.assignment.target_node().empty() ? std::string() : " on node " + t.assignment.target_node(),
                      " at ", t.assignment.target_daemon());
}

void SourceNode::FailUpdate(const absl::Status& err, bool tell_coordinator) {
  if (!update_error_.ok()) return;  // the first cause is the update's; its writes were cancelled then
  update_error_ = err;
  update_failed_ = true;
  spdlog::error("{}", err.ToString());
  if (version_ != -1) updates_.Fail(version_, err);
  if (version_ != -1 && tell_coordinator && opts_.on_update_failed) opts_.on_update_failed(version_, err);
  CancelWrites(err);
  cv_.notify_all();  // FinishUpdate and waiting pushes see it at once
}

void SourceNode::CancelWrites(const absl::Status& why) {
  if (cancel_reason_.ok()) cancel_reason_ = why;
  int n = 0;
  if (version_ != -1) updates_.Fail(version_, why);  // batches of it still queued are refused from now on
  for (auto& t : targets_) {
    if (t->writer == nullptr) continue;
    t->writer->Cancel(why);
    ++n;
  }
  if (n > 0) spdlog::warn("writes to {} targets cancelled: {}", n, why.ToString());
}

void SourceNode::OnWriteFailure(int64_t version, const absl::Status& err) {
  std::lock_guard<std::mutex> l(mu_);
  if (stopping_ || version_ != version) return;  // ended (or the node is going away): nothing left to fail
  FailUpdate(err);
}

std::string SourceNode::NodeRanks(const Target& t) const { return NodeRanksIn(t, targets_); }

std::string SourceNode::NodeRanksIn(const Target& t, const std::vector<std::unique_ptr<Target>>& all) {
  std::vector<std::string> ranks;
  for (const auto& o : all)
    if (o->assignment.target_daemon() == t.assignment.target_daemon())
      ranks.push_back(absl::StrCat("engine ", o->assignment.engine_id(), " rank ", o->assignment.rank()));
  return absl::StrCat(
      t.assignment.target_node().empty() ? std::string("target daemon") : "node " + t.assignment.target_node(), " at ",
      t.assignment.target_daemon(), " (", absl::StrJoin(ranks, ", "), ")");
}

absl::Status SourceNode::ConnectEndpoint(Target* t, absl::Time deadline) {
  const std::string who = Who(*t);
  // A broken endpoint goes first, so the peer sees it close before the new one connects. Swapped under mu_
  // (CancelWrites walks the endpoints under it), destroyed outside it (its threads may take a while to stop).
  std::unique_ptr<TargetWriter> old;
  {
    std::lock_guard<std::mutex> l(mu_);
    old = std::move(t->writer);
  }
  old.reset();
  const std::string context = absl::StrCat("writing to ", who, "; affected: ", t->affected);
  auto ep = t->transport->CreateEndpoint();
  if (!ep.ok()) return Annotate(ep.status(), absl::StrCat("creating an endpoint for ", who));
  absl::Duration timeout = std::min(absl::Seconds(30), std::max(deadline - absl::Now(), absl::ZeroDuration()));
  if (!t->caps.needs_target_daemon) {
    // The receiver is no wsync daemon (e.g. an engine rank's own Mooncake Transfer Engine): the handshake goes to
    // the peer its region descriptors name, directly.
    WSYNC_RETURN_IF_ERROR_CTX((*ep)->Connect(t->peer, timeout), "connecting to ", who, " (", t->transport->name(),
                              " peer ", t->peer, ")");
    auto writer = std::make_unique<TargetWriter>(*std::move(ep), context, &updates_);
    std::lock_guard<std::mutex> l(mu_);
    t->writer = std::move(writer);
    t->broken = absl::OkStatus();
    return absl::OkStatus();
  }
  v1::ConnectTargetRequest creq;
  creq.set_engine_id(t->assignment.engine_id());
  creq.set_rank(t->assignment.rank());
  creq.set_source_endpoint_info((*ep)->LocalInfo());
  creq.set_source_node(opts_.node_id);
  if (opts_.delta_base) creq.set_delta_write_bytes(t->delta_write_bytes);
  auto info = connect_(t->assignment.target_daemon(), creq, deadline);
  if (!info.ok()) return Annotate(info.status(), absl::StrCat("connecting to ", who));
  timeout = std::min(absl::Seconds(30), std::max(deadline - absl::Now(), absl::ZeroDuration()));
  WSYNC_RETURN_IF_ERROR_CTX((*ep)->Connect(info->target_endpoint_info(), timeout), "connecting to ", who);
  WSYNC_RETURN_IF_ERROR(AttachStaging(t, *info));
  auto writer = std::make_unique<TargetWriter>(*std::move(ep), context, &updates_);
  std::lock_guard<std::mutex> l(mu_);
  t->writer = std::move(writer);
  t->broken = absl::OkStatus();
  return absl::OkStatus();
}

absl::Status SourceNode::ConnectTargets(const std::vector<Target*>& targets, absl::Time deadline) {
  // Each connect is a dial to a target daemon (or a peer's handshake) bounded by its own timeout; several run at
  // once so a plan with many engine ranks costs about one connect, not one per rank. Every target is tried (its
  // endpoint state is its own), and the first failure in plan order is answered.
  constexpr size_t kMaxParallel = 16;
  std::vector<absl::Status> results(targets.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < targets.size(); i = next++) {
      results[i] = absl::Now() < deadline
                       ? ConnectEndpoint(targets[i], deadline)
                       : absl::DeadlineExceededError(
                             absl::StrCat("connecting to ", Who(*targets[i]), ": the caller's deadline passed first"));
    }
  };
  std::vector<std::thread> threads;
  const size_t n = std::min(kMaxParallel, targets.size());
  for (size_t i = 1; i < n; ++i) threads.emplace_back(work);
  if (n > 0) work();
  for (auto& t : threads) t.join();
  for (const absl::Status& st : results)
    if (!st.ok()) return st;
  return absl::OkStatus();
}

absl::Status SourceNode::DrainOutstanding(absl::Duration timeout) {
  // One deadline for the whole drain (targets behind the same dead link must not each wait the full timeout), and
  // every failed target named in the result.
  const absl::Time deadline = absl::Now() + timeout;
  const bool drained = updates_.WaitDrained(deadline);
  absl::Status cancelled;
  {
    std::lock_guard<std::mutex> l(mu_);
    cancelled = cancel_reason_;
  }
  std::vector<absl::Status> failed;
  for (auto& t : targets_) {
    if (t->writer == nullptr) continue;
    if (!drained && t->writer->busy() > 0) {
      // A batch we stop waiting for must not stay pending on an endpoint we reuse.
      t->writer->Cancel(
          absl::DeadlineExceededError(absl::StrCat("writing to ", Who(*t), "; affected: ", t->affected,
                                                   ": batches not written within ", absl::FormatDuration(timeout))));
    }
    absl::Status st = t->writer->broken();
    if (st.ok() || !t->broken.ok()) continue;
    t->broken = st;
    // A batch this node cancelled (possibly while this drain waited) failed for the update's own error, which the
    // caller reports once.
    if (cancelled.ok() || !absl::StrContains(st.message(), cancelled.message())) failed.push_back(st);
  }
  if (failed.size() <= 1) return failed.empty() ? absl::OkStatus() : failed.front();
  std::vector<std::string> msgs;
  for (const auto& s : failed) msgs.emplace_back(s.message());
  return absl::Status(failed.front().code(),
                      absl::StrCat(failed.size(), " targets failed: ", absl::StrJoin(msgs, "; ")));
}

absl::Status SourceNode::StartUpdate(const v1::StartUpdateRequest& req, absl::Time deadline) {
  std::lock_guard<std::shared_mutex> ingest(ingest_mu_);
  absl::Status cancelled;  // why the last update's writes were cancelled: then every endpoint is unusable
  {
    std::lock_guard<std::mutex> l(mu_);
    cancelled = cancel_reason_;
    if (!configured_) return absl::FailedPreconditionError("source is not configured (no transfer plan yet)");
    if (req.plan_epoch() != plan_epoch_)
      return absl::FailedPreconditionError(absl::StrCat("update ", req.version(), " is for plan ", req.plan_epoch(),
                                                        " but this source is configured for plan ", plan_epoch_));
    if (version_ != -1 && req.version() == version_ && !finishing_) return absl::OkStatus();  // a repeat
    if (version_ != -1 && (finishing_ || req.version() < version_))
      return absl::FailedPreconditionError(absl::StrCat("cannot start update ", req.version(), ": update ", version_,
                                                        finishing_ ? " is finishing" : " is open"));
    const int64_t newest = std::max(last_version_, ended_version_);
    if (req.version() <= newest)
      return absl::FailedPreconditionError(
          absl::StrCat("version ", req.version(), " is not newer than the last update ", newest));
    if (version_ != -1) {
      // The coordinator only starts a newer update once it has given up on the open one (its begin failed at
      // another source): end it here as failed; its batches are dealt with below.
      spdlog::warn("update {} abandoned: update {} starts", version_, req.version());
      ended_version_ = version_;
      ended_result_ = absl::AbortedError(
          absl::StrCat("update ", version_, " was abandoned: the coordinator started update ", req.version()));
      version_ = -1;
      SetLogUpdateVersion(-1);
    }
  }
  // Every update ends by draining its batches; anything left is of unknown fate, so its endpoint is not reused.
  for (auto& t : targets_) {
    if (t->writer == nullptr) continue;
    if (const int busy = t->writer->busy(); busy > 0 && t->broken.ok())
      t->broken = absl::InternalError(absl::StrCat(busy, " batches of an earlier update were never waited for"));
    if (t->broken.ok()) t->broken = t->writer->broken();
  }
  // Re-establish what the last update broke before any push is accepted (ingest_mu_ keeps pushes out; mu_ is not
  // held across the dial, so status and BeginPush callers are not blocked behind it).
  std::vector<Target*> broken;
  for (auto& t : targets_) {
    if (!cancelled.ok() && t->broken.ok())
      t->broken = absl::CancelledError(absl::StrCat("its writes were cancelled: ", cancelled.message()));
    if (t->broken.ok()) continue;
    spdlog::warn("update {}: reconnecting to {} (its endpoint failed: {})", req.version(), Who(*t),
                 t->broken.ToString());
    broken.push_back(t.get());
  }
  if (absl::Status st = ConnectTargets(broken, deadline); !st.ok()) {
    absl::Status err = Annotate(st, absl::StrCat("update ", req.version(), ": cannot re-establish the endpoint"));
    spdlog::error("{}", err.ToString());
    return err;  // those not reconnected stay broken: the next StartUpdate tries again
  }
  for (Target* t : broken) spdlog::info("update {}: reconnected to {}", req.version(), Who(*t));
  WSYNC_RETURN_IF_ERROR(SelectSegmentSets(req));
  WSYNC_RETURN_IF_ERROR(DecideDeltas(req));
  // The replica is about to be rewritten: every range of an earlier update is hashed first (its FinishUpdate or
  // AbortUpdate waited already; an abandoned update did not).
  WaitForChecksums();
  std::lock_guard<std::mutex> l(mu_);
  // The base is rewritten by this update: it holds a complete version again only once the update finishes here.
  delta_from_ = delta_base_version_;
  delta_base_version_ = -1;
  sent_bytes_ = 0;
  if (replica_) replica_->BeginUpdate();
  staged_.clear();
  for (auto& c : completed_) std::fill(c.begin(), c.end(), 0);
  version_ = req.version();
  SetLogUpdateVersion(version_);
  checksums_[version_] = Recorded{};
  while (checksums_.size() > kChecksumVersionsKept) checksums_.erase(checksums_.begin());
  update_error_ = absl::OkStatus();
  update_failed_ = false;
  cancel_reason_ = absl::OkStatus();
  updates_.Begin(version_);
  ended_ranks_.clear();
  // Only ranks lost while this update is open count (a rank whose process ended after the last update may start
  // its next process at any time; until it pushes, the commit's own timeout applies).
  lost_ranks_.clear();
  placement_open_ = opts_.placement && !req.no_placement();
  bytes_written_ = params_written_ = tensors_received_ = 0;
  ingest_seconds_ = write_seconds_ = 0;
  spdlog::info("update {} started", version_);
  cv_.notify_all();
  return absl::OkStatus();
}

absl::Status SourceNode::SelectSegmentSets(const v1::StartUpdateRequest& req) {
  std::vector<std::pair<Target*, int>> change;
  for (auto& t : targets_) {
    auto it = req.segment_sets().find(t->assignment.engine_id());
    const int set = it == req.segment_sets().end() ? 0 : it->second;
    if (set == t->segment_set) continue;
    const int shift = t->assignment.layout().staging_segment_shift();
    if (set < 0 || set > 1 || (set != 0 && shift <= 0))
      return absl::FailedPreconditionError(absl::StrCat("update ", req.version(), ": copy ", set, " of ", Who(*t),
                                                        "'s segments: its layout has one copy only"));
    for (int seg : t->dst_segment)
      if (!t->by_segment.count(seg + set * shift))
        return absl::FailedPreconditionError(absl::StrCat("update ", req.version(), ": ", Who(*t),
                                                          "'s layout lacks segment ", seg + set * shift, " (copy ", set,
                                                          " of segment ", seg, ")"));
    change.emplace_back(t.get(), set);
  }
  for (auto [t, set] : change) {
    const int shift = t->assignment.layout().staging_segment_shift();
    for (size_t i = 0; i < t->dst_segment.size(); ++i)
      t->dst_region[i] = t->by_segment.at(t->dst_segment[i] + set * shift);
    t->segment_set = set;
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::BeginPushReply> SourceNode::BeginPush(const v1::BeginPushRequest& req, absl::Duration max_wait,
                                                         const CancelFn& cancelled) {
  std::unique_lock<std::mutex> l(mu_);
  Session* s = FindSession(req.session_id());
  if (s == nullptr) return UnknownSession();
  const int rank = s->local_rank;
  // The coordinator opens the update; ranks that arrive first wait for it.
  const absl::Duration wait = std::max(absl::ZeroDuration(), std::min(opts_.push_timeout, max_wait));
  bool gone = false;
  bool ready = WaitCancellable(l, wait, cancelled, &gone, [&] {
    return version_ == req.version() || last_version_ >= req.version() || ended_version_ >= req.version();
  });
  if (gone) return absl::CancelledError(absl::StrCat("BeginPush(", req.version(), ") cancelled by the caller"));
  if (!ready)
    return absl::DeadlineExceededError(absl::StrCat(
        "no update is open: update ", req.version(), " was not opened on this node within ", absl::FormatDuration(wait),
        ": the driver must open it first (Coordinator.begin_update / BeginUpdate(", req.version(),
        ")) before the ranks begin their push"));
  if (version_ != req.version())
    return absl::FailedPreconditionError(absl::StrCat("update ", req.version(), " already ended"));
  v1::BeginPushReply out;
  auto it = rank_push_.find(rank);
  if (it != rank_push_.end())
    for (const auto& n : it->second) {
      out.add_tensor_names(n);
      v1::PushSpec* spec = out.add_expected();
      spec->set_name(n);
      if (auto e = replica_ ? replica_->Expected(n) : std::nullopt) {
        for (int64_t d : e->shape) spec->add_shape(d);
        spec->set_dtype(std::string(DTypeName(e->dtype)));
      }
    }
  auto sl = rank_slices_.find(rank);
  if (sl != rank_slices_.end())
    for (const auto& x : sl->second) *out.add_slices() = x;
  // A rank the byte split left without tensors gets no FP8 hint (as before the split, when it had no list at all).
  if (fp8_hint_.tensor_names_size() > 0 && it != rank_push_.end() && !it->second.empty()) {
    const std::set<std::string> mine(it->second.begin(), it->second.end());
    v1::Fp8PushHint* h = out.mutable_fp8();
    h->set_block_n(fp8_hint_.block_n());
    h->set_block_k(fp8_hint_.block_k());
    h->set_ue8m0(fp8_hint_.ue8m0());
    for (const auto& n : fp8_hint_.tensor_names())
      if (mine.count(n)) h->add_tensor_names(n);
  }
  if (auto offers = rank_offers_.find(rank); placement_open_ && offers != rank_offers_.end()) {
    for (const auto& [name, offer] : offers->second) *out.add_placements() = offer.proto;
    out.set_replica_generation(replica_generation_);
  }
  return out;
}

absl::StatusOr<BucketView> SourceNode::WaitForBucket(RingConsumer& ring, absl::Duration timeout,
                                                     const CancelFn& cancelled) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    const absl::Duration left = deadline - absl::Now();
    auto b = ring.NextBucket(std::max(absl::ZeroDuration(), std::min(left, kCancelPoll)));
    if (b.ok() || !absl::IsDeadlineExceeded(b.status())) return b;
    if (left <= kCancelPoll)
      return absl::DeadlineExceededError(absl::StrCat("ring '", ring.name(), "': no bucket committed within ",
                                                      absl::FormatDuration(timeout),
                                                      " of CommitBucket (a rank commits the bucket before the call)"));
    if (cancelled && cancelled())
      return absl::CancelledError(absl::StrCat("ring '", ring.name(), "': the caller cancelled the wait for a bucket"));
  }
}

template <typename Pred>
bool SourceNode::WaitCancellable(std::unique_lock<std::mutex>& l, absl::Duration wait, const CancelFn& cancelled,
                                 bool* gone, Pred pred) {
  const absl::Time deadline = absl::Now() + std::max(wait, absl::ZeroDuration());
  for (;;) {
    const absl::Duration left = deadline - absl::Now();
    if (cv_.wait_for(l, absl::ToChronoNanoseconds(std::max(absl::ZeroDuration(), std::min(left, kCancelPoll))), pred))
      return true;
    if (left <= kCancelPoll) return false;
    if (cancelled && cancelled()) {
      *gone = true;
      return false;
    }
  }
}

absl::StatusOr<v1::CommitBucketReply> SourceNode::CommitBucket(const v1::CommitBucketRequest& req,
                                                               const CancelFn& cancelled) {
  std::shared_ptr<RingConsumer> ring;
  std::shared_ptr<std::mutex> rank_mu;
  int local_rank = 0;
  {
    std::lock_guard<std::mutex> l(mu_);
    Session* s = FindSession(req.session_id());
    if (s == nullptr) return UnknownSession();
    local_rank = s->local_rank;
    ring = s->ring;  // shared: a session replaced meanwhile keeps its ring mapped until this call is done
    rank_mu = s->commit_mu;
  }
  // One bucket at a time per rank (its ring is consumed in order); a second concurrent call of the same rank waits
  // for the first only briefly.
  // (Polled with try_lock rather than a timed mutex: ThreadSanitizer cannot follow pthread_mutex_clocklock.)
  std::unique_lock<std::mutex> rank_lock(*rank_mu, std::try_to_lock);
  for (const absl::Time until = absl::Now() + kBucketWait; !rank_lock.owns_lock(); rank_lock.try_lock()) {
    if (absl::Now() >= until || (cancelled && cancelled()))
      return absl::FailedPreconditionError(absl::StrCat("bucket ", req.bucket_seq(),
                                                        ": another CommitBucket of this "
                                                        "rank is still running"));
    absl::SleepFor(absl::Milliseconds(10));
  }
  // The trainer commits in the ring before it calls us, so the bucket is there already. A rank stuck mid-bucket waits
  // here, holding no node-wide lock, so other ranks' buckets go on; a cancelled call stops waiting within
  // kCancelPoll.
  WSYNC_ASSIGN_OR_RETURN(BucketView bucket, WaitForBucket(*ring, kBucketWait, cancelled));
  struct ReleaseGuard {
    RingConsumer* ring;
    const BucketView& b;
    ~ReleaseGuard() {
      if (auto st = ring->Release(b); !st.ok()) spdlog::error("ring release: {}", st.ToString());
    }
  } guard{ring.get(), bucket};
  const absl::Time got = absl::Now();
  // Buckets of other ranks run beside this one (shared); StartUpdate, Configure and the drains wait for it.
  std::shared_lock<std::shared_mutex> ingest(ingest_mu_);
  const absl::Time begin = absl::Now();
  int64_t version;
  absl::Status failed;
  {
    std::lock_guard<std::mutex> l(mu_);
    version = version_;
    failed = update_error_;
  }
  if (bucket.seq != req.bucket_seq())
    return absl::FailedPreconditionError(
        absl::StrCat("bucket seq mismatch: ring holds ", bucket.seq, ", commit names ", req.bucket_seq()));
  if (version == -1)
    return absl::FailedPreconditionError(absl::StrCat("bucket ", bucket.seq,
                                                      " committed while no update is open (after update ",
                                                      last_version_, " ended); nothing was written"));
  // Fail fast: once the update failed here nothing more of it is loaded or posted (the engines stay paused only
  // until the coordinator hears it).
  if (!failed.ok())
    return absl::AbortedError(absl::StrCat("bucket ", bucket.seq, " of update ", version,
                                           " not loaded: the update already failed on node ", opts_.node_id, " (",
                                           failed.message(), "); nothing from it was written"));

  if (!replica_)
    return absl::FailedPreconditionError(absl::StrCat("bucket ", bucket.seq, ": this node writes nothing in plan ",
                                                      plan_epoch_,
                                                      " (its ranks' push filters are empty); nothing "
                                                      "was written"));
  // Validate and claim the whole bucket before anything of it reaches the replica or an engine.
  std::vector<BucketTensor> tensors;
  if (absl::Status bad = ClaimBucket(bucket, &tensors); !bad.ok()) {
    std::lock_guard<std::mutex> l(mu_);
    absl::Status err = Annotate(
        bad, absl::StrCat("bucket ", bucket.seq, " of update ", version, " rejected, nothing from it was written"));
    if (version_ == version) FailUpdate(err);
    metrics_.Add("wsync_source_buckets_total", {{"result", "rejected"}}, 1);
    return err;
  }

  std::vector<replica::ReadyParam> ready;
  if (absl::Status st = LoadBucket(tensors, &ready); !st.ok()) {
    std::lock_guard<std::mutex> l(mu_);
    if (version_ == version) FailUpdate(st);
    return st;
  }
  const absl::Time loaded = absl::Now();
  absl::Status ws = WriteReady(version, ready);
  const absl::Time posted = absl::Now();
  if (opts_.bucket_observer)
    opts_.bucket_observer({local_rank, bucket.seq, bucket.payload_bytes, got, begin, loaded, posted});
  const double ingest_s = absl::ToDoubleSeconds(loaded - begin), write_s = absl::ToDoubleSeconds(posted - loaded);
  // A weight pushed pre-quantized comes as two frames (codes, then `_scale_inv`); progress counts the weight once.
  const size_t scales = static_cast<size_t>(std::count_if(
      tensors.begin(), tensors.end(), [](const BucketTensor& b) { return replica::IsScaleFrame(b.t.name); }));
  std::lock_guard<std::mutex> l(mu_);
  ingest_seconds_ += ingest_s;
  write_seconds_ += write_s;
  tensors_received_ += tensors.size() - scales;
  metrics_.Add("wsync_source_tensors_received_total", {}, static_cast<double>(tensors.size() - scales));
  metrics_.Observe("wsync_source_bucket_ingest_seconds", {}, ingest_s);
  metrics_.Observe("wsync_source_bucket_write_seconds", {}, write_s);
  if (!ws.ok()) {
    if (version_ == version) FailUpdate(ws);
    metrics_.Add("wsync_source_buckets_total", {{"result", "write_failed"}}, 1);
    return ws;
  }
  metrics_.Add("wsync_source_buckets_total", {{"result", "ok"}}, 1);
  v1::CommitBucketReply out;
  out.set_tensors(static_cast<uint32_t>(tensors.size()));
  out.set_bytes(bucket.payload_bytes);
  out.set_params_ready(static_cast<uint32_t>(ready.size()));
  return out;
}

absl::Status SourceNode::ClaimBucket(const BucketView& bucket, std::vector<BucketTensor>* tensors) {
  // The names live in memory the trainer can still write: each is copied out once, and only the copies are parsed,
  // compared and used as keys (a name changing under a std::set would break its ordering).
  tensors->resize(bucket.tensors.size());  // not resized again: each t.name views its own entry's `name`
  for (size_t i = 0; i < bucket.tensors.size(); ++i) {
    const TensorView& v = bucket.tensors[i];
    BucketTensor& b = (*tensors)[i];
    b.name.assign(v.name.data(), v.name.size());
    b.t = replica::HfTensor{b.name, v.dtype, v.shape, v.data, v.bytes};
  }
  std::vector<replica::HfTensor> wholes;
  std::set<absl::string_view> seen;
  bool any_slice = false;
  for (BucketTensor& b : *tensors) {
    WSYNC_ASSIGN_OR_RETURN(b.slice, ParseSliceName(b.t.name, b.t.shape));
    if (b.slice.has_value()) {
      any_slice = true;
    } else {
      if (!seen.insert(b.t.name).second)
        return absl::InvalidArgumentError(absl::StrCat("tensor ", b.t.name, " appears twice in one bucket"));
      wholes.push_back(b.t);
    }
  }
  if (!any_slice) return replica_->Claim(wholes);
  // Slices are checked against what other buckets claimed of the same tensors, and claimed with the bucket's whole
  // tensors: both under staged_mu_, so a refusal leaves nothing of the bucket claimed.
  std::lock_guard<std::mutex> l(staged_mu_);
  std::vector<std::pair<TensorSlice, DType>> bucket_slices;
  std::map<std::string, Staged> fresh;  // tensors whose first slice is in this bucket
  std::vector<replica::HfTensor> direct;
  for (const BucketTensor& b : *tensors) {
    if (!b.slice.has_value()) continue;
    WSYNC_RETURN_IF_ERROR(CheckSlice(*b.slice, b.t.dtype, b.t.bytes, bucket_slices));
    bucket_slices.push_back({*b.slice, b.t.dtype});
    if (staged_.count(b.slice->name) || fresh.count(b.slice->name)) continue;
    Staged& st = fresh[b.slice->name] = NewStaged(*b.slice, b.t.dtype);
    if (st.direct)
      direct.push_back({b.slice->name, st.dtype, st.shape, nullptr,
                        static_cast<uint64_t>(b.slice->full_rows * b.slice->full_cols) * DTypeSize(st.dtype)});
  }
  // A tensor landing directly is claimed now, with the bucket's whole tensors, so no other bucket of any rank can
  // load it (its bytes would mix with the slices'). Should the second claim be refused, the first stays: the bucket
  // is refused, which fails the update, and nothing of it was written.
  WSYNC_RETURN_IF_ERROR(replica_->Claim(wholes));
  if (!direct.empty()) WSYNC_RETURN_IF_ERROR(replica_->ClaimPlaced(direct));
  for (BucketTensor& b : *tensors)
    if (b.slice.has_value()) b.staged = ReserveSlice(*b.slice, &fresh);
  return absl::OkStatus();
}

absl::Status SourceNode::LoadBucket(const std::vector<BucketTensor>& tensors, std::vector<replica::ReadyParam>* ready) {
  for (const BucketTensor& b : tensors) {
    if (b.slice.has_value()) {
      WSYNC_RETURN_IF_ERROR(StageSlice(*b.slice, b.staged, b.t.data, ready));
      continue;
    }
    WSYNC_ASSIGN_OR_RETURN(std::vector<replica::ReadyParam> r, replica_->Load(b.t));
    ready->insert(ready->end(), r.begin(), r.end());
  }
  return absl::OkStatus();
}

absl::Status SourceNode::CheckSlice(const TensorSlice& s, DType dtype, uint64_t bytes,
                                    const std::vector<std::pair<TensorSlice, DType>>& bucket) {
  const std::string what = absl::StrCat("slice of ", s.name, " (", s.Describe(), ")");
  WSYNC_ASSIGN_OR_RETURN(const uint64_t want, ShapeBytes(s.extents, dtype, what));
  WSYNC_ASSIGN_OR_RETURN(const uint64_t full, ShapeBytes(s.full_shape, dtype, what));
  if (bytes != want)
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", bytes, " bytes of data, expected ", want));
  auto it = staged_.find(s.name);
  if (it != staged_.end() && it->second.done)
    return absl::AlreadyExistsError(absl::StrCat("slice of ", s.name, " (", s.Describe(),
                                                 ") arrived after the tensor was complete in this update"));
  // The whole tensor must be one the model has, with this shape and dtype (nothing is read through the pointer).
  // Checked at its first slice: one landing directly is claimed in the replica from then on, so the replica would
  // call it a duplicate; later slices must agree with the first.
  if (it == staged_.end()) {
    static const uint8_t kNoData = 0;
    replica::HfTensor whole{s.name, dtype, s.full_shape, &kNoData, full};
    WSYNC_RETURN_IF_ERROR_CTX(replica_->Validate(whole), "slice ", s.Describe());
  } else if (it->second.shape != s.full_shape) {
    return absl::InvalidArgumentError(absl::StrCat("slice of ", s.name, " (", s.Describe(), ") names the shape ",
                                                   ShapeStr(s.full_shape), ", earlier slices ",
                                                   ShapeStr(it->second.shape)));
  }
  std::vector<const TensorSlice*> earlier;
  if (it != staged_.end()) {
    if (it->second.dtype != dtype)
      return absl::InvalidArgumentError(absl::StrCat("slice of ", s.name, " (", s.Describe(), ") is ", DTypeName(dtype),
                                                     ", earlier slices were ", DTypeName(it->second.dtype)));
    for (const auto& g : it->second.got) earlier.push_back(&g);
  }
  for (const auto& [b, bd] : bucket) {
    if (b.name != s.name) continue;
    if (bd != dtype)
      return absl::InvalidArgumentError(absl::StrCat("slice of ", s.name, " (", s.Describe(), ") is ", DTypeName(dtype),
                                                     ", an earlier slice was ", DTypeName(bd)));
    earlier.push_back(&b);
  }
  for (const TensorSlice* o : earlier)
    if (replica::SlicesOverlap(s, *o))
      return absl::InvalidArgumentError(absl::StrCat("slice of ", s.name, ": ", s.Describe(), " overlaps ",
                                                     o->Describe(), " pushed earlier in this update"));
  return absl::OkStatus();
}

SourceNode::Staged SourceNode::NewStaged(const TensorSlice& s, DType dtype) const {
  Staged st;
  st.dtype = dtype;
  st.shape = s.full_shape;
  for (const replica::TensorRead& r : replica_->Reads(s.name)) {
    const bool needed = required_[r.layout][r.param] || (r.scale_param >= 0 && required_[r.layout][r.scale_param]);
    if (!needed) continue;
    if (r.constant) {
      st.constant = true;
    } else {
      st.need.push_back(r);
    }
  }
  st.needed = !st.need.empty() || st.constant;
  if (!st.needed) return st;
  // Direct when no read converts; a conversion (another dtype, FP8 quantized here) needs the whole tensor.
  auto rects = replica_->PlaceRects(s.name, dtype);
  st.direct = rects.ok();
  if (st.direct) {
    st.rects = *std::move(rects);
  } else {
    st.data.assign(static_cast<size_t>(s.full_rows * s.full_cols) * DTypeSize(dtype), 0);
  }
  return st;
}

SourceNode::Staged* SourceNode::ReserveSlice(const TensorSlice& s, std::map<std::string, Staged>* fresh) {
  auto it = staged_.find(s.name);
  if (it == staged_.end()) {
    auto f = fresh->find(s.name);
    it = staged_.emplace(s.name, std::move(f->second)).first;
    fresh->erase(f);
  }
  Staged& st = it->second;
  st.got.push_back(s);
  ++st.copying;
  return &st;
}

absl::Status SourceNode::StageSlice(const TensorSlice& s, Staged* st, const uint8_t* data,
                                    std::vector<replica::ReadyParam>* ready) {
  // The rectangle is this bucket's alone (claimed disjoint), and `data` stays allocated until the last claimed
  // slice has landed (copying > 0): the copy needs no lock.
  if (st->direct && !st->need.empty()) {
    replica::LandSlice(s, DTypeSize(st->dtype), st->rects, data, [&](int layout) { return replica_->data(layout); });
  } else if (!st->data.empty()) {
    replica::StageSlice(s, DTypeSize(st->dtype), data, st->data.data());
  }
  std::vector<uint8_t> whole_data;
  size_t slices = 0;
  {
    std::lock_guard<std::mutex> l(staged_mu_);
    st->landed.push_back(s);
    --st->copying;
    if (st->done || !st->needed || st->copying > 0) return absl::OkStatus();
    // Complete when every rectangle read by a parameter this node writes is covered (slices are disjoint).
    if (!replica::SlicesCover(st->need, st->landed)) return absl::OkStatus();
    st->done = true;
    whole_data.swap(st->data);
    slices = st->landed.size();
  }
  // The mutex ordered every landed slice's copy before this point: the tensor's bytes are all in place.
  metrics_.Add("wsync_source_sliced_tensors_total", {{"path", st->direct ? "direct" : "staged"}}, 1);
  const uint64_t bytes = static_cast<uint64_t>(s.full_rows * s.full_cols) * DTypeSize(st->dtype);
  replica::HfTensor whole{s.name, st->dtype, st->shape, whole_data.data(), st->direct ? bytes : whole_data.size()};
  auto r = st->direct ? replica_->MarkPlaced(whole) : replica_->Ingest(whole);
  if (!r.ok()) return Annotate(r.status(), absl::StrCat("assembled from ", slices, " slices"));
  ready->insert(ready->end(), r->begin(), r->end());
  return absl::OkStatus();
}

absl::Status SourceNode::WriteReady(int64_t version, const std::vector<replica::ReadyParam>& ready) {
  if (ready.empty()) return absl::OkStatus();
  std::map<Target*, std::vector<transport::WriteRequest>> batches;
  // A relay tree's root takes the bucket in pieces of at most a relay chunk (cut inside parameters), each posted with
  // its own landed notice, so that the root forwards a piece as soon as it landed: a level of the tree then adds
  // about one chunk's time, not one bucket's or one large parameter's (docs/planner.md, "The relay data path").
  std::map<Target*, std::vector<RelayPiece>> pieces;
  const bool relaying = std::any_of(targets_.begin(), targets_.end(),
                                    [](const auto& t) { return t->assignment.relay_root(); });
  uint64_t bytes = 0, sent = 0;
  for (const auto& r : ready) {
    for (Target* t : targets_by_layout_[r.layout])
      for (const auto& [offset, length] : t->ranges[r.param]) bytes += length;
    if (!relaying) {
      sent += PlanWrites(version, r, &batches);
      continue;
    }
    std::map<Target*, std::vector<transport::WriteRequest>> planned;
    sent += PlanWrites(version, r, &planned);
    for (auto& [t, writes] : planned) {
      if (!t->assignment.relay_root()) {
        auto& b = batches[t];
        b.insert(b.end(), writes.begin(), writes.end());
        continue;
      }
      CutRelayPieces(*t, r, writes, &pieces[t]);
    }
  }
  RefreshBase(ready);
  std::map<Target*, std::shared_ptr<BatchOutcome>> outcomes;
  for (auto& [t, writes] : batches) {
    auto outcome = std::make_shared<BatchOutcome>();
    outcomes[t] = outcome;
    WSYNC_RETURN_IF_ERROR(PostToTarget(version, t, std::move(writes), [outcome](const absl::Status& st) {
      outcome->state.store(st.ok() ? 1 : 2, std::memory_order_release);
    }));
  }
  for (auto& [t, list] : pieces) {
    // The target's outcome: written once every piece is, not written when any piece is not.
    auto outcome = std::make_shared<BatchOutcome>();
    outcomes[t] = outcome;
    auto left = std::make_shared<std::atomic<size_t>>(list.size());
    auto failed = std::make_shared<std::atomic<bool>>(false);
    for (RelayPiece& piece : list) {
      TargetWriter::Done notice = RelayNoticeFor(version, *t, std::move(piece.ranges));
      WSYNC_RETURN_IF_ERROR(PostToTarget(version, t, std::move(piece.writes),
                                         [outcome, left, failed, notice](const absl::Status& st) {
                                           if (!st.ok()) failed->store(true);
                                           if (notice) notice(st);
                                           if (left->fetch_sub(1) == 1)
                                             outcome->state.store(failed->load() ? 2 : 1, std::memory_order_release);
                                         }));
    }
  }
  RecordChecksums(version, ready, outcomes);
  for (const auto& r : ready) completed_[r.layout][r.param] = 1;  // this bucket's alone: the replica said so once
  std::lock_guard<std::mutex> l(mu_);
  bytes_written_ += bytes;
  sent_bytes_ += sent;
  params_written_ += ready.size();
  metrics_.Add("wsync_source_bytes_written_total", {}, static_cast<double>(bytes));
  metrics_.Add("wsync_source_bytes_sent_total", {}, static_cast<double>(sent));
  metrics_.Add("wsync_source_params_written_total", {}, static_cast<double>(ready.size()));
  return absl::OkStatus();
}

absl::Status SourceNode::PostToTarget(int64_t version, Target* t, std::vector<transport::WriteRequest> writes,
                                      TargetWriter::Done done) {
  // Fail fast: a failure elsewhere (another rank's bucket, another target) stops this bucket's writes too.
  if (update_failed_)
    return absl::AbortedError(absl::StrCat("update ", version, ": writes to ", Who(*t),
                                           " not posted: the update already failed on node ", opts_.node_id));
  if (!t->broken.ok() || t->writer == nullptr)
    return absl::UnavailableError(absl::StrCat(
        "writing to ", Who(*t), ": its endpoint failed and is not re-established (", t->broken.message(), ")"));
  return t->writer->Submit(version, std::move(writes), std::move(done));
}

absl::Status SourceNode::EndPush(const v1::EndPushRequest& req) {
  std::lock_guard<std::mutex> l(mu_);
  Session* s = FindSession(req.session_id());
  if (s == nullptr) return UnknownSession();
  if (req.version() != version_) {
    if (ended_version_ == req.version())
      return absl::FailedPreconditionError(absl::StrCat(
          "EndPush for update ", req.version(),
          ", which has ended: ", ended_result_.ok() ? std::string("it finished") : ended_result_.status().ToString()));
    return absl::FailedPreconditionError(
        absl::StrCat("EndPush for update ", req.version(), " but ",
                     version_ >= 0 ? absl::StrCat("update ", version_, " is open") : std::string("no update is open")));
  }
  s->ended_version = req.version();
  ended_ranks_.insert(s->local_rank);
  cv_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<v1::FinishUpdateReply> SourceNode::FinishUpdate(const v1::FinishUpdateRequest& req,
                                                               const CancelFn& cancelled) {
  const absl::Duration timeout = req.timeout_seconds() > 0 ? absl::Seconds(req.timeout_seconds()) : opts_.push_timeout;
  const int64_t v = req.version();
  absl::Status result;
  {
    std::unique_lock<std::mutex> l(mu_);
    if (req.plan_epoch() != plan_epoch_)
      return absl::FailedPreconditionError(absl::StrCat("finish of update ", v, " is for plan ", req.plan_epoch(),
                                                        " but this source is configured for plan ", plan_epoch_));
    // A repeat while the first call runs waits for it (bounded by the first call's own timeouts).
    cv_.wait(l, [&] { return !(finishing_ && version_ == v); });
    if (ended_version_ == v) return ended_result_;
    if (version_ != v) {
      const int64_t newest = std::max({last_version_, ended_version_, version_});
      if (v < newest)
        return absl::FailedPreconditionError(
            absl::StrCat("cannot finish update ", v, ": it is older than update ", newest));
      return absl::FailedPreconditionError(absl::StrCat("update ", v, " is not open here"));
    }
    // Claimed under the lock that checked it: from here on no other call can finish, restart or reconfigure v.
    finishing_ = true;
    // Counted by rank, not by live session: a rank may close its session right after its last EndPush.
    auto all_ended = [&] {
      return static_cast<int>(ended_ranks_.size()) >= opts_.trainer_ranks || !update_error_.ok();
    };
    bool gone = false;
    if (!WaitCancellable(l, timeout, cancelled, &gone, all_ended) && gone) {
      // The coordinator's call is gone: the update fails here (a repeat of the call answers the same).
      result = absl::CancelledError(absl::StrCat("update ", v,
                                                 ": the coordinator's FinishUpdate call was cancelled "
                                                 "while this node waited for its trainer ranks"));
      CancelWrites(result);  // nobody waits for the drain either
    } else if (!all_ended()) {
      std::vector<int> missing;
      for (int r = 0; r < opts_.trainer_ranks; ++r)
        if (!ended_ranks_.count(r)) missing.push_back(r);
      result =
          absl::DeadlineExceededError(absl::StrCat("update ", v, ": trainer ranks [", absl::StrJoin(missing, ","),
                                                   "] did not finish pushing within ", absl::FormatDuration(timeout)));
    }
  }
  // Even a failed update drains its batches, so no batch id outlives the update it belongs to.
  std::lock_guard<std::shared_mutex> ingest(ingest_mu_);
  absl::Time t0 = absl::Now();
  absl::Status drained = DrainOutstanding(timeout);
  const double drain_s = Seconds(t0);
  // The update is reported finished (and its checksums complete) only once every range it wrote is hashed (not
  // counted as write time: wsync_source_checksum_wait_seconds).
  const double hash_wait_s = WaitForChecksums();
  std::lock_guard<std::mutex> l(mu_);
  write_seconds_ += drain_s;
  if (hasher_) metrics_.Observe("wsync_source_checksum_wait_seconds", {}, hash_wait_s);
  if (result.ok()) result = update_error_;  // the first cause (a bucket's failure, a lost rank, the coordinator's word)
  if (!drained.ok())
    result = result.ok()
                 ? drained
                 : absl::Status(result.code(), absl::StrCat(result.message(), "; draining: ", drained.message()));
  if (result.ok()) {
    // Every parameter this node writes must be complete (the plan may leave others of its layouts to other nodes).
    std::vector<std::string> missing;
    size_t count = 0;
    for (size_t li = 0; li < required_.size(); ++li)
      for (size_t p = 0; p < required_[li].size(); ++p)
        if (required_[li][p] && !completed_[li][p] && ++count <= 5) {
          // A draft's parameter names the engine ranks whose draft it is: the update fails for them, never skipped.
          const replica::ParamTable& table = replica_->table(static_cast<int>(li));
          std::string whose;
          for (const Target* t : table.IsDraft(p) ? targets_by_layout_[li] : std::vector<Target*>{})
            absl::StrAppend(&whose, whose.empty() ? "draft of " : ", ", "engine ", t->assignment.engine_id(), " rank ",
                            t->assignment.rank());
          missing.push_back(
              absl::StrCat(whose, whose.empty() ? "" : ": ", table.params()[p].name, " (layout ", li, ")"));
        }
    std::vector<std::string> partial;  // tensors pushed in slices that never covered what this node reads
    for (const auto& [name, st] : staged_)
      if (!st.done && !st.data.empty() && partial.size() < 5)
        partial.push_back(absl::StrCat(name, " (", st.got.size(), " slices)"));
    if (count > 0)
      result = absl::FailedPreconditionError(
          absl::StrCat("update ", v, ": ", count,
                       " parameters this node writes are incomplete (their checkpoint tensors were not "
                       "all pushed): ",
                       absl::StrJoin(missing, ", "), count > missing.size() ? ", ..." : "",
                       partial.empty() ? ""
                                       : absl::StrCat("; tensors whose slices do not cover what this node reads: ",
                                                      absl::StrJoin(partial, ", "))));
  }
  version_ = -1;
  SetLogUpdateVersion(-1);
  finishing_ = false;
  ended_version_ = v;
  cv_.notify_all();
  if (!result.ok()) {
    spdlog::error("update {} failed: {}", v, result.ToString());
    ended_result_ = result;
    metrics_.Add("wsync_source_updates_total", {{"result", "failed"}}, 1);
    return result;
  }
  last_version_ = v;
  if (auto it = checksums_.find(v); it != checksums_.end()) it->second.finished = true;
  metrics_.Add("wsync_source_updates_total", {{"result", "ok"}}, 1);
  if (write_seconds_ > 0)
    metrics_.Set("wsync_source_update_write_bytes_per_second", {}, bytes_written_ / write_seconds_);
  v1::FinishUpdateReply out;
  out.set_bytes_written(bytes_written_);
  out.set_params_written(params_written_);
  out.set_tensors_received(tensors_received_);
  out.set_ingest_seconds(ingest_seconds_);
  out.set_write_seconds(write_seconds_);
  DeltaReply(v, &out);
  if (refresh_base_) delta_base_version_ = v;  // else the base was not kept up to date (source_delta.cc)
  ended_result_ = out;
  spdlog::info("update {} done: {} tensors in, {} params / {:.1f} MiB written (ingest {:.3f}s, write {:.3f}s{})", v,
               tensors_received_, params_written_, bytes_written_ / 1048576.0, ingest_seconds_, write_seconds_,
               hasher_ ? absl::StrFormat(", then %.3fs for the checksums", hash_wait_s) : std::string());
  return out;
}

absl::StatusOr<v1::AbortSourceUpdateReply> SourceNode::AbortUpdate(const v1::AbortSourceUpdateRequest& req,
                                                                   absl::Duration drain_timeout) {
  const int64_t v = req.version();
  {
    std::lock_guard<std::mutex> l(mu_);
    if (aborted_version_ == v) return aborted_reply_;
    if (version_ != v) {
      if (last_version_ == v)
        return absl::FailedPreconditionError(absl::StrCat("cannot abort update ", v, ": it finished successfully"));
      // Never started here, or ended (failed/abandoned) already: nothing of it can be written any more.
      v1::AbortSourceUpdateReply out;
      out.set_was_open(false);
      out.set_quiescent(true);
      if (ended_version_ == v) out.set_bytes_written(bytes_written_);
      return out;
    }
    if (finishing_) {
      // The commit owns the update and ends it; what the coordinator learnt (a node lost its lease) fails it now:
      // every write still in flight is cancelled, so FinishUpdate's drain returns at once with this reason.
      absl::Status err =
          absl::AbortedError(absl::StrCat("update ", v, " failed during its commit",
                                          req.reason().empty() ? std::string() : absl::StrCat(": ", req.reason())));
      if (update_error_.ok()) {
        FailUpdate(err, /*tell_coordinator=*/false);
      } else {
        CancelWrites(err);  // failed already: still, nothing of it may be written any more
      }
      v1::AbortSourceUpdateReply out;
      out.set_was_open(true);
      out.set_quiescent(false);  // FinishUpdate reports the result
      out.set_bytes_written(bytes_written_);
      return out;
    }
    // From here on BeginPush/CommitBucket/EndPush of v are refused (CommitBucket reads version_ under ingest_mu_).
    version_ = -1;
    SetLogUpdateVersion(-1);
    ended_version_ = v;
    absl::Status err = absl::AbortedError(absl::StrCat(
        "update ", v, " was aborted", req.reason().empty() ? std::string() : absl::StrCat(": ", req.reason())));
    ended_result_ = err;
    update_error_ = err;
    update_failed_ = true;
    aborted_version_ = v;
    // A bucket blocked on a dead link holds ingest_mu_: its writes are cancelled so that it (and the drain) end now.
    CancelWrites(err);
    cv_.notify_all();
  }
  // A bucket being written when the abort came holds ingest_mu_: wait for it, then for every write in flight.
  std::lock_guard<std::shared_mutex> ingest(ingest_mu_);
  absl::Status drained = DrainOutstanding(drain_timeout);
  WaitForChecksums();  // what the aborted update wrote is recorded in full
  std::lock_guard<std::mutex> l(mu_);
  v1::AbortSourceUpdateReply out;
  out.set_was_open(true);
  out.set_bytes_written(bytes_written_);
  out.set_quiescent(drained.ok());
  aborted_reply_ = out;
  metrics_.Add("wsync_source_updates_total", {{"result", "aborted"}}, 1);
  spdlog::warn("update {} aborted ({}): {:.1f} MiB of it had been written{}", v,
               req.reason().empty() ? "no reason given" : req.reason(), bytes_written_ / 1048576.0,
               drained.ok() ? "" : absl::StrCat("; draining its writes failed: ", drained.ToString()));
  return out;
}

absl::Status SourceNode::WaitWritten(absl::Duration timeout) {
  int64_t version;
  {
    std::lock_guard<std::mutex> l(mu_);
    version = version_;
  }
  if (!updates_.WaitDrained(absl::Now() + timeout))
    return absl::DeadlineExceededError(
        absl::StrCat("the writes of update ", version, " did not finish within ", absl::FormatDuration(timeout)));
  return updates_.error(version);
}

v1::NodeStatus SourceNode::Status() const {
  std::lock_guard<std::mutex> l(mu_);
  v1::NodeStatus s;
  s.set_node_id(opts_.node_id);
  s.set_role("source");
  s.set_transport(transport_->name());
  s.set_sessions(static_cast<int>(sessions_.size()));
  uint64_t total = 0;
  if (replica_)
    for (int i = 0; i < replica_->num_layouts(); ++i) total += replica_->table(i).total_bytes();
  s.set_replica_bytes(total);
  s.set_last_version(last_version_);
  s.set_state(version_ != -1 ? (finishing_ ? "finishing" : "updating") : (replica_ ? "ready" : "unconfigured"));
  s.set_open_version(version_);
  s.set_bytes_written(bytes_written_);
  s.set_tensors_received(tensors_received_);
  s.set_tensors_expected(push_names_.size() + push_slices_);  // slices count as tensors: each is one frame
  uint64_t expected = 0;
  if (replica_)
    for (const auto& t : targets_) expected += replica_->table(t->layout).total_bytes();
  s.set_bytes_expected(expected);
  s.set_trainer_ranks(opts_.trainer_ranks);
  s.set_ranks_ended(static_cast<int>(ended_ranks_.size()));
  return s;
}

}  // namespace wsync::daemon

namespace wsync::daemon {

absl::StatusOr<v1::WriteChecksumsReply> SourceNode::WriteChecksums(int64_t version) const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<std::string> kept;
  for (const auto& [v, rec] : checksums_) kept.push_back(absl::StrCat(v));
  auto it =
      version < 0 ? (checksums_.empty() ? checksums_.end() : std::prev(checksums_.end())) : checksums_.find(version);
  if (it == checksums_.end())
    return absl::NotFoundError(absl::StrCat(
        "source ", opts_.node_id, " has no write checksums of ",
        version < 0 ? std::string("any update") : absl::StrCat("update ", version), " (it keeps the last ",
        kChecksumVersionsKept,
        " updates since it started; it has: ", kept.empty() ? std::string("none") : absl::StrJoin(kept, ", "), ")"));
  v1::WriteChecksumsReply out;
  out.set_node_id(opts_.node_id);
  out.set_version(it->first);
  out.set_finished(it->second.finished);
  // What each engine got: an entry of a batch its writer did not write (dropped at an abort, failed, cancelled in
  // flight) is not listed. A batch still under way is listed (the bytes posted; finished records have none).
  const Recorded& rec = it->second;
  for (size_t i = 0; i < rec.writes.size(); ++i) {
    const BatchOutcome* o = i < rec.outcomes.size() ? rec.outcomes[i].get() : nullptr;
    if (o != nullptr && o->state.load(std::memory_order_acquire) == 2) continue;
    *out.add_writes() = rec.writes[i];
  }
  for (const auto& [v, rec] : checksums_) out.add_versions_kept(v);
  return out;
}

SourceNode::Retained SourceNode::RetainedSizes() {
  std::lock_guard<std::shared_mutex> ingest(ingest_mu_);
  std::lock_guard<std::mutex> l(mu_);
  Retained r;
  r.checksum_versions = checksums_.size();
  for (const auto& [v, rec] : checksums_) r.checksum_entries += rec.writes.size();
  r.sessions = sessions_.size();
  r.lost_ranks = lost_ranks_.size();
  r.ended_ranks = ended_ranks_.size();
  r.staged_tensors = staged_.size();
  return r;
}

void SourceNode::RecordChecksums(int64_t version, const std::vector<replica::ReadyParam>& ready,
                                 const std::map<Target*, std::shared_ptr<BatchOutcome>>& outcomes) {
  if (!hasher_ || ready.empty()) return;
  // One batch per bucket: its entries in the order posted, each hex filled in by the job hashing its range.
  struct Batch {
    int64_t version = -1;
    std::vector<v1::WriteChecksum> sums;
    std::vector<std::shared_ptr<const BatchOutcome>> outcomes;  // per entry of sums
    std::atomic<size_t> jobs_left{0};
  };
  struct Range {
    const uint8_t* data;
    uint64_t length;
    std::vector<size_t> entries;  // indices into Batch::sums: targets of one layout share the bytes, hashed once
  };
  auto batch = std::make_shared<Batch>();
  batch->version = version;
  std::vector<Range> ranges;
  std::map<std::tuple<int, int, uint64_t, uint64_t>, size_t> index;  // (layout, param, offset, length) → ranges
  for (const auto& r : ready) {
    const replica::EngineParam& p = replica_->table(r.layout).params()[r.param];
    for (Target* t : targets_by_layout_[r.layout]) {
      for (const auto& [offset, length] : t->ranges[r.param]) {
        if (length == 0) continue;
        auto [it, fresh] = index.try_emplace({r.layout, r.param, offset, length}, ranges.size());
        if (fresh) ranges.push_back({replica_->data(r.layout) + p.offset + offset, length, {}});
        ranges[it->second].entries.push_back(batch->sums.size());
        auto o = outcomes.find(t);
        batch->outcomes.push_back(o == outcomes.end() ? nullptr : o->second);
        v1::WriteChecksum& c = batch->sums.emplace_back();
        c.set_engine_id(t->assignment.engine_id());
        c.set_rank(t->assignment.rank());
        c.set_param(p.name);
        c.set_offset(offset);
        c.set_length(length);
      }
    }
  }
  if (ranges.empty()) return;
  // Jobs of about kJobBytes (small parameters grouped, so the queue does not dominate; a large range is one job).
  constexpr uint64_t kJobBytes = 4ull << 20;
  std::vector<std::vector<Range>> jobs(1);
  uint64_t in_job = 0, total = 0;
  for (auto& r : ranges) {
    if (in_job >= kJobBytes) jobs.emplace_back(), in_job = 0;
    in_job += r.length;
    total += r.length;
    jobs.back().push_back(std::move(r));
  }
  batch->jobs_left = jobs.size();
  metrics_.Add("wsync_source_checksum_bytes_total", {}, static_cast<double>(total));
  for (auto& job : jobs) {
    hasher_->Submit([this, batch, job = std::move(job)] {
      for (const Range& r : job) {
        if (opts_.checksum_hook) opts_.checksum_hook();
        const XXH128_hash_t h = XXH3_128bits(r.data, r.length);
        const std::string hex = absl::StrFormat("%016x%016x", h.high64, h.low64);
        for (size_t e : r.entries) batch->sums[e].set_xxh128(hex);
      }
      // The last job of the batch publishes it whole (acq_rel: it sees every other job's entries).
      if (batch->jobs_left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
      std::lock_guard<std::mutex> l(mu_);
      if (auto it = checksums_.find(batch->version); it != checksums_.end()) {
        for (auto& c : batch->sums) it->second.writes.push_back(std::move(c));
        for (auto& o : batch->outcomes) it->second.outcomes.push_back(std::move(o));
      }
    });
  }
}

double SourceNode::WaitForChecksums() {
  if (!hasher_) return 0;
  const absl::Time t0 = absl::Now();
  hasher_->WaitIdle();
  return Seconds(t0);
}

SourceNode::RankOffers SourceNode::PlanPlacements(const replica::Replica& replica,
                                                  const std::map<int, std::vector<std::string>>& rank_push,
                                                  const v1::Fp8PushHint& fp8) {
  const std::set<std::string> quantized(fp8.tensor_names().begin(), fp8.tensor_names().end());
  RankOffers out;
  for (const auto& [rank, names] : rank_push) {
    std::map<std::string, Offer>& mine = out[rank];
    auto offer = [&](const std::string& name) {
      const DType dtype = replica.PlaceableDType(name);
      if (dtype == DType::kInvalid) return;
      absl::StatusOr<std::vector<replica::PlacedRect>> rects = replica.PlaceRects(name, dtype);
      if (!rects.ok() || rects->empty()) return;  // some layout converts it: the ring
      Offer o;
      o.dtype = dtype;
      o.shape = replica.Shape(name);
      o.bytes = DTypeSize(dtype);
      for (int64_t d : o.shape) o.bytes *= static_cast<uint64_t>(d);
      o.proto.set_name(name);
      o.proto.set_dtype(std::string(DTypeName(dtype)));
      for (int64_t d : o.shape) o.proto.add_shape(d);
      for (const replica::PlacedRect& r : *rects) {
        v1::PlacedRegion* g = o.proto.add_regions();
        g->set_layout(r.layout);
        g->set_offset(r.offset);
        g->set_pitch(r.pitch);
        g->set_src_offset(r.src_offset);
        g->set_src_pitch(r.src_pitch);
        g->set_rows(r.rows);
        g->set_row_bytes(r.row_bytes);
      }
      mine[name] = std::move(o);
    };
    for (const std::string& name : names) {
      offer(name);
      // A weight the rank may quantize: its codes (float8_e4m3fn, offered above) and its scales land as they are.
      if (quantized.count(name)) offer(absl::StrCat(name, "_scale_inv"));
    }
  }
  return out;
}

absl::StatusOr<SourceNode::ReplicaHandles> SourceNode::ReplicaFds(const std::string& session_id) {
  std::lock_guard<std::mutex> l(mu_);
  if (FindSession(session_id) == nullptr) return UnknownSession();
  if (!replica_)
    return absl::FailedPreconditionError(
        absl::StrCat("this node has no replica in plan ", plan_epoch_, ": nothing to place into"));
  ReplicaHandles out;
  out.generation = replica_generation_;
  for (int i = 0; i < replica_->num_layouts(); ++i) {
    WSYNC_ASSIGN_OR_RETURN(ScopedFd fd, DupFd(replica_->fd(i)));
    out.fds.push_back(std::move(fd));
    out.bytes.push_back(replica_->mapped_bytes(i));
  }
  return out;
}

absl::Status SourceNode::CheckPlaced(const v1::CommitPlacedRequest& req, int64_t* version,
                                     std::vector<replica::HfTensor>* tensors, uint64_t* bytes, absl::Status* refusal) {
  absl::Status& bad = *refusal;
  Session* s = FindSession(req.session_id());
  if (s == nullptr) return UnknownSession();
  *version = version_;
  if (*version == -1)
    return absl::FailedPreconditionError(absl::StrCat("placement committed for update ", req.version(),
                                                      " while no update is open; nothing was written"));
  auto offers = rank_offers_.find(s->local_rank);
  if (req.version() != *version) {
    bad = absl::FailedPreconditionError(
        absl::StrCat("placement committed for update ", req.version(), " while update ", *version, " is open"));
  } else if (!placement_open_) {
    bad = absl::FailedPreconditionError(absl::StrCat("update ", *version, " offers no placements"));
  } else if (req.replica_generation() != replica_generation_) {
    bad = absl::FailedPreconditionError(absl::StrCat("placement committed for replica generation ",
                                                     req.replica_generation(), ", but the replica in use is ",
                                                     replica_generation_, " (reconfigured: map it again)"));
  } else if (ended_ranks_.count(s->local_rank)) {
    bad = absl::FailedPreconditionError(absl::StrCat("trainer rank ", s->local_rank, " already ended its push"));
  }
  if (!bad.ok()) {
    std::vector<std::string> some(req.names().begin(), req.names().begin() + std::min(req.names_size(), 5));
    bad = Annotate(bad, absl::StrCat("placing ", absl::StrJoin(some, ", "), req.names_size() > 5 ? ", ..." : ""));
  }
  for (const std::string& name : req.names()) {
    if (!bad.ok()) break;
    const Offer* o = nullptr;
    if (offers != rank_offers_.end()) {
      auto it = offers->second.find(name);
      if (it != offers->second.end()) o = &it->second;
    }
    if (o == nullptr) {
      bad = absl::PermissionDeniedError(
          absl::StrCat("tensor ", name, " was not offered to trainer rank ", s->local_rank, " for placement"));
      break;
    }
    tensors->push_back(replica::HfTensor{name, o->dtype, o->shape, nullptr, o->bytes});
    *bytes += o->bytes;
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::CommitPlacedReply> SourceNode::CommitPlaced(const v1::CommitPlacedRequest& req) {
  // Buckets and placements of all ranks run beside each other (shared); StartUpdate, Configure and the drains wait.
  std::shared_lock<std::shared_mutex> ingest(ingest_mu_);
  const absl::Time begin = absl::Now();
  int64_t version = -1;
  std::vector<replica::HfTensor> tensors;
  uint64_t bytes = 0;
  absl::Status bad;  // a refusal: fails the update
  {
    std::lock_guard<std::mutex> l(mu_);
    WSYNC_RETURN_IF_ERROR(CheckPlaced(req, &version, &tensors, &bytes, &bad));
    // Fail fast, as for buckets: nothing more of a failed update is claimed, loaded or posted.
    if (bad.ok() && !update_error_.ok())
      return absl::AbortedError(absl::StrCat("placement of update ", version,
                                             " not loaded: the update already failed on node ", opts_.node_id, " (",
                                             update_error_.message(), "); nothing from it was written"));
  }
  // Claimed all or none, against every bucket's and placement's claims of this update: a tensor arrives once.
  if (bad.ok() && !tensors.empty()) bad = replica_->ClaimPlaced(tensors);
  if (!bad.ok()) {
    std::lock_guard<std::mutex> l(mu_);
    absl::Status err =
        Annotate(bad, absl::StrCat("placement of update ", req.version(), " refused, nothing from it was written"));
    if (version_ != -1) FailUpdate(err);
    metrics_.Add("wsync_source_placements_total", {{"result", "rejected"}}, 1);
    return err;
  }
  std::vector<replica::ReadyParam> ready;
  for (const replica::HfTensor& t : tensors) {
    absl::StatusOr<std::vector<replica::ReadyParam>> r = replica_->MarkPlaced(t);
    if (!r.ok()) {
      std::lock_guard<std::mutex> l(mu_);
      if (version_ == version) FailUpdate(r.status());
      return r.status();
    }
    ready.insert(ready.end(), r->begin(), r->end());
  }
  const absl::Time loaded = absl::Now();
  absl::Status ws = WriteReady(version, ready);
  const double write_s = absl::ToDoubleSeconds(absl::Now() - loaded);
  // Progress counts a weight once (its `_scale_inv` rides along), as for buckets.
  const size_t scales = static_cast<size_t>(std::count_if(
      tensors.begin(), tensors.end(), [](const replica::HfTensor& t) { return replica::IsScaleFrame(t.name); }));
  std::lock_guard<std::mutex> l(mu_);
  ingest_seconds_ += absl::ToDoubleSeconds(loaded - begin);
  write_seconds_ += write_s;
  tensors_received_ += tensors.size() - scales;
  metrics_.Add("wsync_source_tensors_received_total", {}, static_cast<double>(tensors.size() - scales));
  metrics_.Add("wsync_source_placed_bytes_total", {}, static_cast<double>(bytes));
  if (!ws.ok()) {
    if (version_ == version) FailUpdate(ws);
    metrics_.Add("wsync_source_placements_total", {{"result", "write_failed"}}, 1);
    return ws;
  }
  metrics_.Add("wsync_source_placements_total", {{"result", "ok"}}, 1);
  v1::CommitPlacedReply out;
  out.set_tensors(static_cast<uint32_t>(tensors.size()));
  out.set_bytes(bytes);
  out.set_params_ready(static_cast<uint32_t>(ready.size()));
  return out;
}

}  // namespace wsync::daemon
