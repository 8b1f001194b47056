#pragma once
// The source role of wsyncd: trainer sessions (one shared-memory ring each), the CPU engine replica, and the
// writes from the replica into the targets' registered weight memory.
//
// Lifecycle (driven by the coordinator): Configure (once per plan: build replica, check every target's layout
// against it, register replica memory, connect to targets) → per update v: StartUpdate(v) → trainer ranks
// BeginPush/CommitBucket*/EndPush → FinishUpdate(v) (waits for every local rank and every write).
// Exactly once per version: StartUpdate and FinishUpdate carry the plan epoch and refuse another plan's; versions
// only increase (a StartUpdate newer than a still-open update abandons it: the coordinator gave up on it); a repeated
// StartUpdate(v) of the open v succeeds without restarting it; FinishUpdate(v) claims v under the lock that checked it,
// so a concurrent or repeated FinishUpdate(v) runs nothing again and returns the first call's result; FinishUpdate
// for an older version is refused.
// Plain C++ (no gRPC types beyond the generated messages) so it can be tested without a server.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/fd_passing.h"
#include "base/tensor_slice.h"
#include "client/ring/ring.h"
#include "daemon/common/metrics.h"
#include "daemon/node/hash_pool.h"
#include "daemon/node/source_plan.h"
#include "daemon/node/source_writer.h"
#include "daemon/node/relay_notice.h"
#include "replica/replica.h"
#include "transport/transport.h"
#include "wsync/v1/daemon.grpc.pb.h"
#include "wsync/v1/trainer.pb.h"

namespace wsync::daemon {

// One bucket's way through the source, for SourceOptions::bucket_observer (bench_node's per-rank timeline).
struct BucketTiming {
  int local_rank = 0;
  uint64_t seq = 0;
  uint64_t bytes = 0;  // payload of the bucket
  absl::Time got;      // the ring had it (the rank's CommitBucket found it)
  absl::Time begin;    // the node's locks were taken: work on it began
  absl::Time loaded;   // validated, claimed and loaded into the replica
  absl::Time posted;   // the writes of the parameters it completed were handed to the targets' writers
};

struct SourceOptions {
  std::string node_id;
  int trainer_ranks = 1;  // sessions expected per update
  uint64_t ring_bytes = 256ull << 20;
  absl::Duration push_timeout = absl::Seconds(120);
  // A trainer rank whose process exited (or that closed its session) during an open update, without having ended
  // its push, fails the update once it has not come back (a new session for the same local rank) within this time.
  absl::Duration rank_grace = absl::Seconds(5);
  absl::Duration liveness_poll = absl::Milliseconds(200);  // how often trainer processes are checked
  // Record the XXH3-128 of every byte range written (WriteChecksums, wsyncctl verify): one hash pass over each
  // update's bytes per replica layout, on a pool of write_checksum_threads threads (0: HashPool::DefaultThreads())
  // off the ingest thread, overlapping the writes in flight and the next buckets' ingest.
  bool write_checksums = true;
  int write_checksum_threads = 0;
  // Tests only: called on the hashing thread just before each range is hashed.
  std::function<void()> checksum_hook;
  // Benchmarks and tests: called on a bucket's thread once its writes are posted (BucketTiming); null: not called.
  std::function<void(const BucketTiming&)> bucket_observer;
  // Delta updates (docs/delta.md): keep the delta base, a copy of every range this source last wrote (one more
  // replica's worth of memory, refreshed by one copy per update), so that updates send engine ranks holding that
  // version only what changed. false: every update is dense.
  bool delta_base = true;
  // Zero-copy placement (docs/operations.md): offer ranks the replica regions of tensors that need no conversion,
  // so they copy them there themselves instead of into the ring. StartUpdateRequest.no_placement turns it off for
  // one update.
  bool placement = true;
  // Called (under the source's lock: it must only hand the report on, never block) when this source fails the open
  // update on its own (FailUpdate), with the version and the error; wsyncd reports it to the coordinator at once
  // (FailureReporter) so the update ends then, not when the trainer commits. Null: not called.
  std::function<void(int64_t version, const absl::Status& err)> on_update_failed;
};

// Dials a peer daemon's ConnectTarget (injected so tests can run without gRPC).
using ConnectTargetFn =
    std::function<absl::StatusOr<std::string>(const std::string& target_daemon, const v1::ConnectTargetRequest& req)>;
// The same, answering the whole reply (the delta staging region with the connection's endpoint info).
using ConnectTargetReplyFn = std::function<absl::StatusOr<v1::ConnectTargetReply>(const std::string& target_daemon,
                                                                                  const v1::ConnectTargetRequest& req)>;
// The same, ended by `deadline`: the source's caller's (Configure's, StartUpdate's), so a dial never outlives the
// call it serves (DialConnectTargetBy).
using ConnectTargetByFn = std::function<absl::StatusOr<v1::ConnectTargetReply>(
    const std::string& target_daemon, const v1::ConnectTargetRequest& req, absl::Time deadline)>;

// A trainer rank asking for a session (from the hand-over socket: the pid and uid are the kernel's SO_PEERCRED, not
// the rank's word).
struct SessionRequest {
  int local_rank = 0;
  int global_rank = 0;
  int64_t pid = 0;  // 0: not visible in this pid namespace (liveness then comes from the hand-over connection alone)
  uint32_t uid = 0;
};

// What a rank gets back: the secret session id, and its own duplicate of the ring memfd to send it.
struct OpenedSession {
  std::string id;     // 128 random bits, hex: authorizes the rank's TrainerIngest calls
  std::string label;  // "<node>-s<n>": names the session in logs and the ring (never the id)
  ScopedFd ring_fd;
  uint64_t ring_bytes = 0;
  int num_local_ranks = 0;
};

// Polled by long waits in handlers: true once the caller is gone (gRPC cancellation or deadline).
using CancelFn = std::function<bool()>;

// Delta updates (source_delta.cc): what of a ConfigureSource the delta base depends on — everything but where the
// targets' memory is (region descriptors, target daemon addresses) and the plan epoch. Two requests of the same
// shape give every engine rank the same layout and the same ranges from this source, so a base holding version V is
// still the bytes each rank holding V holds (a rank that re-attached holds none and is written dense).
std::string DeltaBaseShape(const v1::ConfigureSourceRequest& req);
// Whether a re-configuration to a plan of shape `next` keeps the base of shape `current` holding `version`.
bool KeepsDeltaBase(const std::string& current, int64_t version, const std::string& next);

class SourceNode {
 public:
  // How long CommitBucket waits for a bucket the trainer says it committed, and how often a waiting handler checks
  // for its caller's cancellation.
  static constexpr absl::Duration kBucketWait = absl::Seconds(5);
  static constexpr absl::Duration kCancelPoll = absl::Milliseconds(100);

