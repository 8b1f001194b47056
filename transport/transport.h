#pragma once
// The transport interface: one-sided writes of a local registered region into a remote registered region.
//
// Model (shared by tcp, verbs and later shm backends):
//   * Both sides register memory once (`RegisterMemory`). The receiving side exports each region as an opaque
//     descriptor (`LocalRegion::Descriptor()`), which travels through the control plane; the sending side turns it
//     into a `RemoteRegion` with `ImportRegion` once and reuses it for every update.
//   * Connections are set up through the control plane too: each side creates an `Endpoint`, the two exchange
//     `Endpoint::LocalInfo()` blobs (opaque bytes), and each side calls `Connect(peer_info)`. A backend never opens a
//     side channel of its own for this handshake.
//   * The sender posts batches of `WriteRequest`s (`Post`) and learns of their completion (`Wait`, woken through
//     `CompletionFd`). The receiver's CPU is not involved for RDMA backends; for tcp the receiving transport's own
//     threads apply the writes.
//   * Out-of-bounds requests are rejected by `Post` before anything is sent.
//
// The sending side's contract, one meaning on every backend (the conformance suite has a case per rule):
//   Post    never waits on the network or for room in a send queue: it validates the whole batch (on error nothing
//           of it is posted), hands the backend what its queues take now and keeps the rest inside the endpoint,
//           to be handed on as completions free room, by the endpoint's own threads (tcp) or by the owner's next
//           Wait (verbs, fabric: their completion queues are polled by the owner). It returns once the batch is
//           accepted, whatever its size.
//   Wait    Wait(batch, timeout) returns the batch's result, or DeadlineExceeded after `timeout` with the batch still
//           outstanding. Wait(batch, ZeroDuration()) never blocks: it collects what completed, hands on queued
//           work and answers. Completion means every byte of the batch is in the remote region.
//   CompletionFd  an fd (owned by the endpoint, valid for its life) that polls readable (POLLIN) when a Wait may
//           have news: a batch finished or failed, queued work can be handed on, or Cancel was called. Level
//           triggered until the owner's next Wait, which consumes it. -1 for a backend whose completions only a
//           poll of its own queues discovers (fabric: a provider progressed by the caller): its owner then waits in
//           Wait(batch, slice), which polls.
//   Cancel  from any thread: at once, every batch in flight and every later Post/Wait fails with the caller's
//           reason, and nothing of a batch that was still queued inside the endpoint is ever handed to the
//           network. Bytes already on the wire when it was called may still land (a NIC cannot recall a write, a tcp
//           receiver applies what reached its socket); a receiving side that must stop them closes its window or
//           revokes the grant, which the receiving transport enforces. The endpoint is re-created afterwards.
//   Reusable  receiving side: whether a repeat connect from the same sender is answered with this live endpoint
//           (see Endpoint::Reusable); a repeat never replaces an endpoint an update writes through.
//
// Threading: a Transport and its regions may be used from any thread. One Endpoint is used by one thread at a time
// (its owner: callers that want parallelism open several endpoints); Cancel, Reusable and CompletionFd may be called
// from any thread.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace wsync::transport {

// Memory registered with a transport. Owns the registration (not the memory); deregisters on destruction.
// The memory must outlive the region.
class LocalRegion {
 public:
  virtual ~LocalRegion() = default;
  virtual void* addr() const = 0;
  virtual uint64_t length() const = 0;
  // Opaque bytes a peer passes to ImportRegion to write into this region.
  virtual std::string Descriptor() const = 0;
  // Makes the writes that completed into this region visible in the memory it stands for. A no-op except for
  // device memory a NIC backend writes through a host mirror (verbs without GPUDirect, see RegisterSink): there it
  // copies the mirror to the device and returns when the copy finished. The receiving side calls it after the
  // writes of an update completed and before the memory's owner reads them (the target: before the commit).
  virtual absl::Status Settle() { return absl::OkStatus(); }
  // How writes reach device memory registered with RegisterSink, for status and logs: "staging (tcp)",
  // "gpudirect", "staging (no GPUDirect: <reason>)"; empty for host memory.
  virtual std::string DevicePath() const { return {}; }
};

