#include "replica/replica.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/fd_passing.h"
#include "base/status.h"
#include "replica/convert.h"
#include "replica/fp8.h"
#include "replica/layout_plan.h"
#include "replica/mapper.h"

namespace wsync::replica {
namespace {

constexpr size_t kPageSize = 4096;

std::string ShapeStr(absl::Span<const int64_t> s) { return absl::StrCat("[", absl::StrJoin(s, ", "), "]"); }

bool IsFloat(DType t) { return t == DType::kBF16 || t == DType::kF16 || t == DType::kF32; }

// [E, R, C] view of a parameter (1-D: [1, n, 1]; 2-D: [1, R, C]).
struct View {
  int64_t e = 1, r = 1, c = 1;
};
View ViewOf(const std::vector<int64_t>& s) {
  View v;
  if (s.size() == 1) v.r = s[0];
  if (s.size() == 2) v.r = s[0], v.c = s[1];
  if (s.size() == 3) v.e = s[0], v.r = s[1], v.c = s[2];
  return v;
}

// Page-aligned, zeroed, shareable memory: a memfd mapped MAP_SHARED (populated up front so the first update pays no
// page faults), so a trainer process can map the same pages and place tensors into them. Released on destruction.
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept : ptr_(o.ptr_), size_(o.size_), fd_(std::move(o.fd_)) { o.ptr_ = nullptr; }
  Buffer& operator=(Buffer&&) = delete;
  ~Buffer() {
    if (ptr_ != nullptr) munmap(ptr_, size_);
  }
  absl::Status Allocate(uint64_t bytes) {
    size_ = std::max<uint64_t>(kPageSize, (bytes + kPageSize - 1) / kPageSize * kPageSize);
    auto fail = [&](const char* what) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate a replica buffer of ", bytes, " bytes (", what, "): ", std::strerror(errno)));
    };
    fd_.reset(static_cast<int>(syscall(SYS_memfd_create, "wsync-replica", MFD_CLOEXEC)));
    if (!fd_.valid()) return fail("memfd_create");
    if (ftruncate(fd_.get(), static_cast<off_t>(size_)) != 0) return fail("ftruncate");
    void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_.get(), 0);
    if (p == MAP_FAILED) return fail("mmap");
    ptr_ = static_cast<uint8_t*>(p);
    // Huge pages where the host allows them for shared memory (shmem_enabled=advise); a refusal only costs TLB misses.
    (void)madvise(ptr_, size_, MADV_HUGEPAGE);
    // Populate now (MAP_POPULATE on a fresh memfd would also do it, but not after the madvise above).
    if (madvise(ptr_, size_, MADV_POPULATE_WRITE) != 0) {
      for (uint64_t o = 0; o < size_; o += kPageSize) ptr_[o] = 0;
    }
    return absl::OkStatus();
  }
  uint8_t* data() const { return ptr_; }
  int fd() const { return fd_.get(); }
  uint64_t size() const { return size_; }

 private:
  uint8_t* ptr_ = nullptr;
  uint64_t size_ = 0;
  ScopedFd fd_;
};

class ReplicaImpl final : public Replica {
 public:
  static absl::StatusOr<std::unique_ptr<Replica>> Make(const ModelConfig& config, std::vector<RankParallelism> ranks,
                                                       const QuantSpec& quant);

  int num_layouts() const override { return static_cast<int>(layouts_.size()); }
  const RankParallelism& layout(int l) const override { return layouts_[l].rank; }
  const ParamTable& table(int l) const override { return layouts_[l].plan.table; }
  uint8_t* data(int l) override { return layouts_[l].buffer.data(); }
  int fd(int l) const override { return layouts_[l].buffer.fd(); }
  uint64_t mapped_bytes(int l) const override { return layouts_[l].buffer.size(); }

  void BeginUpdate() override {
    for (Layout& l : layouts_)
      for (auto& a : l.arrived) a.store(0, std::memory_order_relaxed);
    for (auto& s : seen_) s.store(kNotSeen, std::memory_order_relaxed);
  }

