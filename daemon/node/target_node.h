#pragma once
// The target role of wsyncd: engine ranks on this node attach their weight memory (segments handed over as file
// descriptors on a Unix socket, docs/engines.md "The attach protocol"); the daemon maps and registers every segment
// with the transport once, exports where each parameter lives, accepts the sources' transport connections, and
// drives every engine through its EngineAdapter (for kinds other than "reference" it serves an EngineControl facade
// per engine that the coordinator calls).
//
// Threading: one loop thread (poll) accepts and serves the attach socket; everything else is called from gRPC
// threads or main. No lock is held across an adapter call, a transport registration or a socket write.

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/fd_passing.h"
#include "daemon/common/engine_adapter.h"
#include "daemon/node/armed_switch.h"
#include "daemon/node/relay_forwarder.h"
#include "daemon/node/target_node_cuda.h"
#include "transport/transport.h"
#include "wsync/v1/coordinator.pb.h"
#include "wsync/v1/daemon.pb.h"
#include "wsync/v1/engine.pb.h"

namespace wsync::daemon {

// One mapped segment of an engine rank's weight memory (MAP_SHARED of the fd the rank handed over).
class MappedSegment {
 public:
  static absl::StatusOr<std::unique_ptr<MappedSegment>> Map(int fd, uint64_t bytes, const std::string& who);
  ~MappedSegment();
  uint8_t* data() const { return base_; }
  uint64_t size() const { return size_; }

 private:
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
};

struct TargetOptions {
  std::string node_id;
  // Unix stream socket engine ranks attach to; created (with its directory) by Start, removed on destruction.
  std::string engine_socket;
  // Peer uids allowed to attach besides the daemon's own (SO_PEERCRED).
  std::vector<uid_t> engine_uids;
  // How long AddEngine waits for every rank of an engine to attach.
  absl::Duration attach_timeout = absl::Seconds(120);
  // Host the per-engine EngineControl facades listen on (port 0 each); "" = no facades (tests drive TargetNode).
  std::string facade_host = "127.0.0.1";
  // Largest attach message accepted.
  size_t max_attach_bytes = 64ull << 20;
  // Delta updates (docs/delta.md): each source connection that asks gets a host staging region of this fraction of
  // the bytes it writes to the rank (0: no staging, so every update is dense). A quarter: records measured 2.2 % of
  // the dense bytes at lr 1e-6 and up to 13.6 % at 1e-5 (bf16, docs/delta.md), so 1e-5 still fits with headroom.
  double delta_staging_fraction = 0.25;
  // Imports a rank's cuda segments (null: ImportCudaSegment). Tests put host memory behind a cuda segment with it,
  // so that the target's device path (records applied through the segment's SegmentScatter) runs without a GPU.
  CudaSegmentImporter import_cuda_segment;
};

// One record a source stages for ApplyDelta (docs/delta.md): this header, then `enc_bytes` of a
// replica/delta.h encoding, then padding to 8 bytes. Records follow each other from the region's start.
struct DeltaRecordHeader {
  uint32_t magic;
  uint32_t param;      // index into the rank's RankLayout.params
  int64_t version;     // the update it belongs to
  uint64_t offset;     // inside the parameter
  uint64_t length;     // bytes of the parameter it rewrites
  uint64_t enc_bytes;  // encoding that follows
};
static_assert(sizeof(DeltaRecordHeader) == 40, "a wire layout: sources and targets of one build agree on it");
inline constexpr uint32_t kDeltaRecordMagic = 0x52445357;  // "WSDR"
inline uint64_t DeltaRecordBytes(uint64_t enc_bytes) { return (sizeof(DeltaRecordHeader) + enc_bytes + 7) & ~7ull; }

// One checked record: where its encoding is and which parameter range it rewrites.
struct DeltaRecordRef {
  uint32_t param = 0;  // index into RankLayout.params
  uint64_t offset = 0, length = 0;
  const uint8_t* enc = nullptr;
  uint64_t enc_bytes = 0;
};
// Decides whether the `bytes` of records a source staged for one engine rank may be applied (nothing is written):
// exactly `records` records of update `version`, each naming a parameter of `layout` in a segment records can be
// applied into (`host_segment_bytes`: id → bytes; host segments and cuda ones alike), a range inside it, and,
// unless `owned` is null, inside one of the plan's ranges for that source. A refusal names `who`, the record and
// the parameter.
absl::StatusOr<std::vector<DeltaRecordRef>> CheckDeltaRecords(const uint8_t* data, uint64_t bytes, uint32_t records,
                                                              int64_t version, const v1::RankLayout& layout,
                                                              const std::map<int, uint64_t>& host_segment_bytes,
                                                              const std::vector<v1::WriteRange>* owned,
                                                              const std::string& who);

// What ConnectTarget does with the connection a source already has to an engine rank (decided before acting): make
// the first one; keep one the asking sender endpoint can write through (Endpoint::Reusable, one meaning on every
// backend: the same grant goes back, a repeat never disturbs an update writing through it); replace any other
// (its peer gone, its grant revoked, or, on verbs, a new sender endpoint that needs a QP pair of its own).
enum class ConnectTargetAction { kCreate, kReuse, kReplace };
ConnectTargetAction DecideConnectTarget(bool have_connection, bool reusable);

// The default engine socket of a daemon whose API listens on `port`: /run/wsync/target-<port>.sock when that
// directory can be created, else under $XDG_RUNTIME_DIR/wsync, else /tmp/wsync-<uid>.
std::string DefaultEngineSocket(int port);

class TargetNode {
 public:
  TargetNode(TargetOptions opts, transport::Transport* transport);
  ~TargetNode();

