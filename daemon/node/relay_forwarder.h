#pragma once
// The relay forwarder of a target daemon (issue 41, docs/planner.md "The relay data path"): for one engine of this
// node and one update, it learns which byte ranges landed in the engine's memory (RelayLanded notices from the
// source that wrote them, or from its own parent relay), checks each range against the checksum the writer sent,
// and forwards it one-sided, through this daemon's transport, into the same range of the same rank of every child
// (another engine instance of the same layout), then tells each child what landed there, so the child forwards on.
//
// Threading: Landed and Drain are called from gRPC threads, Begin from the coordinator's SetRelay; no lock is held
// across a ConnectTarget, a Submit or a notice RPC. Per child rank one TargetWriter (source_writer.h) owns the
// endpoint; one notice thread sends the children's notices, batched (one call per child per round).

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/mutex.h"
#include "daemon/node/source_writer.h"
#include "transport/transport.h"
#include "wsync/v1/daemon.pb.h"

namespace wsync::daemon {

// One rank of the relaying engine as the forwarder reads it: its layout, its host segments' bytes (for the check)
// and their registered regions (the writes' sources). `keep` holds the mappings alive for the update.
struct RelayRankMemory {
  v1::RankLayout layout;
  std::map<int, const uint8_t*> data;                    // host segment id → its bytes
  std::map<int, const transport::LocalRegion*> regions;  // host segment id → its registration
  std::vector<std::shared_ptr<const void>> keep;
};

// Checks `child` against the relaying engine's ranks: as many ranks, every parameter at the same segment, offset and
// size, every segment host memory. InvalidArgument naming the child and the first difference. Pure.
absl::Status CheckRelayChild(const std::vector<RelayRankMemory>& ranks, const v1::RelayChild& child);

// The forward batches of ranges that landed, in order: per rank, consecutive ranges of at most `max_bytes` together
// (a longer range alone), each batch (rank, ranges). A child hears of a batch, and forwards it on, once all of it
// landed there, so a tree level costs about one batch's time. Pure.
std::vector<std::pair<int, std::vector<v1::LandedRange>>> ForwardBatches(const std::vector<v1::LandedRange>& ranges,
                                                                          uint64_t max_bytes);

class RelayForwarder {
 public:
  using Dial = std::function<absl::StatusOr<v1::ConnectTargetReply>(const std::string& daemon,
                                                                    const v1::ConnectTargetRequest& req)>;
  using Notify = std::function<absl::Status(const std::string& daemon, const v1::RelayLandedRequest& req)>;
  // `node_id` names this relay in errors; `transport` is the daemon's own; `dial` makes a ConnectTarget call,
  // `notify` a RelayLanded call to a child's daemon.
  RelayForwarder(std::string node_id, transport::Transport* transport, Dial dial, Notify notify);
  ~RelayForwarder();
  RelayForwarder(const RelayForwarder&) = delete;
  RelayForwarder& operator=(const RelayForwarder&) = delete;

  // Update `req.version()`: the previous update's forwarding is cancelled; every child rank is connected (a
  // ConnectTarget as a source would) before it returns. Blocks on the children's handshakes.
  absl::StatusOr<v1::SetRelayReply> Begin(const v1::SetRelayRequest& req, std::vector<RelayRankMemory> ranks);
  // The same update, with `req.children()` replacing this relay's children (a dead relay's children re-parented
  // here, docs/planner.md "A relay that dies"): forwarding starts over (batches and notices of the children before
  // are ignored when they end, their failures too), every child is connected as Begin does, and every range that
  // landed so far is checked again and forwarded to every child from the start. FailedPrecondition when this relay
  // is not relaying `req.version()` of `req.engine_id()`.
  absl::StatusOr<v1::SetRelayReply> Adopt(const v1::SetRelayRequest& req);
  // Ranges that landed: each is checked against its checksum (a mismatch fails the update here, naming this relay,
  // the range and the writer), then queued to every child. Returns once queued, not written. A range landed before
  // in this update (a new parent re-sends everything, Adopt) is checked again but neither counted nor forwarded.
  absl::Status Landed(const v1::RelayLandedRequest& req);
  // Waits until every byte of every rank has landed and been forwarded and the children told, the first failure, or
  // `req.timeout_seconds()`.
  absl::StatusOr<v1::RelayDrainReply> Drain(const v1::RelayDrainRequest& req);
  // What this relay wrote into its children in update `version` (the newest kWritesKept updates): per child engine,
  // rank, parameter and range, the XXH3-128 the range's writer sent and this relay found in its own engine before
  // forwarding it — the relay's answer to GetWriteChecksums, as a source's is (`wsyncctl verify` compares the
  // children's memory with it). `finished`: its Drain succeeded. NotFound when it relayed no such update.
  struct Written {
    bool finished = false;
    std::vector<v1::WriteChecksum> writes;
  };
  absl::StatusOr<Written> WriteChecksums(int64_t version) const;
  static constexpr size_t kWritesKept = 4;

 private:
  struct Child {
    v1::RelayChild spec;
    std::vector<std::vector<std::unique_ptr<transport::RemoteRegion>>> regions;  // per rank, per segment index
    std::vector<std::map<int, const transport::RemoteRegion*>> by_segment;       // per rank: segment id → region
    std::vector<std::unique_ptr<TargetWriter>> writers;                          // per rank
  };
  struct Notice {
    int child = 0;
    uint64_t generation = 0;  // the forwarding it belongs to (Begin, Adopt)
    std::vector<v1::LandedRange> ranges;
  };
  // Per rank: parameter name → index into its layout.
  using ParamIndex = std::map<std::string, int>;

  absl::Status Connect(Child* child, const std::string& relay_node);
  void Fail(const absl::Status& st);
  void NoticeLoop();

  const std::string node_id_;
  transport::Transport* const transport_;
  const Dial dial_;
  const Notify notify_;
  UpdateWrites writes_;

  mutable Mutex mu_;
  CondVar cv_;
  int64_t version_ ABSL_GUARDED_BY(mu_) = -1;
  // Bumped by Begin and Adopt: the batches, notices and failures of an earlier generation are ignored when they end.
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  // Per rank: (parameter, offset) of every range landed this update, and the ranges in the order they landed (what
  // Adopt forwards again).
  std::vector<std::set<std::pair<std::string, uint64_t>>> seen_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::LandedRange> landed_log_ ABSL_GUARDED_BY(mu_);
  std::string engine_id_ ABSL_GUARDED_BY(mu_);
  std::vector<RelayRankMemory> ranks_ ABSL_GUARDED_BY(mu_);
  std::vector<ParamIndex> params_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> expected_ ABSL_GUARDED_BY(mu_);  // per rank: parameter bytes of one copy
  std::vector<uint64_t> landed_ ABSL_GUARDED_BY(mu_);    // per rank: bytes landed and checked
  // Children of the update: shared with the writers' callbacks of that update only.
  std::shared_ptr<std::vector<Child>> children_ ABSL_GUARDED_BY(mu_);
  uint64_t pending_ ABSL_GUARDED_BY(mu_) = 0;  // batches queued or in flight, and notices not yet sent
  uint64_t forwarded_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t notices_sent_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  absl::Status check_error_ ABSL_GUARDED_BY(mu_);  // a range that failed its check (Adopt keeps it)
  std::deque<std::pair<int64_t, Notice>> notices_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, Written> written_ ABSL_GUARDED_BY(mu_);  // the newest kWritesKept updates' (WriteChecksums)
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread notice_thread_;  // last: started once everything it touches exists
};

}  // namespace wsync::daemon
