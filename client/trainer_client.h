#pragma once
// C++ client library for trainer ranks: one session with the local wsyncd, tensors written straight into the
// session's shared-memory ring, buckets committed as they fill.
//
// The session starts on the source daemon's local Unix socket (wsyncd --trainer-socket): the daemon checks this
// process's uid/gid (SO_PEERCRED), hands over the ring's memfd (SCM_RIGHTS) and a session id, and serves this rank's
// RPCs on a second local socket; nothing of it goes over TCP (docs/security.md).
//
//   auto c = TrainerClient::Connect({.daemon = "/run/wsync/wsyncd.sock", .local_rank = 0});
//   auto names = (*c)->BeginPush(version);          // the push filter: what this rank must hand over
//   for (name : names) (*c)->Push(name, dtype, shape, ptr, bytes);
//   (*c)->EndPush(version);
//
// Pipelining: committing a bucket publishes it in the ring and hands the daemon a doorbell on a background
// thread; the next bucket is written while the daemon loads the previous one (at most one bucket in flight, so a
// bucket is at most half the ring). An error the daemon reports for a bucket is returned by the next call.
// Threading: one thread uses a TrainerClient at a time.

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "base/fd_passing.h"
#include "base/host_copy.h"
#include "base/tensor_slice.h"
#include "client/device_copy.h"
#include "client/ring/ring.h"
#include "wsync/v1/trainer.grpc.pb.h"

namespace wsync::client {

struct TrainerOptions {
  // The local source wsyncd's trainer socket (its --trainer-socket). A host:port is refused: trainer ranks do not
  // use TCP.
  std::string daemon = "/run/wsync/wsyncd.sock";
  int local_rank = 0;                     // index of this rank on its node
  int global_rank = 0;
  uint64_t bucket_bytes = 0;              // 0: half the ring
  absl::Duration timeout = absl::Seconds(120);          // per bucket / per begin-push wait
  // Opening the session, all of it (waiting for the socket to appear, the hand-over, the RPC channel): a daemon not up
  // by then fails Connect with DeadlineExceeded naming the path.
  absl::Duration connect_timeout = absl::Seconds(30);
  // Quantize on the GPU: when the node's replica stores FP8 block-quantized weights, BeginPush says which tensors
  // may come pre-quantized (and the block and scale format); PushDevice of such a tensor (2-D, bf16/f16/f32) then
  // quantizes it on its GPU and copies the float8_e4m3fn codes and float32 `<name>_scale_inv` into the ring instead
  // of the tensor: about half the PCIe bytes of bf16. Byte-identical to the daemon's own CPU quantization.
  bool gpu_fp8 = false;
  // Zero-copy placement (docs/operations.md): a tensor BeginPush offers for placement (its engine layouts read it
  // unconverted) and that is pushed whole with exactly the offered dtype and shape is copied by Push / PushDevice
  // straight into the node's replica (the layout buffers mapped from the daemon's memfds once per replica; host: a
  // memcpy per region row, CUDA: cudaMemcpy2DAsync into the page-locked mapping) instead of into the ring, and
  // committed with CommitPlaced once its copies completed (at least every bucket_bytes, and at Flush/EndPush).
  // Off: every tensor goes through the ring.
  bool placement = true;
  // Threads a host tensor's copy (into the ring, or placed into the replica) is spread over when it is at least
  // 16 MiB (base/host_copy.h): 0 = the host's hardware threads divided among the node's trainer ranks (at least 1,
  // at most 8), 1 = the calling thread alone. Started once per session (a CopyPool), not per copy. CUDA tensors are
  // copied by the GPU's engines and do not use them.
  int host_copy_threads = 0;
};

struct PushStats {
  uint64_t tensors = 0;
  uint64_t bytes = 0;
  uint64_t buckets = 0;
  uint64_t fp8_quantized = 0;  // tensors quantized on the GPU before the copy (TrainerOptions::gpu_fp8)
  uint64_t placed = 0;         // tensors (and fp8 scales) copied straight into the replica (TrainerOptions::placement)
  uint64_t placed_bytes = 0;   // their bytes (each counted once, however many layouts it lands in)
};

class TrainerClient {
 public:
  static absl::StatusOr<std::unique_ptr<TrainerClient>> Connect(const TrainerOptions& opts);
  ~TrainerClient();  // closes the session

