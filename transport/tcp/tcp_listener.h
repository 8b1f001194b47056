#pragma once
// The receiving side's listener.

#include <memory>
#include <string>

#include "transport/tcp/tcp_region_table.h"
#include "transport/tcp/tcp_socket.h"
#include "transport/transport.h"

namespace wsync::transport::tcp {

// Accepts connections on the transport's listening socket. A new connection stays in the accept loop's own poll set,
// holding no thread, while the loop reads its hello without blocking, whatever the byte rate; the hello must be
// complete within hello_timeout of the accept (one total deadline: a peer trickling bytes cannot extend it) and is
// checked there (AdmitHello). Only an admitted connection gets a thread that serves it. Connections per peer address
// and in total are capped (pending and served together), so an idle or trickling flood costs a bounded number of fds
// and no threads, and the listener keeps serving. Refusals and failed connections are logged at most once per peer
// per minute (RegionTable::WarnPeer).
class Listener {
 public:
  // Starts the accept thread on `listen_fd`; a write to `wake_fd` (an eventfd) stops it.
  Listener(std::shared_ptr<RegionTable> table, Fd listen_fd, Fd wake_fd, std::string address,
           const TransportOptions& opts);
  // Stops accepting, shuts down and joins every connection.
  ~Listener();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace wsync::transport::tcp
