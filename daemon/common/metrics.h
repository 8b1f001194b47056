#pragma once
// Prometheus metrics of a wsync process (coordinator or wsyncd) and the HTTP endpoint that serves them.
//
// A `Metrics` registry holds counters, gauges and histograms, each a family (name, help, type) with label sets;
// updates are thread-safe and cheap (one mutex, no allocation after a series' first use). `Render()` writes the
// Prometheus text exposition format (version 0.0.4). Values that are cheaper to read at scrape time than to keep
// up to date (sessions, engines by state) are set by a collect callback just before rendering.
//
// `MetricsServer` serves `GET /metrics` (the registry) and `GET /healthz` ("ok") on --metrics-listen HOST:PORT.
// The metric names and what they mean: docs/operations.md, "Metrics".

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace httplib {
class Server;
}

namespace wsync::daemon {

using Labels = std::vector<std::pair<std::string, std::string>>;

class Metrics {
 public:
  // Bucket upper bounds (seconds) used by every *_seconds histogram: 1 ms … 10 min.
  static const std::vector<double>& DefaultSecondsBuckets();

  // Declares a family; calling again with the same name is a no-op. Types: "counter", "gauge", "histogram".
  void Declare(const std::string& name, const std::string& type, const std::string& help,
               std::vector<double> buckets = {});
  void Add(const std::string& name, const Labels& labels, double delta);        // counter (delta ≥ 0)
  void Set(const std::string& name, const Labels& labels, double value);        // gauge
  // A counter mirrored from a count kept elsewhere (read at collect time); `value` never decreases.
  void SetCounter(const std::string& name, const Labels& labels, double value);
  void Observe(const std::string& name, const Labels& labels, double value);    // histogram
  // Creates the given series at zero where absent, so that a counter or histogram whose label sets are known up front
  // is exported from the start (a rate() or increase() over its first update then sees 0 → 1, not nothing).
  void Preset(const std::string& name, const std::vector<Labels>& label_sets = {Labels{}});
  // Drops every series of a gauge family (before a collect callback re-sets the current ones).
  void ClearFamily(const std::string& name);
  double Value(const std::string& name, const Labels& labels) const;  // counter/gauge value, 0 when absent

  // Runs before every Render (e.g. to set gauges from current state).
  void OnCollect(std::function<void(Metrics&)> fn);
  std::string Render();

 private:
  struct Series {
    double value = 0;                // counter / gauge; histogram: sum
    uint64_t count = 0;              // histogram
    std::vector<uint64_t> buckets;   // histogram, cumulative at render time
  };
  struct Family {
    std::string type, help;
    std::vector<double> bounds;
    std::map<Labels, Series> series;
  };
  Family* Find(const std::string& name, const char* want_type);  // requires mu_

  mutable std::mutex mu_;
  std::map<std::string, Family> families_;
  std::vector<std::function<void(Metrics&)>> collect_;
};

// The refusals of attacks on this process, read at scrape time: wsync_tls_handshake_failures_total (gRPC's failed
// TLS handshakes, tls::HandshakeFailures) and, when `refused_writes` is given, wsync_refused_writes_total (what the
// node's data listener refused: Transport::refused_writes). Their log lines are rate-limited; these count them all.
void ExportRefusalCounters(Metrics& m, std::function<uint64_t()> refused_writes = nullptr);

// The coordinator's update counters and histograms at zero from the start: wsync_updates_total for every result,
// wsync_update_phase_seconds for every classic phase, the unlabelled byte counters and wsync_update_seconds
// (families its Coordinator declares). Called by its main.
void PresetCoordinatorSeries(Metrics& m);

class MetricsServer {
 public:
  // Binds `listen` (host:port; port 0 = any free port) and serves in a background thread. InvalidArgument for a
  // malformed address, Unavailable when the port cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& listen, Metrics* metrics);
  ~MetricsServer();
  int port() const { return port_; }

 private:
  MetricsServer() = default;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace wsync::daemon
