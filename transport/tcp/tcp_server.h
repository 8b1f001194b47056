#pragma once
// The receiving side's per-connection server.

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/tcp/tcp_region_table.h"
#include "transport/tcp/tcp_wire.h"

namespace wsync::transport::tcp {

// Decides whether a complete hello admits its connection: its write grant when it presented a live secret, null
// when it presented none (accepted for the symmetric handshake; with grants required its write frames are refused),
// or the error its hello ack answers (bad magic or version, another transport's token, an unknown or expired secret),
// counted as a refusal. Does not block.
absl::StatusOr<std::shared_ptr<RegionTable::Grant>> AdmitHello(const Hello& hello, RegionTable& table);

// Answers a refused hello with an error ack, without blocking (the accept loop calls it; a fresh connection's send
// buffer always holds the ack, and if it did not the peer would only miss the reason).
void RejectHello(int fd, const absl::Status& why);

// Serves one admitted connection (AdmitHello's `grant`): sends the hello ack, then serves batches until the
// connection closes, fails, or the socket is shut down.
// Errors in a batch's content (unknown region, out of bounds) are reported in that batch's ack, after which the
// connection closes (the sender re-creates its endpoint). A malformed stream is answered with an error ack at
// once and closed. Writes into a read-only region (a source's memory) are refused and counted; `peer` (host:port)
// names the writer in that error.
absl::Status ServeConnection(int fd, RegionTable& table, const std::string& peer,
                             std::shared_ptr<RegionTable::Grant> grant);

}  // namespace wsync::transport::tcp
