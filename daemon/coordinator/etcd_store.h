#pragma once
// The coordinator's state store on etcd v3, shared by several coordinators of which exactly one leads
// (docs/operations.md, "High availability (etcd)"). etcd is reached through its JSON gateway (/v3/kv/...,
// /v3/lease/...) with base64 keys and values; no etcd client library.
//
// Keys under PREFIX:
//   PREFIX/leader  the leader's gRPC address, put with a create-if-absent txn (create_revision == 0) and attached to
//                  the leader's lease (TTL lease_ttl, kept alive every TTL/3): when the leader dies, the lease expires
//                  and the key disappears; a standby's next campaign creates it.
//   PREFIX/...     the state, one key per object (state_objects.h). A Save writes only the objects that changed, in
//                  txns guarded by the leadership ("PREFIX/leader still has the create_revision this store created it
//                  with"), so a deposed leader can never overwrite the state of the leader that replaced it (fencing):
//                  its Save fails with FailedPrecondition.
//
// Atomicity. A save that fits one txn (max_txn_ops operations, max_txn_bytes of request) is one txn: etcd applies
// it whole or not at all. A larger one (a first save, a migration, a node with many new layouts) is several txns:
// the first also puts PREFIX/saving, the last writes PREFIX/root and deletes PREFIX/saving. A Load that finds
// PREFIX/saving (a save under way, or its writer died) reads every object at the revision of PREFIX/root's last
// write (etcd keeps past revisions until compacted), i.e. the last whole save. The next save of the leader deletes
// what the broken save left.
// Migration: a store holding schema 1's PREFIX/state (the whole state in one value) is read as such; the next save
// writes the objects and deletes PREFIX/state in its last txn.
//
// Threads: the election runs in one thread of its own (StartElection); Load/Save/TryAcquire/KeepAlive/Resign may be
// called from any thread. Every HTTP request is bounded by request_timeout and tried on each endpoint in turn.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/coordinator/state_store.h"

namespace wsync::daemon {

struct EtcdOptions {
  std::vector<std::string> endpoints;  // host:port of etcd's client URLs (http)
  std::string prefix;                  // key prefix shared by the coordinators of one cluster (no trailing '/')
  std::string advertise;               // this coordinator's gRPC address: the leader key's value when it leads
  double lease_ttl_seconds = 3;        // the leader's lease; a dead leader is replaced within about this
  absl::Duration request_timeout = absl::Seconds(2);
  absl::Duration campaign_interval = absl::Milliseconds(250);  // how often a standby tries to become the leader
  // etcd's defaults are --max-txn-ops 128 and --max-request-bytes 1.5 MiB; a save stays under both, with room for
  // the JSON gateway's base64.
  int max_txn_ops = 128;
  size_t max_txn_bytes = size_t{1} << 20;  // of the JSON request body
  size_t layout_part_bytes = 512 << 10;    // a layout value's part (base64: 4/3 of it in the request)
  int range_page = 256;                    // keys per range request when reading the state
};

class EtcdStateStore final : public StateStore {
 public:
  // Checks that etcd answers (Unavailable naming every endpoint when none does). Does not campaign.
  static absl::StatusOr<std::unique_ptr<EtcdStateStore>> Open(EtcdOptions opts);
  ~EtcdStateStore() override;  // stops the election thread; the lease is left to expire unless Resign() was called

  absl::StatusOr<v1::CoordinatorState> Load() override;
  // Only while leading, and only while the leader key is still the one this store created (fencing); otherwise
  // FailedPrecondition, and a leader that finds itself deposed calls on_lost. A save whose txns did not all apply
  // (etcd unreachable part way) leaves the previous state readable; the next save reads what is there first.
  absl::Status SaveChanges(const v1::CoordinatorState& state, bool nodes_changed) override;
  const std::string& path() const override { return where_; }
  StateStoreStats stats() const override;

  // One campaign step: grants a lease when this store has none, then tries to create the leader key. True when this
  // store leads (now or already).
  absl::StatusOr<bool> TryAcquire();
  // Renews the lease once. FailedPrecondition when etcd says the lease has expired.
  absl::Status KeepAlive();
  // Runs the election in a thread: campaigns every campaign_interval until it leads, then calls on_elected once and
  // keeps the lease alive. When the leadership is lost (lease expired, or not renewed for a TTL, or a fenced Save)
  // it calls on_lost once and stops. Callbacks run on the election thread (on_lost may also run on a Save caller's).
  void StartElection(std::function<void()> on_elected, std::function<void(const absl::Status&)> on_lost);
  // Gives up leadership at once (deletes the leader key if it is still ours, revokes the lease): a standby takes over
  // within one campaign interval instead of a lease TTL. Stops the election thread.
  void Resign();

  bool leader() const { return leader_.load(); }
  // The current leader's address as last read from etcd ("" when unknown or none); reads etcd when `refresh`.
  std::string LeaderAddress(bool refresh);

 private:
  explicit EtcdStateStore(EtcdOptions opts);
  // POSTs `body` to `path` on the endpoints in turn (starting with the last one that answered); the parsed answer,
  // or an error naming the endpoints.
  absl::StatusOr<std::string> Post(const std::string& path, const std::string& body);
  void Lost(const absl::Status& why);
  void ElectionLoop();
  // Every key under PREFIX/ (relative, state keys only) at `revision` (0: the latest), page by page at one revision.
  // `root_revision`: mod_revision of the root, 0 if none.
  absl::StatusOr<StateObjects> ReadAll(int64_t revision, int64_t* root_revision);
  // One fenced txn of `ops` (request_put / request_delete_range objects).
  absl::Status Txn(const std::vector<std::string>& ops, int64_t leader_revision);

  const EtcdOptions opts_;
  const std::string where_;  // etcd://endpoints/prefix
  const std::string leader_key_;
  std::atomic<size_t> endpoint_{0};

  std::mutex save_mu_;  // Load and Save one at a time; the two members below
  StateObjectSet objects_;
  StateStoreStats stats_;  // also read by stats() under stats_mu_
  mutable std::mutex stats_mu_;

  std::mutex mu_;
  int64_t lease_id_ = 0;                          // 0: none
  int64_t leader_revision_ = 0;                   // create_revision of our leader key while leading
  std::string leader_address_;                    // last read
  absl::Time lease_sent_ = absl::InfinitePast();  // when the last successful keepalive (or grant) was sent
  std::atomic<bool> leader_{false};
  std::atomic<bool> lost_{false};

  std::function<void()> on_elected_;
  std::function<void(const absl::Status&)> on_lost_;
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace wsync::daemon
