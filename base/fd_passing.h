#pragma once
// File-descriptor ownership and passing over unix-domain sockets (SCM_RIGHTS). The daemon uses this to hand
// a trainer rank the memfd of its shared-memory ring; engine ranks use it to hand the target daemon their weight
// memory segments (docs/engines.md, "The attach protocol").

#include <string>
#include <vector>

#include "absl/types/span.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace wsync {

// Owns one file descriptor; closes it on destruction. Movable, not copyable.
class ScopedFd {
 public:
  ScopedFd() = default;
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() { reset(); }
  ScopedFd(ScopedFd&& other) noexcept : fd_(other.release()) {}
  ScopedFd& operator=(ScopedFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Gives up ownership without closing.
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  // Closes the owned fd (errors are logged, never thrown) and takes `fd`.
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// Returns an owned duplicate (F_DUPFD_CLOEXEC) of `fd`.
absl::StatusOr<ScopedFd> DupFd(int fd);

// Sends `fd` plus `msg` (may be empty, at most kMaxFdMessageBytes) on the unix socket `sock` in one sendmsg.
// Works on SOCK_STREAM and SOCK_SEQPACKET sockets; the message is length-prefixed so stream sockets keep framing.
// Blocks until the kernel accepts the bytes. The caller keeps ownership of `fd` (the receiver gets its own).
absl::Status SendFd(int sock, int fd, const std::string& msg);

inline constexpr size_t kMaxFdMessageBytes = 64 * 1024;

struct ReceivedFd {
  ScopedFd fd;
  std::string message;
};

// Receives one SendFd() frame from `sock`. Blocks until it arrives; Unavailable if the peer closed the socket,
// DataLoss if the frame is malformed or carries no descriptor. The returned fd is close-on-exec.
absl::StatusOr<ReceivedFd> ReceiveFd(int sock);

// Frames with any number of descriptors, 0 to kMaxFdsPerFrame. Same framing as SendFd (4-byte little-endian length,
// then the bytes); the descriptors ride on the sendmsg that carries the frame's first byte.
inline constexpr size_t kMaxFdsPerFrame = 200;
// Largest message SendFds accepts (a receiver chooses its own limit, at most this).
inline constexpr size_t kMaxFramedMessageBytes = 64ull << 20;

// Sends `fds` (0..kMaxFdsPerFrame) plus `msg` (at most kMaxFramedMessageBytes) on the unix socket `sock`. Blocks
// until the kernel accepted every byte (or the socket's SO_SNDTIMEO passed). The caller keeps ownership of `fds`.
absl::Status SendFds(int sock, absl::Span<const int> fds, const std::string& msg);

struct ReceivedFds {
  std::vector<ScopedFd> fds;  // in the sender's order, close-on-exec
  std::string message;
};

// Receives one frame sent by SendFds or SendFd from `sock`. Blocks until it arrives (or the socket's SO_RCVTIMEO
// passed: Unavailable/DeadlineExceeded per errno). Unavailable if the peer closed the socket before the frame,
// DataLoss if the frame is malformed, its message exceeds `max_message_bytes` or its descriptors were truncated
// (more than kMaxFdsPerFrame); descriptors received with a bad frame are closed.
absl::StatusOr<ReceivedFds> ReceiveFds(int sock, size_t max_message_bytes = kMaxFdMessageBytes);

}  // namespace wsync
