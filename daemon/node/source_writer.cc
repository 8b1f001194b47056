#include "daemon/node/source_writer.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "spdlog/spdlog.h"

namespace wsync::daemon {

void UpdateWrites::Begin(int64_t version) {
  MutexLock l(&mu_);
  version_ = version;
  pending_ = 0;
  error_ = absl::OkStatus();
  cv_.SignalAll();
}

bool UpdateWrites::Add(int64_t version) {
  MutexLock l(&mu_);
  if (version != version_ || !error_.ok()) return false;
  ++pending_;
  return true;
}

void UpdateWrites::Report(int64_t version, const absl::Status& st) {
  {
    MutexLock l(&mu_);
    if (version != version_) return;  // an earlier update's batch: its update ended without it
    if (st.ok() || !error_.ok()) {
      if (pending_ > 0 && --pending_ == 0) cv_.SignalAll();
      return;
    }
    error_ = st;
    cv_.SignalAll();
  }
  // The first failure: the batch counts as pending until the source has failed the update, so a drain that returns
  // finds the update failed (and its writes cancelled).
  if (on_failure_) on_failure_(version, st);
  MutexLock l(&mu_);
  if (version == version_ && pending_ > 0 && --pending_ == 0) cv_.SignalAll();
}

void UpdateWrites::Fail(int64_t version, const absl::Status& err) {
  MutexLock l(&mu_);
  if (version != version_ || !error_.ok() || err.ok()) return;
  error_ = err;
  cv_.SignalAll();
}

bool UpdateWrites::failed(int64_t version) const {
  MutexLock l(&mu_);
  return version == version_ && !error_.ok();
}

bool UpdateWrites::WaitDrained(absl::Time deadline) {
  MutexLock l(&mu_);
  while (pending_ > 0) {
    if (cv_.WaitWithDeadline(&mu_, deadline)) return pending_ == 0;
  }
  return true;
}

absl::Status UpdateWrites::error(int64_t version) const {
  MutexLock l(&mu_);
  return version == version_ ? error_ : absl::OkStatus();
}

uint64_t UpdateWrites::pending() const {
  MutexLock l(&mu_);
  return pending_;
}

TargetWriter::TargetWriter(std::unique_ptr<transport::Endpoint> endpoint, std::string context, UpdateWrites* updates,
                           Options opts)
    : endpoint_(std::move(endpoint)),
      context_(std::move(context)),
      updates_(updates),
      opts_(opts),
      completion_fd_(endpoint_->CompletionFd()) {
  if (completion_fd_ >= 0) {
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) spdlog::warn("{}: eventfd failed; the writer polls its endpoint instead", context_);
  }
  thread_ = std::thread([this] { Run(); });
}

void TargetWriter::Wake() {
  if (wake_fd_ < 0) return;
  const uint64_t one = 1;
  ssize_t r = write(wake_fd_, &one, sizeof(one));
  (void)r;  // only EAGAIN (the counter is full: readable already) can fail it
}

