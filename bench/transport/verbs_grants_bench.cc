// bench_verbs_grants: what per-connection write grants cost a verbs target (docs/security.md, "Write grants
// (verbs)"), next to plain connections measured in the same run. A figure, not a test.
//
// A target serves N source connections; each is granted one engine rank's R regions of B bytes (as ConnectTarget
// grants a rank). Measured per way:
//   connect   per connection: the target's endpoint (plain: CreateEndpoint; granted: CreateGrantedEndpoint, i.e.
//             a protection domain per device and the rank's regions registered again in it) plus both Connects.
//             Paid once per source connection, not per update.
//   window    per close+open cycle of the write window over the N connections (what every update pays).
//   write     one batch writing every region of one rank through its connection (the sender picks the grant's
//             rkeys: a lookup per work request).
// The regions' own first registration (RegisterMemory, paid once at engine attach) is printed for scale.
//
// Usage: bench_verbs_grants [--connections N] [--regions R] [--region-bytes B] [--cycles C]
// Under soft-RoCE emulation absolute times mean little; the ratios measured in the same run are the figure.
// The last line is one JSON object: {"bench":"verbs_grants","value":V,"baseline":B,"ratio":V/B,...} where V is a
// granted connection's setup in ms and B a plain one's; window_* and write_* give the per-update figures.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "bench/transport/bench_util.h"
#include "transport/transport.h"
#include "transport/verbs/verbs_transport.h"

namespace {

using wsync::transport::Endpoint;
using wsync::transport::LocalRegion;
using wsync::transport::RemoteRegion;
using wsync::transport::Transport;
using wsync::transport::WriteRequest;

using wsync::bench::Connect;
using wsync::bench::Flag;
using wsync::bench::Must;
using wsync::bench::Pair;

}  // namespace

int main(int argc, char** argv) {
  const uint64_t connections = Flag(argc, argv, "--connections", 16);
  const uint64_t regions = Flag(argc, argv, "--regions", 4);
  const uint64_t region_bytes = Flag(argc, argv, "--region-bytes", 4 << 20);
  const uint64_t cycles = Flag(argc, argv, "--cycles", 3);
  wsync::InitLogging("bench_verbs_grants", std::getenv("WSYNC_LOG_LEVEL") ? "" : "warn");

  auto source = Must(wsync::transport::verbs::CreateVerbsTransport({}), "create transport");
  auto target = Must(wsync::transport::verbs::CreateVerbsTransport({}), "create transport");
  if (!source->viable()) {
    std::printf("verbs transport not viable: %s\n", source->reason().c_str());
    std::printf("{\"bench\":\"verbs_grants\",\"value\":null,\"baseline\":null,\"ratio\":null}\n");
    return 0;
  }
  // Engine memory on the target: `regions` regions per rank, one rank per connection.
  std::vector<std::vector<uint8_t>> mem(connections * regions, std::vector<uint8_t>(region_bytes, 0));
  std::vector<std::unique_ptr<LocalRegion>> regs;
  absl::Time t0 = absl::Now();
  for (auto& m : mem) regs.push_back(Must(target->RegisterMemory(m.data(), m.size()), "register"));
  const double register_ms = absl::ToDoubleMilliseconds(absl::Now() - t0) / connections;
  std::vector<Transport::WriteGrant> grants(connections);
  for (uint64_t c = 0; c < connections; ++c) {
    grants[c].peer = absl::StrCat("source:s", c);
    grants[c].scope = absl::StrCat("engine0/", c);
    for (uint64_t r = 0; r < regions; ++r) grants[c].regions.push_back(regs[c * regions + r].get());
  }
  std::vector<uint8_t> src_mem(region_bytes, 0x5a);
  auto src = Must(source->RegisterSourceMemory(src_mem.data(), src_mem.size()), "register source");
  std::vector<std::unique_ptr<RemoteRegion>> remote;
  for (const auto& r : regs) remote.push_back(Must(source->ImportRegion(r->Descriptor()), "import"));
  std::vector<WriteRequest> rank0;
  for (uint64_t r = 0; r < regions; ++r) rank0.push_back({src.get(), 0, remote[r].get(), 0, region_bytes});

  struct Way {
    double connect_ms = 0, window_ms = 0, write_ms = 0;
  };
  auto measure = [&](bool granted) {
    Way w;
    Must(target->RequireGrants(granted), "require grants");
    std::vector<Pair> pairs;
    for (uint64_t k = 0; k < cycles; ++k) {
      pairs.clear();
      const absl::Time s = absl::Now();
      for (uint64_t c = 0; c < connections; ++c)
        pairs.push_back(Connect(*source, *target, granted ? &grants[c] : nullptr));
      w.connect_ms += absl::ToDoubleMilliseconds(absl::Now() - s) / connections;
    }
    absl::Time s = absl::Now();
    for (uint64_t k = 0; k < cycles; ++k) {
      Must(target->SetWriteWindow(false), "close window");
      Must(target->SetWriteWindow(true), "open window");
    }
    w.window_ms = absl::ToDoubleMilliseconds(absl::Now() - s) / cycles;
    s = absl::Now();
    for (uint64_t k = 0; k < cycles; ++k) Must(pairs[0].src->Write(rank0, absl::Seconds(120)), "write");
    w.write_ms = absl::ToDoubleMilliseconds(absl::Now() - s) / cycles;
    w.connect_ms /= cycles;
    return w;
  };
  const Way plain = measure(false);
  const Way granted = measure(true);

  std::printf(
      "verbs write grants, %llu connections (2 QPs each on one device), each granted %llu regions of %llu "
      "bytes, %llu cycles\n",
      static_cast<unsigned long long>(connections), static_cast<unsigned long long>(regions),
      static_cast<unsigned long long>(region_bytes), static_cast<unsigned long long>(cycles));
  std::printf("%-10s %16s %16s %16s\n", "way", "connect ms/conn", "window ms/cycle", "write ms/rank");
  std::printf("%-10s %16.3f %16.3f %16.3f\n", "plain", plain.connect_ms, plain.window_ms, plain.write_ms);
  std::printf("%-10s %16.3f %16.3f %16.3f\n", "granted", granted.connect_ms, granted.window_ms, granted.write_ms);
  std::printf("first registration of one rank's regions (once per engine attach): %.3f ms\n", register_ms);
  std::printf(
      "{\"bench\":\"verbs_grants\",\"value\":%.4f,\"baseline\":%.4f,\"ratio\":%.4f,\"window_granted_ms\":%.4f,"
      "\"window_plain_ms\":%.4f,\"write_granted_ms\":%.4f,\"write_plain_ms\":%.4f,\"register_rank_ms\":%.4f,"
      "\"connections\":%llu,\"regions\":%llu,\"region_bytes\":%llu}\n",
      granted.connect_ms, plain.connect_ms, granted.connect_ms / plain.connect_ms, granted.window_ms, plain.window_ms,
      granted.write_ms, plain.write_ms, register_ms, static_cast<unsigned long long>(connections),
      static_cast<unsigned long long>(regions), static_cast<unsigned long long>(region_bytes));
  return 0;
}
