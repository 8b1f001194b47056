// The source's half of delta updates (docs/delta.md): which engine ranks take deltas, the records staged for them,
// and the delta base they are computed against.
#include <algorithm>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/dtype.h"
#include "base/status.h"
#include "daemon/common/config_digest.h"
#include "daemon/node/source_node.h"
#include "daemon/node/target_node.h"
#include "replica/delta.h"
#include "spdlog/spdlog.h"

namespace wsync::daemon {

std::string DeltaBaseShape(const v1::ConfigureSourceRequest& req) {
  v1::ConfigureSourceRequest copy = req;
  for (auto& t : *copy.mutable_targets()) {
    t.clear_target_daemon();
    for (auto& seg : *t.mutable_layout()->mutable_segments()) seg.clear_region_descriptor();
  }
  return ConfigureSourceDigest(copy);  // ignores the plan epoch
}

bool KeepsDeltaBase(const std::string& current, int64_t version, const std::string& next) {
  return version >= 0 && !current.empty() && current == next;
}

absl::Status SourceNode::AttachStaging(Target* t, const v1::ConnectTargetReply& reply) {
  t->staging.reset();
  t->staging_bytes = 0;
  t->staging_refused = reply.staging_refused();
  if (reply.staging_descriptor().empty()) return absl::OkStatus();
  auto region = t->transport->ImportRegion(reply.staging_descriptor());
  if (!region.ok()) return Annotate(region.status(), absl::StrCat("importing the delta staging of ", Who(*t)));
  if (t->mirror == nullptr || t->mirror_region == nullptr || t->mirror_region->length() != reply.staging_bytes()) {
    t->mirror_region.reset();  // before the memory it registers
    t->mirror.reset(new uint8_t[reply.staging_bytes()]());
    auto mr = transport_->RegisterSourceMemory(t->mirror.get(), reply.staging_bytes());
    if (!mr.ok()) return Annotate(mr.status(), absl::StrCat("registering the delta mirror of ", Who(*t)));
    t->mirror_region = *std::move(mr);
  }
  t->staging = *std::move(region);
  t->staging_bytes = reply.staging_bytes();
  return absl::OkStatus();
}

namespace {

// Which copy of its segments the plan points this rank's parameters at (LayoutForCopy): 1 when they name segment
// id + staging_segment_shift, else 0. The target applies the rank's delta records to that copy.
int SegmentSet(const v1::RankLayout& layout) {
  const int shift = layout.staging_segment_shift();
  if (shift <= 0) return 0;
  for (const auto& p : layout.params())
    if (p.segment() >= shift) return 1;
  return 0;
}

}  // namespace

absl::Status SourceNode::DecideDeltas(const v1::StartUpdateRequest& req) {
  const std::string& mode = req.delta();
  if (!mode.empty() && mode != "auto" && mode != "off" && mode != "always")
    return absl::InvalidArgumentError(
        absl::StrCat("update ", req.version(), ": delta mode '", mode, "' is not auto, off or always"));
  std::map<std::pair<std::string, int>, int64_t> held;
  for (const auto& h : req.held()) held[{h.engine_id(), h.rank()}] = h.version();
  int64_t base;
  {
    std::lock_guard<std::mutex> l(mu_);
    base = delta_base_version_;
  }
  std::vector<std::string> refused;
  // The base is worth keeping only when some engine rank could take deltas from it, now or in a later update (a host
  // parameter behind a staging region, not Mooncake memory): otherwise refreshing it would copy every byte of every
  // update for nothing (e.g. a node writing only Mooncake memory).
  refresh_base_ = false;
  for (auto& t : targets_) {
    std::string why;
    if (!delta_base_.empty() && t->staging != nullptr && !t->caps.one_sided_only &&
        std::find(t->host_param.begin(), t->host_param.end(), 1) != t->host_param.end())
      refresh_base_ = true;
    auto h = held.find({t->assignment.engine_id(), t->assignment.rank()});
    const int64_t holds = h == held.end() ? -1 : h->second;
    if (mode == "off") {
      why = "delta=off";
    } else if (delta_base_.empty()) {
      why = "this source keeps no delta base (wsyncd --delta-base=false)";
    } else if (t->caps.one_sided_only) {
      why =
          absl::StrCat(t->transport->name(), "-registered memory: written one-sided, nothing beside it decodes deltas");
    } else if (t->staging == nullptr) {
      why = t->staging_refused.empty() ? "the target daemon gave no delta staging region" : t->staging_refused;
    } else if (base < 0) {
      why = "the source's delta base holds no complete version (a new plan, or its last update failed)";
    } else if (holds != base) {
      why = holds < 0 ? absl::StrCat("the rank holds no known version (new or re-attached engine, or a failed ",
                                     "update); the delta base is version ", base)
                      : absl::StrCat("the rank holds version ", holds, ", the delta base is version ", base);
    }
    t->delta = why.empty();
    t->fallback = why;
    t->staged = t->dense_bytes = t->sent_bytes = 0;
    t->records = t->dense_ranges = 0;
    if (!why.empty() && mode == "always")
      refused.push_back(absl::StrCat("engine ", t->assignment.engine_id(), " rank ", t->assignment.rank(), ": ", why));
  }
  if (!refused.empty())
    return absl::FailedPreconditionError(
        absl::StrCat("update ", req.version(), " asks delta=always, but ", absl::StrJoin(refused, "; ")));
  return absl::OkStatus();
}

uint64_t SourceNode::PlanWrites(int64_t version, const replica::ReadyParam& r,
                                std::map<Target*, std::vector<transport::WriteRequest>>* batches) {
  const replica::EngineParam& p = replica_->table(r.layout).params()[r.param];
  const uint8_t* neu = replica_->data(r.layout) + p.offset;
  const uint8_t* old = delta_base_.empty() ? nullptr : delta_base_[r.layout].get() + p.offset;
  // One encoding per distinct range: targets of the same layout usually take the same ranges.
  std::map<std::pair<uint64_t, uint64_t>, std::string> encoded;
  uint64_t sent = 0;
  for (Target* t : targets_by_layout_[r.layout]) {
    for (const auto& [offset, length] : t->ranges[r.param]) {
      if (length == 0) continue;
      t->dense_bytes += length;
      if (t->delta && old != nullptr && t->host_param[r.param]) {
        auto [it, fresh] = encoded.try_emplace({offset, length});
        if (fresh) {
          uint32_t es = static_cast<uint32_t>(DTypeSize(p.dtype));
          if (es != 1 && es != 2 && es != 4) es = 1;
          if (offset % es != 0 || length % es != 0) es = 1;
          // Worth it only when the record is smaller than the dense range.
          const uint64_t limit = length > sizeof(DeltaRecordHeader) + 8 ? length - sizeof(DeltaRecordHeader) - 8 : 0;
          // A range where nearly everything changed goes dense without a full compare (auto must not cost more
          // than off when nothing is sparse).
          if (!replica::delta::SampledDenseSmaller(old + offset, neu + offset, length, es, limit))
            replica::delta::Encode(old + offset, neu + offset, length, es, limit, &it->second);
        }
        const std::string& enc = it->second;
        const uint64_t rec = DeltaRecordBytes(enc.size());
        // Reserves [pos, pos + rec) of the staging region: buckets of several ranks stage into it at once.
        uint64_t pos = t->staged.load();
        bool fits = !enc.empty() && pos + rec <= t->staging_bytes;
        while (fits && !t->staged.compare_exchange_weak(pos, pos + rec)) fits = pos + rec <= t->staging_bytes;
        if (fits) {
          DeltaRecordHeader h{kDeltaRecordMagic, t->layout_index[r.param], version, offset, length, enc.size()};
          uint8_t* at = t->mirror.get() + pos;
          std::memcpy(at, &h, sizeof(h));
          std::memcpy(at + sizeof(h), enc.data(), enc.size());
          std::memset(at + sizeof(h) + enc.size(), 0, rec - sizeof(h) - enc.size());
          (*batches)[t].push_back({t->mirror_region.get(), pos, t->staging.get(), pos, rec});
          t->sent_bytes += rec;
          ++t->records;
          sent += rec;
          continue;
        }
        ++t->dense_ranges;  // not smaller than dense, or the staging region is full
      }
      transport::WriteRequest w;
      w.src = (*t->src_regions)[r.layout].get();
      w.src_offset = p.offset + offset;
      w.dst = t->dst_region[r.param];
      w.dst_offset = t->dst_offset[r.param] + offset;
      w.length = length;
      (*batches)[t].push_back(w);
      t->sent_bytes += length;
      sent += length;
    }
  }
  return sent;
}

void SourceNode::RefreshBase(const std::vector<replica::ReadyParam>& ready) {
  if (!refresh_base_) return;
  // A parameter is loaded once per update by one bucket: its bytes in the base are this call's alone.
  for (const auto& r : ready) {
    const replica::EngineParam& p = replica_->table(r.layout).params()[r.param];
    std::memcpy(delta_base_[r.layout].get() + p.offset, replica_->data(r.layout) + p.offset, p.bytes);
  }
}

void SourceNode::DeltaReply(int64_t version, v1::FinishUpdateReply* out) {
  uint64_t dense = 0, records = 0;
  for (auto& t : targets_) {
    dense += t->dense_bytes;
    auto* d = out->add_ranks();
    d->set_engine_id(t->assignment.engine_id());
    d->set_rank(t->assignment.rank());
    d->set_target_daemon(t->assignment.target_daemon());
    d->set_dense_bytes(t->dense_bytes);
    d->set_sent_bytes(t->sent_bytes);
    d->set_staged_bytes(t->staged);
    d->set_records(t->records);
    d->set_dense_ranges(t->dense_ranges);
    d->set_fallback(t->fallback);
    d->set_segment_set(SegmentSet(t->assignment.layout()) + t->segment_set);
    records += t->records;
  }
  out->set_dense_bytes(dense);
  spdlog::info("update {}: {:.2f} MiB sent for {:.2f} MiB of ranges ({} delta records)", version,
               sent_bytes_ / 1048576.0, dense / 1048576.0, records);
}

}  // namespace wsync::daemon
