#pragma once
// The rdma-core verbs backend: RC queue pairs and one-sided RDMA WRITE.
//
// What it does beyond the Transport contract:
//   * Devices: TransportOptions::devices ("mlx5_0" or "mlx5_0:1"), or every device with an active port. A region is
//     written through the devices on its memory's NUMA node (sysfs), else the first device; with an explicit device
//     list, through all of them.
//   * Memory: RegisterMemory registers the range on every device, split into chunks no larger than the device's
//     max_mr_size (or VerbsOptions::max_mr_chunk). The descriptor carries base address, length, chunk size and all
//     rkeys. Writes crossing a chunk boundary (source or destination) are split.
//   * Endpoints: qps_per_device RC QPs per device, connected 1:1 to the peer's QPs through the opaque LocalInfo
//     blob (QPN, PSN, GID, LID, port, MTU). Writes longer than stripe_bytes are cut into stripe_bytes pieces spread
//     round-robin over the QPs. Posting uses linked work-request lists with only the last WR of each list
//     signaled, never more than max_send_wr WRs outstanding per QP (Post polls the CQ when a send queue is full).
//   * Errors: a failed completion fails its batch with a status naming the peer, the queue pair and the write
//     (index, destination offset); every later call fails too, and the endpoint must be re-created. A vanished
//     peer surfaces as Unavailable (transport retries exceeded), a stale or out-of-bounds remote region as
//     FailedPrecondition.
//   * Cancel (from any thread): a Wait or a Post blocked on the send queue returns at once with the caller's
//     reason; every QP is moved to the error state, so the NIC stops sending and flushes the WRs still queued
//     (their completions are retired by the next Post or Wait, never reported as success); every later Post and
//     Wait fails with the reason, and the endpoint must be re-created.
//   * Write window (receiving side): SetWriteWindow grants IBV_ACCESS_REMOTE_WRITE on this transport's QPs only while
//     open (WriteWindow in verbs_internal.h); a peer's write while it is closed fails at the peer and kills that
//     connection, counted in refused_writes(). RegisterSourceMemory registers MRs without remote access.
//   * Write grants (receiving side): CreateGrantedEndpoint gives the endpoint one protection domain per device and
//     registers the granted regions again in it (GrantDomain in verbs_internal.h); its QPs reach only those MRs and
//     its LocalInfo carries their rkeys, which the sending endpoint uses for those regions instead of the
//     descriptor's. RequireGrants(true) denies remote write to plain endpoints' QPs; RevokeGrants denies it to the
//     revoked grants' QPs at once.
//   * No device (host kernel without RDMA, empty device list, device not found): the transport is returned with
//     viable() == false and reason() saying why; every other call then fails with FailedPrecondition.
//
// Thread safety: as in transport.h. Regions and endpoints keep the device contexts alive, so they may outlive the
// transport that made them.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace wsync::transport::verbs {

struct IbvApi;  // transport/verbs/ibv_api.h

// Tuning knobs. Zero / negative = take the environment variable named beside it, else the default.
struct VerbsOptions {
  uint64_t max_mr_chunk = 0;  // WSYNC_VERBS_MAX_MR_SIZE: cap on one MR's size (bytes); default device max_mr_size
  int qps_per_device = 0;     // WSYNC_VERBS_QPS_PER_DEVICE: RC QPs per device per endpoint; default 2
  uint64_t stripe_bytes = 0;  // WSYNC_VERBS_STRIPE_BYTES: largest piece of one write on one QP; default 1 MiB
  uint32_t max_send_wr = 0;   // WSYNC_VERBS_MAX_SEND_WR: outstanding WRs per QP (capped by the device); default 256
  uint32_t signal_every = 0;  // WSYNC_VERBS_SIGNAL_EVERY: WRs per linked list, last one signaled; default 32
  int qp_timeout = -1;        // WSYNC_VERBS_QP_TIMEOUT: ack timeout exponent (4.096 us * 2^n); default 14
  int retry_cnt = -1;         // WSYNC_VERBS_RETRY_CNT: retries before failing (0..7; rxe: 7 = forever); default 6
  // Start every QP's send PSN at 0 instead of a random value. For peers that are not wsync and assume PSN 0 on
  // both sides (the Mooncake Transfer Engine's rdma transport: transport/mooncake).
  bool zero_psn = false;
};

// Creates the verbs backend. Hardware absence is not an error: the transport is returned with viable() == false.
// Errors only for malformed options (e.g. an unparsable WSYNC_VERBS_* variable).
absl::StatusOr<std::unique_ptr<Transport>> CreateVerbsTransport(const TransportOptions& opts);
absl::StatusOr<std::unique_ptr<Transport>> CreateVerbsTransport(const TransportOptions& opts,
                                                                const VerbsOptions& verbs_opts);

// Introspection for tests and benchmarks; nullopt when the object is not from the verbs backend.
struct VerbsRegionInfo {
  uint64_t chunk_size = 0;
  uint32_t num_chunks = 0;
  std::vector<std::string> devices;            // devices the region is registered on
  std::vector<std::string> preferred_devices;  // devices its writes go through when it is a source
};
std::optional<VerbsRegionInfo> GetVerbsRegionInfo(const LocalRegion& region);

struct VerbsEndpointStats {
  std::vector<std::string> qp_devices;  // per connected QP: its local device
  std::vector<uint64_t> wrs_per_qp;     // work requests posted per QP
  std::vector<uint64_t> bytes_per_qp;
  uint64_t post_calls = 0;  // ibv_post_send calls (one per linked list)
  uint64_t signaled_wrs = 0;
  uint64_t send_queue_full_waits = 0;  // times Post had to poll for completions before posting more
  // WRs posted and not yet retired by a completion (success, error or flush), summed over the QPs; after Cancel
  // and the next call that polls (Post, Wait), 0: the QPs are in the error state and every WR flushed.
  uint64_t outstanding_wrs = 0;
  bool cancelled = false;  // Cancel was called
};
std::optional<VerbsEndpointStats> GetVerbsEndpointStats(const Endpoint& endpoint);

// How RegisterSink writes device memory (docs/operations.md, "GPUDirect RDMA"). GPUDirect RDMA — the NIC writes the
// GPU memory itself — needs rdma-core's ibv_reg_dmabuf_mr (in `api`), a dma-buf over the memory from its
// driver (`dmabuf`: the sink's ExportDmabuf status), and WSYNC_VERBS_GPUDIRECT not set to 0 (`env`, may be null).
// `api` is the loaded libibverbs table (tests pass a fake one).
// Anything missing chooses the host mirror (writes land in page-locked host memory, copied to the device when the
// target settles the update), with the reason; a later failure of ibv_reg_dmabuf_mr itself falls back the same way.
struct GpuDirectChoice {
  bool gpu_direct = false;
  std::string reason;  // why not, when !gpu_direct
};
GpuDirectChoice ChooseGpuDirect(const IbvApi& api, const absl::Status& dmabuf, const char* env);
// Whether WSYNC_VERBS_GPUDIRECT (value `env`, may be null) lets RegisterSink try GPUDirect at all.
bool GpuDirectAllowed(const char* env);

// The devices a verbs transport opened, in order (empty for another backend or a transport that is not viable).
std::vector<std::string> GetVerbsTransportDevices(const Transport& transport);

}  // namespace wsync::transport::verbs
