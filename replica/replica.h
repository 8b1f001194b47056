#pragma once
// The source-side CPU engine replica: HF-named tensors in, engine-layout parameters (SGLang's layout, bit-exact) out.
//
// Contract used by the daemon (the pieces behind it live in model_config.h, mapper.h, param_table.h, ...):
//   * A Replica holds one buffer per distinct target layout (RankParallelism). Identical target ranks of different
//     engine instances share one layout, so one load serves them all.
//   * Arriving HF tensors are sliced / fused / quantized straight into every layout buffer that needs them: the
//     layout buffer is the staging area, so no extra copy. A parameter is *ready* only when every shard (and every
//     local expert) of it has arrived for this update; only ready parameters may be sent. A parameter no checkpoint
//     tensor fills (SliceSource::Kind::kConstant, the FP8 MLA KV-cache scales) is written with the engine's value and
//     reported ready when its designated tensor of the same layer arrives.
//   * Validate() checks a tensor (known name, shape and dtype agreeing with the config, not a duplicate in this update)
//     without writing anything; Claim() checks a whole bucket and marks its tensors arrived, all or none, so the
//     daemon knows before it loads anything that no other bucket (of any rank) will load the same tensor.
//   * Layout buffers are memfd-backed shared memory (fd()), so trainer processes may map them and place tensors that
//     need no conversion themselves (PlaceRects, ClaimPlaced, MarkPlaced): the replica then only counts arrivals.
// Threading: BeginUpdate runs alone. Validate, Claim, ClaimPlaced, Load, MarkPlaced and Ingest may be called from
// several threads at once: different tensors fill disjoint bytes, each parameter's arrivals are counted atomically
// and exactly one Load or MarkPlaced (the one that completes it) reports it ready, after every byte of it was written
// (acquire/release on the count), so the caller may send it at once. Buffers may be read (sent) concurrently for
// parameters already reported ready.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "replica/model_config.h"
#include "replica/param_table.h"

namespace wsync::replica {

// One HF tensor as the trainer hands it over. `data` is borrowed for the duration of the call.
struct HfTensor {
  absl::string_view name;
  DType dtype = DType::kInvalid;
  absl::Span<const int64_t> shape;
  const uint8_t* data = nullptr;
  uint64_t bytes = 0;
};

// One rectangle of an HF tensor that a layout reads into a parameter: the tensor's 2-D row-major view (1-D as
// [n, 1]; an FP8 `weight_scale_inv` in its own elements, i.e. blocks). `constant`: the parameter is filled with a
// fixed value when the tensor arrives and reads none of its bytes (SliceSource::Kind::kConstant).
struct TensorRead {
  int layout = 0;
  int param = 0;
  int scale_param = -1;  // also filled by this read (weights quantized here)
  bool constant = false;
  int64_t row0 = 0, rows = 0, col0 = 0, cols = 0;
};

// Where one read of a tensor lands when its bytes need no conversion (placement: the trainer copies them straight
// into the layout buffer): `rows` rows of `row_bytes` bytes, the i-th from tensor byte `src_offset + i * src_pitch`
// to layout-buffer byte `offset + i * pitch`. A 2-D strided copy (cudaMemcpy2D's shape); contiguous when both
// pitches equal row_bytes.
struct PlacedRect {
  int layout = 0;
  uint64_t offset = 0, pitch = 0;
  uint64_t src_offset = 0, src_pitch = 0;
  int64_t rows = 0;
  uint64_t row_bytes = 0;
};

// A parameter that became complete in one layout's buffer: send table(layout).params()[param] bytes.
struct ReadyParam {
  int layout = 0;
  int param = 0;
};

class Replica {
 public:
  // Builds every layout's parameter table and allocates its buffer (page-aligned, zeroed).
  static absl::StatusOr<std::unique_ptr<Replica>> Create(const ModelConfig& config,
                                                         std::vector<RankParallelism> layouts,
                                                         const QuantSpec& quant);
  virtual ~Replica() = default;