// A peer's registered region, imported from its descriptor. Immutable; shareable across endpoints.
class RemoteRegion {
 public:
  virtual ~RemoteRegion() = default;
  virtual uint64_t length() const = 0;
};

// One write: `length` bytes from `src` at `src_offset` into `dst` at `dst_offset`.
// The writes of a batch may be applied in any order and concurrently (tcp splits a large batch over several
// connections), so destinations that overlap within one batch end up undefined.
struct WriteRequest {
  const LocalRegion* src = nullptr;
  uint64_t src_offset = 0;
  const RemoteRegion* dst = nullptr;
  uint64_t dst_offset = 0;
  uint64_t length = 0;
};

using BatchId = uint64_t;

// Receiving-side memory the CPU cannot write into (GPU memory imported from an engine). A backend whose receiver
// runs on the CPU (tcp) receives each write's payload into host staging buffers the sink hands out, piece by piece,
// and the sink copies them on asynchronously; a batch is acknowledged only after Flush returned, i.e. after every
// copy of it reached the memory. Thread-safe: several connection threads use one sink at once.
class RegionSink {
 public:
  struct Staging {
    uint8_t* data = nullptr;  // host memory for up to chunk_bytes() bytes
    int slot = -1;            // the sink's own handle
  };
  virtual ~RegionSink() = default;
  virtual uint64_t length() const = 0;
  // Largest piece Acquire hands out; the backend splits longer writes.
  virtual uint64_t chunk_bytes() const = 0;
  // A free staging buffer; blocks while every buffer is in flight (until the oldest copy finished).
  virtual absl::StatusOr<Staging> Acquire() = 0;
  // The buffer holds `len` bytes for [offset, offset + len): starts their copy (asynchronous) and takes the
  // buffer back once it finished. The backend has checked the bounds.
  virtual absl::Status Submit(const Staging& s, uint64_t offset, uint64_t len) = 0;
  // Gives back a buffer that will not be submitted (its receive failed).
  virtual void Cancel(const Staging& s) = 0;
  // Waits until every copy submitted so far has finished; the first copy error, naming the memory, otherwise.
  virtual absl::Status Flush() = 0;
  // For logs and errors ("engine E rank R segment S on cuda:0").
  virtual std::string Describe() const = 0;

  // For a backend whose receiver is the NIC (verbs), which cannot stage write by write. Either the NIC writes the
  // memory itself (GPUDirect RDMA): ExportDmabuf gives a dma-buf over the whole memory (the caller owns the fd and
  // closes it once registered), or why the platform cannot (the driver has no dma-buf support, ...). Or writes land
  // in a page-locked host mirror of the whole memory: HostMirror allocates it once, filled with the memory's current
  // contents (a partial update leaves the rest as it was), and CopyMirror copies it to the memory, returning when
  // the copy finished. Both default to Unimplemented (a sink that supports neither).
  struct Dmabuf {
    int fd = -1;
    uint64_t offset = 0;  // of the memory inside the dma-buf
    uint64_t iova = 0;    // the memory's device address: what remote writes target
  };
  virtual absl::StatusOr<Dmabuf> ExportDmabuf() {
    return absl::UnimplementedError(absl::StrCat(Describe(), " cannot be exported as a dma-buf"));
  }
  virtual absl::StatusOr<uint8_t*> HostMirror() {
    return absl::UnimplementedError(absl::StrCat(Describe(), " has no host mirror"));
  }
  virtual absl::Status CopyMirror() {
    return absl::UnimplementedError(absl::StrCat(Describe(), " has no host mirror"));
  }
};

// Checks a request against both regions' bounds. Every backend calls this in Post before anything is sent.
absl::Status ValidateWrite(const WriteRequest& w);

