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
  // Writes are expected now: the transport's write window is open (a target opens it for each update and closes
  // it at the end; fabric_transport.h). The one exact signal there is that writes are on their way.
  bool expected = false;
};

// Decides what the progress thread does after each read; not thread-safe (one per progress thread).
//
// Incoming one-sided writes leave no entry in any queue of the receiver, so activity is told by what a read cost:
// one clearly dearer than an empty read (their running average) did work. ofi_rxm handles about one incoming
// message per read, so while writes arrive any pause between reads caps the receiver at one message per pause; and
// a flow of writes shows as busy reads with empty ones between them (the next message is not in yet). So:
//  - after a read that did work, the next read follows at once;
//  - for `spin` after a flow was last seen (a busy read that followed another read at once, or entries), empty
//    reads are followed by another after a sched_yield only: the thread spins while a core is free and gives way
//    where other threads want it (on a host with few cores, the sender's thread). Not while a thread of the
//    domain drives its endpoints itself (a sender polling its own queue, which progresses its endpoint as this
//    read would): no second thread spins beside it;
//  - while writes are expected (the write window is open), empty reads are followed by another after a sched_yield
//    only, for as long as it stays open: no pause can then cap the rate, whatever the reads cost (estimating
//    activity from cost alone can settle into pausing between every message: the reads that each handle one
//    message then count as empty). Not while the domain is driven, as above;
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
  struct Step {
    enum Kind {
      kRead,   // read again at once
      kYield,  // sched_yield, then read
      kPause,  // wait `pause` (ended early only by shutdown), then read
    };
    Kind kind = kRead;
    std::chrono::microseconds pause{0};
  };

  ProgressPacer() : ProgressPacer(Options{}) {}
  explicit ProgressPacer(const Options& opts) : opts_(opts), pause_(opts.min_pause / 2) {}

  // Records `r` and decides what comes before the next read.
  Step Next(const ProgressRead& r);

  // Whether a flow was seen within the last `spin` (as of the last read).
  bool spinning() const { return active_; }

 private:
  bool Busy(const ProgressRead& r) const;
  void TrackEmptyCost(const ProgressRead& r, bool busy);

  Options opts_;
  std::chrono::microseconds pause_;  // the pause the next empty read outside a spin doubles
  double empty_cost_ns_ = 0;         // running average of an empty read's CPU cost
  bool active_ = false;              // a flow was seen, last at last_active_
  std::chrono::steady_clock::time_point last_active_;
  bool after_pause_ = true;  // the next read follows a pause (or is the first)
};

}  // namespace wsync::transport::fabric