  SourceNode(SourceOptions opts, transport::Transport* transport, ConnectTargetFn connect);
  SourceNode(SourceOptions opts, transport::Transport* transport, ConnectTargetReplyFn connect);
  SourceNode(SourceOptions opts, transport::Transport* transport, ConnectTargetByFn connect);
  ~SourceNode();

  // Creates the rank's ring and session; a rank that reconnects replaces its previous session. Taking over a live
  // session of a rank that has not finished pushing the open update fails that update (docs/operations.md).
  absl::StatusOr<OpenedSession> OpenSession(const SessionRequest& req);
  absl::Status CloseSession(const std::string& session_id);
  // The rank's hand-over connection closed (its process exited, or it closed the client): the session is dead, as
  // when its process is seen gone. Unknown ids are ignored (replaced or closed sessions).
  void SessionDisconnected(const std::string& session_id, const std::string& why);
  // Waits for the update to open at most min(push_timeout, max_wait) (the caller's deadline, so the rank hears
  // "no update is open" rather than its own deadline passing).
  // `cancelled` (the caller's RPC was cancelled or its deadline passed) ends the wait early.
  absl::StatusOr<v1::BeginPushReply> BeginPush(const v1::BeginPushRequest& req,
                                               absl::Duration max_wait = absl::InfiniteDuration(),
                                               const CancelFn& cancelled = nullptr);
  // Waits for the rank's bucket in its ring (kBucketWait at most; `cancelled` ends it early) without holding any
  // node-wide lock, then validates it, loads it into the replica and hands the writes of the parameters it completed
  // to the targets' writers (source_writer.h: it waits on their credits, never on a Post).
  // Thread-safe and parallel: ranks' buckets share the ingest lock (only StartUpdate, FinishUpdate's and
  // AbortUpdate's drains and Configure exclude them), so each runs on its caller's thread beside the others; one
  // rank's buckets run one at a time (its ring is consumed in order).
  absl::StatusOr<v1::CommitBucketReply> CommitBucket(const v1::CommitBucketRequest& req,
                                                     const CancelFn& cancelled = nullptr);
  absl::Status EndPush(const v1::EndPushRequest& req);
  // Zero-copy placement. ReplicaFds: a duplicate of every layout buffer's memfd of the replica in use, for the
  // session `session_id` to map (the hand-over socket sends them), with the generation BeginPush names it by.
  // FailedPrecondition when no replica is configured.
  struct ReplicaHandles {
    uint64_t generation = 0;
    std::vector<ScopedFd> fds;
    std::vector<uint64_t> bytes;
  };
  absl::StatusOr<ReplicaHandles> ReplicaFds(const std::string& session_id);
  // The rank placed `req.names` (its copies completed): claimed exactly like a bucket's tensors (all or none; a
  // name not offered to this rank in this update, placed twice, also pushed through a ring, for another update or
  // another replica generation is refused, naming it, and fails the update), then the parameters they complete are
  // written. Thread-safe and parallel like CommitBucket.
  absl::StatusOr<v1::CommitPlacedReply> CommitPlaced(const v1::CommitPlacedRequest& req);

