#pragma once
// A mutex whose contracts the compiler checks (clang -Wthread-safety: ABSL_GUARDED_BY,
// ABSL_EXCLUSIVE_LOCKS_REQUIRED on the members and functions it guards), built on std::mutex.
//
// Why not absl::Mutex, which carries the same annotations: Debian's Abseil is not built with ThreadSanitizer, and
// absl::Mutex synchronizes through its own futex code, which an uninstrumented library hides from TSan: every access
// it guards would be reported as a race in the tsan build (tools/cli/quickstart.sh). std::mutex goes through
// pthread_mutex_lock, which TSan intercepts. The API follows absl's (Lock/Unlock, MutexLock, CondVar::Wait taking the
// mutex, WaitWithDeadline answering whether the deadline passed), so code reads the same either way.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace wsync {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  // For the analysis only: asserts that the caller holds the mutex (nothing is checked at run time).
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds `mu` for its scope.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// MutexLock that may be released before its scope ends (Release, at most once).
class ABSL_SCOPED_LOCKABLE ReleasableMutexLock {
 public:
  explicit ReleasableMutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~ReleasableMutexLock() ABSL_UNLOCK_FUNCTION() {
    if (mu_ != nullptr) mu_->Unlock();
  }
  void Release() ABSL_UNLOCK_FUNCTION() {
    mu_->Unlock();
    mu_ = nullptr;
  }
  ReleasableMutexLock(const ReleasableMutexLock&) = delete;
  ReleasableMutexLock& operator=(const ReleasableMutexLock&) = delete;

 private:
  Mutex* mu_;
};

// A condition variable for Mutex. Wait and WaitWithDeadline require the mutex held, release it while waiting and
// hold it again when they return (spurious wake-ups included: callers loop on their condition).
class CondVar {
 public:
  void Wait(Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> l(mu->mu_, std::adopt_lock);
    cv_.wait(l);
    l.release();  // still held: the caller's lock owns it
  }
  // True when `deadline` passed (the condition may still have become true meanwhile: check it).
  bool WaitWithDeadline(Mutex* mu, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> l(mu->mu_, std::adopt_lock);
    // Bounded: a wait_for of a huge duration overflows inside the standard library and returns at once.
    const absl::Duration left = std::min(deadline - absl::Now(), absl::Hours(24 * 365));
    bool timed_out = left <= absl::ZeroDuration();
    if (!timed_out)
      timed_out = cv_.wait_for(l, absl::ToChronoNanoseconds(left)) == std::cv_status::timeout;
    l.release();
    return timed_out;
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace wsync