class Endpoint {
 public:
  virtual ~Endpoint() = default;
  // Opaque connection info to hand to the peer's Endpoint::Connect (through the control plane).
  virtual std::string LocalInfo() const = 0;
  // Completes the connection with the peer's LocalInfo(). Blocks until connected or `timeout`.
  virtual absl::Status Connect(const std::string& peer_info, absl::Duration timeout) = 0;
  // Queues a batch of writes and returns without waiting on the network or for send-queue room (see the contract at
  // the top). On error nothing of the batch is posted (validation happens first).
  virtual absl::StatusOr<BatchId> Post(absl::Span<const WriteRequest> writes) = 0;
  // Waits for a posted batch. DeadlineExceeded on timeout (the batch stays outstanding); any transport error
  // fails the batch with a status naming the peer. After an error the endpoint must be re-created. A zero timeout
  // never blocks and advances the endpoint (hands on queued work).
  virtual absl::Status Wait(BatchId batch, absl::Duration timeout) = 0;
  // Readable when a Wait may have news (see the contract at the top); -1 when the backend has no such fd.
  virtual int CompletionFd() const { return -1; }
  // Convenience: Post + Wait.
  absl::Status Write(absl::Span<const WriteRequest> writes, absl::Duration timeout);
  // Human-readable peer name for errors and logs.
  virtual std::string PeerName() const = 0;
  // Fails every batch in flight and every later Post/Wait with `why` (the caller's reason: an aborted or failed
  // update), without waiting for the network: a sender blocked on a vanished peer is released at once. The one call
  // that may come from any thread, concurrently with the thread using the endpoint. The endpoint must be re-created
  // afterwards. Every backend implements it (tcp shuts its sockets, verbs moves its QPs to the error state, mooncake
  // does either); the default is for test doubles.
  virtual void Cancel(const absl::Status& why) { (void)why; }
  // Receiving side, granted endpoints (Transport::CreateGrantedEndpoint): whether a sender endpoint whose LocalInfo
  // is `peer_info` can write through this endpoint, connected as it is, once it is handed this endpoint's LocalInfo
  // (its grant). A target daemon answers a repeat ConnectTarget of the same source with this endpoint (the same
  // grant) exactly when this is true, and otherwise replaces it (DecideConnectTarget), so a repeat never disturbs an
  // update writing through a live endpoint. One meaning on every backend: false for a plain or unconnected
  // endpoint, once Cancel was called, and once its grant was revoked; otherwise
  //   tcp:    a connection carrying the grant's secret is open (any sender endpoint holding the secret connects);
  //           once none is, the source gets a fresh grant;
  //   fabric: true (connectionless: any sender endpoint holding the grant's keys writes through it);
  //   verbs:  `peer_info` is the sender endpoint it was connected with (an RC QP pair serves that pair alone: a
  //           retried ConnectTarget is answered with it, a new sender endpoint needs a new pair).
  // A backend without grants answers false. Any thread; never blocks.
  virtual bool Reusable(const std::string& peer_info) const {
    (void)peer_info;
    return false;
  }
};

