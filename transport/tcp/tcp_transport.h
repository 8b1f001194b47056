#pragma once
// The tcp backend: one-sided-write semantics over TCP sockets.
//
// Every TcpTransport runs a listener (TransportOptions::bind_host/tcp_port, ephemeral by default) with one
// thread per accepted connection; those threads receive frames and recv() the payload straight into the
// destination region after checking its bounds, then acknowledge each batch. Regions registered on a transport
// are writable by any connected peer holding their descriptor. An endpoint's LocalInfo is its transport's
// listener address plus the transport's random token; Connect() opens a connection to the peer's listener,
// so either side may send. A sending endpoint sends a batch's frames with sendmsg() straight from the source
// region, split over up to TransportOptions::tcp_streams connections when the batch is large.

#include <memory>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace wsync::transport::tcp {

// Starts the listener. Unavailable when it cannot bind.
absl::StatusOr<std::unique_ptr<Transport>> CreateTcpTransport(const TransportOptions& opts);

}  // namespace wsync::transport::tcp