  // Validates the whole request first: a refused one (InvalidArgument / FailedPrecondition naming why: no targets
  // while the push filters name tensors, an unknown engine kind or quantization, a layout that does not match the
  // model, a write range outside its parameter, a bad region descriptor) leaves the configuration in use — plan
  // epoch, replica, connections — untouched. A failure after that (memory, connecting) leaves it unconfigured.
  // The targets are connected several at once; each connect ends by `deadline` (the caller's), a target not
  // connected by then fails the call (DeadlineExceeded naming it).
  absl::StatusOr<v1::ConfigureSourceReply> Configure(const v1::ConfigureSourceRequest& req,
                                                     absl::Time deadline = absl::InfiniteFuture());
  // The configuration held (heartbeats report it, daemon/coordinator/coordinator.h "Self-healing"): its plan epoch
  // (-1: none) and daemon/common/config_digest.h of the request applied ("": none).
  std::pair<int64_t, std::string> AppliedConfig() const;
  // Targets whose endpoint the last update broke are connected again first, each by `deadline` (the caller's).
  absl::Status StartUpdate(const v1::StartUpdateRequest& req, absl::Time deadline = absl::InfiniteFuture());
  // `cancelled` ends the wait for the trainer ranks early (the coordinator's call was cancelled).
  absl::StatusOr<v1::FinishUpdateReply> FinishUpdate(const v1::FinishUpdateRequest& req,
                                                     const CancelFn& cancelled = nullptr);
  // Ends the open update `req.version()` as aborted: pushes and buckets of it are refused from now on, a bucket
  // being written is let finish, outstanding writes are drained (bounded by `drain_timeout`), then the bytes it wrote
  // are reported. Idempotent: a repeat answers the first call's result. Refused while the update is finishing
  // (FinishUpdate owns it) or after it finished successfully.
  absl::StatusOr<v1::AbortSourceUpdateReply> AbortUpdate(const v1::AbortSourceUpdateRequest& req,
                                                         absl::Duration drain_timeout = absl::Seconds(30));

  // Waits until every batch handed to the writers so far in the open update is written or failed, at most
  // `timeout` (DeadlineExceeded), and answers the update's first write error. Benchmarks and tests: what a returned
  // CommitBucket posted has landed (the writers post asynchronously).
  absl::Status WaitWritten(absl::Duration timeout);

  v1::NodeStatus Status() const;
  // What this source wrote into engine memory in `version` (-1: the newest recorded): per (engine, rank, parameter
  // byte range) the XXH3-128 of the bytes posted, hashed from the replica by the hash pool after each bucket's writes
  // were posted. While the update is open (finished false) the list holds the buckets hashed so far; `finished` is
  // set only once every range of the update is hashed (FinishUpdate waits for the pool). The last
  // kChecksumVersionsKept versions are kept; NotFound names the ones kept for any other. With
  // SourceOptions::write_checksums off the lists are empty.
  absl::StatusOr<v1::WriteChecksumsReply> WriteChecksums(int64_t version) const;
  static constexpr size_t kChecksumVersionsKept = 4;
  // Sizes of what the node keeps from one update to the next (tests: bounded however many updates ran).
  struct Retained {
    size_t checksum_versions = 0, checksum_entries = 0;  // write checksum records (all versions kept)
    size_t sessions = 0, lost_ranks = 0, ended_ranks = 0;
    size_t staged_tensors = 0;
  };
  Retained RetainedSizes();
  // Bytes, params, tensors, buckets by result, updates by result, ingest/write times, sessions (docs/operations.md).
  Metrics& metrics() { return metrics_; }