// What a transport instance can do (Transport::Query). A flag is a promise the conformance suite holds the instance
// to by what it does (tests/transport/conformance_test.cc, run against every backend): an instance that says it
// enforces something does; and a call that answers OK (SetWriteWindow, RequireGrants) is enforced, promised or not.
// The registry (transport/registry.h) keeps what every instance of a backend shares, for planning before any
// instance exists: needs_target_daemon, one_sided_only, writes_from_host. What depends on the host and on what the
// instance found there when it was created (the libfabric provider picked, the RDMA devices opened, whether device
// memory can be registered) is the instance's alone: provider, writes_into_device, write_windows, write_grants,
// refusals_counted.
struct Capabilities {
  // The backend and what this instance runs on: "tcp", "verbs (rxe0)", "fabric (tcp;ofi_rxm)", "mooncake".
  // Empty in the registry's per-backend entry.
  std::string provider;
  // The sending side writes from host memory registered with RegisterSourceMemory (every backend today).
  bool writes_from_host = true;
  // The receiving side accepts device memory through RegisterSink.
  bool writes_into_device = false;
  // A connection is set up through the target daemon's ConnectTarget (an exchange of Endpoint::LocalInfo blobs).
  // False: Endpoint::Connect takes the peer address the region descriptors name (RegionPeer), and no wsync
  // process runs on the receiving side.
  bool needs_target_daemon = true;
  // Only the sending side exists in wsync (the receiver is a foreign engine): nothing beside the memory decodes
  // deltas or stages writes, so only dense byte ranges are written through it.
  bool one_sided_only = false;
  // SetWriteWindow is enforced by this instance (fabric: only on a provider that lets wsync choose memory keys).
  bool write_windows = false;
  // CreateGrantedEndpoint / RequireGrants are enforced.
  bool write_grants = false;
  // Every write the receiving side refuses (a closed window, a region outside the connection's grant, a revoked or
  // missing grant) is counted in its refused_writes() by the time the sender's Post or Wait fails. False where some
  // refusals happen out of the receiving CPU's sight (a NIC checking memory keys: verbs, fabric).
  bool refusals_counted = false;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string name() const = 0;
  // False (with a reason) when the backend cannot run here, e.g. no RDMA device. Never a crash.
  virtual bool viable() const = 0;
  virtual std::string reason() const = 0;
  // What this instance can do (Capabilities), as decided when it was created: fabric's window enforcement depends on
  // the provider libfabric picked, device sinks on the memory registration the provider offers. Never blocks; any
  // thread. A decorator forwards its inner instance's answer. Default: the registry's entry for name() (what every
  // instance of the backend shares, nothing enforced), for stand-ins and test doubles.
  virtual Capabilities Query() const;
  // Registers [addr, addr+len). Costly: do it once at start-up. Registration time is logged by the backend.
  virtual absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterMemory(void* addr, uint64_t len) = 0;
  // Registers memory this side only writes from (a source's replica): peers get no write access to it (verbs: MRs
  // without remote access, a peer's write into it fails; tcp: write frames into it are refused, PermissionDenied,
  // and counted in refused_writes()). Same cost as RegisterMemory. A write grant cannot name it. A backend whose
  // receiving side cannot tell the two apart registers it as RegisterMemory does.
  virtual absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterSourceMemory(void* addr, uint64_t len) {
    return RegisterMemory(addr, len);
  }
  // Registers memory written through `sink` (see RegionSink). tcp stages every write through the sink (addr() is
  // null); verbs registers the device memory for GPUDirect RDMA when the platform allows, else a host mirror that
  // Settle copies to the device, and says which in the region's DevicePath() and its log. Unimplemented for a
  // backend that can do neither (mooncake).
  virtual absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterSink(std::shared_ptr<RegionSink> sink) {
    return absl::UnimplementedError(
        absl::StrCat("the ", name(), " transport cannot write into ", sink->Describe(),
                     " (device memory is written through the tcp or verbs transports only)"));
  }
  // Parses a peer's region descriptor.
  virtual absl::StatusOr<std::unique_ptr<RemoteRegion>> ImportRegion(const std::string& descriptor) = 0;
  // Creates an unconnected endpoint (both sides of a connection create one).
  virtual absl::StatusOr<std::unique_ptr<Endpoint>> CreateEndpoint() = 0;

  // The receiving side's write window: while it is closed, writes from peers are refused (their batch fails with
  // PermissionDenied on tcp; on verbs with a NAK completion error, FailedPrecondition, and the connection is dead
  // and must be re-made), nothing of it is written, and the refusal is counted in refused_writes() (verbs counts
  // refused connections). Open when the transport is created; a target daemon closes it at start and the
  // coordinator opens it only while an update is open.
  // Unimplemented for a backend that cannot enforce it (the caller reports that the window is not enforced).
  virtual absl::Status SetWriteWindow(bool open) {
    (void)open;
    return absl::UnimplementedError(absl::StrCat("the ", name(), " transport does not enforce write windows"));
  }
  virtual uint64_t refused_writes() const { return 0; }

