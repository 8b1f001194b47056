#include "base/fd_passing.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <vector>
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace wsync {
namespace {

absl::Status ErrnoStatus(absl::string_view what, int err) {
  return absl::ErrnoToStatus(err, absl::StrCat(what, ": ", std::strerror(err)));
}

// Reads exactly `len` bytes from a stream socket (after the first recvmsg).
absl::Status ReadFull(int sock, char* buf, size_t len) {
  size_t done = 0;
  while (done < len) {
    ssize_t n = ::recv(sock, buf + done, len - done, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK)
        return absl::DeadlineExceededError("ReceiveFds: frame incomplete at the socket's receive timeout");
      return ErrnoStatus("ReceiveFds: recv", errno);
    }
    if (n == 0) return absl::DataLossError("ReceiveFds: peer closed the socket inside a frame");
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

void ScopedFd::reset(int fd) {
  if (fd_ >= 0 && ::close(fd_) != 0) {
    spdlog::warn("close(fd {}) failed: {}", fd_, std::strerror(errno));
  }
  fd_ = fd;
}

absl::StatusOr<ScopedFd> DupFd(int fd) {
  int d = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (d < 0) return ErrnoStatus(absl::StrCat("dup(fd ", fd, ")"), errno);
  return ScopedFd(d);
}

absl::Status SendFds(int sock, absl::Span<const int> fds, const std::string& msg) {
  if (msg.size() > kMaxFramedMessageBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("SendFds: message of ", msg.size(), " bytes exceeds ", kMaxFramedMessageBytes));
  }
  if (fds.size() > kMaxFdsPerFrame) {
    return absl::InvalidArgumentError(
        absl::StrCat("SendFds: ", fds.size(), " descriptors exceed ", kMaxFdsPerFrame, " per frame"));
  }
  // One buffer: 4-byte little-endian length, then the message. The fds ride on the first byte.
  static_assert(sizeof(uint32_t) == 4 && kMaxFramedMessageBytes <= UINT32_MAX, "the length prefix is 4 bytes");
  std::string frame(4 + msg.size(), '\0');
  const uint32_t len = static_cast<uint32_t>(msg.size());
  std::memcpy(frame.data(), &len, 4);
  std::memcpy(frame.data() + 4, msg.data(), msg.size());

  std::vector<char> control(fds.empty() ? 0 : CMSG_SPACE(sizeof(int) * fds.size()));
  struct iovec iov = {frame.data(), frame.size()};
  struct msghdr mh = {};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  if (!fds.empty()) {
    mh.msg_control = control.data();
    mh.msg_controllen = control.size();
    struct cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }

  size_t sent = 0;
  while (sent < frame.size()) {
    ssize_t n;
    if (sent == 0) {
      n = ::sendmsg(sock, &mh, MSG_NOSIGNAL);
    } else {
      n = ::send(sock, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(absl::StrCat("SendFds: sendmsg(sock ", sock, ", ", fds.size(), " fds)"), errno);
    }
    sent += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status SendFd(int sock, int fd, const std::string& msg) {
  if (msg.size() > kMaxFdMessageBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("SendFd: message of ", msg.size(), " bytes exceeds ", kMaxFdMessageBytes));
  }
  const int fds[1] = {fd};
  return SendFds(sock, fds, msg);
}

absl::StatusOr<ReceivedFds> ReceiveFds(int sock, size_t max_message_bytes) {
  max_message_bytes = std::min(max_message_bytes, kMaxFramedMessageBytes);
  int type = 0;
  socklen_t type_len = sizeof(type);
  if (::getsockopt(sock, SOL_SOCKET, SO_TYPE, &type, &type_len) != 0) {
    return ErrnoStatus("ReceiveFds: getsockopt(SO_TYPE)", errno);
  }
  const bool stream = type == SOCK_STREAM;
  // A stream socket may hold the next frame right behind this one, so read only the length prefix first;
  // packet sockets must take the whole frame in one call or the rest is discarded.
  std::string buf(stream ? 4 : 4 + max_message_bytes, '\0');
  std::vector<char> control(CMSG_SPACE(sizeof(int) * kMaxFdsPerFrame));
  struct iovec iov = {buf.data(), buf.size()};
  struct msghdr mh = {};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control.data();
  mh.msg_controllen = control.size();

  ssize_t n;
  do {
    n = ::recvmsg(sock, &mh, MSG_CMSG_CLOEXEC | (stream ? MSG_WAITALL : 0));
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK)
      return absl::DeadlineExceededError("ReceiveFds: no frame before the socket's receive timeout");
    return ErrnoStatus("ReceiveFds: recvmsg", errno);
  }

  // Take ownership of every received descriptor first, so none leaks on an error path.
  ReceivedFds out;
  for (struct cmsghdr* c = CMSG_FIRSTHDR(&mh); c != nullptr; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      out.fds.emplace_back(fd);
    }
  }
  if (n == 0) return absl::UnavailableError("ReceiveFds: peer closed the socket");
  if (mh.msg_flags & MSG_CTRUNC)
    return absl::DataLossError(absl::StrCat("ReceiveFds: descriptors truncated (more than ", kMaxFdsPerFrame,
                                            " on one frame?)"));
  if (n < 4) return absl::DataLossError(absl::StrCat("ReceiveFds: short frame (", n, " bytes)"));

  uint32_t len;
  std::memcpy(&len, buf.data(), 4);
  if (len > max_message_bytes) {
    return absl::DataLossError(absl::StrCat("ReceiveFds: message length ", len, " exceeds ", max_message_bytes));
  }
  if (stream) {
    out.message.resize(len);
    absl::Status s = ReadFull(sock, out.message.data(), len);
    if (!s.ok()) return s;
  } else {
    if (static_cast<size_t>(n) != 4 + len || (mh.msg_flags & MSG_TRUNC)) {
      return absl::DataLossError(
          absl::StrCat("ReceiveFds: packet of ", n, " bytes does not match its length prefix ", len));
    }
    out.message.assign(buf.data() + 4, len);
  }
  return out;
}

absl::StatusOr<ReceivedFd> ReceiveFd(int sock) {
  auto r = ReceiveFds(sock, kMaxFdMessageBytes);
  if (!r.ok()) return r.status();
  if (r->fds.empty()) return absl::DataLossError("ReceiveFd: frame carried no file descriptor");
  if (r->fds.size() > 1) spdlog::warn("ReceiveFd: closed {} unexpected extra descriptors", r->fds.size() - 1);
  ReceivedFd out;
  out.fd = std::move(r->fds.front());
  out.message = std::move(r->message);
  return out;
}

}  // namespace wsync
