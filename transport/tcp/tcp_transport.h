#pragma once
// The tcp backend: one-sided-write semantics over TCP sockets.
//
// Every TcpTransport runs a listener (TransportOptions::bind_host/tcp_port, ephemeral by default). A new connection
// waits in the accept loop's poll set (no thread) until its hello arrives (hello_timeout, else it is closed), then
// gets a thread that receives frames and recv()s the payload straight into the destination region after checking
// its bounds, and acknowledges each batch; connections per peer address and in total are capped. Writes need the
// open write window and, with RequireGrants, a connection whose hello carried the secret of a live write grant
// covering the region (CreateGrantedEndpoint); otherwise any connected peer holding a region's descriptor may
// write. An endpoint's LocalInfo is its transport's listener address plus the transport's random token (and a
// granted endpoint's secret); Connect() opens a connection to the peer's listener, so either side may send. A
// sending endpoint sends a batch's frames with sendmsg() straight from the source region, split over up to
// TransportOptions::tcp_streams connections when the batch is large.
//
// Liveness: a sending connection whose peer acknowledges nothing for TransportOptions::send_progress_timeout while
// bytes or probes await its answer (a pulled link, a peer host gone) fails its batch with Unavailable; a peer that
// answers with a zero window (alive, not reading) is waited for up to io_timeout. The first failed connection shuts
// the endpoint's others down, so the batch fails at once rather than at their own timeouts. Endpoint::Cancel shuts
// the endpoint's sockets down, so a batch blocked on a dead peer fails at once with the canceller's reason.

#include <memory>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace wsync::transport::tcp {

// Starts the listener. Unavailable when it cannot bind.
absl::StatusOr<std::unique_ptr<Transport>> CreateTcpTransport(const TransportOptions& opts);

}  // namespace wsync::transport::tcp