  virtual int num_layouts() const = 0;
  virtual const RankParallelism& layout(int l) const = 0;
  virtual const ParamTable& table(int l) const = 0;
  virtual uint8_t* data(int l) = 0;  // table(l).total_bytes() bytes
  // The memfd behind data(l) (owned by the replica, valid for its life) and its size (a whole number of pages): what
  // a trainer process maps read-write (MAP_SHARED) to place tensors straight into the layout (PlaceRects). The
  // mapping aliases data(l), so bytes copied there are what Load would have written.
  virtual int fd(int l) const = 0;
  virtual uint64_t mapped_bytes(int l) const = 0;

  // Starts a new update: forgets which parameters arrived.
  virtual void BeginUpdate() = 0;
  // Checks one tensor without writing anything.
  virtual absl::Status Validate(const HfTensor& t) const = 0;
  // Checks every tensor as Validate does, against each other as well (a duplicate, a weight quantized here and its
  // published scale), and marks them arrived in this update: all of them, or none when one is refused (the error
  // names it). Atomic against concurrent Claims: of two claiming the same tensor, one is refused.
  virtual absl::Status Claim(absl::Span<const HfTensor> tensors) = 0;
  // Loads a tensor Claim accepted into every layout that needs it (tensors no layout needs are ignored) and returns
  // the parameters it completed. Data is read from `t`; nothing is checked again (Claim did).
  virtual absl::StatusOr<std::vector<ReadyParam>> Load(const HfTensor& t) = 0;
  // Claim({t}) then Load(t): on a refusal nothing was written.
  absl::StatusOr<std::vector<ReadyParam>> Ingest(const HfTensor& t);
  // Placement (the trainer copies a tensor's bytes into the layout buffers itself, docs/operations.md "Zero-copy
  // placement"). PlaceRects: where `hf_name` lands in every layout when it arrives as `dtype`, FailedPrecondition
  // when some read of it converts (another dtype, FP8 quantization) and so must go through Load; constant reads need
  // no bytes and give no rectangle. The dtype every non-constant read stores (the only one PlaceRects may accept) is
  // PlaceableDType's, kInvalid for a tensor nothing reads. Pure: callable at configuration time.
  virtual absl::StatusOr<std::vector<PlacedRect>> PlaceRects(absl::string_view hf_name, DType dtype) const = 0;
  virtual DType PlaceableDType(absl::string_view hf_name) const = 0;
  // Claim for tensors whose bytes the caller placed (t.data is ignored, t.bytes must match the shape): the same
  // checks against each other and every earlier claim (ring or placed) of this update, and each must be placeable
  // as its dtype; all or none.
  virtual absl::Status ClaimPlaced(absl::Span<const HfTensor> tensors) = 0;
  // Load's bookkeeping for a tensor ClaimPlaced accepted, copying nothing (constant reads are written): returns the
  // parameters it completed. The caller must know the placed bytes landed (the trainer's commit says so).
  virtual absl::StatusOr<std::vector<ReadyParam>> MarkPlaced(const HfTensor& t) = 0;
  // FailedPrecondition naming the parameters that are still incomplete (first few) if any layout is incomplete.
  virtual absl::Status FinishUpdate() const = 0;
  // The checkpoint shape of a tensor this replica knows (empty for any other name).
  virtual std::vector<int64_t> Shape(absl::string_view hf_name) const = 0;
  // Whether any layout of this replica needs the tensor (the push filter; also true for skipped-by-rule names, except
  // another model's: the target's tensors for a draft-only replica, mapper.h kTargetOnly / kSharedWithTarget).
  virtual bool Needs(absl::string_view hf_name) const = 0;
  // Every rectangle of `hf_name` the layouts read (empty for a tensor no layout needs): what a source assembling the
  // tensor from slices must have before it may Ingest it.
  virtual std::vector<TensorRead> Reads(absl::string_view hf_name) const = 0;
  // The shape and dtype the model's checkpoint holds for `hf_name` (what a trainer is told to push: float32 and
  // float16 are accepted for a bfloat16 tensor and converted, docs/operations.md), or nullopt for a name this replica
  // does not accept.
  virtual std::optional<TensorSpec> Expected(absl::string_view hf_name) const { return std::nullopt; }
};

}  // namespace wsync::replica
