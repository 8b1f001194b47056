#pragma once
// The mooncake backend: one-sided writes into memory that a Mooncake Transfer Engine peer registered (SGLang's
// P2P weight update memory), over the engine's `tcp` transport, protocol version 2. The peer is the real engine
// (an SGLang rank); wsync never runs the receiving side of this backend: it is a source-only transport.
//
//   * Remote regions are not exported by a wsync transport but built from what the engine publishes (SGLang's
//     bootstrap: session id and each parameter's data_ptr): `MakeRegionDescriptor(session_id, base_addr, length)`.
//     A region covers [base_addr, base_addr + length) of the peer's address space (one registered buffer or a
//     range inside one); `dst_offset` of a write maps to the absolute peer address base_addr + dst_offset.
//   * `Endpoint::Connect(session_id)` ("ip:port", the engine's handshake port) runs the P2P Metadata handshake
//     once, learns the data port, requires tcp protocol version 2 and keeps the peer's registered buffers. There is
//     nothing to exchange in the other direction: `LocalInfo()` is empty.
//   * `Post` checks every destination region lies inside one of the peer's registered buffers and belongs to the
//     connected session, before anything is sent. Writes are split into chunks (never across a buffer, since a
//     region lies inside one) and sent by a small pool of worker threads, each keeping one data connection open
//     for its requests (the engine serves requests back to back on one connection). Each request is acknowledged
//     by the peer after the bytes are in its memory; a batch completes when all its requests are acknowledged.
//   * `RegisterMemory` registers source memory only (nothing to pin for tcp); its `Descriptor()` is empty and
//     `ImportRegion("")` fails: a wsync region cannot be written by this backend, and nobody writes into wsync
//     through it.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace wsync::transport::mooncake {

// Knobs beyond TransportOptions (which sets io_timeout, and tcp_streams = worker connections per endpoint).
struct MooncakeOptions {
  // Largest single request; a longer write is sent as several requests (run in parallel by the workers).
  uint64_t chunk_bytes = 4ull << 20;
  // Requests (chunks) an endpoint holds queued or in flight before Post waits for completions.
  uint64_t max_outstanding_chunks = 1 << 16;
  // Timeout of the handshake connection (connect + request + reply), also capped by Connect's timeout.
  absl::Duration handshake_timeout = absl::Seconds(10);
  // Tests only: skip Post's check against the peer's registered buffers, to observe the peer's own rejection.
  bool check_peer_buffers = true;
  // The engine's protocol: "tcp" or "rdma" (SGLang: its MOONCAKE_PROTOCOL, default rdma). Empty: the environment
  // variable WSYNC_MOONCAKE_PROTOCOL, else "tcp". rdma writes through wsync's verbs backend on exactly one device
  // (TransportOptions::devices / gid_index; with no list, $WSYNC_MOONCAKE_DEVICE, else the machine's only active
  // device). The daemons create this transport with default options: the two variables select rdma for them.
  std::string protocol;
  // rdma: queue pairs per endpoint; must equal the engine's (MC_NUM_QP_PER_EP, default 2), which refuses others.
  int rdma_qps = 2;
};

// tcp: always viable (plain TCP). rdma: viable when the verbs backend finds its device (else viable() is false and
// reason() says why). InvalidArgument for an unknown protocol or, for rdma, more than one device.
absl::StatusOr<std::unique_ptr<Transport>> CreateMooncakeTransport(const TransportOptions& opts,
                                                                   const MooncakeOptions& mopts = {});

// The region descriptor ImportRegion accepts: text "mooncake/1 <session_id> 0x<base_addr hex> <length>",
// e.g. "mooncake/1 127.0.0.1:15452 0x7fc324ccf000 353280". InvalidArgument for an empty session id or a zero
// length (the engine refuses zero-length requests) or a range that wraps around the address space.
absl::StatusOr<std::string> MakeRegionDescriptor(const std::string& session_id, uint64_t base_addr,
                                                 uint64_t length);

// The fields of a region descriptor made by MakeRegionDescriptor; InvalidArgument for anything else.
struct RegionDescriptorFields {
  std::string session_id;
  uint64_t base_addr = 0;
  uint64_t length = 0;
};
absl::StatusOr<RegionDescriptorFields> ParseRegionDescriptor(const std::string& descriptor);

// "host:port" or "[v6]:port" → host (without brackets) and port. InvalidArgument otherwise.
struct SessionAddress {
  std::string host;
  int port = 0;
};
absl::StatusOr<SessionAddress> ParseSessionId(const std::string& session_id);

}  // namespace wsync::transport::mooncake