  // Opens this rank's part of update `version` (waits until the coordinator started it) and returns the names of
  // the HF tensors this rank must push.
  absl::StatusOr<std::vector<std::string>> BeginPush(int64_t version);
  // Copies one tensor into the ring (the only copy on this side), or, when offered, straight into the replica.
  absl::Status Push(absl::string_view name, DType dtype, absl::Span<const int64_t> shape, const void* data,
                    uint64_t bytes);
  // Like Push, but `fill` writes the `bytes` bytes in place (e.g. a device-to-host copy straight into the ring).
  absl::Status PushWith(absl::string_view name, DType dtype, absl::Span<const int64_t> shape, uint64_t bytes,
                        const std::function<void(uint8_t*)>& fill);
  // Pushes a tensor that lives in CUDA memory (`data` is a device pointer of CUDA device `device` in this process;
  // `stream` the cudaStream_t, as an integer, whose queued work produces it; 0 = the legacy default stream). The
  // first such push page-locks the ring (once per session); each push queues one asynchronous device-to-host copy
  // into the tensor's ring slot and returns, so the next push (and the daemon's work on earlier buckets) overlaps
  // it. The copies are waited for before their bucket is published. The tensor must stay unchanged until the next
  // Flush/EndPush returned. With TrainerOptions::gpu_fp8, a tensor the last BeginPush listed for FP8 is quantized
  // on the GPU first and pushed as codes + scales (two frames). Unimplemented in a build without CUDA.
  absl::Status PushDevice(absl::string_view name, DType dtype, absl::Span<const int64_t> shape, const void* data,
                          uint64_t bytes, int device, uint64_t stream);
  // Pushes a slice of HF tensor `name` whose whole shape is `full_shape`: the data (`bytes` bytes, row-major) has
  // shape `extents` and starts at `offsets` (a range along dim 0 — row ranges, whole experts — or any rectangle of
  // a 2-D tensor; base/tensor_slice.h). The node's daemon assembles a tensor from the slices its ranks push and
  // loads only completely covered parameters. InvalidArgument (naming tensor and ranges) for a malformed slice.
  absl::Status PushSlice(absl::string_view name, DType dtype, absl::Span<const int64_t> full_shape,
                         absl::Span<const int64_t> offsets, absl::Span<const int64_t> extents, const void* data,
                         uint64_t bytes);
  // PushSlice for data in CUDA memory (see PushDevice).
  absl::Status PushSliceDevice(absl::string_view name, DType dtype, absl::Span<const int64_t> full_shape,
                               absl::Span<const int64_t> offsets, absl::Span<const int64_t> extents,
                               const void* data, uint64_t bytes, int device, uint64_t stream);
  // The slices the last BeginPush asked this rank to push (shard-aware plans; empty otherwise), in push order.
  const std::vector<TensorSlice>& push_slices() const { return push_slices_; }
  // The tensors the last BeginPush offered for pre-quantization (empty unless the node's replica is FP8).
  const v1::Fp8PushHint& fp8_hint() const { return fp8_hint_; }
  // Per name the last BeginPush returned, same order: the shape and dtype the model holds (float32/float16 pushed for
  // a bfloat16 tensor are converted by the daemon), to check tensors before pushing them.
  const google::protobuf::RepeatedPtrField<v1::PushSpec>& expected() const { return expected_; }
  // Commits the current bucket and waits until the daemon has taken every committed bucket.
  absl::Status Flush();
  // Flush, then tells the daemon this rank is done with `version`.
  absl::Status EndPush(int64_t version);

