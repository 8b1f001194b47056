#pragma once
// How a domain's progress thread paces its reads of the progress queue: the decision, apart from the thread that
// acts on it (Domain::ProgressLoop), so that it can be tested without a provider or a clock.

#include <chrono>
#include <cstdint>

namespace wsync::transport::fabric {

// What one read of the progress queue did.
struct ProgressRead {
  // The read returned entries or an error (there is more to handle at once).
  bool entries_or_error = false;
  // CPU time the reading thread spent in the read (not wall time: a read the scheduler preempted did no work).
  std::chrono::nanoseconds cpu{0};
  // When the read ended (steady clock).
  std::chrono::steady_clock::time_point now;
  // A thread using one of the domain's endpoints is polling that endpoint's own queue (in Post or Wait), which
  // progresses the endpoint as much as this read does.
  bool driven = false;
};

// Decides the pause before the next read; not thread-safe (one per progress thread).
//
// Incoming one-sided writes leave no entry in any queue of the receiver, so activity is told by what a read cost:
// one clearly dearer than an empty read (the cheapest recent one) did work. ofi_rxm handles about one incoming message
// per read, so while writes arrive any pause between reads caps the receiver at one message per pause; and a flow
// of writes shows as busy reads with empty ones between them (the next message is not in yet). So:
//  - after a read that did work, the next read follows at once; the first read after a pause, which can look dear
//    for cold caches alone, counts as work only if the one following it at once does too;
//  - for `spin` after the last read that did work, empty reads are followed at once too (the thread spins) unless
//    a thread of the domain drives its endpoints itself: a sender polling its own queue needs no second spinning
//    thread, and on a host with few cores one would take the sender's core;
//  - otherwise every empty read doubles the pause from `min_pause` up to `max_pause`: an idle domain costs a few
//    hundred cheap reads a second, and a first write after an idle spell waits at most `max_pause`.
class ProgressPacer {
 public:
  struct Options {
    std::chrono::microseconds min_pause{50};
    std::chrono::microseconds max_pause{5000};
    std::chrono::microseconds spin{1000};
    // A read that handled one small message costs a few microseconds more than an empty one.
    std::chrono::nanoseconds busy_floor{2000};
  };

  ProgressPacer() : ProgressPacer(Options{}) {}
  explicit ProgressPacer(const Options& opts) : opts_(opts), pause_(opts.min_pause / 2) {}

  // Records `r` and returns how long to pause before the next read (zero: read again at once).
  std::chrono::microseconds Next(const ProgressRead& r);

  // Whether the last read was taken for work (entries, an error, or its cost without a pause before it).
  bool last_busy() const { return last_busy_; }

 private:
  bool Busy(const ProgressRead& r) const;
  void TrackEmptyCost(const ProgressRead& r);

  Options opts_;
  std::chrono::microseconds pause_;  // the pause the next empty read outside a spin doubles
  double empty_cost_ns_ = 0;         // what an empty read costs: the cheapest recent read (see TrackEmptyCost)
  bool active_ = false;              // a read did work, at last_active_
  std::chrono::steady_clock::time_point last_active_;
  bool last_busy_ = false;
  bool after_pause_ = true;  // the next read follows a pause (or is the first)
};

}  // namespace wsync::transport::fabric
