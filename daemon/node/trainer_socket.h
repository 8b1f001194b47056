#pragma once
// The source daemon's hand-over socket for trainer ranks (docs/security.md, "Trainer ranks").
//
// A rank connects to the Unix socket at `path`; the daemon reads the kernel's SO_PEERCRED of the connection and
// refuses, with a message naming the uid and gid, any process whose uid is neither the daemon's nor listed, and whose
// gid is not listed. An allowed rank sends one frame (base/fd_passing.h framing, JSON):
//   {"type": "open", "protocol": 1, "local_rank": R, "global_rank": G}
// and gets back one frame carrying the ring's memfd (SCM_RIGHTS):
//   {"type": "opened", "ok": true, "session_id": "<32 hex>", "ring_bytes": N, "num_local_ranks": K,
//    "rpc": "unix:<path>.rpc"}
// or, without a descriptor, {"type": "opened", "ok": false, "error": "..."}. The rank keeps the connection open for
// the session's life: its end (process exit included) marks the session dead. The session id authorizes the rank's
// TrainerIngest calls on the gRPC server at "rpc" (a Unix socket too; the TCP listener does not serve them).
// A rank that places tensors straight into the replica (zero-copy placement) opens another connection and sends
//   {"type": "replica", "protocol": 1, "session_id": "<its session id>"}
// and gets {"type": "replica", "ok": true, "replica_generation": G, "replica_bytes": [...]} with one memfd per
// replica layout (kMaxFdsPerFrame at most), after which the daemon closes that connection.
//
// Threads: one loop thread polls the listener and every connection and never blocks on a peer: a hello frame is read
// as its bytes arrive (non-blocking), and the whole frame must have arrived within one deadline from the accept (a
// few seconds), so a peer that trickles its hello delays no other rank's session.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "base/fd_passing.h"
#include "daemon/node/source_node.h"

namespace wsync::daemon {

inline constexpr int kTrainerProtocol = 1;

struct TrainerSocketOptions {
  std::string path;                 // the hand-over socket; the gRPC socket is path + ".rpc"
  std::vector<uint32_t> uids;       // further uids allowed (the daemon's own always is)
  std::vector<uint32_t> gids;       // gids allowed (a peer whose primary gid is listed)
};

// "<dir>/wsyncd.sock" in DefaultSocketPath's directory.
std::string DefaultTrainerSocket();

class TrainerSocket {
 public:
  // Binds `opts.path` (mode 0660; 0666 when other uids are allowed: SO_PEERCRED decides) and starts the loop.
  // A live socket at the path (another daemon answers there) is an error; a stale one is replaced.
  // `rpc_address` is what ranks are told to dial for TrainerIngest ("unix:...").
  static absl::StatusOr<std::unique_ptr<TrainerSocket>> Start(TrainerSocketOptions opts, SourceNode* source,
                                                              std::string rpc_address);
  ~TrainerSocket();  // stops the loop, closes every connection, removes the socket file

  // The file mode the sockets get for these options.
  static int SocketMode(const TrainerSocketOptions& opts);
  // Fails when something answers on `path` (another daemon), replaces a stale socket, refuses a non-socket file.
  static absl::Status ClaimPath(const std::string& path);

 private:
  struct Conn {
    ScopedFd fd;
    uint32_t uid = 0, gid = 0;
    int64_t pid = 0;
    std::string session_id;  // empty until its hello opened a session
    int64_t hello_by_ms = 0; // monotonic deadline for the whole hello frame
    std::string hello;       // what has arrived of the hello frame: its 4-byte length prefix, then the message
    bool hello_fds = false;  // descriptors rode on it (refused; they were closed on arrival)
  };
  TrainerSocket(TrainerSocketOptions opts, SourceNode* source, std::string rpc_address)
      : opts_(std::move(opts)), source_(source), rpc_address_(std::move(rpc_address)) {}
  void Loop();
  void Accept();
  // Handles a readable connection; false when it is finished (closed or refused).
  bool Serve(Conn* c);
  // Reads, without blocking, what has arrived of `c`'s hello frame: true once the frame is complete, false while
  // more is to come; an error when the peer closed or the frame is malformed.
  static absl::StatusOr<bool> ReadHello(Conn* c);
  // A {"type": "replica", "session_id": ...} hello: answers with the replica's memfds (zero-copy placement); always
  // finishes the connection.
  bool ServeReplica(Conn* c, const std::string& session_id);
  std::string Allowed() const;  // "uid 1000" / "uid 1000, 1001; gid 50" for messages

  TrainerSocketOptions opts_;
  SourceNode* source_;
  std::string rpc_address_;
  ScopedFd listen_fd_, wake_rd_, wake_wr_;
  std::map<int, std::unique_ptr<Conn>> conns_;  // loop thread only
  std::atomic<bool> stop_{false};
  std::thread loop_;
};

}  // namespace wsync::daemon
