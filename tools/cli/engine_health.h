#pragma once
// Readiness for routers (docs/operations.md, "Staged updates"): an HTTP health endpoint per engine, fed by the
// coordinator's WatchEngines stream (`wsyncctl engines --watch --health-listen HOST:PORT`). An L7 proxy or a router
// health-checks GET /engines/<engine id>/ready and keeps an engine in rotation only while it answers 200.

#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "wsync/v1/coordinator.pb.h"

namespace wsync::tools {

struct HealthAnswer {
  int code = 503;    // 200 ready; 503 stale, paused, not on the current version, or no state yet; 404 unknown engine
  std::string body;  // one line: "ready version V" or why not
};

// What GET /engines/<id>/ready answers for engine `id` given the latest states (`have_states` false: none received
// yet). Pure.
HealthAnswer EngineHealth(const v1::EngineStates& states, bool have_states, const std::string& id);

// The HTTP server: serves the latest states it was given from its own thread until destroyed.
class EngineHealthServer {
 public:
  // Listens on `host`:`port` (0: any free port; port() says which).
  static absl::StatusOr<std::unique_ptr<EngineHealthServer>> Start(const std::string& host, int port);
  ~EngineHealthServer();
  int port() const;
  void Update(const v1::EngineStates& states);

 private:
  struct Impl;
  explicit EngineHealthServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace wsync::tools
