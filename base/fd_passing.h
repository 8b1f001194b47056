#pragma once
// File-descriptor ownership and passing over unix-domain sockets (SCM_RIGHTS). The daemon uses this to hand
// a trainer rank the memfd of its shared-memory ring.

#include <string>

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

}  // namespace wsync