 private:
  struct Session {
    std::string id;
    std::string label;
    int local_rank = 0;
    int64_t pid = 0;
    std::shared_ptr<RingConsumer> ring;  // shared with a CommitBucket using it (which may outlive the session)
    std::shared_ptr<std::mutex> commit_mu = std::make_shared<std::mutex>();  // one bucket at a time
    int64_t ended_version = -1;
    bool dead = false;  // its process is gone (seen by the liveness watcher)
  };
  // Why a local rank is missing from the open update, and since when.
  struct LostRank {
    absl::Time since;
    std::string what;  // "exited (pid 123, session s0)" | "closed its session s0"
    // The process, when its connection closed while it was still exiting (the kernel closes a killed process's
    // sockets before it is gone): looked at again when the grace ends, so the failure says it exited.
    int64_t pid = 0;
    std::string label;
  };
  // One (engine, rank) this source writes.
  struct Target {
    v1::TargetAssignment assignment;
    int layout = 0;
    std::vector<std::unique_ptr<transport::RemoteRegion>> regions;  // one per segment of its layout
    std::unique_ptr<transport::Endpoint> endpoint;
    // Per replica param of its layout: the segment's region and the offset inside it.
    std::vector<const transport::RemoteRegion*> dst_region;
    std::vector<uint64_t> dst_offset;
    // Staged updates: per replica param, the segment the configuration names; every segment's region by id; which
    // copy of the segments dst_region points at now (StartUpdateRequest.segment_sets, relative to the configured one).
    std::vector<int> dst_segment;
    std::map<int, const transport::RemoteRegion*> by_segment;
    int segment_set = 0;
    // Per replica param of its layout: the byte ranges (offset, length) this source writes (the plan's slices);
    // empty for a parameter another source writes.
    std::vector<std::vector<std::pair<uint64_t, uint64_t>>> ranges;
    // Its writer (source_writer.h): the thread that alone uses the connection's endpoint, fed by a bounded queue.
    // Replaced (a new connection) only under the exclusive ingest lock and mu_; buckets hand it batches under the
    // shared ingest lock; CancelWrites reaches it under mu_.
    std::unique_ptr<TargetWriter> writer;
    // "node N at D (engine E rank R, ...)": what a failed link to its node affects (NodeRanks over its plan's targets).
    std::string affected;
    // Which transport writes to it (the node's own, or the registered backend that owns its segments' kind:
    // daemon/node/source_plan.h), what that one declares, the replica's regions in it, and the peer it connects to
    // directly when it needs no target daemon (e.g. an engine rank's own Mooncake Transfer Engine).
    transport::Transport* transport = nullptr;
    transport::Capabilities caps;
    const std::vector<std::unique_ptr<transport::LocalRegion>>* src_regions = nullptr;
    std::string peer;
    // Not OK once its writer broke (a Post or Wait failed, or its writes were cancelled) or a drain gave up on it: the
    // transport contract says such an endpoint must be re-created, which the next StartUpdate does before accepting
    // pushes. Changed under the exclusive ingest lock.
    absl::Status broken;
    // Delta updates (source_delta.cc). Per replica param of its layout: its index in the rank's layout and whether
    // it lies in memory the target applies deltas into (source_plan.h).
    std::vector<uint32_t> layout_index;
    std::vector<char> host_param;
    uint64_t delta_write_bytes = 0;  // bytes of those parameters it takes from this source
    // The target's staging region for this connection (null: none; staging_refused says why when the target did),
    // and the registered host buffer records are assembled in before they are written there.
    std::unique_ptr<transport::RemoteRegion> staging;
    uint64_t staging_bytes = 0;
    std::string staging_refused;
    std::unique_ptr<uint8_t[]> mirror;
    std::unique_ptr<transport::LocalRegion> mirror_region;
    // The open update: deltas or why not (set by StartUpdate under the exclusive ingest lock), and what was sent:
    // counters buckets add to at once under the shared ingest lock (PlanWrites), read by FinishUpdate under the
    // exclusive one; `staged` is also the staging region's allocator (a record reserves its bytes by a
    // compare-exchange).
    bool delta = false;
    std::string fallback;
    std::atomic<uint64_t> staged{0}, dense_bytes{0}, sent_bytes{0};
    std::atomic<uint32_t> records{0}, dense_ranges{0};
  };

