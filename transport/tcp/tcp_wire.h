#pragma once
// Wire format of the tcp transport. Host byte order on both ends (see the static_assert), fixed-size structs
// sent as raw bytes, so every struct below has an exact, padding-free size.
//
// A connection (sender → receiver's listener):
//   sender:   Hello
//   receiver: Ack{type = kHelloAck}            (code != 0: rejected, connection closes)
//   then per batch, on each connection the batch uses:
//   sender:   FrameHeader{kWrite} + payload, ...  FrameHeader{kCommit}
//   receiver: Ack{type = kBatchAck} [+ message] (code != 0: the batch failed, connection closes)

#include <cstdint>

namespace wsync::transport::tcp {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "wire structs are sent in host order; every supported host is little-endian");

constexpr uint32_t kFrameMagic = 0x57535946;   // "WSYF"
constexpr uint32_t kDescMagic = 0x57535444;    // "WSTD"
constexpr uint16_t kProtocolVersion = 2;  // 2: Hello carries the write secret
// Largest payload of one write frame; larger writes are streamed as several frames. The receiver rejects
// anything bigger, which bounds what a corrupt header can make it read.
constexpr uint64_t kMaxFramePayload = 1 << 20;
constexpr uint32_t kMaxAckMessage = 1024;

enum FrameType : uint16_t {
  kHello = 1,
  kHelloAck = 2,
  kWrite = 3,
  kCommit = 4,
  kBatchAck = 5,
};

struct Hello {
  uint32_t magic;
  uint16_t type;
  uint16_t version;
  uint64_t token;  // the receiving transport's token, from its LocalInfo: rejects stale or foreign peer info
  uint32_t stream;
  uint32_t reserved;
  // The write secret of a granted endpoint's LocalInfo (Transport::CreateGrantedEndpoint); zero when it had none.
  uint64_t secret[2];
};
static_assert(sizeof(Hello) == 40, "Hello is sent as raw bytes");

// kWrite: `length` payload bytes follow, to land at `offset` in region `region`.
// kCommit: end of the batch's frames on this connection; `region` = number of write frames, `length` = bytes.
struct FrameHeader {
  uint32_t magic;
  uint16_t type;
  uint16_t reserved;
  uint64_t batch;
  uint64_t region;
  uint64_t offset;
  uint64_t length;
};
static_assert(sizeof(FrameHeader) == 40, "FrameHeader is sent as raw bytes");

// `code` is an absl::StatusCode; `message_len` bytes of message follow.
struct Ack {
  uint32_t magic;
  uint16_t type;
  uint16_t code;
  uint64_t batch;
  uint64_t bytes;
  uint32_t message_len;
  uint32_t reserved;
};
static_assert(sizeof(Ack) == 32, "Ack is sent as raw bytes");

// A LocalRegion's descriptor, as bytes.
struct RegionDescriptor {
  uint32_t magic;
  uint16_t version;
  uint16_t reserved;
  uint64_t token;  // the owning transport's random token
  uint64_t region;
  uint64_t length;
};
static_assert(sizeof(RegionDescriptor) == 32, "RegionDescriptor is exchanged as raw bytes");

}  // namespace wsync::transport::tcp
