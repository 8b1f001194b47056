#include "transport/tcp/tcp_socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "spdlog/spdlog.h"

namespace wsync::transport::tcp {
namespace {

// Socket buffers we ask for. Setting SO_SNDBUF/SO_RCVBUF turns off the kernel's autotuning, so we only do it
// when the kernel lets us go at least this large; otherwise autotuning (up to tcp_rmem/tcp_wmem) does better.
constexpr int kSocketBufferBytes = 8 << 20;
// TCP_RTO_MAX_MS of linux/tcp.h (Linux 6.15), which Debian 12's headers predate.
constexpr int kTcpRtoMaxMs = 44;

int ReadProcInt(const char* path) {
  std::ifstream f(path);
  int v = 0;
  f >> v;
  return v;
}

absl::StatusOr<sockaddr_in> Resolve(const std::string& host, int port) {
  if (port < 0 || port > 65535) return absl::InvalidArgumentError(absl::StrCat("bad port ", port));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (host.empty() || host == "0.0.0.0") {
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    return addr;
  }
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) == 1) return addr;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot resolve host \"", host, "\": ", gai_strerror(rc)));
  }
  addr.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return addr;
}

absl::Status IoError(const char* op, int err) {
  if (err == EAGAIN || err == EWOULDBLOCK) {
    return absl::DeadlineExceededError(absl::StrCat(op, ": no progress within the i/o timeout"));
  }
  if (err == ETIMEDOUT) {
    return absl::DeadlineExceededError(absl::StrCat(
        op, ": the peer acknowledged no byte within the send progress timeout (link down or peer host gone; ",
        ErrnoText(err), ")"));
  }
  return absl::UnavailableError(absl::StrCat(op, ": ", ErrnoText(err)));
}

}  // namespace

void Fd::Reset() {
  if (fd_ >= 0 && ::close(fd_) != 0) spdlog::warn("tcp: close({}) failed: {}", fd_, ErrnoText(errno));
  fd_ = -1;
}

void Fd::ShutdownBoth() const {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

std::string ErrnoText(int err) { return absl::StrCat(std::strerror(err), " (errno ", err, ")"); }

absl::StatusOr<Fd> Listen(const std::string& host, int port, int* bound_port) {
  absl::StatusOr<sockaddr_in> addr = Resolve(host, port);
  if (!addr.ok()) return addr.status();
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return absl::InternalError(absl::StrCat("socket: ", ErrnoText(errno)));
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) != 0) {
    return absl::UnavailableError(absl::StrCat("bind ", host, ":", port, ": ", ErrnoText(errno)));
  }
  if (::listen(fd.get(), 128) != 0) {
    return absl::InternalError(absl::StrCat("listen ", host, ":", port, ": ", ErrnoText(errno)));
  }
  sockaddr_in bound{};
  socklen_t len = sizeof(bound);
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
    return absl::InternalError(absl::StrCat("getsockname: ", ErrnoText(errno)));
  }
  *bound_port = ntohs(bound.sin_port);
  return fd;
}

absl::StatusOr<Fd> ConnectTo(const std::string& host, int port, absl::Duration timeout) {
  absl::StatusOr<sockaddr_in> addr = Resolve(host, port);
  if (!addr.ok()) return addr.status();
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return absl::InternalError(absl::StrCat("socket: ", ErrnoText(errno)));
  const std::string where = absl::StrCat(host, ":", port);
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) != 0) {
    if (errno != EINPROGRESS) {
      return absl::UnavailableError(absl::StrCat("connect to ", where, ": ", ErrnoText(errno)));
    }
    pollfd p{fd.get(), POLLOUT, 0};
    int64_t ms = absl::ToInt64Milliseconds(timeout);
    int rc;
    do {
      rc = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(ms, 1 << 30))));
    } while (rc < 0 && errno == EINTR);
    if (rc == 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("connect to ", where, ": no answer within ", absl::FormatDuration(timeout)));
    }
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (rc < 0) err = errno;
    if (err != 0) return absl::UnavailableError(absl::StrCat("connect to ", where, ": ", ErrnoText(err)));
  }
  int flags = ::fcntl(fd.get(), F_GETFL);
  ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

void TuneSocket(int fd, absl::Duration io_timeout) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  static const bool kBigBuffersAllowed = ReadProcInt("/proc/sys/net/core/wmem_max") >= kSocketBufferBytes &&
                                         ReadProcInt("/proc/sys/net/core/rmem_max") >= kSocketBufferBytes;
  if (kBigBuffersAllowed) {
    int size = kSocketBufferBytes;
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof(size));
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof(size));
  }
  timeval tv{};
  int64_t us = absl::ToInt64Microseconds(io_timeout);
  if (us > 0) {
    tv.tv_sec = us / 1000000;
    tv.tv_usec = us % 1000000;
  }
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

void SetSendProgressTimeout(int fd, absl::Duration timeout) {
  const int64_t ms = absl::ToInt64Milliseconds(timeout);
  if (ms <= 0) return;
  int one = 1;
  int idle = static_cast<int>(std::clamp<int64_t>(ms / 2000, 1, 3600));
  int interval = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  // Zero-window probes back off like retransmissions, up to 120 s apart by default: a peer that died after a long
  // zero window would be noticed only at its next probes. Linux 6.15+ caps the backoff per socket (1 s at least);
  // on older kernels the option is refused and the i/o timeout bounds that case.
  int rto_max_ms = static_cast<int>(std::clamp<int64_t>(ms / 4, 1000, 120000));
  ::setsockopt(fd, IPPROTO_TCP, kTcpRtoMaxMs, &rto_max_ms, sizeof(rto_max_ms));
}