  absl::Status Validate(const HfTensor& t) const override { return Check(t).status(); }
  absl::Status Claim(absl::Span<const HfTensor> tensors) override;
  absl::StatusOr<std::vector<ReadyParam>> Load(const HfTensor& t) override;
  absl::StatusOr<std::vector<PlacedRect>> PlaceRects(absl::string_view hf_name, DType dtype) const override;
  DType PlaceableDType(absl::string_view hf_name) const override;
  absl::Status ClaimPlaced(absl::Span<const HfTensor> tensors) override;
  absl::StatusOr<std::vector<ReadyParam>> MarkPlaced(const HfTensor& t) override;
  absl::Status FinishUpdate() const override;
  bool Needs(absl::string_view hf_name) const override;
  std::vector<int64_t> Shape(absl::string_view hf_name) const override {
    auto it = index_.find(hf_name);
    return it == index_.end() ? std::vector<int64_t>{} : entries_[it->second].shape;
  }
  std::vector<TensorRead> Reads(absl::string_view hf_name) const override;
  std::optional<TensorSpec> Expected(absl::string_view hf_name) const override {
    auto it = index_.find(std::string(hf_name));
    if (it == index_.end()) return std::nullopt;
    const HfEntry& e = entries_[it->second];
    return TensorSpec{std::string(hf_name), e.dtype, e.shape};
  }

 private:
  enum class Role : uint8_t { kPlain, kFp8Weight, kFp8Scale };
  enum Seen : uint8_t { kNotSeen = 0, kSeenConverted, kSeenFp8 };
  struct Placement {
    int layout;
    int source;
  };
  struct HfEntry {
    std::vector<int64_t> shape;
    DType dtype = DType::kBF16;  // the checkpoint's (CheckpointTensors, trainer format)
    Role role = Role::kPlain;
    int partner = -1;  // weight <-> its weight_scale_inv
    std::vector<Placement> placements;
  };
  struct Layout {
    RankParallelism rank;
    LayoutPlan plan;
    Buffer buffer;
    // Per param: sources loaded in this update. Counted by concurrent Loads; the one reaching plan.expected reports
    // the param ready.
    std::vector<std::atomic<int>> arrived;
  };

  ReplicaImpl(const ModelConfig& c, const QuantSpec& q, ParamMapper m) : config_(c), quant_(q), mapper_(std::move(m)) {}

  // Index of the entry for a valid tensor, -1 for a tensor skipped by rule; errors name the tensor. `placed`: the
  // bytes are in the layouts already (t.data is not looked at).
  absl::StatusOr<int> Check(const HfTensor& t, bool placed = false) const;
  absl::Status Place(const HfTensor& t, const Layout& l, const SliceSource& s);
  // Claim and ClaimPlaced.
  absl::Status ClaimImpl(absl::Span<const HfTensor> tensors, bool placed);
  // Load and MarkPlaced: `copy` false writes only constant reads.
  absl::StatusOr<std::vector<ReadyParam>> LoadImpl(const HfTensor& t, bool copy);
  // The dtype a non-constant source stores unconverted (its parameter's; FP8 weights: float8_e4m3fn codes).
  DType StoredDType(const Layout& l, const SliceSource& s) const { return l.plan.table.params()[s.param].dtype; }

  ModelConfig config_;
  QuantSpec quant_;
  ParamMapper mapper_;
  std::vector<Layout> layouts_;
  absl::flat_hash_map<std::string, int> index_;
  std::vector<HfEntry> entries_;
  // Per entry: a Seen, set by Claim under claim_mu_ (a tensor and its FP8 partner are decided together), read
  // anywhere.
  std::vector<std::atomic<uint8_t>> seen_;
  std::mutex claim_mu_;
};