  // Binds the engine socket and starts the loop thread. Call once, before AddEngine.
  absl::Status Start();
  const std::string& engine_socket() const { return opts_.engine_socket; }

  // Describes the engine, asks it to attach (RequestAttach with a fresh random token), waits until every rank has
  // attached (bounded by attach_timeout, the error names the ranks missing), and for kinds without their own
  // EngineControl endpoint starts the facade. Blocks.
  absl::Status AddEngine(std::unique_ptr<EngineAdapter> adapter);
  // What the coordinator needs to plan (layouts with one region descriptor per segment, kind, control address).
  std::vector<v1::EngineRegistration> Registrations() const;

  // `source` is the caller's identity from its certificate ("" on an insecure daemon): the write grant minted for
  // the connection is bound to it and to the engine rank's regions. Idempotent while the source's connection for
  // the rank is live: the same grant is answered (DecideConnectTarget).
  absl::StatusOr<v1::ConnectTargetReply> ConnectTarget(const v1::ConnectTargetRequest& req,
                                                       const std::string& source = "");
  // Opens or closes the transport's write window (closed from Start until the coordinator opens it). An open that
  // names held assignments this node does not hold changes nothing and answers assignments_missing.
  v1::SetWriteWindowReply SetWriteWindow(const v1::SetWriteWindowRequest& req);
  v1::NodeStatus Status() const;

