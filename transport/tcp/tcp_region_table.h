#pragma once
// The tcp backend's registered regions and write grants (RegionTable), and its region types.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "absl/time/clock.h"
#include "base/log_limiter.h"
#include "spdlog/spdlog.h"
#include "transport/tcp/tcp_wire.h"
#include "transport/transport.h"

namespace wsync::transport::tcp {

// Regions registered on one transport. Shared by the transport, its regions and its connection threads, so any
// of them may go first. A region is removed only when no connection thread is writing into it.
class RegionTable {
 public:
  struct Entry {
    char* addr;
    uint64_t length;
    std::shared_ptr<RegionSink> sink;  // set for memory the CPU cannot write (payload goes through its staging)
    bool read_only = false;            // a source's memory (RegisterSourceMemory): peers may not write into it
    int writers = 0;
  };

  explicit RegionTable(uint64_t token) : token_(token) {}
  uint64_t token() const { return token_; }

  // Region ids are random (never 0, never reused while registered): a peer cannot guess another region's id.
  uint64_t Add(void* addr, uint64_t length, std::shared_ptr<RegionSink> sink = nullptr, bool read_only = false) {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t id = 0;
    while (id == 0 || regions_.count(id)) id = (static_cast<uint64_t>(rng_()) << 32) ^ rng_();
    regions_[id] = std::make_shared<Entry>(Entry{static_cast<char*>(addr), length, std::move(sink), read_only});
    return id;
  }

  // A write grant (Transport::CreateGrantedEndpoint): the region ids it covers, live until revoked.
  struct Grant {
    Transport::WriteGrant info;
    std::unordered_set<uint64_t> regions;
    std::atomic<bool> live{true};
    std::atomic<int> connections{0};  // open connections whose hello carried its secret (Endpoint::Reusable)
  };
  using Secret = std::pair<uint64_t, uint64_t>;
  struct SecretHash {
    size_t operator()(const Secret& s) const { return std::hash<uint64_t>()(s.first ^ (s.second * 0x9e3779b97f4a7c15ULL)); }
  };

  // Mints a fresh random 128-bit secret for `g`.
  Secret AddGrant(std::shared_ptr<Grant> g) {
    std::lock_guard<std::mutex> lock(mu_);
    Secret sec{0, 0};
    while ((sec.first == 0 && sec.second == 0) || grants_.count(sec))
      sec = {(static_cast<uint64_t>(rng_()) << 32) ^ rng_(), (static_cast<uint64_t>(rng_()) << 32) ^ rng_()};
    grants_[sec] = std::move(g);
    return sec;
  }
  void RemoveGrant(const Secret& sec) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = grants_.find(sec);
    if (it == grants_.end()) return;
    it->second->live = false;
    grants_.erase(it);
  }
  void RevokeGrants(const std::function<bool(const Transport::WriteGrant&)>& keep) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = grants_.begin(); it != grants_.end();) {
      if (keep(it->second->info)) {
        ++it;
        continue;
      }
      spdlog::info("tcp: write grant for {} ({}) revoked", it->second->info.peer, it->second->info.scope);
      it->second->live = false;
      it = grants_.erase(it);
    }
  }
  // Null when the secret is unknown or was revoked.
  std::shared_ptr<Grant> FindGrant(const Secret& sec) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = grants_.find(sec);
    return it == grants_.end() ? nullptr : it->second;
  }
  void SetRequireGrants(bool r) { require_grants_.store(r); }
  bool require_grants() const { return require_grants_.load(); }

  void SetWindow(bool open) { window_open_.store(open); }
  bool window_open() const { return window_open_.load(); }
  void CountRefused() { refused_.fetch_add(1); }
  uint64_t refused() const { return refused_.load(); }
  // Logs `what` (a refusal, or a connection of peer address `host` that failed) as a warning, at most one line per
  // host per minute, saying how many were left out since the previous one: a peer hammering the port with refused
  // writes or bad hellos cannot fill the log (refused() still counts every refusal).
  void WarnPeer(const std::string& host, const std::string& what) {
    if (std::optional<uint64_t> left_out = peer_log_.Admit(host, absl::Now())) {
      if (*left_out == 0) {
        spdlog::warn("{}", what);
      } else {
        spdlog::warn("{} [{} more refusals/failures from {} not logged since the previous line]", what, *left_out,
                     host);
      }
    }
  }

  // Blocks while a connection thread is still receiving into the region.
  void Remove(uint64_t id) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = regions_.find(id);
    if (it == regions_.end()) return;
    std::shared_ptr<Entry> e = std::move(it->second);
    regions_.erase(it);
    idle_.wait(lock, [&] { return e->writers == 0; });
  }

  // Null when the id is not (or no longer) registered.
  std::shared_ptr<Entry> AcquireForWrite(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(id);
    if (it == regions_.end()) return nullptr;
    ++it->second->writers;
    return it->second;
  }

  void Release(const std::shared_ptr<Entry>& e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (--e->writers == 0) idle_.notify_all();
  }

 private:
  const uint64_t token_;
  std::atomic<bool> window_open_{true};
  std::atomic<bool> require_grants_{false};
  std::atomic<uint64_t> refused_{0};
  LogLimiter peer_log_;
  std::mutex mu_;
  std::condition_variable idle_;
  std::random_device rng_;
  std::unordered_map<uint64_t, std::shared_ptr<Entry>> regions_;
  std::unordered_map<Secret, std::shared_ptr<Grant>, SecretHash> grants_;
};

class TcpLocalRegion final : public LocalRegion {
 public:
  TcpLocalRegion(std::shared_ptr<RegionTable> table, uint64_t id, void* addr, uint64_t length)
      : table_(std::move(table)), id_(id), addr_(addr), length_(length) {}
  ~TcpLocalRegion() override { table_->Remove(id_); }
  uint64_t id() const { return id_; }
  void* addr() const override { return addr_; }
  uint64_t length() const override { return length_; }
  std::string Descriptor() const override {
    RegionDescriptor d{kDescMagic, kProtocolVersion, 0, table_->token(), id_, length_};
    return std::string(reinterpret_cast<const char*>(&d), sizeof(d));
  }

 private:
  std::shared_ptr<RegionTable> table_;
  uint64_t id_;
  void* addr_;
  uint64_t length_;
};

class TcpRemoteRegion final : public RemoteRegion {
 public:
  TcpRemoteRegion(uint64_t token, uint64_t id, uint64_t length) : token_(token), id_(id), length_(length) {}
  uint64_t length() const override { return length_; }
  uint64_t token() const { return token_; }
  uint64_t id() const { return id_; }

 private:
  uint64_t token_;
  uint64_t id_;
  uint64_t length_;
};

}  // namespace wsync::transport::tcp
