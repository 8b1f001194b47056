#include "daemon/coordinator/fanout.h"

#include <malloc.h>

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace wsync::daemon {

void Cancellation::Cancel(const std::string& why) {
  std::lock_guard<std::mutex> l(mu_);
  if (cancelled_) return;
  cancelled_ = true;
  why_ = why;
  for (auto& [id, wake] : wakes_) wake(why_);
}

bool Cancellation::cancelled() const {
  std::lock_guard<std::mutex> l(mu_);
  return cancelled_;
}

std::string Cancellation::why() const {
  std::lock_guard<std::mutex> l(mu_);
  return why_;
}

int Cancellation::Subscribe(std::function<void(const std::string&)> wake) {
  std::lock_guard<std::mutex> l(mu_);
  if (cancelled_) wake(why_);
  wakes_.emplace_back(next_id_, std::move(wake));
  return next_id_++;
}

void Cancellation::Unsubscribe(int id) {
  std::lock_guard<std::mutex> l(mu_);
  wakes_.erase(std::remove_if(wakes_.begin(), wakes_.end(), [id](const auto& w) { return w.first == id; }),
               wakes_.end());
}

std::vector<absl::Status> RunFanout(size_t n, const std::function<absl::Status(size_t)>& call,
                                    const FanoutOptions& opts) {
  std::vector<absl::Status> out(n);
  if (n == 0) return out;
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    size_t next = 0;      // items handed to a worker
    size_t finished = 0;  // of those, returned
    std::vector<bool> running;
    bool cancel_seen = false;  // set by the Cancellation's wake-up (never take its mutex under mu: lock order)
    std::string cancel_why;
    bool stop = false;  // no further item starts
  } s;
  s.running.assign(n, false);
  const absl::Time deadline =
      opts.deadline == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + opts.deadline;
  Cancellation* cancellation = opts.cancellation.get();
  const int sub = cancellation == nullptr ? -1 : cancellation->Subscribe([&s](const std::string& why) {
    std::lock_guard<std::mutex> l(s.mu);
    s.cancel_seen = true;
    s.cancel_why = why;
    s.cv.notify_all();
  });

  const auto work = [&] {
    for (;;) {
      size_t i;
      {
        std::lock_guard<std::mutex> l(s.mu);
        // Also checked here, not only by Run's thread: a phase cancelled or past its deadline starts no call.
        if (s.stop || s.cancel_seen || s.next >= n || absl::Now() >= deadline) return;
        i = s.next++;
        s.running[i] = true;
      }
      absl::Status st = call(i);
      std::lock_guard<std::mutex> l(s.mu);
      out[i] = std::move(st);
      s.running[i] = false;
      ++s.finished;
      s.cv.notify_all();
    }
  };
  std::vector<std::thread> workers;
  const size_t k = std::min(n, std::max<size_t>(opts.max_parallel, 1));
  workers.reserve(k);
  for (size_t w = 0; w < k; ++w) workers.emplace_back(work);

  absl::Status stopped;  // why the items not started were not called
  {
    std::unique_lock<std::mutex> l(s.mu);
    const auto all_done = [&] { return s.finished == s.next && (s.stop || s.next == n); };
    while (!all_done()) {
      if (!s.stop && (s.cancel_seen || absl::Now() >= deadline)) {
        s.stop = true;
        const std::string phase = opts.phase.empty() ? std::string("the phase") : opts.phase;
        stopped = s.cancel_seen
                      ? absl::CancelledError(absl::StrCat("not called: ", phase, " was cancelled (", s.cancel_why, ")"))
                      : absl::DeadlineExceededError(absl::StrCat("not called: ", phase, " ran past its deadline of ",
                                                                 absl::FormatDuration(opts.deadline)));
        std::vector<size_t> running;
        for (size_t i = 0; i < n; ++i)
          if (s.running[i]) running.push_back(i);
        if (opts.cancel_running) {
          l.unlock();  // the cancel calls a peer's transport: never under this lock
          for (size_t i : running) opts.cancel_running(i);
          l.lock();
        }
        continue;
      }
      if (s.stop || deadline == absl::InfiniteFuture()) {
        s.cv.wait(l);
      } else {
        s.cv.wait_for(l, absl::ToChronoNanoseconds(std::max(deadline - absl::Now(), absl::ZeroDuration())));
      }
    }
    for (size_t i = s.next; i < n; ++i) out[i] = stopped;
  }
  for (auto& w : workers) w.join();
  if (sub >= 0) cancellation->Unsubscribe(sub);
  return out;
}

absl::Status CombineStatuses(const std::vector<absl::Status>& results) {
  std::vector<const absl::Status*> failed;
  for (const auto& s : results)
    if (!s.ok()) failed.push_back(&s);
  if (failed.empty()) return absl::OkStatus();
  if (failed.size() == 1) return *failed.front();
  std::vector<std::string> msgs;
  msgs.reserve(failed.size());
  for (const auto* s : failed) msgs.emplace_back(s->message());
  return absl::Status(failed.front()->code(), absl::StrCat(failed.size(), " of ", results.size(),
                                                           " calls failed: ", absl::StrJoin(msgs, "; ")));
}

bool LimitMallocArenas(int arenas) { return mallopt(M_ARENA_MAX, arenas) == 1; }

}  // namespace wsync::daemon