  // --- the EngineControl facade of one engine (kinds other than "reference") ---
  absl::StatusOr<v1::EngineInfo> EngineInfo(const std::string& engine_id);
  absl::StatusOr<v1::RankLayout> Layout(const std::string& engine_id, int rank);
  absl::Status Pause(const std::string& engine_id, const std::string& mode);
  // Sends {"type":"commit","version":V} to every rank, then adapter->PostProcess(version). A rank that is not
  // attached fails it (FailedPrecondition naming engine and rank) before anything is sent or called.
  absl::Status PostProcess(const std::string& engine_id, const std::string& version);
  absl::Status SetWeightVersion(const std::string& engine_id, const std::string& version);
  absl::Status Continue(const std::string& engine_id);
  // XXH3-128 of byte ranges (`req.ranges`, else every whole parameter) of one attached rank's weight memory as this
  // daemon maps it (wsyncctl verify). Host segments only: a parameter in a cuda segment is FailedPrecondition. Holds
  // mu_ while hashing (the mapping must not go away under it): a diagnostic, not for the update path.
  // `req.staging` (staged updates, an engine whose layout stages in place): the reply also carries the digest of the
  // rank's whole staging memory; FailedPrecondition for any other engine. Hashes without mu_ (mappings are shared).
  absl::StatusOr<v1::ChecksumReply> Checksums(const std::string& engine_id, const v1::RankRequest& req);
  // Staged updates, an engine that stages in place: checks that every rank's staging memory still hashes to the
  // digest it was verified with (FailedPrecondition naming the rank otherwise). Nothing is swapped: the engine's
  // post-processing then makes those bytes live. `prepare` (PrepareSwitch): the same check, while the engine serves,
  // arming the switch; the next switch of that version and those digests then skips the re-hash
  // (daemon/node/armed_switch.h).
  absl::Status Switch(const std::string& engine_id, const v1::SwitchRequest& req, bool prepare);

  // Every source finished update `req.version()`: validates every staged delta record of it (structure, version,
  // parameter and range inside the rank's layout, in host memory, inside the plan's ranges of the source that staged
  // it), then applies them (replica/delta.h Apply: the base checksum must match what the rank holds; a refused
  // record writes nothing), then records the ranks the window was opened for as holding the version. A refusal
  // names the engine, rank and parameter; those ranks then hold no known version (the next update is dense there).
  // Holds mu_ while applying (the mappings must not go away under it; the records are a fraction of the update).
  absl::StatusOr<v1::ApplyDeltaReply> ApplyDelta(const v1::ApplyDeltaRequest& req);

  // Relay trees (relay_forwarder.h, docs/planner.md "The relay data path"). SetRelay: for update `req.version()`,
  // the engine's children (connected before it returns; empty: a leaf that only checks what lands). RelayLanded: a
  // writer's notice of ranges landed in the engine (checked, then forwarded). RelayDrain: waits until all of the
  // update landed, was checked and forwarded. Blocking; gRPC threads; mu_ is not held across them.
  absl::StatusOr<v1::SetRelayReply> SetRelay(const v1::SetRelayRequest& req);
  absl::Status RelayLanded(const v1::RelayLandedRequest& req);
  absl::StatusOr<v1::RelayDrainReply> RelayDrain(const v1::RelayDrainRequest& req);
  // What this node's relays wrote into their children in update `version` (RelayForwarder::WriteChecksums, every
  // relaying engine of the node): GetWriteChecksums on a target daemon, for `wsyncctl verify`. `finished`: every
  // relay that forwarded part of it drained. NotFound when none of them forwarded any of it.
  absl::StatusOr<v1::WriteChecksumsReply> WriteChecksums(int64_t version);