namespace {

// What TCP_INFO says of the peer's answers at one look.
struct AckLook {
  absl::Time at;
  bool awaiting = false;     // bytes unacknowledged or two probes in a row unanswered
  uint32_t last_ack_ms = 0;  // since the last acknowledgement arrived
};

bool LookAtPeer(int fd, AckLook* look) {
  tcp_info ti{};
  socklen_t len = sizeof(ti);
  if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) return false;
  look->at = absl::Now();
  // One unanswered probe is no sign: a receiver answers out-of-window segments (zero-window probes) at most every
  // 500 ms (tcp_invalid_ratelimit), and the next probe may be far off.
  look->awaiting = ti.tcpi_unacked > 0 || ti.tcpi_probes >= 2;
  look->last_ack_ms = ti.tcpi_last_ack_recv;
  return true;
}

// One send or receive loop's judgement of its peer (PeerWatch in the header).
class Watcher {
 public:
  Watcher(int fd, const PeerWatch& watch, const char* op)
      : fd_(fd), watch_(watch), op_(op), last_progress_(absl::Now()) {
    absl::Duration slice = watch.progress_timeout / 4;
    if (slice <= absl::ZeroDuration() || slice > absl::Milliseconds(250)) slice = absl::Milliseconds(250);
    slice_ms_ = static_cast<int>(std::max<int64_t>(10, absl::ToInt64Milliseconds(slice)));
  }
  void Progressed() {
    last_progress_ = absl::Now();
    silent_ = false;
  }
  // Waits up to one slice for `events`; an error once the peer is judged gone or stalled.
  absl::Status Await(short events) {
    pollfd p{fd_, events, 0};
    int rc = ::poll(&p, 1, slice_ms_);
    if (rc != 0) return absl::OkStatus();  // ready, an error to read from the socket, or EINTR: the caller retries
    const absl::Time now = absl::Now();
    if (watch_.io_timeout > absl::ZeroDuration() && now - last_progress_ >= watch_.io_timeout) {
      return absl::DeadlineExceededError(absl::StrCat(op_, ": no progress within the i/o timeout (",
                                                      absl::FormatDuration(watch_.io_timeout), ")"));
    }
    if (watch_.progress_timeout <= absl::ZeroDuration()) return absl::OkStatus();
    AckLook look;
    if (!LookAtPeer(fd_, &look)) return absl::OkStatus();
    const int64_t limit_ms = absl::ToInt64Milliseconds(watch_.progress_timeout);
    const bool quiet = look.awaiting && look.last_ack_ms >= limit_ms;
    // Silent on two looks a slice apart with no acknowledgement between them (the age of the last one only grew).
    if (quiet && silent_ && look.last_ack_ms >= first_.last_ack_ms &&
        look.at - first_.at >= absl::Milliseconds(slice_ms_)) {
      return absl::UnavailableError(absl::StrCat(
          op_, ": the peer acknowledged no byte within the send progress timeout (nothing for ", look.last_ack_ms,
          " ms with data or a probe awaiting its answer: link down, peer host gone or packets dropped)"));
    }
    if (!quiet) {
      silent_ = false;
    } else if (!silent_) {
      silent_ = true;
      first_ = look;
    }
    return absl::OkStatus();
  }

 private:
  const int fd_;
  const PeerWatch watch_;
  const char* const op_;
  absl::Time last_progress_;
  int slice_ms_ = 250;
  bool silent_ = false;  // the last look found the peer silent; first_ is the first of that run of looks
  AckLook first_;
};

// Moves `*iov`/`*iovcnt` past the first `sent` bytes (a partial sendmsg).
void SkipSent(struct iovec** iov, int* iovcnt, size_t sent) {
  while (*iovcnt > 0 && sent >= (*iov)->iov_len) {
    sent -= (*iov)->iov_len;
    ++*iov;
    --*iovcnt;
  }
  if (*iovcnt > 0) {
    (*iov)->iov_base = static_cast<char*>((*iov)->iov_base) + sent;
    (*iov)->iov_len -= sent;
  }
}

}  // namespace

absl::Status SendAllWatched(int fd, struct iovec* iov, int iovcnt, const PeerWatch& watch) {
  Watcher watcher(fd, watch, "send");
  while (iovcnt > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(iovcnt);
    ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return IoError("send", errno);
      WSYNC_RETURN_IF_ERROR(watcher.Await(POLLOUT));
      continue;
    }
    watcher.Progressed();
    SkipSent(&iov, &iovcnt, static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

absl::Status RecvAllWatched(int fd, void* buf, size_t n, const PeerWatch& watch) {
  Watcher watcher(fd, watch, "recv");
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t got = ::recv(fd, p, n, MSG_DONTWAIT);
    if (got < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return IoError("recv", errno);
      WSYNC_RETURN_IF_ERROR(watcher.Await(POLLIN));
      continue;
    }
    if (got == 0) return absl::UnavailableError("recv: connection closed by the peer");
    watcher.Progressed();
    p += got;
    n -= static_cast<size_t>(got);
  }
  return absl::OkStatus();
}

absl::Status SendAll(int fd, struct iovec* iov, int iovcnt) {
  while (iovcnt > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(iovcnt);
    ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return IoError("send", errno);
    }
    SkipSent(&iov, &iovcnt, static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

absl::Status RecvAll(int fd, void* buf, size_t n) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t got = ::recv(fd, p, n, MSG_WAITALL);
    if (got < 0) {
      if (errno == EINTR) continue;
      return IoError("recv", errno);
    }
    if (got == 0) return absl::UnavailableError("recv: connection closed by the peer");
    p += got;
    n -= static_cast<size_t>(got);
  }
  return absl::OkStatus();
}

}  // namespace wsync::transport::tcp