  // The liveness watcher: marks sessions whose process exited and fails the open update when a rank that has not
  // ended its push stays lost longer than opts_.rank_grace.
  void WatchRanks();
  void CheckRanks();  // requires mu_
  // Configure's second half: builds the replica, registers it, imports every target's regions and connects them
  // (in parallel), as `plan` says. Caller holds ingest_mu_ exclusively, not mu_; the previous plan is torn down.
  absl::Status ApplyPlan(const SourcePlan& plan, const v1::ConfigureSourceRequest& req, absl::Time deadline,
                         v1::ConfigureSourceReply* out);
  // Connects every target of `targets` (ConnectEndpoint), several at once, each by `deadline` at the latest; the
  // first error in their order, naming the target. Caller holds ingest_mu_ exclusively, not mu_.
  absl::Status ConnectTargets(const std::vector<Target*>& targets, absl::Time deadline = absl::InfiniteFuture());
  // Points every target's writes at the copy of its segments `req` names (segment_sets); decides for all first, so a
  // refusal (a copy a rank's layout lacks) changes nothing. Caller holds ingest_mu_ exclusively.
  absl::Status SelectSegmentSets(const v1::StartUpdateRequest& req);
  // The registered backend `name` (transport/registry.h), created at its first use and kept. Caller holds ingest_mu_
  // exclusively.
  absl::StatusOr<transport::Transport*> ExtraTransport(const std::string& name);
  // Posts the writes of the ready parameters of update `version` and queues the hashing of the ranges they read
  // (RecordChecksums). Caller holds ingest_mu_ shared; each target's `mu` is taken for its Post.
  absl::Status WriteReady(int64_t version, const std::vector<replica::ReadyParam>& ready);
  // Hands one batch of the update to `t`'s writer (TargetWriter::Submit: blocks on its credits, never on a Post).
  // Caller holds ingest_mu_ shared.
  absl::Status PostToTarget(int64_t version, Target* t, std::vector<transport::WriteRequest> writes,
                            TargetWriter::Done done = nullptr);
  // Whether one target's batch of a bucket was written: set by its writer when the batch leaves the pipeline. Kept
  // with the batch's checksums: a batch dropped or failed (an abort, the update failing) is not recorded as written.
  struct BatchOutcome {
    std::atomic<int> state{0};  // 0: queued or in flight, 1: written, 2: not written (dropped, failed, cancelled)
  };
  // Queues on hasher_ the XXH3-128 of every range posted for `ready`; the last job of the batch appends the batch to
  // checksums_[version] (if still kept). Replica ordering: those replica bytes stay unchanged until WaitForChecksums
  // returned: a parameter is loaded once per update, and the replica is next written only after StartUpdate (or
  // replaced by Configure), which both wait first. Caller holds ingest_mu_ (shared is enough).
  // `outcomes`: per target, its batch's outcome; an entry of a batch that turns out not written is left out of the
  // record when read (WriteChecksums).
  void RecordChecksums(int64_t version, const std::vector<replica::ReadyParam>& ready,
                       const std::map<Target*, std::shared_ptr<BatchOutcome>>& outcomes = {});
  // Blocks until every queued hash has been taken; returns the seconds waited. Caller holds ingest_mu_ exclusively
  // (so nothing queues more meanwhile), not mu_ (the jobs take it).
  double WaitForChecksums();
  // cv_.wait_for(wait, pred) that also polls `cancelled` every kCancelPoll (then *gone = true, returns false).
  template <typename Pred>
  bool WaitCancellable(std::unique_lock<std::mutex>& l, absl::Duration wait, const CancelFn& cancelled, bool* gone,
                       Pred pred);
  // A tensor a rank may place: exactly this dtype and shape, into these regions (BeginPushReply.placements).
  struct Offer {
    DType dtype = DType::kInvalid;
    std::vector<int64_t> shape;
    uint64_t bytes = 0;
    v1::TensorPlacement proto;
  };
  using RankOffers = std::map<int, std::map<std::string, Offer>>;
  // CommitPlaced's checks (requires mu_; the offers are fixed while the caller holds ingest_mu_): an error for a
  // call that cannot concern the open update (unknown session, no update open), else the update's version and, in
  // `tensors` (viewing `req` and the offers), what the rank may claim, or in `refusal` why the commit is refused
  // (another update, a replaced replica, placement off, the rank ended its push, a tensor not offered to it).
  absl::Status CheckPlaced(const v1::CommitPlacedRequest& req, int64_t* version,
                           std::vector<replica::HfTensor>* tensors, uint64_t* bytes, absl::Status* refusal);
  // Decides, per local rank, which of the tensors it pushes whole (`rank_push`) may be placed: those whose every
  // read in `replica` is a byte copy of the dtype they are stored as, plus `_scale_inv` of the ones `fp8` lists
  // (pushed by a rank that quantized them). Pure.
  static RankOffers PlanPlacements(const replica::Replica& replica,
                                   const std::map<int, std::vector<std::string>>& rank_push,
                                   const v1::Fp8PushHint& fp8);
  static absl::StatusOr<BucketView> WaitForBucket(RingConsumer& ring, absl::Duration timeout,
                                                  const CancelFn& cancelled);
  // A tensor pushed in slices (shard-aware plans). Where every read of it is a byte copy of the dtype it arrives as
  // (Replica::PlaceRects: no conversion), each slice lands straight in the replica's layout buffers, in the parts of
  // the engine-layout rectangles it covers (`direct`; the tensor is claimed in the replica with its first slice, so
  // no whole push of it can write there too). Otherwise (a dtype conversion, FP8 quantization here, whose blocks a
  // slice may split) it is assembled in `data` and ingested whole. Either way the replica reports its parameters
  // ready only once every rectangle this node's writes read has arrived (the slice completing it: MarkPlaced or
  // Ingest), so an incomplete tensor never reaches an engine. Only the rectangles received are meaningful;
  // parameters reading anything else are never written (they are not this node's to write). Slices of one tensor
  // from several ranks are copied in at once (disjoint rectangles); everything but the copied bytes is under
  // staged_mu_.
  struct Staged {
    DType dtype = DType::kInvalid;
    std::vector<int64_t> shape;
    bool needed = false;                     // some parameter this node writes reads it (else slices are dropped)
    bool direct = false;                     // slices land in the replica (`rects`), else in `data`
    std::vector<replica::PlacedRect> rects;  // direct: where the tensor's bytes go in the layout buffers
    std::vector<uint8_t> data;               // staged: the whole tensor; allocated at the first slice
    std::vector<TensorSlice> got;            // rectangles claimed in this update (disjoint)
    std::vector<TensorSlice> landed;         // those of them copied in
    int copying = 0;                         // claimed, not landed yet
    std::vector<replica::TensorRead> need;   // what this node's writes read of it
    bool constant = false;                   // a required parameter only needs the tensor to arrive
    bool done = false;                       // handed to the replica (by the slice that completed it)
  };
  // One tensor of a bucket: whole, or a slice of one.
  struct BucketTensor {
    std::string name;  // copied out of the ring (trainer-writable memory); t.name views it
    replica::HfTensor t;
    std::optional<TensorSlice> slice;
    Staged* staged = nullptr;  // a slice's tensor, set when claimed
  };
  // Checks every tensor of `bucket` (nothing is written) and claims them for this update, all or none: whole tensors
  // in the replica, slices in staged_. A refusal names the tensor.
  absl::Status ClaimBucket(const BucketView& bucket, std::vector<BucketTensor>* tensors);
  // Loads claimed tensors into the replica and appends the parameters they completed.
  absl::Status LoadBucket(const std::vector<BucketTensor>& tensors, std::vector<replica::ReadyParam>* ready);
  // Checks one slice against the model, the open update's earlier slices and `bucket` (the slices before it in the
  // same bucket). Caller holds staged_mu_.
  absl::Status CheckSlice(const TensorSlice& s, DType dtype, uint64_t bytes,
                          const std::vector<std::pair<TensorSlice, DType>>& bucket);
  // The entry for the first slice of `s.name` in this update: what this node needs of it and whether its slices can
  // land directly. Pure over the replica's tables and required_.
  Staged NewStaged(const TensorSlice& s, DType dtype) const;
  // Records a checked slice as claimed in staged_ (`fresh` holds the entries of tensors first seen in its bucket).
  // Caller holds staged_mu_.
  Staged* ReserveSlice(const TensorSlice& s, std::map<std::string, Staged>* fresh);
  // Copies a claimed slice in; the slice that completes the tensor ingests it and appends the ready parameters.
  absl::Status StageSlice(const TensorSlice& s, Staged* st, const uint8_t* data,
                          std::vector<replica::ReadyParam>* ready);
  // "engine E rank R at D": how every error about a target names it.
  static std::string Who(const Target& t);
  // Cancels every in-flight and later write of the open update (Endpoint::Cancel on every target): a write blocked on
  // a dead link returns at once, so the bucket and the drain waiting for it end now. The endpoints are re-created by
  // the next StartUpdate. Requires mu_ (endpoints are swapped under it).
  void CancelWrites(const absl::Status& why);
  // Fails the open update here at its first fault (a rejected bucket or placement, a load or a Post that failed, a
  // lost or taken-over rank): records `err` as its error unless it has one, cancels every write of it (CancelWrites)
  // and wakes FinishUpdate, which answers it at once. Buckets and placements committed after it are refused before
  // they load anything, and a bucket being written posts no further batch. Requires mu_.
  // `tell_coordinator`: false when the coordinator itself ended the update (AbortSourceUpdate).
  void FailUpdate(const absl::Status& err, bool tell_coordinator = true);
  // "node N at D (engine E rank R, ...)": `t`'s node and every engine rank this source writes on it (what a failed
  // link to that node affects). Requires mu_ or ingest_mu_ (targets_ is replaced under both).
  std::string NodeRanks(const Target& t) const;
  static std::string NodeRanksIn(const Target& t, const std::vector<std::unique_ptr<Target>>& all);
  // A writer's first failure in update `version` (UpdateWrites' callback, on the writer's thread): fails the update
  // if it is still the open one.
  void OnWriteFailure(int64_t version, const absl::Status& err);
  // Creates `t`'s endpoint and connects it through the target daemon (connect_). Caller holds ingest_mu_
  // exclusively, not mu_.
  absl::Status ConnectEndpoint(Target* t, absl::Time deadline = absl::InfiniteFuture());
  // Delta updates (source_delta.cc). Imports the staging region the target answered and registers the mirror.
  // Caller holds ingest_mu_ exclusively.
  absl::Status AttachStaging(Target* t, const v1::ConnectTargetReply& reply);
  // Decides per target whether the update takes deltas (pure over the targets, the request and the base version);
  // "always" refuses when one cannot. Caller holds ingest_mu_ exclusively.
  absl::Status DecideDeltas(const v1::StartUpdateRequest& req);
  // For one ready parameter: the writes to every target of its layout (dense ranges from the replica, delta records
  // through the target's staging), appended to `batches`; returns the bytes sent. Caller holds ingest_mu_ shared.
  uint64_t PlanWrites(int64_t version, const replica::ReadyParam& r,
                      std::map<Target*, std::vector<transport::WriteRequest>>* batches);
  // Copies the ready parameters into the delta base once their writes are planned.
  void RefreshBase(const std::vector<replica::ReadyParam>& ready);
  // What FinishUpdate answers about deltas; requires mu_ (ingest_mu_ exclusive is held too).
  void DeltaReply(int64_t version, v1::FinishUpdateReply* out);
  // Waits until every batch of the update is written or failed (UpdateWrites::WaitDrained) within `timeout`; a
  // writer still busy then is cancelled. Every target whose writer broke is marked broken. Returns the first error,
  // naming the target (a batch failed by this node's own cancel is the update's error, answered once by the caller).
  // Caller holds ingest_mu_ exclusively.
  absl::Status DrainOutstanding(absl::Duration timeout);
  Session* FindSession(const std::string& id);
  // PermissionDenied for an id that names no open session (never echoes the id).
  static absl::Status UnknownSession();
  // Marks `s` dead and, during an open update it has not ended, its rank lost. Requires mu_.
  void MarkDead(Session* s, const std::string& what);
  // A new session for `old`'s rank, opened by another process (`new_pid`) while `old`'s is live, during an open
  // update the rank has not ended its push in: a takeover, which fails the update at once (FailTakenOver) naming the
  // rank and both processes. Require mu_.
  bool TakeoverFailsUpdate(const Session& old, int64_t new_pid) const;
  void FailTakenOver(const Session& old, const SessionRequest& req);