 private:
  // An accepted attach connection. Shared between the loop thread and control calls that write to it.
  struct Conn {
    ScopedFd fd;
    uid_t uid = 0;
    std::string engine_id;  // set once attached
    int rank = -1;
    std::mutex send_mu;
  };
  struct Rank {
    enum class State { kWaiting, kAttached, kDetached } state = State::kWaiting;
    v1::RankLayout layout;
    // One per host segment; shared so that ApplyDelta, which scatters without holding mu_, keeps a mapping alive while
    // the rank re-attaches meanwhile.
    std::vector<std::shared_ptr<MappedSegment>> memory;
    // One per cuda segment; shared for the same reason as `memory` (ApplyDelta scatters into it without mu_).
    std::vector<std::shared_ptr<CudaSegment>> cuda;
    std::vector<std::unique_ptr<transport::LocalRegion>> regions;      // one per segment, dropped before memory/cuda
    std::vector<std::string> cuda_paths;  // per cuda segment: "segment S: how writes reach it" (NodeStatus)
    std::shared_ptr<Conn> conn;
    // The update whose every write this rank holds (-1: none known: attached since, or an update is writing it).
    int64_t held_version = -1;
    uint64_t attach_gen = 0;  // which attach this is (TargetNode::attach_gen_ when it attached)
    // Per (parameter index, offset, length) of a cuda segment: the checksum of what the last ApplyDelta's record
    // left there (the encoding's new checksum). The base check of the next record of that range; a range without
    // one (last written dense) is read back and hashed instead. Only the ranges a record rewrote in the update the
    // rank last held survive an ApplyDelta (every other range may have been written dense since).
    std::map<std::tuple<uint32_t, uint64_t, uint64_t>, uint64_t> device_sums;
  };
  // A source connection's delta staging region. Shared by the connections whose grants name it and pinned by an
  // ApplyDelta reading it; freed (and deregistered) when the last of them lets go (docs/delta.md, "Staging").
  struct Staging {
    std::unique_ptr<uint8_t[]> data;
    uint64_t bytes = 0;
    std::unique_ptr<transport::LocalRegion> region;
  };
  // A source's connection to an engine rank (ConnectTarget): its endpoint, whose grant names the staging it holds.
  struct Connection {
    // The source node the plan's assignments name: its identity's when it has one, else the one it named
    // (ConnectTargetRequest.source_node; empty: an insecure source that named none, never dropped by a re-plan).
    std::string source_id;
    std::shared_ptr<Staging> staging;  // its grant's delta staging (null: none); outlives `endpoint`
    std::unique_ptr<transport::Endpoint> endpoint;
  };
  struct Engine {
    std::string id, kind, control_address;
    std::string token;
    int num_ranks = 0;
    std::string model_config_json, version;
    bool paused = false;
    std::unique_ptr<EngineAdapter> adapter;
    std::vector<Rank> ranks;
    std::mutex call_mu;  // one adapter call at a time (the adapter's contract)
    // The last successful Switch prepare (staged updates), until its switch, a continue or the next open window.
    std::optional<ArmedSwitch> armed_switch;
    std::unique_ptr<grpc::Service> facade;
    std::unique_ptr<grpc::Server> facade_server;
  };

  // One rank's layout and its host mappings (kept alive by the shared pointers), taken under mu_.
  struct RankView {
    v1::RankLayout layout;
    std::map<int, std::shared_ptr<MappedSegment>> host;  // segment id → mapping
  };
  absl::StatusOr<RankView> ViewRank(const std::string& engine_id, int rank);
  // Refused unless every rank's staging memory hashes to the digest `req` gives for it.
  absl::Status CheckStagingDigests(const std::string& engine_id, const v1::SwitchRequest& req, int num_ranks);

  void Loop();
  void Accept();
  // Reads one frame from `c`; returns false when the connection is to be dropped.
  bool Serve(const std::shared_ptr<Conn>& c);
  // Validates, maps and registers one attach message; the reply's error on failure.
  absl::Status Attach(const std::shared_ptr<Conn>& c, const std::string& msg, std::vector<ScopedFd> fds);
  void Detach(const std::shared_ptr<Conn>& c, const std::string& why);
  // The engine with every rank attached, or FailedPrecondition naming the first rank that is not. Holds mu_.
  absl::StatusOr<Engine*> Usable(const std::string& engine_id);
  // One control call on an engine's adapter: one call at a time per engine, never under mu_; `record` runs under
  // mu_ once the call succeeded. Errors name the engine and `what`.
  absl::Status CallEngine(const std::string& engine_id, const char* what,
                          const std::function<absl::Status(EngineAdapter*)>& call,
                          const std::function<void(Engine*)>& record);
  absl::StatusOr<Engine*> Find(const std::string& engine_id);
  // The plan's assignments of an open request that carries them replace those held (assignments_, assigned_writes_,
  // their digest). Requires mu_.
  void TakeAssignments(const v1::SetWriteWindowRequest& req);
  // Revokes every write grant of a source identity for an engine rank the held assignments do not give it; returns
  // how many. Requires mu_ and assignments_known_.
  int RevokeUnassignedGrants();
  // Delta updates (target_delta.cc). At a window opening for update `version`: answers and forgets the held version
  // of every rank the held assignments write (every rank when none are held). Requires mu_.
  void OpenDeltaWindow(int64_t version, v1::SetWriteWindowReply* out);
  // ConnectTarget asking for delta staging: creates (or reuses) the connection's staging region, answers it in
  // `out`, adds it to `grant` and hands it to `*staging` (the connection keeps it alive). Takes mu_.
  absl::Status ProvideStaging(const v1::ConnectTargetRequest& req, const std::string& source,
                              v1::ConnectTargetReply* out, transport::Transport::WriteGrant* grant,
                              std::shared_ptr<Staging>* staging);
  // Drops the connections whose source the held assignments do not give their rank (their grants were revoked;
  // nothing may write through them), with the staging only they named. Requires mu_ and assignments_known_; the
  // endpoints go to `dropped`, to be destroyed without mu_.
  void DropUnassignedConnections(std::vector<Connection>* dropped);

