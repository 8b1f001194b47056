#pragma once
// Wire format of the Mooncake Transfer Engine as wsync's `mooncake` transport speaks it: the P2P handshake frame
// and the `tcp` transport's data protocol, version 2. Facts, with the Mooncake source lines they come from and
// packet captures of the real engine, are in docs/mooncake-protocol.md (§2, §3); nothing here is Mooncake's code.
//
// Handshake (the session id's port, one request per connection):
//   u64 length (host order = LE; 1 + JSON bytes) | u8 type | JSON        → the same framing back, same type
// Data (the descriptor's tcp_data_port; requests may follow each other on one connection after a clean status):
//   RequestHeader (24 B) | payload (WRITE)                               → u64 LE status frame ("MCTV" << 32 | code)

#include <cstddef>
#include <cstdint>

namespace wsync::transport::mooncake {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the data header is little-endian on the wire and the handshake length is the sender's host order; "
              "both are sent as raw little-endian bytes here, so a big-endian host would need byte swaps");

// Handshake frame types (docs §2). wsync sends only kMetadata.
enum HandshakeType : uint8_t {
  kConnection = 0,
  kMetadata = 1,
  kNotify = 2,
  kProbe = 3,
};
// The engine refuses frames above 1 MiB by default (its limit is configurable up to 128 MiB); a reply bigger than
// this is not a Mooncake segment descriptor, and the bound keeps a garbage length from allocating gigabytes.
constexpr uint64_t kMaxHandshakeFrame = 128ull << 20;

// The only data protocol version wsync speaks: v2 acknowledges every request with a status frame. v1 has no
// acknowledgement at all, so a writer could never know its bytes landed.
constexpr int kTcpProtoVersion = 2;

// Opcode byte: bits 0..6 the operation, bit 7 "v2 framing" (the server answers with a status frame).
constexpr uint8_t kOpRead = 0;
constexpr uint8_t kOpWrite = 1;
constexpr uint8_t kOpV2Flag = 0x80;

// One request. The engine sends its C struct as raw bytes: two u64 and a u8, unpacked, so 7 bytes of padding
// follow the opcode (the engine ignores them; wsync sends zeros).
struct RequestHeader {
  uint64_t size;  // payload bytes, little-endian
  uint64_t addr;  // absolute virtual address in the peer's registered memory, little-endian
  uint8_t opcode;
  uint8_t padding[7];
};
static_assert(sizeof(RequestHeader) == 24, "the peer reads exactly 24 header bytes (8 size, 8 addr, 1 op, 7 pad)");
static_assert(offsetof(RequestHeader, size) == 0 && offsetof(RequestHeader, addr) == 8 &&
                  offsetof(RequestHeader, opcode) == 16,
              "field offsets of the engine's request header: size @0, addr @8, opcode @16");

// Status frame after each v2 request: u64 LE, high 32 bits the magic "MCTV", low 32 bits the code.
constexpr uint64_t kStatusMagic = 0x4D435456ull;  // "MCTV"
constexpr uint32_t kStatusOk = 0;
constexpr uint32_t kStatusAddressRejected = 1;  // [addr, addr+size) not inside one registered buffer, or size 0
static_assert(sizeof(uint64_t) == 8, "the status frame is 8 bytes");

}  // namespace wsync::transport::mooncake
