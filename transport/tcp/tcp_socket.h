#pragma once
// Socket plumbing for the tcp transport: an owning fd, listen/connect, and full-length send/recv whose
// failures come back as absl::Status (Unavailable: peer gone; DeadlineExceeded: no progress within the
// socket's timeout). Blocking sockets throughout: each connection has its own thread, and another thread
// interrupts a blocked call with ShutdownBoth().

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace wsync::transport::tcp {

// Owns one file descriptor; closes it on destruction. Move-only.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { Reset(); }
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      Reset();
      fd_ = o.fd_;
      o.fd_ = -1;
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void Reset();
  // Wakes any thread blocked on this socket (its call returns EOF/error); the fd stays open until Reset.
  void ShutdownBoth() const;

 private:
  int fd_ = -1;
};

// Binds and listens on host:port (port 0 = ephemeral). Stores the bound port in *bound_port.
absl::StatusOr<Fd> Listen(const std::string& host, int port, int* bound_port);

// Connects to host:port within `timeout`. Unavailable when refused or unreachable, DeadlineExceeded on timeout.
absl::StatusOr<Fd> ConnectTo(const std::string& host, int port, absl::Duration timeout);

// TCP_NODELAY, large buffers where the kernel allows them, and send/recv timeouts of `io_timeout`
// (a blocked call returns EAGAIN after that long without progress).
void TuneSocket(int fd, absl::Duration io_timeout);

// Sending side: a connection whose sent bytes stay unacknowledged for `timeout` fails with ETIMEDOUT
// (TCP_USER_TIMEOUT), and while nothing is in flight, keepalive probes every second after timeout/2 of silence
// detect a vanished peer within about the same time. A zero timeout leaves the kernel's defaults (minutes).
void SetSendProgressTimeout(int fd, absl::Duration timeout);

// Sends every byte described by iov[0..iovcnt) (the array is modified as it is consumed).
absl::Status SendAll(int fd, struct iovec* iov, int iovcnt);

// Receives exactly n bytes into buf.
absl::Status RecvAll(int fd, void* buf, size_t n);

// "strerror(err) (errno err)".
std::string ErrnoText(int err);

}  // namespace wsync::transport::tcp
