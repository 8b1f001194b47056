#pragma once
// RelayLanded notices (issue 41, docs/planner.md "The relay data path"): one-sided writes are invisible to the
// receiver, so whoever writes a relay says what landed. The gRPC call itself, shared by a relay telling its
// children, and the source's notifier: after a batch of writes into a relay tree's root completed, the ranges it
// covered are hashed (XXH3-128 of the replica bytes sent, as the write checksums) and sent to the root's daemon,
// batched: one entry per written range, one call per daemon and engine per round.
//
// Threading: Written may be called from any thread (the writers' completion callbacks); one thread hashes and sends.

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "wsync/v1/daemon.pb.h"

namespace wsync::daemon {

// Calls RelayLanded on the daemon at `daemon` (channels kept per address). Blocks for the call (30 s at most).
absl::Status CallRelayLanded(const std::string& daemon, const v1::RelayLandedRequest& req);
// Calls ConnectTarget on a child's daemon for a relay (connect_target_client.h, 60 s at most).
absl::StatusOr<v1::ConnectTargetReply> DialRelayChild(const std::string& daemon, const v1::ConnectTargetRequest& req);

class RelayNotifier {
 public:
  using Notify = std::function<absl::Status(const std::string& daemon, const v1::RelayLandedRequest& req)>;
  struct Range {
    int rank = 0;
    std::string param;
    uint64_t offset = 0, length = 0;
    const uint8_t* data = nullptr;  // the bytes sent; unchanged until the update ends (the replica's contract)
  };
  RelayNotifier(std::string node_id, Notify notify);
  ~RelayNotifier();
  RelayNotifier(const RelayNotifier&) = delete;
  RelayNotifier& operator=(const RelayNotifier&) = delete;

  // A batch of update `version` into engine `engine_id` at `daemon` completed: its ranges are hashed and sent.
  void Written(int64_t version, const std::string& daemon, const std::string& engine_id, std::vector<Range> ranges);
  // Waits until every notice queued so far was sent (or `deadline`); the first failed call of `version`, if any.
  absl::Status Flush(int64_t version, absl::Time deadline);

 private:
  struct Item {
    int64_t version = -1;
    std::string daemon, engine_id;
    std::vector<Range> ranges;
  };
  void Loop();

  const std::string node_id_;
  const Notify notify_;
  Mutex mu_;
  CondVar cv_;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  int busy_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int64_t, absl::Status> errors_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace wsync::daemon
