#include "transport/fabric/fabric_progress.h"

#include <algorithm>

namespace wsync::transport::fabric {

bool ProgressPacer::Busy(const ProgressRead& r) const {
  if (r.entries_or_error) return true;
  const double cost_ns = static_cast<double>(r.cpu.count());
  return empty_cost_ns_ > 0 && cost_ns > std::max(3 * empty_cost_ns_, static_cast<double>(opts_.busy_floor.count()));
}

void ProgressPacer::TrackEmptyCost(const ProgressRead& r, bool busy) {
  // Only reads not taken for work feed the average. (A cheapest-recent-read estimate, tried instead, cut 16-256 KiB
  // writes on tcp;ofi_rxm to 1-19 % of the rate with the average, on the loaded development machine.)
  if (busy) return;
  const double cost_ns = static_cast<double>(r.cpu.count());
  empty_cost_ns_ = empty_cost_ns_ == 0 ? cost_ns : 0.95 * empty_cost_ns_ + 0.05 * cost_ns;
}

ProgressPacer::Step ProgressPacer::Next(const ProgressRead& r) {
  const bool busy = Busy(r);
  TrackEmptyCost(r, busy);
  const bool after_pause = after_pause_;
  after_pause_ = false;
  if (busy) {
    // A flow is told by work in a read that followed another at once: the first read after a pause can look dear
    // for its cold caches alone (on an idle tcp;ofi_rxm domain it often did), and a spin started by each of those
    // would keep a core busy on an idle domain.
    if (r.entries_or_error || !after_pause) {
      active_ = true;
      last_active_ = r.now;
    }
    pause_ = opts_.min_pause / 2;  // the next pause is min_pause
    return Step{Step::kRead, std::chrono::microseconds(0)};
  }
  if (active_ && r.now - last_active_ < opts_.spin) {
    if (!r.driven) return Step{Step::kYield, std::chrono::microseconds(0)};
  } else {
    active_ = false;
  }
  if (r.expected && !r.driven) {
    pause_ = opts_.min_pause / 2;  // the window closed, the first pause is min_pause
    return Step{Step::kYield, std::chrono::microseconds(0)};
  }
  pause_ = std::min(opts_.max_pause, pause_ * 2);
  after_pause_ = true;
  return Step{Step::kPause, pause_};
}

}  // namespace wsync::transport::fabric