absl::StatusOr<std::unique_ptr<Replica>> ReplicaImpl::Make(const ModelConfig& config,
                                                           std::vector<RankParallelism> ranks,
                                                           const QuantSpec& quant) {
  if (ranks.empty()) return absl::InvalidArgumentError("a replica needs at least one layout");
  for (size_t i = 0; i < ranks.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (ranks[i] == ranks[j]) {
        return absl::InvalidArgumentError(absl::StrCat("layouts ", j, " and ", i, " are identical; share one layout"));
      }
    }
  }
  // Target and draft layouts may share a replica (the same tensors arrive once); the weight sets present decide which
  // names are known, and what a name outside them is (a draft-only replica drops the target's tensors by rule).
  bool has_target = false, has_draft = false;
  for (const RankParallelism& rank : ranks) {
    has_target |= HoldsTarget(rank.weights);
    has_draft |= HoldsDraft(rank.weights);
  }
  const WeightSet mapped = has_target && has_draft ? WeightSet::kAll
                           : has_target            ? WeightSet::kTarget
                                                   : WeightSet::kDraft;
  WSYNC_ASSIGN_OR_RETURN(ParamMapper mapper,
                         ParamMapper::Create(config, ranks[0].ep_size, ranks[0].num_fused_shared_experts, mapped));
  std::unique_ptr<ReplicaImpl> r(new ReplicaImpl(config, quant, std::move(mapper)));
  const bool fp8 = quant.mode == QuantSpec::Mode::kFp8Block;

  // Every checkpoint name is known (also experts no layout needs), so Validate can check any tensor's shape.
  std::vector<std::vector<TensorSpec>> lists;
  for (const WeightSet w : {WeightSet::kTarget, WeightSet::kDraft}) {
    if (!(w == WeightSet::kDraft ? has_draft : has_target)) continue;
    WSYNC_ASSIGN_OR_RETURN(std::vector<TensorSpec> trainer,
                           CheckpointTensors(config, CheckpointFormat::kTrainer, 128, 128, w));
    lists.push_back(std::move(trainer));
    if (fp8) {
      WSYNC_ASSIGN_OR_RETURN(std::vector<TensorSpec> pass, CheckpointTensors(config, CheckpointFormat::kFp8PassThrough,
                                                                             quant.block_n, quant.block_k, w));
      lists.push_back(std::move(pass));
    }
  }
  for (const auto& list : lists) {
    for (const TensorSpec& t : list) {
      auto [it, fresh] = r->index_.emplace(t.name, static_cast<int>(r->entries_.size()));
      if (!fresh) {
        if (t.dtype == DType::kF8E4M3) r->entries_[it->second].role = Role::kFp8Weight;
        continue;
      }
      HfEntry e;
      e.shape = t.shape;
      e.dtype = t.dtype;
      const bool is_scale = t.name.size() > 10 && t.name.compare(t.name.size() - 10, 10, "_scale_inv") == 0;
      e.role = is_scale ? Role::kFp8Scale : t.dtype == DType::kF8E4M3 ? Role::kFp8Weight : Role::kPlain;
      r->entries_.push_back(std::move(e));
    }
  }
  for (auto& [name, idx] : r->index_) {
    if (r->entries_[idx].role != Role::kFp8Scale) continue;
    auto w = r->index_.find(name.substr(0, name.size() - 10));
    if (w != r->index_.end()) {
      r->entries_[idx].partner = w->second;
      r->entries_[w->second].partner = idx;
    }
  }

  r->layouts_.resize(ranks.size());
  for (size_t l = 0; l < ranks.size(); ++l) {
    Layout& lay = r->layouts_[l];
    lay.rank = ranks[l];
    auto plan = PlanLayout(config, ranks[l], quant);
    if (!plan.ok()) {
      return Annotate(
          plan.status(),
          absl::StrCat("layout ", l, " (",
                       ranks[l].weights == WeightSet::kTarget ? "" : absl::StrCat(WeightSetName(ranks[l].weights), " "),
                       "tp ", ranks[l].tp_rank, "/", ranks[l].tp_size, ", ep ", ranks[l].ep_rank, "/", ranks[l].ep_size,
                       ")"));
    }
    lay.plan = std::move(plan).value();
    lay.arrived = std::vector<std::atomic<int>>(lay.plan.table.params().size());
    WSYNC_RETURN_IF_ERROR(lay.buffer.Allocate(lay.plan.table.total_bytes()));
    for (size_t s = 0; s < lay.plan.sources.size(); ++s) {
      const SliceSource& src = lay.plan.sources[s];
      auto it = r->index_.find(src.hf_name);
      if (it == r->index_.end()) {
        return absl::InternalError(absl::StrCat("layout source '", src.hf_name, "' is not in the checkpoint list"));
      }
      r->entries_[it->second].placements.push_back({static_cast<int>(l), static_cast<int>(s)});
    }
  }
  r->seen_ = std::vector<std::atomic<uint8_t>>(r->entries_.size());
  return std::unique_ptr<Replica>(std::move(r));
}