  SourceOptions opts_;
  transport::Transport* transport_;
  ConnectTargetByFn connect_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::unique_ptr<Session>> sessions_;
  int next_session_ = 0;

  // Configured state (replaced by Configure).
  int64_t plan_epoch_ = -1;
  bool configured_ = false;    // a plan was applied (a node without work in it has no replica)
  std::string config_digest_;  // ConfigureSourceDigest of the request applied
  std::unique_ptr<replica::Replica> replica_;
  std::vector<std::unique_ptr<transport::LocalRegion>> replica_regions_;
  // Registered backends beyond the node's own that own some target's segments (created at the first plan that
  // needs them, by name), and the replica's regions in each.
  std::map<std::string, std::unique_ptr<transport::Transport>> extra_transports_;
  std::map<std::string, std::vector<std::unique_ptr<transport::LocalRegion>>> extra_regions_;
  // The update-lifecycle object every writer reports to (before targets_: their writers report into it).
  UpdateWrites updates_{[this](int64_t version, const absl::Status& err) { OnWriteFailure(version, err); }};
  std::vector<std::unique_ptr<Target>> targets_;
  std::vector<std::vector<Target*>> targets_by_layout_;
  std::vector<std::string> push_names_;                          // checkpoint tensors this node needs, in push order
  std::map<int, std::vector<std::string>> rank_push_;            // per local rank, when the plan partitions the push
  std::map<int, std::vector<v1::TensorSliceSpec>> rank_slices_;  // per local rank: slices (shard-aware plans)
  // What BeginPush offers for trainer-side FP8 quantization (trainer.proto Fp8PushHint): block, scale format and the
  // tensors every layout quantizes here; empty names when the replica is not FP8.
  v1::Fp8PushHint fp8_hint_;
  size_t push_slices_ = 0;
  // Zero-copy placement: what each local rank may place (replaced by Configure with the replica), the replica's
  // generation (new at every Configure that builds one), and whether the open update offers placements.
  RankOffers rank_offers_;
  uint64_t replica_generation_ = 0;
  bool placement_open_ = false;
  // Per layout and param: whether some target of this node takes bytes of it (what an update must complete), and
  // whether it completed in the open update (set by the one bucket whose load completed it, without a lock: one
  // writer per element per update; read by FinishUpdate under the exclusive ingest lock).
  std::vector<std::vector<char>> required_, completed_;
  // Delta updates: per layout the delta base (empty with SourceOptions::delta_base off), the version it holds in
  // full (-1: none: a fresh plan, or an update since that did not finish here), and the open update's mode and base.
  std::vector<std::unique_ptr<uint8_t[]>> delta_base_;
  int64_t delta_base_version_ = -1;
  // DeltaBaseShape of the plan the base belongs to; a re-configuration of the same shape keeps the base
  // (`kept_delta_base_`: handed from Configure to ApplyPlan; version -1: none kept).
  std::string delta_base_shape_;
  std::vector<std::unique_ptr<uint8_t[]>> kept_delta_base_;
  int64_t kept_delta_base_version_ = -1;
  // Whether the open update refreshes the base (some engine rank this source writes could take deltas from it; set
  // by DecideDeltas under the exclusive ingest lock, read by buckets under the shared one).
  bool refresh_base_ = false;
  int64_t delta_from_ = -1;
  uint64_t sent_bytes_ = 0;