  TargetOptions opts_;
  transport::Transport* transport_;
  ScopedFd listen_fd_;
  ScopedFd wake_rd_, wake_wr_;  // self-pipe that ends the loop
  std::thread loop_;
  std::atomic<bool> stop_{false};
  std::map<int, std::shared_ptr<Conn>> conns_;  // loop thread only

  mutable std::mutex mu_;
  std::condition_variable attached_cv_;
  std::map<std::string, std::unique_ptr<Engine>> engines_;
  // One connection per (engine, rank, source identity; its transport info when insecure): a source that reconnects
  // after its connection closed replaces (and so revokes the grant of) its own endpoint, nobody else's; while the
  // connection is live a repeat gets the same grant.
  using EndpointKey = std::tuple<std::string, int, std::string>;
  std::map<EndpointKey, Connection> endpoints_;
  bool window_enforced_ = false;  // guarded by mu_
  bool window_open_ = false;      // guarded by mu_
  bool grants_enforced_ = false;  // the transport enforces per-connection write grants (set by Start)
  // The last plan's (source node, engine, rank) assignments on this node, from SetWriteWindow, and their
  // WindowAssignmentsDigest (a later open may name them instead of sending them again); guarded by mu_.
  std::set<std::tuple<std::string, std::string, int>> assignments_;
  bool assignments_known_ = false;
  std::string assignments_digest_;
  // Delta updates, guarded by mu_: staging per (engine, rank, source node); the plan's write ranges per assignment
  // (empty: all of every parameter); the update the window was last opened for and the ranks it writes.
  // staging_ names the newest region of each key; the connections (endpoints_) own them: a region no connection's
  // grant names any more (replaced, revoked by a re-plan) is freed with its last connection.
  std::map<std::tuple<std::string, int, std::string>, std::weak_ptr<Staging>> staging_;
  std::map<std::tuple<std::string, std::string, int>, std::vector<v1::WriteRange>> assigned_writes_;
  int64_t window_version_ = -1;
  std::set<std::pair<std::string, int>> window_ranks_;
  // Per window rank, the attach it had when the window opened: ApplyDelta records a held version only for a rank
  // still on that attach (a rank that re-attached since holds its new process's weights).
  std::map<std::pair<std::string, int>, uint64_t> window_gens_;
  uint64_t attach_gen_ = 0;  // guarded by mu_
  // One ApplyDelta at a time: it validates under mu_, then scatters without it (Status, attaches and connects do not
  // wait for the bytes).
  std::mutex apply_mu_;
  // The forwarder of `engine_id` (FailedPrecondition naming it when it is in no relay tree).
  absl::StatusOr<std::shared_ptr<RelayForwarder>> RelayOf(const std::string& engine_id);
  // One forwarder per relaying engine, created at its first SetRelay and kept.
  std::mutex relay_mu_;
  std::map<std::string, std::shared_ptr<RelayForwarder>> relays_;
};

}  // namespace wsync::daemon
