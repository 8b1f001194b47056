#pragma once
// Which of many repeated events get a log line: at most one per key (a peer's address) per interval, and that line
// says how many were left unlogged since the previous one. Under attack (a peer hammering a port with bad
// handshakes or refused writes) the log then grows by one line per peer per minute, whatever the rate, while the
// counters (metrics) still count every event.
//
// Thread safety: every member may be called from any thread.

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "absl/time/time.h"

namespace wsync {

class LogLimiter {
 public:
  // `max_keys` bounds the memory an attacker with many addresses can make this hold: beyond it, keys whose last
  // line is older than the interval are forgotten, and if none is, every further new key shares one slot.
  explicit LogLimiter(absl::Duration interval = absl::Minutes(1), size_t max_keys = 4096)
      : interval_(interval), max_keys_(max_keys) {}

  // Records one event of `key` at `now`. When it should be logged, returns how many events of that key were
  // suppressed since its previous line (0 for the first); nullopt when it should not be logged.
  std::optional<uint64_t> Admit(const std::string& key, absl::Time now) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = keys_.find(key);
    if (it == keys_.end()) {
      if (keys_.size() >= max_keys_) Prune(now);
      const std::string& k = keys_.size() >= max_keys_ ? kOverflowKey : key;
      it = keys_.find(k);
      if (it == keys_.end()) {
        keys_.emplace(k, Entry{now, 0});
        return 0;
      }
    }
    Entry& e = it->second;
    if (now - e.last_logged < interval_) {
      ++e.suppressed;
      return std::nullopt;
    }
    const uint64_t suppressed = e.suppressed;
    e = Entry{now, 0};
    return suppressed;
  }

 private:
  struct Entry {
    absl::Time last_logged;
    uint64_t suppressed = 0;
  };
  static inline const std::string kOverflowKey = "(other peers)";

  // Forgets keys whose interval has passed; their unlogged count is lost with them (the counters still have it).
  void Prune(absl::Time now) {
    for (auto it = keys_.begin(); it != keys_.end();)
      it = now - it->second.last_logged >= interval_ ? keys_.erase(it) : std::next(it);
  }

  const absl::Duration interval_;
  const size_t max_keys_;
  std::mutex mu_;
  std::unordered_map<std::string, Entry> keys_;
};

}  // namespace wsync