  // Current update.
  int64_t version_ = -1;       // version being pushed; -1 when none is open
  int64_t last_version_ = -1;  // last version finished successfully
  bool finishing_ = false;     // a FinishUpdate(version_) is running; others for it wait on cv_ for its result
  // The newest ended version (finished, failed or abandoned) and its FinishUpdate result, to answer repeats.
  int64_t ended_version_ = -1;
  absl::StatusOr<v1::FinishUpdateReply> ended_result_ = absl::UnknownError("no update has ended");
  absl::Status update_error_;
  // !update_error_.ok() of the open update, read without mu_ between one bucket's posts (WriteReady).
  std::atomic<bool> update_failed_{false};
  absl::Status cancel_reason_;  // why the open update's writes were cancelled (CancelWrites); OK when they were not
  // The last aborted version and AbortUpdate's answer for it (repeats get the same answer).
  int64_t aborted_version_ = -1;
  v1::AbortSourceUpdateReply aborted_reply_;
  std::set<int> ended_ranks_;
  std::map<int, LostRank> lost_ranks_;  // local rank → why and since when it is missing (cleared when it reconnects)
  bool stopping_ = false;
  std::condition_variable watch_cv_;
  Metrics metrics_;
  std::thread watcher_;  // last: started in the constructor once everything it touches exists  // local ranks that
                         // finished pushing the open update
  uint64_t bytes_written_ = 0, params_written_ = 0, tensors_received_ = 0;
  double ingest_seconds_ = 0, write_seconds_ = 0;
  // Per version (newest kChecksumVersionsKept): checksums of every range written, and whether it finished; mu_.
  struct Recorded {
    bool finished = false;
    std::vector<v1::WriteChecksum> writes;
    std::vector<std::shared_ptr<const BatchOutcome>> outcomes;  // per entry of `writes` (null: written)
  };
  std::map<int64_t, Recorded> checksums_;
  // Hashes the ranges posted (null with write_checksums off). Declared after everything its jobs touch; the
  // destructor drains it first.
  std::unique_ptr<HashPool> hasher_;
  // Relay trees (source_relay.cc). A relay root's bucket is posted in pieces of at most kRelayPieceBytes
  // (planner::RelayOptions' chunk; a parameter larger than that is cut at byte offsets), each with its own landed
  // notice (WriteReady), so a relay forwards a chunk once it landed, not a whole parameter.
  struct RelayPiece {
    std::vector<transport::WriteRequest> writes;
    std::vector<RelayNotifier::Range> ranges;  // what the piece's notice says landed (its dense writes' ranges)
    uint64_t bytes = 0;
  };
  // Appends `writes` (PlanWrites' for parameter `r` into relay root `t`) to `pieces`, filling the last piece up to
  // kRelayPieceBytes and cutting a write where it crosses that bound.
  void CutRelayPieces(const Target& t, const replica::ReadyParam& r, const std::vector<transport::WriteRequest>& writes,
                      std::vector<RelayPiece>* pieces);
  // After a piece into a tree's root is written, the notice of `ranges`. The notifier is created at the first such
  // piece; its thread hashes replica ranges, so it is declared after the replica.
  TargetWriter::Done RelayNoticeFor(int64_t version, const Target& t, std::vector<RelayNotifier::Range> ranges);
  static constexpr uint64_t kRelayPieceBytes = 4ull << 20;
  std::once_flag relay_once_;
  std::unique_ptr<RelayNotifier> relay_notifier_;
  // Tensors being assembled from slices in the open update (cleared under ingest_mu_ exclusive).
  std::mutex staged_mu_;
  std::map<std::string, Staged> staged_;
  // Buckets hold it shared, so different ranks' buckets are validated, loaded and posted in parallel; what replaces
  // or drains what they use (StartUpdate, Configure, the drains of FinishUpdate and AbortUpdate) holds it exclusive.
  // Targets' writers are replaced only with it held exclusively (and mu_); buckets submit to them with it shared.
  // The writers do not make it redundant: they own each endpoint's posts, but a bucket also reads the replica, the
  // plan's targets and staged_, which Configure and StartUpdate replace and the drains must see quiescent; no bucket
  // ever waits on a network under it (the writers post), so it orders plan changes against buckets, never ranks
  // against each other.
  std::shared_mutex ingest_mu_;
};

}  // namespace wsync::daemon
