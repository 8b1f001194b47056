#include "transport/tcp/tcp_frame_reader.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "transport/tcp/tcp_socket.h"

namespace wsync::transport::tcp {

absl::Status FrameReader::Read(void* dst, size_t n, bool idle_ok, size_t fill_limit) {
  char* out = static_cast<char*>(dst);
  bool started = false;
  while (n > 0) {
    if (begin_ < end_) {
      size_t k = std::min(n, end_ - begin_);
      std::memcpy(out, buf_.data() + begin_, k);
      begin_ += k;
      out += k;
      n -= k;
      started = true;
      continue;
    }
    begin_ = end_ = 0;
    const bool direct = n >= kDirectRecvBytes;
    ssize_t got = direct ? ::recv(fd_, out, n, MSG_WAITALL)
                         : ::recv(fd_, buf_.data(), std::max(n, std::min(fill_limit, buf_.size())), 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      if ((errno == EAGAIN || errno == EWOULDBLOCK) && idle_ok && !started) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return absl::DeadlineExceededError("sender stalled in the middle of a frame");
      }
      return absl::UnavailableError(absl::StrCat("recv: ", ErrnoText(errno)));
    }
    if (got == 0) {
      return absl::UnavailableError(started || !idle_ok ? "connection closed in the middle of a frame"
                                                        : "connection closed");
    }
    started = true;
    if (direct) {
      out += got;
      n -= static_cast<size_t>(got);
    } else {
      end_ = static_cast<size_t>(got);
    }
  }
  return absl::OkStatus();
}

absl::Status FrameReader::Discard(uint64_t n) {
  char scratch[16 << 10];
  while (n > 0) {
    size_t k = static_cast<size_t>(std::min<uint64_t>(n, sizeof(scratch)));
    WSYNC_RETURN_IF_ERROR(Read(scratch, k, false));
    n -= k;
  }
  return absl::OkStatus();
}

absl::Status ReceiveIntoSink(FrameReader& reader, RegionSink& sink, uint64_t offset, uint64_t length,
                             absl::Status* sink_error) {
  const uint64_t chunk = std::max<uint64_t>(sink.chunk_bytes(), 1);
  for (uint64_t done = 0; done < length;) {
    const uint64_t n = std::min(chunk, length - done);
    absl::StatusOr<RegionSink::Staging> st = sink.Acquire();
    if (!st.ok()) {
      *sink_error = st.status();
      return reader.Discard(length - done);
    }
    absl::Status s = reader.Read(st->data, n, false);
    if (!s.ok()) {
      sink.Cancel(*st);
      return s;
    }
    done += n;
    if (absl::Status ss = sink.Submit(*st, offset + done - n, n); !ss.ok()) {
      *sink_error = ss;
      return reader.Discard(length - done);
    }
  }
  return absl::OkStatus();
}

}  // namespace wsync::transport::tcp