  // Per-connection write authorization (docs/security.md, "Per-connection write grants"). A peer that connects to a
  // granted endpoint may write only into `regions` of this transport, only while the window is open, and only until
  // the grant is revoked (RevokeGrants, or the endpoint is destroyed). tcp: the endpoint's LocalInfo carries a fresh
  // random secret, and with RequireGrants(true) a connection without a live secret gets no write frame accepted.
  // verbs: the endpoint's QPs live in their own protection domains holding MRs of only `regions` (registered when
  // the endpoint is created: costly, once per connection), whose rkeys its LocalInfo carries; with
  // RequireGrants(true) a plain endpoint's QPs get no remote write. Every refusal is counted in refused_writes().
  // Unimplemented for a backend that cannot enforce it.
  struct WriteGrant {
    std::string peer;                         // who it was minted for (logs, RevokeGrants): "source:train0"
    std::string scope;                        // what it covers (logs, RevokeGrants): "engine0/1"
    std::vector<const LocalRegion*> regions;  // of this transport; they must outlive the grant
  };
  virtual absl::StatusOr<std::unique_ptr<Endpoint>> CreateGrantedEndpoint(const WriteGrant& grant) {
    (void)grant;
    return absl::UnimplementedError(absl::StrCat("the ", name(), " transport does not enforce write grants"));
  }
  // Revokes every grant for which `keep` returns false; connections using them are refused from their next frame.
  virtual void RevokeGrants(const std::function<bool(const WriteGrant&)>& keep) { (void)keep; }
  virtual absl::Status RequireGrants(bool require) {
    (void)require;
    return absl::UnimplementedError(absl::StrCat("the ", name(), " transport does not enforce write grants"));
  }
};

struct TransportOptions {
  std::string bind_host = "127.0.0.1";  // tcp: address the receiving side listens on
  int tcp_port = 0;                      // tcp: 0 = ephemeral
  std::vector<std::string> devices;      // verbs: RDMA devices to use; empty = all, chosen automatically
  int gid_index = -1;                    // verbs: -1 = pick a RoCE v2 IPv4 GID automatically
  int tcp_streams = 4;                   // tcp: max parallel connections an endpoint uses for one large batch
  // tcp: a connection that makes no progress for this long fails its batch (a stalled or vanished peer).
  absl::Duration io_timeout = absl::Seconds(30);
  // tcp, sending side: a connection whose peer acknowledges nothing this long while something of ours awaits its
  // answer (unacknowledged bytes, two zero-window or keepalive probes in a row) fails its batch, Unavailable (a
  // pulled link, a peer host gone, packets dropped). Judged by the transport from TCP_INFO while a send or the wait
  // for the batch's ack makes no progress (tcp_socket.h, PeerWatch), not by TCP_USER_TIMEOUT, which Linux also
  // applies to a peer that keeps answering zero-window probes. A peer that is alive but not reading (a zero receive
  // window it answers probes for: a stopped or slow process) is waited for, up to io_timeout.
  absl::Duration send_progress_timeout = absl::Seconds(5);
  // tcp listener limits: a connection must send its hello within hello_timeout (until then it holds no thread, only
  // a slot in the accept loop's poll set); at most max_conns_per_peer connections (pending or served) per peer
  // address and max_conns in total; beyond them new connections are closed at once (and counted).
  absl::Duration hello_timeout = absl::Seconds(5);
  int max_conns_per_peer = 64;
  int max_conns = 512;
  // fabric: the libfabric provider ("efa", "tcp;ofi_rxm", "verbs;ofi_rxm"); empty = libfabric's pick (FI_PROVIDER).
  std::string fabric_provider;
};

// Creates a backend by name ("tcp", "verbs", "fabric", "mooncake"). A backend compiled out or not viable is still
// returned when it exists (check viable()); an unknown name is InvalidArgument.
absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(const std::string& name, const TransportOptions& opts);

// Creates the first viable backend of an ordered, comma-separated list ("verbs", "verbs,tcp", "fabric,tcp"). A daemon
// never falls back on its own: only a backend the operator listed is used. None viable is FailedPrecondition naming
// every backend's reason; an empty list, an unknown or repeated name is InvalidArgument.
absl::StatusOr<std::unique_ptr<Transport>> CreateFirstViableTransport(const std::string& list,
                                                                      const TransportOptions& opts);

}  // namespace wsync::transport
