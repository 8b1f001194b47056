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

// Sending side: keepalive probes every second after timeout/2 of silence (at least 1 s), so that a connection with
// nothing in flight still has something the peer must answer. No TCP_USER_TIMEOUT: on Linux it also aborts a
// connection whose peer keeps answering zero-window probes (alive, not reading) once probing lasted that long, which
// send_progress_timeout must not do; SendAllWatched / RecvAllWatched judge the peer themselves (PeerWatch). A zero
// timeout sets nothing (the kernel's defaults).
void SetSendProgressTimeout(int fd, absl::Duration timeout);

// How a sending connection judges its peer while a send or a receive on it makes no progress
// (TransportOptions::send_progress_timeout and io_timeout):
//   * the peer stopped acknowledging: something of ours awaits its answer (unacknowledged bytes, or an unanswered
//     zero-window or keepalive probe: TCP_INFO's tcpi_unacked, tcpi_probes) and no acknowledgement arrived for
//     `progress_timeout` (tcpi_last_ack_recv), on two looks a poll slice apart with no acknowledgement between them
//     (a probe's answer in flight at the first look is not taken for silence): Unavailable, "the peer acknowledged no
//     byte within the send progress timeout". A peer that answers probes with a zero window (its process stopped or
//     not reading) is alive: it is waited for.
//   * nothing moved at all (no byte sent or received, none of ours acknowledged) for `io_timeout`: DeadlineExceeded,
//     "no progress within the i/o timeout" (a stalled peer, alive or not).
// Zero disables either judgement.
struct PeerWatch {
  absl::Duration progress_timeout = absl::ZeroDuration();
  absl::Duration io_timeout = absl::ZeroDuration();
};

// SendAll / RecvAll for a sending connection's blocking socket, judged by `watch` (they poll in slices of at most
// 250 ms while the socket makes no progress). A socket error or a shutdown (ShutdownBoth) ends them at once.
absl::Status SendAllWatched(int fd, struct iovec* iov, int iovcnt, const PeerWatch& watch);
absl::Status RecvAllWatched(int fd, void* buf, size_t n, const PeerWatch& watch);

// Sends every byte described by iov[0..iovcnt) (the array is modified as it is consumed).
absl::Status SendAll(int fd, struct iovec* iov, int iovcnt);

// Receives exactly n bytes into buf.
absl::Status RecvAll(int fd, void* buf, size_t n);

// "strerror(err) (errno err)".
std::string ErrnoText(int err);

}  // namespace wsync::transport::tcp
