#pragma once
// One phase of an update, called on every peer at once: a bounded set of workers (never a thread per peer), a
// deadline for the whole phase, and cancellation.
//
// The coordinator's calls to peers are blocking calls with their own deadlines (Peers in coordinator.h). A phase runs
// them on at most `max_parallel` workers, which take the next item as they finish one: a fleet of a thousand peers
// costs `max_parallel` threads, not a thousand. Because a queued call starts late, the phase also has a deadline of
// its own: at the deadline, or when its Cancellation fires, items not started yet are not called (DeadlineExceeded
// or Cancelled), and `cancel_running` is asked to cut short each call still running (the coordinator cancels the
// calls in flight to that peer). Run returns only when every call it started has returned: the calls may reference
// the caller's stack.
//
// Workers are started per phase and joined before Run returns, so phases running at once (a commit waiting on its
// sources while the lease watch tells them to abort) never wait for each other's workers.

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace wsync::daemon {

// A flag an operator's abort raises once; phases running under it stop starting calls and cancel the running ones.
// Thread-safe. Cancel() calls the registered wake-ups under the flag's mutex: they must only notify (never block).
class Cancellation {
 public:
  // Raises the flag (repeats do nothing) with `why`, the message calls not started are failed with.
  void Cancel(const std::string& why);
  bool cancelled() const;
  std::string why() const;

  // Run's registration: `wake(why)` is called once when the flag is raised (at once when it is raised already), under
  // the flag's mutex: it gets the reason as an argument so that it never calls back into the flag.
  int Subscribe(std::function<void(const std::string&)> wake);
  void Unsubscribe(int id);

 private:
  mutable std::mutex mu_;
  bool cancelled_ = false;
  std::string why_;
  int next_id_ = 0;
  std::vector<std::pair<int, std::function<void(const std::string&)>>> wakes_;
};

struct FanoutOptions {
  // Calls running at once. The calls wait on the network, not the CPU: this bounds threads and sockets in use.
  size_t max_parallel = 64;
  absl::Duration deadline = absl::InfiniteDuration();  // for the whole phase, from Run's start
  std::shared_ptr<Cancellation> cancellation;          // may be null
  // Asked from Run's thread, once per call still running at the deadline or cancellation (item index); may be null.
  std::function<void(size_t)> cancel_running;
  std::string phase;  // names the phase in the errors of calls not started
};

// Runs call(i) for every i in [0, n) as described above; returns each item's status (index i: item i). Blocks until
// every started call returned. Thread-safe; `call` runs on worker threads, concurrently for different items.
std::vector<absl::Status> RunFanout(size_t n, const std::function<absl::Status(size_t)>& call,
                                    const FanoutOptions& opts);

// glibc's malloc gives threads arenas of their own (up to 8 per core) and an arena keeps what was freed in it: a
// phase's workers each build and free a request of megabytes (a source's configuration at Kimi-K2 scale), and with an
// arena per worker the process kept every worker's largest request resident after the phase (docs/operations.md,
// "Control plane at scale"). The coordinator caps its arenas at kMallocArenas at start; its workers wait on the
// network, not on the allocator. Call in main, before any thread starts. False where the allocator refused.
inline constexpr int kMallocArenas = 2;
bool LimitMallocArenas(int arenas = kMallocArenas);

// The phase's result from per-item statuses: OK when every call succeeded; otherwise the first error's code with
// every failure's message (a link that goes down fails every engine rank behind it: the error names them all). Pure.
absl::Status CombineStatuses(const std::vector<absl::Status>& results);

}  // namespace wsync::daemon