absl::StatusOr<int> ReplicaImpl::Check(const HfTensor& t, bool placed) const {
  auto it = index_.find(t.name);
  if (it == index_.end()) {
    auto m = mapper_.Map(t.name);
    if (!m.ok()) return m.status();
    if (m->skip != SkipRule::kNone) return -1;
    return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' (engine parameter '", m->engine_name,
                                                   "') is not accepted by this replica (quantization ",
                                                   quant_.mode == QuantSpec::Mode::kFp8Block ? "fp8" : "none", ")"));
  }
  const int idx = it->second;
  const HfEntry& e = entries_[idx];
  bool dtype_ok = false;
  switch (e.role) {
    // an integer parameter (EAGLE-3's draft_id_to_target_id, int64) only in its own dtype
    case Role::kPlain: dtype_ok = IsFloat(t.dtype) || t.dtype == e.dtype; break;
    case Role::kFp8Weight: dtype_ok = IsFloat(t.dtype) || t.dtype == DType::kF8E4M3; break;
    case Role::kFp8Scale: dtype_ok = t.dtype == DType::kF32; break;
  }
  if (!dtype_ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", t.name, "': dtype ", DTypeName(t.dtype), " is not accepted: the model holds it as ",
        DTypeName(e.dtype), e.role == Role::kFp8Weight ? " (or float8_e4m3fn with its scales, pre-quantized)" : "",
        e.role == Role::kFp8Scale ? "" : "; push that dtype (float32 and float16 are converted to it)"));
  }
  if (!std::equal(t.shape.begin(), t.shape.end(), e.shape.begin(), e.shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': shape ", ShapeStr(t.shape), ", expected ",
                                                   ShapeStr(e.shape)));
  }
  uint64_t want = DTypeSize(t.dtype);
  for (int64_t d : e.shape) want *= static_cast<uint64_t>(d);
  if (t.bytes != want || (want > 0 && t.data == nullptr && !placed)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': ", t.bytes, " bytes of data, expected ",
                                                   want, " for ", DTypeName(t.dtype), " ", ShapeStr(e.shape)));
  }
  if (seen_[idx].load(std::memory_order_acquire) != kNotSeen) {
    return absl::AlreadyExistsError(absl::StrCat("tensor '", t.name, "' arrived twice in this update"));
  }
  // A weight quantized here produces its own scales, so its published scale must not come too (and vice versa).
  if (e.partner >= 0) {
    const uint8_t partner = seen_[e.partner].load(std::memory_order_acquire);
    if (e.role == Role::kFp8Scale && partner == kSeenConverted) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor '", t.name, "': its weight arrived unquantized and was quantized here; do not send its scales"));
    }
    if (e.role == Role::kFp8Weight && t.dtype != DType::kF8E4M3 && partner != kNotSeen) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor '", t.name, "': its weight_scale_inv already arrived, so the weight must be float8_e4m3fn"));
    }
  }
  return idx;
}

absl::Status ReplicaImpl::Place(const HfTensor& t, const Layout& l, const SliceSource& s) {
  const EngineParam& p = l.plan.table.params()[s.param];
  if (s.kind == SliceSource::Kind::kConstant) {
    if (p.dtype != DType::kF32) return absl::InternalError(absl::StrCat("constant '", p.name, "' is not float32"));
    uint8_t* out = const_cast<uint8_t*>(l.buffer.data()) + p.offset;
    for (uint64_t b = 0; b + sizeof(float) <= p.bytes; b += sizeof(float)) std::memcpy(out + b, &s.value, sizeof(float));
    return absl::OkStatus();
  }
  const View v = ViewOf(p.shape);
  const int64_t src_cols = s.hf_shape.size() > 1 ? s.hf_shape[1] : 1;
  const uint8_t* src = t.data + (s.src_row0 * src_cols + s.src_col0) * static_cast<int64_t>(DTypeSize(t.dtype));
  uint8_t* base = const_cast<uint8_t*>(l.buffer.data());
  uint8_t* dst = base + p.offset +
                 ((s.expert * v.r + s.dst_row0) * v.c + s.dst_col0) * static_cast<int64_t>(DTypeSize(p.dtype));
  if (s.kind == SliceSource::Kind::kFp8Weight && t.dtype != DType::kF8E4M3) {
    const EngineParam& sp = l.plan.table.params()[s.scale_param];
    const View sv = ViewOf(sp.shape);
    float* scale = reinterpret_cast<float*>(base + sp.offset) + (s.expert * sv.r + s.scale_dst_row0) * sv.c +
                   s.scale_dst_col0;
    return QuantizeFp8Block(t.dtype, src, s.rows, s.cols, src_cols, quant_.block_n, quant_.block_k, dst, v.c, scale,
                            sv.c, quant_.ue8m0 ? Fp8ScaleFormat::kUe8m0 : Fp8ScaleFormat::kFloat32);
  }
  return CopyRect(t.dtype, src, src_cols, p.dtype, dst, v.c, s.rows, s.cols);
}