  const PushStats& stats() const { return stats_; }
  void set_gpu_fp8(bool on) { opts_.gpu_fp8 = on; }
  void set_placement(bool on) { opts_.placement = on; }
  // The placements the last BeginPush offered (empty when placement is off on either side).
  size_t placements_offered() const { return placements_.size(); }
  // The session's secret id (authorizes this rank's calls; do not log it) and its name in the daemon's logs.
  const std::string& session_id() const { return session_id_; }
  const std::string& session_label() const { return session_label_; }

 private:
  TrainerClient() = default;
  absl::Status CommitAsync();
  absl::Status WaitInFlight();
  absl::Status PushDeviceFp8(absl::string_view name, DType dtype, absl::Span<const int64_t> shape, const void* data,
                             uint64_t bytes, int device, uint64_t stream);
  absl::Status PushImpl(absl::string_view name, DType dtype, absl::Span<const int64_t> shape, uint64_t bytes,
                        const std::function<absl::Status(uint8_t*)>& fill);
  // Placement: the offer for a whole tensor of exactly this dtype, shape and size (null: it goes through the ring).
  const v1::TensorPlacement* PlacementFor(absl::string_view name, DType dtype, absl::Span<const int64_t> shape,
                                          uint64_t bytes) const;
  // Maps the replica's layout buffers of the offered generation (the hand-over socket sends their memfds).
  absl::Status MapReplica();
  // Copies `p`'s regions from `data` (host memory; or device memory of `device`, or this copier's fp8 scratch with
  // `staged`) into the mapped replica.
  absl::Status PlaceHost(const v1::TensorPlacement& p, const void* data, uint64_t bytes);
  absl::Status PlaceDevice(const v1::TensorPlacement& p, const void* data, uint64_t bytes, int device, uint64_t stream,
                           bool staged);
  absl::Status NotePlaced(absl::string_view name, uint64_t bytes);
  // Waits for the device copies, then tells the daemon which tensors landed (CommitPlaced).
  absl::Status CommitPlacedNow();
  void UnmapReplica();

  TrainerOptions opts_;
  ScopedFd handover_;  // held open for the session's life: its end tells the daemon this rank is gone
  std::unique_ptr<v1::TrainerIngest::Stub> stub_;
  std::string session_id_, session_label_;
  std::unique_ptr<RingProducer> ring_;
  std::unique_ptr<DeviceCopier> device_;  // created by the first PushDevice; goes before ring_
  uint64_t bucket_limit_ = 0;
  // TrainerOptions::host_copy_threads, resolved against the node's rank count, started once for the session.
  std::unique_ptr<CopyPool> copy_pool_;
  std::future<absl::Status> in_flight_;
  PushStats stats_;
  std::vector<TensorSlice> push_slices_;
  v1::Fp8PushHint fp8_hint_;
  google::protobuf::RepeatedPtrField<v1::PushSpec> expected_;
  absl::flat_hash_set<std::string> fp8_names_;
  // Placement: the last BeginPush's offers and replica generation, the mapping (if any), what was placed but not
  // committed yet.
  struct MappedLayout {
    uint8_t* addr = nullptr;
    uint64_t bytes = 0;
  };
  int64_t version_ = -1;
  absl::flat_hash_map<std::string, v1::TensorPlacement> placements_;
  uint64_t placement_generation_ = 0, mapped_generation_ = 0;
  std::vector<MappedLayout> replica_;
  bool replica_registered_ = false;  // page-locked in device_
  std::vector<std::string> placed_pending_;
  uint64_t placed_pending_bytes_ = 0;
};

// Checks a slice push (shape, ranges, byte count) and returns its frame name (EncodeSliceName).
absl::StatusOr<std::string> SliceFrameName(absl::string_view name, DType dtype, absl::Span<const int64_t> full_shape,
                                           absl::Span<const int64_t> offsets, absl::Span<const int64_t> extents,
                                           uint64_t bytes);

}  // namespace wsync::client
