// The target's half of delta updates (docs/delta.md): staging regions for the sources' delta records, the version
// each engine rank holds, and ApplyDelta.
#include <algorithm>
#include <cstring>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "base/memory_kind.h"
#include "base/status.h"
#include "daemon/node/target_node.h"
#include "replica/delta.h"
#include "spdlog/spdlog.h"

namespace wsync::daemon {
namespace {

constexpr uint64_t kStagingAlign = 4096;

// Where records of one segment go: host memory the daemon maps, or a cuda segment's scatter.
struct SegmentTarget {
  uint8_t* host = nullptr;
  CudaSegment* cuda = nullptr;
  uint64_t bytes = 0;
};

// The rank's segments by id (host ones are mapped in layout order, cuda ones imported in layout order).
template <typename RankT>
std::map<int, SegmentTarget> Segments(const RankT& r) {
  std::map<int, SegmentTarget> out;
  size_t next_host = 0, next_cuda = 0;
  for (const auto& seg : r.layout.segments()) {
    // The kinds were parsed and checked when the rank attached (an unknown one never reaches a layout).
    if (ParseSegmentKind(seg.kind()).value_or(SegmentKind::kHost) == SegmentKind::kCuda) {
      if (next_cuda < r.cuda.size()) out[seg.id()] = {nullptr, r.cuda[next_cuda++].get(), seg.bytes()};
    } else if (next_host < r.memory.size()) {
      const MappedSegment* m = r.memory[next_host++].get();
      out[seg.id()] = {m->data(), nullptr, m->size()};
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<DeltaRecordRef>> CheckDeltaRecords(const uint8_t* data, uint64_t bytes, uint32_t records,
                                                              int64_t version, const v1::RankLayout& layout,
                                                              const std::map<int, uint64_t>& host_segment_bytes,
                                                              const std::vector<v1::WriteRange>* owned,
                                                              const std::string& who) {
  std::vector<DeltaRecordRef> out;
  uint64_t off = 0;
  uint32_t n = 0;
  while (off < bytes) {
    DeltaRecordHeader h;
    const std::string at = absl::StrCat(who, ": record ", n, " at byte ", off);
    if (bytes - off < sizeof(h))
      return absl::InvalidArgumentError(absl::StrCat(at, " is truncated; nothing was written"));
    std::memcpy(&h, data + off, sizeof(h));
    if (h.magic != kDeltaRecordMagic || h.version != version)
      return absl::InvalidArgumentError(absl::StrCat(at, " is not a record of update ", version, " (magic ", h.magic,
                                                     ", version ", h.version, "); nothing was written"));
    if (h.param >= static_cast<uint32_t>(layout.params_size()))
      return absl::InvalidArgumentError(absl::StrCat(at, " names parameter index ", h.param, " but the rank has ",
                                                     layout.params_size(), "; nothing was written"));
    const v1::ParamDesc& p = layout.params(static_cast<int>(h.param));
    const std::string what = absl::StrCat(at, ", parameter ", p.name(), " [", h.offset, ", +", h.length, ")");
    if (h.length == 0 || h.offset > p.bytes() || h.length > p.bytes() - h.offset ||
        h.enc_bytes > bytes - off - sizeof(h))
      return absl::InvalidArgumentError(absl::StrCat(what, ": the range or its encoding (", h.enc_bytes,
                                                     " bytes) is out of bounds; nothing was written"));
    auto seg = host_segment_bytes.find(p.segment());
    if (seg == host_segment_bytes.end() || p.offset() > seg->second || p.bytes() > seg->second - p.offset())
      return absl::InvalidArgumentError(absl::StrCat(what, ": not in a segment of the rank; nothing was written"));
    if (owned != nullptr && std::none_of(owned->begin(), owned->end(), [&](const v1::WriteRange& w) {
          return w.param() == p.name() && w.offset() <= h.offset && h.offset + h.length <= w.offset() + w.length();
        }))
      return absl::PermissionDeniedError(absl::StrCat(what,
                                                      ": the plan does not give that range to the source; "
                                                      "nothing was written"));
    out.push_back({h.param, h.offset, h.length, data + off + sizeof(h), h.enc_bytes});
    off += DeltaRecordBytes(h.enc_bytes);
    ++n;
  }
  if (n != records || off != bytes)
    return absl::InvalidArgumentError(absl::StrCat(who, ": ", n, " records in ", off, " bytes, the source reported ",
                                                   records, " in ", bytes, "; nothing was written"));
  return out;
}

void TargetNode::OpenDeltaWindow(int64_t version, v1::SetWriteWindowReply* out) {
  window_version_ = version;
  window_ranks_.clear();
  window_gens_.clear();
  if (assignments_known_) {
    for (const auto& [source, engine, rank] : assignments_) window_ranks_.insert({engine, rank});
  } else {
    for (const auto& [id, e] : engines_)
      for (int r = 0; r < e->num_ranks; ++r) window_ranks_.insert({id, r});
  }
  // From now on the rank's memory is being written: it holds no complete version until ApplyDelta of this update.
  for (const auto& [engine, rank] : window_ranks_) {
    auto it = engines_.find(engine);
    if (it == engines_.end() || rank < 0 || rank >= it->second->num_ranks) continue;
    Rank& r = it->second->ranks[rank];
    window_gens_[{engine, rank}] = r.attach_gen;
    auto* h = out->add_held();
    h->set_engine_id(engine);
    h->set_rank(rank);
    h->set_version(r.state == Rank::State::kAttached ? r.held_version : -1);
    r.held_version = -1;
  }
}

absl::Status TargetNode::ProvideStaging(const v1::ConnectTargetRequest& req, const std::string& source,
                                        v1::ConnectTargetReply* out, transport::Transport::WriteGrant* grant,
                                        std::shared_ptr<Staging>* staging) {
  if (req.delta_write_bytes() == 0 || opts_.delta_staging_fraction <= 0) return absl::OkStatus();
  const std::string who = absl::StrCat("engine ", req.engine_id(), " rank ", req.rank());
  if (req.source_node().empty())
    return absl::InvalidArgumentError(absl::StrCat("ConnectTarget for ", who,
                                                   " asks for delta staging without naming "
                                                   "its source node"));
  // With identities, a source stages only under its own name (ApplyDelta checks records against its assignment).
  if (!source.empty() && source.substr(source.find(':') + 1) != req.source_node())
    return absl::PermissionDeniedError(
        absl::StrCat("ConnectTarget from ", source, " asks for delta staging as source ", req.source_node()));
  const std::tuple<std::string, int, std::string> key{req.engine_id(), req.rank(), req.source_node()};
  // Records land here for host and cuda segments alike (cuda ones are scattered from it on the device).
  uint64_t rank_bytes = 0;
  {
    std::lock_guard<std::mutex> l(mu_);
    WSYNC_ASSIGN_OR_RETURN(Engine * e, Find(req.engine_id()));
    for (const auto& seg : e->ranks[req.rank()].layout.segments()) rank_bytes += seg.bytes();
  }
  uint64_t want = static_cast<uint64_t>(opts_.delta_staging_fraction *
                                        static_cast<double>(std::min<uint64_t>(req.delta_write_bytes(), rank_bytes)));
  want = std::max<uint64_t>((want + kStagingAlign - 1) / kStagingAlign * kStagingAlign, kStagingAlign);
  {
    std::lock_guard<std::mutex> l(mu_);
    // A live region of the key (a connection's grant names it) big enough is shared by the new connection.
    auto it = staging_.find(key);
    if (std::shared_ptr<Staging> live = it == staging_.end() ? nullptr : it->second.lock();
        live != nullptr && live->bytes >= want) {
      out->set_staging_descriptor(live->region->Descriptor());
      out->set_staging_bytes(live->bytes);
      grant->regions.push_back(live->region.get());
      *staging = std::move(live);
      return absl::OkStatus();
    }
  }
  // Registered outside mu_ (registration can take long).
  auto st = std::make_shared<Staging>();
  st->data.reset(new uint8_t[want]());
  st->bytes = want;
  auto region = transport_->RegisterMemory(st->data.get(), want);
  if (!region.ok()) return Annotate(region.status(), absl::StrCat("registering the delta staging of ", who));
  st->region = *std::move(region);
  out->set_staging_descriptor(st->region->Descriptor());
  out->set_staging_bytes(want);
  grant->regions.push_back(st->region.get());
  std::lock_guard<std::mutex> l(mu_);
  // A smaller region of the key stays as long as a connection still names it; the map forgets freed ones.
  for (auto s = staging_.begin(); s != staging_.end();) s = s->second.expired() ? staging_.erase(s) : std::next(s);
  staging_[key] = st;
  *staging = std::move(st);
  spdlog::info("{}: {} KiB of delta staging for source {}", who, want / 1024, req.source_node());
  return absl::OkStatus();
}

absl::StatusOr<v1::ApplyDeltaReply> TargetNode::ApplyDelta(const v1::ApplyDeltaRequest& req) {
  const int64_t v = req.version();
  std::lock_guard<std::mutex> apply(apply_mu_);
  std::unique_lock<std::mutex> l(mu_);
  if (v != window_version_)
    return absl::FailedPreconditionError(absl::StrCat("ApplyDelta for update ", v,
                                                      ", but the write window was last "
                                                      "opened for update ",
                                                      window_version_));
  using RangeKey = std::tuple<uint32_t, uint64_t, uint64_t>;  // (parameter index, offset, length)
  using RankKey = std::pair<std::string, int>;
  struct Pending {
    std::string who;  // "engine E rank R parameter P [off, +len)"
    uint8_t* dst;     // host memory; null for a cuda segment
    CudaSegment* cuda;
    uint64_t seg_offset;               // of the range inside its cuda segment
    std::optional<uint64_t> recorded;  // cuda: the checksum recorded for the range (Rank::device_sums)
    DeltaRecordRef rec;
    RankKey rank;
    uint64_t gen;  // the rank's attach when checked
  };
  std::vector<Pending> pending;
  std::vector<std::shared_ptr<MappedSegment>> pins;  // the mappings `pending` writes, alive after mu_ is released
  std::vector<std::shared_ptr<CudaSegment>> cuda_pins;
  std::vector<std::shared_ptr<Staging>> staging_pins;  // the records `pending` points into, alive without mu_
  // Every record of every source is checked before any is applied.
  for (const auto& s : req.staged()) {
    const std::string who = absl::StrCat("engine ", s.engine_id(), " rank ", s.rank());
    const std::string from = absl::StrCat(" (delta staged by source ", s.source_node(), " for update ", v, ")");
    auto found = staging_.find({s.engine_id(), s.rank(), s.source_node()});
    std::shared_ptr<Staging> st = found == staging_.end() ? nullptr : found->second.lock();
    if (st == nullptr || s.bytes() > st->bytes)
      return absl::FailedPreconditionError(
          absl::StrCat(who, from, ": ", s.bytes(), " bytes of records but ",
                       st == nullptr ? "no staging region" : "a smaller staging region", " here"));
    staging_pins.push_back(st);
    WSYNC_ASSIGN_OR_RETURN(Engine * e, Find(s.engine_id()));
    if (s.rank() < 0 || s.rank() >= e->num_ranks || e->ranks[s.rank()].state != Rank::State::kAttached)
      return absl::FailedPreconditionError(absl::StrCat(who, from, ": the rank is not attached"));
    Rank& r = e->ranks[s.rank()];
    const std::map<int, SegmentTarget> segs = Segments(r);
    pins.insert(pins.end(), r.memory.begin(), r.memory.end());
    cuda_pins.insert(cuda_pins.end(), r.cuda.begin(), r.cuda.end());
    const std::vector<v1::WriteRange>* owned = nullptr;
    if (assignments_known_) {
      auto aw = assigned_writes_.find({s.source_node(), s.engine_id(), s.rank()});
      if (aw == assigned_writes_.end())
        return absl::PermissionDeniedError(absl::StrCat(who, from,
                                                        ": the plan does not assign the rank to that "
                                                        "source; nothing was written"));
      if (!aw->second.empty()) owned = &aw->second;
    }
    std::map<int, uint64_t> seg_bytes;
    for (const auto& [id, t] : segs) seg_bytes[id] = t.bytes;
    auto recs =
        CheckDeltaRecords(st->data.get(), s.bytes(), s.records(), v, r.layout, seg_bytes, owned, who + from);
    if (!recs.ok()) {
      r.held_version = -1;  // whatever it held, the next update writes it dense
      return recs.status();
    }
    // The copy of the segments the source's plan wrote (staged engines with two copies: the live one after a
    // switch may be the second, segment id + staging_segment_shift).
    const int set = s.segment_set();
    const int shift = r.layout.staging_segment_shift();
    if (set != 0 && (set != 1 || shift <= 0))
      return absl::InvalidArgumentError(absl::StrCat(who, from, ": records for copy ", set,
                                                     " of the segments; the rank has ", shift > 0 ? 2 : 1));
    for (const DeltaRecordRef& d : *recs) {
      const v1::ParamDesc& p = r.layout.params(static_cast<int>(d.param));
      auto seg = segs.find(p.segment() + set * shift);
      if (seg == segs.end())
        return absl::FailedPreconditionError(absl::StrCat(who, from, ": segment ", p.segment() + set * shift,
                                                          " of parameter ", p.name(), " is not mapped here"));
      const SegmentTarget& t = seg->second;
      if (t.cuda != nullptr && set != 0)
        return absl::FailedPreconditionError(absl::StrCat(
            who, from, ": delta records for the second copy of a cuda segment are not supported; nothing written"));
      Pending pd{absl::StrCat(who, " parameter ", p.name(), " [", d.offset, ", +", d.length, ")", from),
                 t.host == nullptr ? nullptr : t.host + p.offset() + d.offset,
                 t.cuda,
                 p.offset() + d.offset,
                 std::nullopt,
                 d,
                 {s.engine_id(), s.rank()},
                 r.attach_gen};
      if (t.cuda != nullptr)
        if (auto sum = r.device_sums.find({d.param, d.offset, d.length}); sum != r.device_sums.end())
          pd.recorded = sum->second;
      pending.push_back(std::move(pd));
    }
  }
  // The records were checked against the rank's current mapping; the scatter runs without mu_ (the mappings and the
  // staging regions are pinned; apply_mu_ keeps a second ApplyDelta out).
  l.unlock();
  // Forgets what a refused record's rank held, unless it re-attached meanwhile (its new process holds no version).
  auto forget = [&](const Pending& p) {
    std::lock_guard<std::mutex> relock(mu_);
    auto it = engines_.find(p.rank.first);
    if (it == engines_.end() || p.rank.second >= it->second->num_ranks) return;
    Rank& r = it->second->ranks[p.rank.second];
    if (r.attach_gen == p.gen) r.held_version = -1;
  };
  v1::ApplyDeltaReply out;
  // cuda segments: records are staged per segment and written at the end (one kernel per segment); what each range
  // then holds is the encoding's new checksum, recorded below for the rank's next delta.
  std::map<CudaSegment*, SegmentScatter*> scatters;
  std::map<RankKey, std::map<RangeKey, uint64_t>> new_sums;
  // Read-backs go through a bounded buffer (a range can be a whole embedding), hashed piece by piece.
  constexpr uint64_t kReadBackPiece = 16ull << 20;
  std::vector<uint8_t> readback;
  auto flush_all = [&]() -> absl::Status {
    absl::Status first;
    for (const auto& [seg, sc] : scatters) first.Update(sc->Flush());
    return first;
  };
  for (const Pending& p : pending) {
    absl::Status st;
    if (p.cuda == nullptr) {
      uint64_t consumed = 0;
      // Apply checks the encoding and that the range holds its base before it writes anything of the record.
      st = replica::delta::Apply(p.dst, p.rec.length, p.rec.enc, p.rec.enc_bytes, &consumed);
    } else {
      absl::StatusOr<SegmentScatter*> sc = p.cuda->Scatter();
      st = sc.status();
      uint64_t base = p.recorded.value_or(0);
      if (st.ok() && !p.recorded.has_value()) {
        // Last written dense: what the range holds is known only by reading it (one D2H copy of the range).
        readback.resize(std::min(p.rec.length, kReadBackPiece));
        replica::delta::ChecksumStream sum;
        for (uint64_t at = 0; st.ok() && at < p.rec.length; at += kReadBackPiece) {
          const uint64_t n = std::min(kReadBackPiece, p.rec.length - at);
          st = (*sc)->ReadBack(p.seg_offset + at, n, readback.data());
          if (st.ok()) sum.Update(readback.data(), n);
        }
        if (st.ok()) base = sum.Digest();
      }
      if (st.ok()) {
        absl::StatusOr<replica::delta::Info> info =
            (*sc)->Add(p.seg_offset, p.rec.length, p.rec.enc, p.rec.enc_bytes, base);
        st = info.status();
        if (st.ok()) {
          scatters[p.cuda] = *sc;
          new_sums[p.rank][{p.rec.param, p.rec.offset, p.rec.length}] = info->new_checksum;
        }
      }
    }
    if (!st.ok()) {
      forget(p);
      flush_all().IgnoreError();  // what was staged before it was checked against its base: written, as on a host
      return Annotate(st, absl::StrCat(p.who, ": refused, nothing of it written (", out.records_applied(),
                                       " earlier records applied; the rank takes dense writes next)"));
    }
    out.set_records_applied(out.records_applied() + 1);
    out.set_bytes_applied(out.bytes_applied() + p.rec.length);
  }
  if (absl::Status st = flush_all(); !st.ok()) {
    for (const Pending& p : pending)
      if (p.cuda != nullptr) forget(p);
    return Annotate(st, absl::StrCat("update ", v,
                                     ": writing delta records into GPU memory (those ranks take dense "
                                     "writes next)"));
  }
  l.lock();
  if (v != window_version_)
    return absl::AbortedError(absl::StrCat("ApplyDelta for update ", v, ": the write window was opened for update ",
                                           window_version_, " while the records were applied"));
  int committed = 0;
  for (const auto& [engine, rank] : window_ranks_) {
    auto it = engines_.find(engine);
    if (it == engines_.end() || rank < 0 || rank >= it->second->num_ranks) continue;
    Rank& r = it->second->ranks[rank];
    if (r.state != Rank::State::kAttached) continue;
    auto gen = window_gens_.find({engine, rank});
    if (gen == window_gens_.end() || gen->second != r.attach_gen) continue;  // re-attached since the window opened
    r.held_version = v;
    // Ranges written dense in this update have no known checksum any more; the records' ranges hold their new one.
    auto sums = new_sums.find({engine, rank});
    r.device_sums = sums == new_sums.end() ? std::map<RangeKey, uint64_t>{} : std::move(sums->second);
    ++committed;
  }
  out.set_ranks_committed(committed);
  spdlog::info("update {}: {} delta records applied ({:.1f} MiB of parameters); {} engine ranks hold it", v,
               out.records_applied(), out.bytes_applied() / 1048576.0, committed);
  return out;
}

}  // namespace wsync::daemon