void TargetWriter::Sleep() {
  pollfd fds[2] = {{completion_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  // Bounded all the same: a lost wake-up costs sleep_cap, not a hang.
  if (poll(fds, 2, static_cast<int>(absl::ToInt64Milliseconds(opts_.sleep_cap))) < 0 && errno != EINTR)
    spdlog::warn("{}: poll: {}", context_, std::strerror(errno));
  uint64_t n;
  while (read(wake_fd_, &n, sizeof(n)) == static_cast<ssize_t>(sizeof(n))) {
  }
}

TargetWriter::~TargetWriter() {
  Cancel(absl::CancelledError(absl::StrCat(context_, ": the connection was closed")));
  {
    MutexLock l(&mu_);
    stop_ = true;
    cv_.SignalAll();
  }
  Wake();
  thread_.join();
  if (wake_fd_ >= 0) close(wake_fd_);
}

absl::Status TargetWriter::Submit(int64_t version, std::vector<transport::WriteRequest> batch, Done done) {
  MutexLock l(&mu_);
  for (;;) {
    if (!broken_.ok())
      return absl::UnavailableError(
          absl::StrCat(context_, ": its endpoint failed and is not re-established (", broken_.message(), ")"));
    if (updates_->failed(version))
      return absl::AbortedError(
          absl::StrCat(context_, ": update ", version, " not written: the update already failed"));
    if (static_cast<int>(queue_.size()) + in_flight_ < opts_.credits) break;
    cv_.Wait(&mu_);  // a credit frees when a batch completes; a Cancel or failure wakes it too
  }
  if (!updates_->Add(version))
    return absl::AbortedError(absl::StrCat(context_, ": update ", version, " not written: the update already failed"));
  queue_.push_back(Item{version, std::move(batch), std::move(done)});
  cv_.SignalAll();
  Wake();
  return absl::OkStatus();
}

std::vector<TargetWriter::Dropped> TargetWriter::BreakLocked(const absl::Status& err) {
  if (broken_.ok()) broken_ = err;
  std::vector<Dropped> dropped;
  for (Item& i : queue_) dropped.push_back(Dropped{i.version, std::move(i.done)});
  queue_.clear();
  cv_.SignalAll();
  return dropped;
}

void TargetWriter::End(int64_t version, const Done& done, const absl::Status& st, const absl::Status& report) {
  if (done) done(st);
  updates_->Report(version, report);
}

void TargetWriter::Cancel(const absl::Status& why) {
  std::vector<Dropped> dropped;
  {
    MutexLock l(&mu_);
    dropped = BreakLocked(why);
  }
  Wake();
  endpoint_->Cancel(why);  // in-flight batches fail at once; the thread reports them
  // The canceller fails the update itself (or it ended): the dropped batches only leave the count.
  for (const Dropped& d : dropped) End(d.version, d.done, why, absl::OkStatus());
}

absl::Status TargetWriter::broken() const {
  MutexLock l(&mu_);
  return broken_;
}

int TargetWriter::busy() const {
  MutexLock l(&mu_);
  return static_cast<int>(queue_.size()) + in_flight_;
}

void TargetWriter::Run() {
  std::deque<InFlight> flying;  // this thread's alone; in_flight_ counts them for the producers' credits
  const bool sleeps = completion_fd_ >= 0 && wake_fd_ >= 0;
  // The last Wait(0) found the oldest batch outstanding: nothing is news until the completion fd or a wake-up fires
  // (that Wait consumed the fd before it looked, so a later completion signals it again).
  bool idle = false;
  for (;;) {
    Item item;
    bool post = false;
    absl::Status abandon;
    std::vector<InFlight> abandoned;
    {
      MutexLock l(&mu_);
      while (!stop_ && queue_.empty() && flying.empty()) cv_.Wait(&mu_);
      if (!broken_.ok() && !flying.empty()) {
        // The endpoint must be re-created: its batches are abandoned with it (a Cancel failed them already, or a
        // double whose Cancel does not reach its Wait would hold them forever).
        abandon = broken_;
        abandoned.assign(flying.begin(), flying.end());
        in_flight_ -= static_cast<int>(flying.size());
        flying.clear();
        cv_.SignalAll();
      } else if (flying.empty() && queue_.empty()) {
        break;  // stop_
      } else if (!queue_.empty()) {
        item = std::move(queue_.front());
        queue_.pop_front();
        ++in_flight_;
        post = true;
      }
    }
    if (!post && abandoned.empty() && sleeps && idle) {
      Sleep();
      idle = false;
      continue;  // look at the queue and the stop flag again first
    }
    if (!abandoned.empty()) {
      for (const InFlight& f : abandoned) End(f.version, f.done, abandon, abandon);
      continue;
    }
    absl::Status failure;
    int64_t failed_version = -1;
    if (post) {
      absl::StatusOr<transport::BatchId> id =
          updates_->failed(item.version)
              ? absl::StatusOr<transport::BatchId>(absl::AbortedError("the update already failed"))
              : endpoint_->Post(item.writes);
      if (id.ok()) {
        flying.push_back(InFlight{item.version, *id, std::move(item.done)});
        continue;
      }
      failed_version = item.version;
      failure = Annotate(id.status(), context_);
      if (updates_->failed(item.version)) {
        // Dropped, not failed: the update's first error is elsewhere.
        {
          MutexLock l(&mu_);
          --in_flight_;
          cv_.SignalAll();
        }
        End(item.version, item.done, failure, absl::OkStatus());
        continue;
      }
    } else {
      InFlight f = flying.front();
      absl::Status st = endpoint_->Wait(f.id, sleeps ? absl::ZeroDuration() : opts_.wait_slice);
      if (st.code() == absl::StatusCode::kDeadlineExceeded) {  // still outstanding: look at the queue
        idle = true;
        continue;
      }
      flying.pop_front();
      if (st.ok()) {
        {
          MutexLock l(&mu_);
          --in_flight_;
          cv_.SignalAll();
        }
        End(f.version, f.done, st, st);
        continue;
      }
      failed_version = f.version;
      failure = Annotate(st, context_);
      item.done = std::move(f.done);
    }
    std::vector<Dropped> dropped;
    bool first = false;
    {
      MutexLock l(&mu_);
      --in_flight_;
      first = broken_.ok();
      dropped = BreakLocked(failure);
    }
    if (first) spdlog::error("{}; its endpoint will be re-created at the next update", failure.ToString());
    End(failed_version, item.done, failure, failure);
    for (const Dropped& d : dropped) End(d.version, d.done, failure, failure);
  }
}

}  // namespace wsync::daemon
