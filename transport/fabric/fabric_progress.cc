#include "transport/fabric/fabric_progress.h"

#include <algorithm>

namespace wsync::transport::fabric {

bool ProgressPacer::Busy(const ProgressRead& r) const {
  if (r.entries_or_error) return true;
  const double cost_ns = static_cast<double>(r.cpu.count());
  return empty_cost_ns_ > 0 && cost_ns > std::max(3 * empty_cost_ns_, static_cast<double>(opts_.busy_floor.count()));
}

void ProgressPacer::TrackEmptyCost(const ProgressRead& r) {
  if (r.entries_or_error) return;
  // Down at once to a cheaper read, up by 2 % a read: the cheap reads between the busy ones of a flow hold it down,
  // and a lasting rise (more endpoints bound to the queue) is caught up with in a few hundred reads instead of
  // every read being taken for work from then on.
  const double cost_ns = static_cast<double>(r.cpu.count());
  empty_cost_ns_ = empty_cost_ns_ == 0 ? cost_ns : std::min(cost_ns, empty_cost_ns_ * 1.02);
}

std::chrono::microseconds ProgressPacer::Next(const ProgressRead& r) {
  const bool looks_busy = Busy(r);
  TrackEmptyCost(r);
  // The first read after a pause can look busy for its cold caches alone (and did, on every pause, on an idle
  // tcp;ofi_rxm domain): it is followed by another at once, and only a busy read that follows without a pause, or
  // entries, counts as work.
  last_busy_ = r.entries_or_error || (looks_busy && !after_pause_);
  after_pause_ = false;
  if (last_busy_) {
    active_ = true;
    last_active_ = r.now;
    pause_ = opts_.min_pause / 2;  // the first empty read after the spin waits min_pause
    return std::chrono::microseconds(0);
  }
  if (looks_busy) return std::chrono::microseconds(0);
  if (active_ && r.now - last_active_ < opts_.spin) {
    if (!r.driven) return std::chrono::microseconds(0);
  } else {
    active_ = false;
  }
  pause_ = std::min(opts_.max_pause, pause_ * 2);
  after_pause_ = true;
  return pause_;
}

}  // namespace wsync::transport::fabric
