#pragma once
// The transport registry: every backend by name, with the factory that builds it and what every instance of it shares.
//
// Callers choose a transport by what it can do, never by comparing its name: a source asks which transport writes a
// segment of a given kind (engine memory a Mooncake Transfer Engine registered is written only by the mooncake
// backend), whether its connections go through a target daemon or straight to the region's owner, and whether the
// receiving side decodes deltas. The table is fixed at compile time (a backend compiled out is still listed and
// builds a non-viable stand-in that says why), so every lookup is pure and needs no transport instance: the source's
// planning step (daemon/node/source_plan.h) decides from it before any memory is registered. What depends on the
// host (the provider, device sinks, enforcement) is an instance's answer to Transport::Query, never an entry here.
// Thread-safe: the registry is immutable.

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/memory_kind.h"
#include "transport/transport.h"

namespace wsync::transport {

struct TransportEntry {
  std::string name;
  // What every instance shares: needs_target_daemon, one_sided_only, writes_from_host. The rest is left at its
  // default (nothing promised): an instance's Query answers it.
  Capabilities caps;
  // Engine memory segments of this kind are written only by this backend, whatever the daemon's own transport is
  // (none for a backend chosen by the operator instead).
  std::optional<SegmentKind> segment_kind;
  // Whether an operator may pick it for a daemon's data path (wsyncd --transport).
  bool daemon_selectable = false;
  std::function<absl::StatusOr<std::unique_ptr<Transport>>(const TransportOptions&)> create;
  // needs_target_daemon false: the peer (Endpoint::Connect's argument) a region descriptor names; InvalidArgument
  // for a descriptor the backend cannot parse. Null for the other backends.
  std::function<absl::StatusOr<std::string>(const std::string& descriptor)> region_peer;
};

// Every backend, in the order they are listed in messages.
const std::vector<TransportEntry>& RegisteredTransports();
// The backend named `name`, or null.
const TransportEntry* FindTransport(absl::string_view name);
// The backend that owns segments of `kind`, or null when the daemon's own transport writes them.
const TransportEntry* TransportForSegmentKind(SegmentKind kind);
// What every instance of the backend named `name` shares (TransportEntry::caps); a name the registry lacks (a test
// double) gets the defaults.
Capabilities CapabilitiesOf(absl::string_view name);
// "tcp, verbs, fabric, mooncake" (daemon_only: only those an operator may pick).
std::string KnownTransports(bool daemon_only = false);

}  // namespace wsync::transport
