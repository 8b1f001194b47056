#pragma once
// The libfabric backend: reliable-datagram (FI_EP_RDM) endpoints and one-sided RMA writes (fi_writemsg), for every
// libfabric provider with RMA: efa on AWS, verbs;ofi_rxm, tcp;ofi_rxm (docs/operations.md lists what each enforces).
//
// What it does beyond the Transport contract (docs/operations.md, "AWS EFA" and "The fabric transport"):
//   * Provider: TransportOptions::fabric_provider ("efa", "tcp;ofi_rxm"), else libfabric's pick (which also honours
//     FI_PROVIDER). One fabric and one domain per transport (the first the provider offers). A provider without
//     RMA, or one not present, makes the transport not viable with a reason naming it and the providers present.
//   * Memory: registered once per region (fi_mr_reg), honouring the domain's mr_mode: FI_MR_LOCAL (a descriptor
//     with every write), FI_MR_VIRT_ADDR (remote addresses are virtual addresses, else offsets into the MR),
//     FI_MR_PROV_KEY (the provider picks keys, else the transport does, at random), FI_MR_ALLOCATED (only
//     allocated memory is registered; a zero-length region registers nothing), FI_MR_ENDPOINT (an MR is bound to an
//     endpoint and enabled before use: the local MRs a write is posted with are registered per endpoint then, and
//     a receiving endpoint gets remote-write MRs of its own for the regions registered before it, keys in its
//     LocalInfo as a grant's).
//     A region gets one MR for local access (FI_WRITE: the source of writes) and, unless it is a source's memory,
//     one for remote writes, which is the write window's and the grants' lever (below).
//   * Endpoints: one FI_EP_RDM endpoint with its own address vector and transmit completion queue; LocalInfo carries
//     its address (fi_getname), the provider and the fabric; Connect inserts the peer's address into the AV
//     (another provider, fabric or address format is refused naming both sides). Writes are cut at the provider's
//     max_msg_size (and FabricOptions::max_piece), posted with FI_DELIVERY_COMPLETE where the provider offers it,
//     at most min(tx_attr->size, FabricOptions::tx_depth) outstanding; Post polls the queue for room. Completions
//     are read by the thread using the endpoint. Where the provider needs the receiver's CPU to progress
//     (FI_PROGRESS_MANUAL, e.g. tcp;ofi_rxm), one thread per transport (not per connection) drives it through a
//     completion queue shared by every endpoint of the transport. That thread reads without pauses while the write
//     window is open (writes are expected: a target opens it for each update), and paces itself by what its reads
//     cost otherwise (fabric_progress.h).
//   * Errors: a failed completion fails its batch with a status naming the peer, the provider's error and the write;
//     every later call fails too (re-create the endpoint).
//   * Write window and grants (receiving side): remote write is possible only through MRs with FI_REMOTE_WRITE,
//     and this backend keeps such an MR registered only while it may be used: a region's own remote MR (whose key
//     its descriptor carries) while the window is open and grants are not required; a grant's MRs (one per granted
//     region, registered for that connection, keys in its LocalInfo) while the window is open and the grant is live.
//     Closing the window or revoking a grant closes those MRs; opening registers them again under the same keys.
//     That needs keys the transport chooses: where the provider picks keys (FI_MR_PROV_KEY, e.g. efa), the window is
//     not enforced (SetWriteWindow is Unimplemented) while grants and revocation are. What a refused write does is
//     the provider's: tcp;ofi_rxm fails it (and that connection), sockets fails it (EACCES), shm never
//     completes it (the sender's Wait times out). The receiving side is not told, so refused_writes() stays 0.
//   * No libfabric (library or provider missing): viable() == false with the reason; every other call fails.
//
// Thread safety: as in transport.h. Regions and endpoints keep the domain alive, so they may outlive the transport.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace wsync::transport::fabric {

// Tuning and test knobs. Zero / empty = the environment variable named beside it, else the default.
struct FabricOptions {
  uint64_t max_piece = 0;  // WSYNC_FABRIC_MAX_PIECE: largest piece of one write (bytes); default 4 MiB
  uint32_t tx_depth = 0;   // WSYNC_FABRIC_TX_DEPTH: writes outstanding per endpoint (capped by tx_attr->size); 64
  // WSYNC_FABRIC_FORCE_MR_MODE: act as if the provider required these mr_mode bits even where it does not
  // ("local,prov_key"): tests of the code paths efa needs, on a provider that runs here. "endpoint" (FI_MR_ENDPOINT,
  // cxi's): MRs registered per endpoint, as bound to it (the binding itself only where the provider requires it).
  std::string force_mr_mode;
  // WSYNC_FABRIC_DOMAINS ("rdmap16s27-rdm,rdmap32s27-rdm", "mlx5_0,mlx5_1"): the domains (NICs) to use, in this
  // order; empty: every domain libfabric offers on the fabric of its preferred answer.
  std::vector<std::string> domains;
};

absl::StatusOr<std::unique_ptr<Transport>> CreateFabricTransport(const TransportOptions& opts);
absl::StatusOr<std::unique_ptr<Transport>> CreateFabricTransport(const TransportOptions& opts,
                                                                 const FabricOptions& fabric_opts);

// What a fabric transport negotiated (tests, benchmarks, logs); nullopt for another backend or a non-viable one.
struct FabricInfo {
  std::string provider;
  std::string fabric;
  std::string domain;                // the first domain
  std::vector<std::string> domains;  // every domain (NIC) in use, in the order endpoints index them
  std::vector<int> domain_numa;      // their NUMA nodes (-1: unknown)
  bool hmem = false;                 // device memory is registered directly (FI_HMEM); else through a host mirror
  uint64_t mr_mode = 0;  // the bits the backend honours (the provider's, plus forced ones)
  bool delivery_complete = false;
  bool manual_progress = false;
  bool app_keys = false;  // keys chosen by the transport: the write window is enforced
  uint64_t max_msg_size = 0;
  uint64_t max_piece = 0;
  uint32_t tx_depth = 0;
};
std::optional<FabricInfo> GetFabricInfo(const Transport& transport);

// Parses a FabricOptions::force_mr_mode list ("local,prov_key") into FI_MR_* bits.
absl::StatusOr<uint64_t> ParseForcedMrMode(const std::string& list);

}  // namespace wsync::transport::fabric
