#include "transport/tcp/tcp_transport.h"

#include <sys/eventfd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "spdlog/spdlog.h"
#include "transport/registry.h"
#include "transport/tcp/tcp_endpoint.h"
#include "transport/tcp/tcp_listener.h"
#include "transport/tcp/tcp_region_table.h"
#include "transport/tcp/tcp_socket.h"
#include "transport/tcp/tcp_wire.h"

namespace wsync::transport::tcp {
namespace {

uint64_t RandomToken() {
  std::random_device rd;
  uint64_t t = 0;
  while (t == 0) t = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return t;
}

class TcpTransport final : public Transport {
 public:
  TcpTransport(const TransportOptions& opts, std::shared_ptr<RegionTable> table, std::string host, int port,
               Fd listen_fd, Fd wake_fd)
      : opts_(opts),
        table_(table),
        local_info_(FormatInfo(host, port, table->token())),
        listener_(std::move(table), std::move(listen_fd), std::move(wake_fd), absl::StrCat(host, ":", port), opts) {}

  std::string name() const override { return "tcp"; }
  bool viable() const override { return true; }
  std::string reason() const override { return ""; }
  // The same on every host: the receiving transport's own threads apply (or refuse and count) every write frame.
  Capabilities Query() const override {
    Capabilities c = CapabilitiesOf(name());
    c.provider = "tcp";
    c.writes_into_device = true;  // staged through the sink's host buffers
    c.write_windows = true;
    c.write_grants = true;
    c.refusals_counted = true;
    return c;
  }

  absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterMemory(void* addr, uint64_t len) override {
    return Register(addr, len, /*read_only=*/false);
  }
  // The receiver refuses every write frame into it (docs/security.md): the replica is the source's own memory.
  absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterSourceMemory(void* addr, uint64_t len) override {
    return Register(addr, len, /*read_only=*/true);
  }

  absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterSink(std::shared_ptr<RegionSink> sink) override {
    if (sink == nullptr) return absl::InvalidArgumentError("cannot register a null sink");
    const uint64_t len = sink->length();
    uint64_t id = table_->Add(nullptr, len, sink);
    spdlog::debug("tcp: registered region {} ({} bytes, staged into {})", id, len, sink->Describe());
    return std::unique_ptr<LocalRegion>(std::make_unique<TcpLocalRegion>(table_, id, nullptr, len));
  }

  absl::StatusOr<std::unique_ptr<RemoteRegion>> ImportRegion(const std::string& descriptor) override {
    RegionDescriptor d;
    if (descriptor.size() != sizeof(d)) {
      return absl::InvalidArgumentError(absl::StrCat("tcp region descriptor must be ", sizeof(d),
                                                     " bytes, got ", descriptor.size()));
    }
    std::memcpy(&d, descriptor.data(), sizeof(d));
    if (d.magic != kDescMagic || d.version != kProtocolVersion || d.token == 0 || d.region == 0) {
      return absl::InvalidArgumentError("not a tcp region descriptor (bad magic, version or ids)");
    }
    return std::unique_ptr<RemoteRegion>(std::make_unique<TcpRemoteRegion>(d.token, d.region, d.length));
  }

  absl::StatusOr<std::unique_ptr<Endpoint>> CreateEndpoint() override {
    return NewTcpEndpoint(local_info_, opts_);
  }

  absl::StatusOr<std::unique_ptr<Endpoint>> CreateGrantedEndpoint(const WriteGrant& grant) override {
    auto g = std::make_shared<RegionTable::Grant>();
    g->info = grant;
    for (const LocalRegion* r : grant.regions) {
      auto* tr = dynamic_cast<const TcpLocalRegion*>(r);
      if (tr == nullptr) return absl::InvalidArgumentError("write grant names a region of another transport");
      g->regions.insert(tr->id());
    }
    const RegionTable::Secret sec = table_->AddGrant(std::move(g));
    std::unique_ptr<Endpoint> ep = NewTcpEndpoint(FormatGrantedInfo(local_info_, sec), opts_, table_, sec);
    spdlog::info("tcp: write grant minted for {} ({}, {} regions)", grant.peer, grant.scope, grant.regions.size());
    return ep;
  }
  void RevokeGrants(const std::function<bool(const WriteGrant&)>& keep) override { table_->RevokeGrants(keep); }
  absl::Status RequireGrants(bool require) override {
    table_->SetRequireGrants(require);
    return absl::OkStatus();
  }

  absl::Status SetWriteWindow(bool open) override {
    table_->SetWindow(open);
    return absl::OkStatus();
  }
  uint64_t refused_writes() const override { return table_->refused(); }

 private:
  absl::StatusOr<std::unique_ptr<LocalRegion>> Register(void* addr, uint64_t len, bool read_only) {
    if (addr == nullptr && len > 0) return absl::InvalidArgumentError("cannot register a null address");
    absl::Time start = absl::Now();
    uint64_t id = table_->Add(addr, len, nullptr, read_only);
    spdlog::debug("tcp: registered region {} ({} bytes at {}{}) in {}", id, len, addr,
                  read_only ? ", source: no remote writes" : "", absl::FormatDuration(absl::Now() - start));
    return std::unique_ptr<LocalRegion>(std::make_unique<TcpLocalRegion>(table_, id, addr, len));
  }

  const TransportOptions opts_;
  std::shared_ptr<RegionTable> table_;
  const std::string local_info_;
  Listener listener_;  // last: its threads stop before anything above goes away
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateTcpTransport(const TransportOptions& opts) {
  int port = 0;
  absl::StatusOr<Fd> listen_fd = Listen(opts.bind_host, opts.tcp_port, &port);
  if (!listen_fd.ok()) return Annotate(listen_fd.status(), "tcp transport");
  Fd wake_fd(::eventfd(0, EFD_CLOEXEC));
  if (!wake_fd.valid()) return absl::InternalError(absl::StrCat("eventfd: ", ErrnoText(errno)));
  auto table = std::make_shared<RegionTable>(RandomToken());
  spdlog::info("tcp transport listening on {}:{}", opts.bind_host, port);
  return std::unique_ptr<Transport>(std::make_unique<TcpTransport>(opts, std::move(table), opts.bind_host, port,
                                                                   std::move(*listen_fd), std::move(wake_fd)));
}

}  // namespace wsync::transport::tcp
