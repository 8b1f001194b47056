#include "daemon/coordinator/store_writer.h"

#include <algorithm>

#include "absl/time/clock.h"

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace wsync::daemon {
namespace {

// After a failed write, the next attempt waits this long unless a new state arrives first (a store that is down is
// not hammered; one that is back is written at the next change or after this).
constexpr absl::Duration kRetryAfter = absl::Seconds(1);

void MergeHistory(v1::CoordinatorState* from, std::map<int64_t, v1::UpdateRecord>* into, int64_t* floor) {
  for (auto& r : *from->mutable_history()) (*into)[r.version()] = std::move(r);
  from->clear_history();
  *floor = std::max(*floor, from->history_floor());
  into->erase(into->begin(), into->lower_bound(*floor));
}

}  // namespace

StoreWriter::StoreWriter(std::unique_ptr<StateStore> store) : store_(std::move(store)) {
  thread_ = std::thread([this] { Run(); });
}

StoreWriter::~StoreWriter() {
  {
    MutexLock l(&mu_);
    stop_ = true;
    cv_.SignalAll();
  }
  thread_.join();
}

uint64_t StoreWriter::Submit(v1::CoordinatorState state) {
  uint64_t t;
  {
    MutexLock l(&mu_);
    MergeHistory(&state, &pending_history_, &pending_floor_);
    pending_ = std::move(state);
    t = pending_ticket_ = ++next_ticket_;
    cv_.SignalAll();
  }
  return t;
}

void StoreWriter::SetTestHooks(TestHooks hooks) {
  MutexLock l(&mu_);
  hooks_ = std::move(hooks);
}

uint64_t StoreWriter::last_ticket() const {
  MutexLock l(&mu_);
  return next_ticket_;
}

v1::CoordinatorState StoreWriter::TakePending(uint64_t* ticket) {
  v1::CoordinatorState s = std::move(*pending_);
  pending_.reset();
  for (auto& [v, r] : pending_history_) *s.add_history() = std::move(r);
  pending_history_.clear();
  s.set_history_incremental(true);
  s.set_history_floor(std::max(s.history_floor(), pending_floor_));
  *ticket = pending_ticket_;
  return s;
}

void StoreWriter::Requeue(const v1::CoordinatorState& state) {
  for (const auto& r : state.history())
    if (r.version() >= pending_floor_) pending_history_.emplace(r.version(), r);  // a newer record of it wins
}

void StoreWriter::Attempted(uint64_t t, const absl::Status& st) {
  attempted_ = std::max(attempted_, t);
  if (st.ok()) {
    written_ = std::max(written_, t);
  } else {
    last_error_ = st;
    last_error_ticket_ = t;
  }
  done_cv_.SignalAll();
}

void StoreWriter::Run() {
  mu_.Lock();
  uint64_t failed = 0;  // the ticket of a failed write queued again: retried after kRetryAfter or a newer state
  for (;;) {
    if (failed > 0) {
      const absl::Time deadline = absl::Now() + kRetryAfter;
      while (!stop_ && pending_ticket_ <= failed)
        if (cv_.WaitWithDeadline(&mu_, deadline)) break;
    } else {
      while (!stop_ && !pending_.has_value()) cv_.Wait(&mu_);
    }
    failed = 0;
    if (!pending_) {
      if (stop_) break;
      continue;  // a retry with nothing new: records left from a failed write go with the next state
    }
    // The state is taken under io_mu_, as SaveNow takes it: a SaveNow between this thread's take and its write
    // would write a newer state first, its ticket would cover this older one before it landed, and this write
    // would then put the older state back over the newer (seen: the store left at version 2 after SaveNow(3)).
    mu_.Unlock();
    io_mu_.Lock();
    mu_.Lock();
    if (!pending_) {  // a SaveNow wrote it meanwhile, with its records
      io_mu_.Unlock();
      continue;
    }
    uint64_t ticket;
    v1::CoordinatorState s = TakePending(&ticket);
    writing_ = true;
    const std::function<void()> after_take = hooks_.after_take;
    mu_.Unlock();
    if (after_take) after_take();
    const absl::Status st = store_->SaveChanges(s, /*nodes_changed=*/false);
    mu_.Lock();
    writing_ = false;
    io_mu_.Unlock();
    if (!st.ok()) {
      spdlog::error("state store {}: {} (the coordinator goes on from memory; the next change retries)",
                    store_->path(), st.ToString());
      if (!pending_) {
        pending_ = s;  // written again unless a newer state came
        pending_->clear_history();
      }
      Requeue(s);
      if (pending_ticket_ < ticket) pending_ticket_ = ticket;
      failed = pending_ticket_;
    }
    Attempted(ticket, st);
    if (stop_ && !st.ok()) break;  // stopping: one attempt is all a failing store gets
  }
  mu_.Unlock();
}

absl::Status StoreWriter::SaveNow(v1::CoordinatorState* state, bool nodes_changed, uint64_t* ticket) {
  std::function<void()> waits;
  {
    MutexLock l(&mu_);
    if (writing_) waits = hooks_.save_now_waits;
  }
  if (waits) waits();
  MutexLock io(&io_mu_);  // after the write in progress; the thread cannot start another meanwhile
  uint64_t t;
  {
    MutexLock l(&mu_);
    writing_ = true;
    // This state is newer than the one queued, which it replaces; every record not yet written goes with it.
    MergeHistory(state, &pending_history_, &pending_floor_);
    for (auto& [v, r] : pending_history_) *state->add_history() = std::move(r);
    pending_history_.clear();
    state->set_history_incremental(true);
    state->set_history_floor(pending_floor_);
    pending_.reset();
    t = pending_ticket_ = ++next_ticket_;
  }
  absl::Status st = store_->SaveChanges(*state, nodes_changed);
  MutexLock l(&mu_);
  writing_ = false;
  if (!st.ok()) {
    if (!pending_) {
      // Queued again without its nodes (lent: they stay the caller's; the store has taken its own form of them).
      google::protobuf::RepeatedPtrField<v1::RegisterNodeRequest> lent;
      state->mutable_nodes()->Swap(&lent);
      pending_ = *state;
      state->mutable_nodes()->Swap(&lent);
      pending_->clear_history();
      pending_ticket_ = t;
    }
    Requeue(*state);
    cv_.SignalAll();
  }
  Attempted(t, st);
  if (ticket != nullptr) *ticket = t;
  return st;
}

absl::Status StoreWriter::Wait(uint64_t t, absl::Duration timeout) {
  MutexLock l(&mu_);
  const absl::Time deadline = absl::Now() + timeout;
  while (attempted_ < t && written_ < t)
    if (done_cv_.WaitWithDeadline(&mu_, deadline)) break;
  const bool done = attempted_ >= t || written_ >= t;
  if (written_ >= t) return absl::OkStatus();
  if (!done)
    return absl::DeadlineExceededError(absl::StrCat("state store ", store_->path(), " did not record the state within ",
                                                    absl::FormatDuration(timeout)));
  return last_error_ticket_ >= t ? last_error_ : absl::OkStatus();
}

}  // namespace wsync::daemon
