#pragma once
// The receiving side's per-connection server.

#include <string>

#include "absl/status/status.h"
#include "transport/tcp/tcp_region_table.h"

namespace wsync::transport::tcp {

// Serves one accepted connection until it closes, fails, or the socket is shut down.
// Errors in a batch's content (unknown region, out of bounds) are reported in that batch's ack, after which the
// connection closes (the sender re-creates its endpoint). A malformed stream is answered with an error ack at
// once and closed. Writes into a read-only region (a source's memory) are refused and counted; `peer` (host:port)
// names the writer in that error and its log line.
absl::Status ServeConnection(int fd, RegionTable& table, const std::string& peer);

}  // namespace wsync::transport::tcp
