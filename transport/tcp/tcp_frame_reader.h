#pragma once
// The receiving side's frame reader: a connection's byte stream into headers and payloads, and payloads into a
// RegionSink's staging buffers.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "transport/transport.h"

namespace wsync::transport::tcp {

// The receiver reads headers and small payloads through this buffer; payloads at least kDirectRecvBytes long
// are recv()d straight into the destination region.
constexpr size_t kRecvBufferBytes = 256 << 10;
constexpr size_t kDirectRecvBytes = 64 << 10;

// Reads a connection's byte stream: headers and small payloads through a buffer (few syscalls for many small
// writes), large payloads straight into their destination.
class FrameReader {
 public:
  explicit FrameReader(int fd) : fd_(fd), buf_(kRecvBufferBytes) {}

  // Reads exactly n bytes into dst. With `idle_ok`, a receive timeout before the first byte is an idle
  // connection between batches, not a stall: keep waiting (shutdown of the socket ends the wait).
  // `fill_limit` caps how much one buffered recv pulls in: after a large payload the next header is read
  // alone, so that the large payload after it is not copied through the buffer.
  absl::Status Read(void* dst, size_t n, bool idle_ok, size_t fill_limit = kRecvBufferBytes);
  // Reads and drops n bytes.
  absl::Status Discard(uint64_t n);

 private:
  int fd_;
  std::vector<char> buf_;
  size_t begin_ = 0;
  size_t end_ = 0;
};

// Receives one write's payload through a sink's staging buffers, one chunk at a time; each chunk's copy starts as
// soon as it is in, so receiving the next chunk overlaps the copy of the previous ones. Returns the stream's
// status; a failure of the sink (a device error) goes to *sink_error, the rest of the payload is read and dropped
// so the stream stays in step, and the batch's ack reports it.
absl::Status ReceiveIntoSink(FrameReader& reader, RegionSink& sink, uint64_t offset, uint64_t length,
                             absl::Status* sink_error);

}  // namespace wsync::transport::tcp
