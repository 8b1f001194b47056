#pragma once
// The coordinator's read-only status page (`wsync-coordinator --http-listen HOST:PORT`, docs/operations.md, "Status
// page"): cluster membership, each engine's version and state (ready / stale / paused) and the last updates as a
// timeline (timeline_svg.h), rendered on the server as HTML with the SVG inline; no script.
//
// The same TLS and role rules as the coordinator's gRPC API (docs/security.md): with TLS the page is served over
// HTTPS only, the handshake requires a client certificate of the cluster CA (refused otherwise), and the
// certificate's CN must name a wsync role (any role may read, as GetClusterStatus); the server's certificate and the
// CA are the process's (proto/tls.h), read at every handshake so that a rotation applies to the page too; a plain
// HTTP request to the HTTPS port gets a plain-text 400 saying to use https:// with a client certificate. Without TLS
// (loopback only, as the API) it is plain HTTP.
//
// Paths: GET / (the page; ?n=N updates, default 10, at most 100), GET /timeline.svg (the timeline alone, same ?n=).
// A standby coordinator (high availability) answers 503 naming the leader.

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "wsync/v1/coordinator.pb.h"

namespace httplib {
class Server;
}

namespace wsync::daemon {

// The page for `status` and the updates of `history` (oldest first), as of `now`. Pure.
std::string StatusPageHtml(const v1::ClusterStatus& status, const v1::HistoryReply& history, absl::Time now);

// Where the page reads from; each is called per request, from the server's threads.
struct StatusPageSource {
  std::function<absl::Status()> ready;  // not OK: answered 503 with its message (a standby); null: always ready
  std::function<v1::ClusterStatus()> status;
  std::function<v1::HistoryReply(int limit)> history;
};

class StatusPageServer {
 public:
  // Binds `listen` (host:port; port 0 = any free port) and serves in a background thread; HTTPS when the process
  // configuration has TLS (tls::Enabled()). InvalidArgument for a malformed address, Unavailable when the port cannot
  // be bound, Internal when the TLS context cannot be set up.
  static absl::StatusOr<std::unique_ptr<StatusPageServer>> Start(const std::string& listen, StatusPageSource source);
  ~StatusPageServer();
  int port() const { return port_; }

 private:
  StatusPageServer() = default;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace wsync::daemon