absl::Status ReplicaImpl::Claim(absl::Span<const HfTensor> tensors) { return ClaimImpl(tensors, false); }

absl::Status ReplicaImpl::ClaimPlaced(absl::Span<const HfTensor> tensors) {
  for (const HfTensor& t : tensors) {
    if (!index_.contains(t.name)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' cannot be placed: no layout stores it"));
    }
    WSYNC_RETURN_IF_ERROR(PlaceRects(t.name, t.dtype).status());
  }
  return ClaimImpl(tensors, true);
}

absl::Status ReplicaImpl::ClaimImpl(absl::Span<const HfTensor> tensors, bool placed) {
  // Checked once outside the lock (the shape and dtype checks cost), then again under it for what concurrent
  // claims change (seen_): one short critical section per bucket, no data touched.
  for (const HfTensor& t : tensors) WSYNC_RETURN_IF_ERROR(Check(t, placed).status());
  std::lock_guard<std::mutex> l(claim_mu_);
  std::vector<int> marked;
  for (const HfTensor& t : tensors) {
    absl::StatusOr<int> idx = Check(t, placed);
    if (!idx.ok()) {
      for (int m : marked) seen_[m].store(kNotSeen, std::memory_order_release);
      return idx.status();
    }
    if (*idx < 0) continue;
    seen_[*idx].store(t.dtype == DType::kF8E4M3 ? kSeenFp8 : kSeenConverted, std::memory_order_release);
    marked.push_back(*idx);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ReadyParam>> ReplicaImpl::Load(const HfTensor& t) { return LoadImpl(t, true); }

absl::StatusOr<std::vector<ReadyParam>> ReplicaImpl::MarkPlaced(const HfTensor& t) { return LoadImpl(t, false); }

absl::StatusOr<std::vector<ReadyParam>> ReplicaImpl::LoadImpl(const HfTensor& t, bool copy) {
  std::vector<ReadyParam> ready;
  auto it = index_.find(t.name);
  if (it == index_.end()) return ready;  // skipped by rule (Claim accepted it)
  const int idx = it->second;
  if (seen_[idx].load(std::memory_order_acquire) == kNotSeen)
    return absl::InternalError(absl::StrCat("tensor '", t.name, "' loaded without being claimed"));
  for (const Placement& pl : entries_[idx].placements) {
    Layout& l = layouts_[pl.layout];
    const SliceSource& s = l.plan.sources[pl.source];
    if (copy || s.kind == SliceSource::Kind::kConstant) {
      WSYNC_RETURN_IF_ERROR_CTX(Place(t, l, s), "loading '", t.name, "' into '", l.plan.table.params()[s.param].name,
                                "'");
    }
    // acq_rel: the Load completing a param sees every other Load's bytes of it before reporting it ready.
    auto bump = [&](int param) {
      if (l.arrived[param].fetch_add(1, std::memory_order_acq_rel) + 1 == l.plan.expected[param])
        ready.push_back({pl.layout, param});
    };
    bump(s.param);
    if (s.kind == SliceSource::Kind::kFp8Weight && t.dtype != DType::kF8E4M3) bump(s.scale_param);
  }
  return ready;
}

absl::Status ReplicaImpl::FinishUpdate() const {
  std::vector<std::string> missing;
  size_t count = 0;
  for (size_t li = 0; li < layouts_.size(); ++li) {
    const Layout& l = layouts_[li];
    for (size_t p = 0; p < l.arrived.size(); ++p) {
      const int arrived = l.arrived[p].load(std::memory_order_acquire);
      if (arrived >= l.plan.expected[p]) continue;
      if (++count <= 5) {
        missing.push_back(absl::StrCat(l.plan.table.params()[p].name, " (layout ", li, ", ", arrived, "/",
                                       l.plan.expected[p], " slices)"));
      }
    }
  }
  if (count == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(count, " parameter(s) incomplete: ", absl::StrJoin(missing, ", "),
                                                    count > missing.size() ? ", ..." : ""));
}

std::vector<TensorRead> ReplicaImpl::Reads(absl::string_view hf_name) const {
  std::vector<TensorRead> out;
  auto it = index_.find(hf_name);
  if (it == index_.end()) return out;
  for (const Placement& p : entries_[it->second].placements) {
    const SliceSource& s = layouts_[p.layout].plan.sources[p.source];
    TensorRead r;
    r.layout = p.layout;
    r.param = s.param;
    r.scale_param = s.scale_param;
    r.constant = s.kind == SliceSource::Kind::kConstant;
    r.row0 = s.src_row0, r.rows = s.rows, r.col0 = s.src_col0, r.cols = s.cols;
    out.push_back(r);
  }
  return out;
}

DType ReplicaImpl::PlaceableDType(absl::string_view hf_name) const {
  auto it = index_.find(hf_name);
  if (it == index_.end()) return DType::kInvalid;
  for (const Placement& p : entries_[it->second].placements) {
    const Layout& l = layouts_[p.layout];
    const SliceSource& s = l.plan.sources[p.source];
    if (s.kind != SliceSource::Kind::kConstant) return StoredDType(l, s);
  }
  return DType::kInvalid;
}

absl::StatusOr<std::vector<PlacedRect>> ReplicaImpl::PlaceRects(absl::string_view hf_name, DType dtype) const {
  std::vector<PlacedRect> out;
  auto it = index_.find(hf_name);
  if (it == index_.end()) return out;
  const HfEntry& e = entries_[it->second];
  const int64_t src_cols = e.shape.size() > 1 ? e.shape[1] : 1;
  const uint64_t es = DTypeSize(dtype);
  for (const Placement& pl : e.placements) {
    const Layout& l = layouts_[pl.layout];
    const SliceSource& s = l.plan.sources[pl.source];
    if (s.kind == SliceSource::Kind::kConstant) continue;
    const EngineParam& p = l.plan.table.params()[s.param];
    // What Place would do as a plain byte copy: same dtype (FP8 codes into an FP8 weight, a published scale into its
    // scale parameter, or a parameter of the tensor's dtype).
    if (StoredDType(l, s) != dtype || es == 0) {
      return absl::FailedPreconditionError(absl::StrCat("tensor '", hf_name, "' as ", DTypeName(dtype),
                                                        " cannot be placed: '", p.name, "' stores ", DTypeName(p.dtype),
                                                        " (converted on load)"));
    }
    const View v = ViewOf(p.shape);
    PlacedRect r;
    r.layout = pl.layout;
    r.offset = p.offset + static_cast<uint64_t>((s.expert * v.r + s.dst_row0) * v.c + s.dst_col0) * es;
    r.pitch = static_cast<uint64_t>(v.c) * es;
    r.src_offset = static_cast<uint64_t>(s.src_row0 * src_cols + s.src_col0) * es;
    r.src_pitch = static_cast<uint64_t>(src_cols) * es;
    r.rows = s.rows;
    r.row_bytes = static_cast<uint64_t>(s.cols) * es;
    out.push_back(r);
  }
  return out;
}

bool ReplicaImpl::Needs(absl::string_view hf_name) const {
  auto it = index_.find(hf_name);
  if (it != index_.end()) return !entries_[it->second].placements.empty();
  auto m = mapper_.Map(hf_name);
  // Another model's tensor (a draft-only replica and the target's tensors) is not needed here.
  return m.ok() && m->skip != SkipRule::kNone && m->skip != SkipRule::kTargetOnly &&
         m->skip != SkipRule::kSharedWithTarget;
}

}  // namespace

absl::StatusOr<std::vector<ReadyParam>> Replica::Ingest(const HfTensor& t) {
  WSYNC_RETURN_IF_ERROR(Claim(absl::MakeConstSpan(&t, 1)));
  return Load(t);
}

absl::StatusOr<std::unique_ptr<Replica>> Replica::Create(const ModelConfig& config,
                                                         std::vector<RankParallelism> layouts,
                                                         const QuantSpec& quant) {
  return ReplicaImpl::Make(config, std::move(layouts), quant);
}

}  // namespace wsync::replica
