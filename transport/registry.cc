#include "transport/registry.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "transport/mooncake/mooncake_transport.h"
#include "transport/tcp/tcp_transport.h"

#ifdef WSYNC_WITH_VERBS
#include "transport/verbs/verbs_transport.h"
#endif
#ifdef WSYNC_WITH_FABRIC
#include "transport/fabric/fabric_transport.h"
#endif

namespace wsync::transport {
namespace {

// Stand-in for a backend that exists but cannot run here (compiled out): says why, does nothing.
class NonViableTransport final : public Transport {
 public:
  NonViableTransport(std::string name, std::string reason) : name_(std::move(name)), reason_(std::move(reason)) {}
  std::string name() const override { return name_; }
  bool viable() const override { return false; }
  std::string reason() const override { return reason_; }
  absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterMemory(void*, uint64_t) override { return Error(); }
  absl::StatusOr<std::unique_ptr<RemoteRegion>> ImportRegion(const std::string&) override { return Error(); }
  absl::StatusOr<std::unique_ptr<Endpoint>> CreateEndpoint() override { return Error(); }

 private:
  absl::Status Error() const {
    return absl::FailedPreconditionError(absl::StrCat(name_, " transport is not viable: ", reason_));
  }
  std::string name_;
  std::string reason_;
};

[[maybe_unused]] absl::StatusOr<std::unique_ptr<Transport>> NonViable(std::string name, std::string reason) {
  return std::unique_ptr<Transport>(std::make_unique<NonViableTransport>(std::move(name), std::move(reason)));
}

std::vector<TransportEntry> BuildRegistry() {
  std::vector<TransportEntry> r;
  {
    TransportEntry e;
    e.name = "tcp";
    e.daemon_selectable = true;
    e.create = [](const TransportOptions& o) { return tcp::CreateTcpTransport(o); };
    r.push_back(std::move(e));
  }
  {
    TransportEntry e;
    e.name = "verbs";
    e.daemon_selectable = true;
#ifdef WSYNC_WITH_VERBS
    e.create = [](const TransportOptions& o) { return verbs::CreateVerbsTransport(o); };
#else
    e.create = [](const TransportOptions&) { return NonViable("verbs", "built without verbs support"); };
#endif
    r.push_back(std::move(e));
  }
  {
    TransportEntry e;
    e.name = "fabric";
    e.daemon_selectable = true;
#ifdef WSYNC_WITH_FABRIC
    e.create = [](const TransportOptions& o) { return fabric::CreateFabricTransport(o); };
#else
    e.create = [](const TransportOptions&) {
      return NonViable("fabric", "built without libfabric support (install libfabric-dev and reconfigure)");
    };
#endif
    r.push_back(std::move(e));
  }
  {
    // Writes into memory an engine's own Mooncake Transfer Engine registered (SGLang): the engine is the receiver.
    TransportEntry e;
    e.name = "mooncake";
    e.caps.needs_target_daemon = false;
    e.caps.one_sided_only = true;
    e.segment_kind = SegmentKind::kMooncake;
    e.create = [](const TransportOptions& o) { return mooncake::CreateMooncakeTransport(o); };
    e.region_peer = [](const std::string& descriptor) -> absl::StatusOr<std::string> {
      auto f = mooncake::ParseRegionDescriptor(descriptor);
      if (!f.ok()) return f.status();
      return f->session_id;
    };
    r.push_back(std::move(e));
  }
  return r;
}

}  // namespace

const std::vector<TransportEntry>& RegisteredTransports() {
  static const std::vector<TransportEntry>* const registry = new std::vector<TransportEntry>(BuildRegistry());
  return *registry;
}

const TransportEntry* FindTransport(absl::string_view name) {
  for (const TransportEntry& e : RegisteredTransports())
    if (e.name == name) return &e;
  return nullptr;
}

const TransportEntry* TransportForSegmentKind(SegmentKind kind) {
  for (const TransportEntry& e : RegisteredTransports())
    if (e.segment_kind == kind) return &e;
  return nullptr;
}

Capabilities CapabilitiesOf(absl::string_view name) {
  const TransportEntry* e = FindTransport(name);
  return e == nullptr ? Capabilities{} : e->caps;
}

std::string KnownTransports(bool daemon_only) {
  std::vector<std::string> names;
  for (const TransportEntry& e : RegisteredTransports())
    if (!daemon_only || e.daemon_selectable) names.push_back(e.name);
  return absl::StrJoin(names, ", ");
}

Capabilities Transport::Query() const { return CapabilitiesOf(name()); }

absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(const std::string& name, const TransportOptions& opts) {
  const TransportEntry* e = FindTransport(name);
  if (e == nullptr)
    return absl::InvalidArgumentError(
        absl::StrCat("unknown transport \"", name, "\" (known: ", KnownTransports(), ")"));
  return e->create(opts);
}

}  // namespace wsync::transport
