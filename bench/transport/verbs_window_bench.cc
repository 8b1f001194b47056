// bench_verbs_window: what it costs to open and close a verbs target's write window, per way of doing it, for N
// source connections and N registered regions (docs/security.md, "Write windows (verbs)"). A figure, not a test.
//
//   window     Transport::SetWriteWindow(false) + (true): every QP's remote-write flag cleared and set again
//              (RTS→RTS modify, plus a state query per QP). What wsync does.
//   reconnect  tear every connection down and build it again (both sides' QPs created and moved to RTS): the cost
//              of moving the target's QPs out of RTS at close and reconnecting at open, before any control-plane
//              round trip (each source must also be sent fresh connection info).
//   reregister deregister and register every region again (the baseline): the cost of granting remote write
//              per window through the MRs themselves; new rkeys would also have to reach every source.
//
// Usage: bench_verbs_window [--connections N] [--regions N] [--region-bytes B] [--cycles N]
// Each connection has the transport's default QPs per device (2). Under soft-RoCE emulation the absolute times
// mean little; the ratio between the ways, measured in the same run, is the figure.
// The last line is one JSON object: {"bench":"verbs_window","value":V,"baseline":B,"ratio":V/B,...} where V is the
// window's ms per close+open cycle and B re-registration's ms per cycle.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "bench/transport/bench_util.h"
#include "transport/transport.h"
#include "transport/verbs/verbs_transport.h"

namespace {

using wsync::transport::Endpoint;
using wsync::transport::LocalRegion;
using wsync::transport::Transport;

using wsync::bench::Connect;
using wsync::bench::Flag;
using wsync::bench::Must;
using wsync::bench::Pair;

}  // namespace

int main(int argc, char** argv) {
  const uint64_t connections = Flag(argc, argv, "--connections", 64);
  const uint64_t regions = Flag(argc, argv, "--regions", 64);
  const uint64_t region_bytes = Flag(argc, argv, "--region-bytes", 4 << 20);
  const uint64_t cycles = Flag(argc, argv, "--cycles", 5);
  wsync::InitLogging("bench_verbs_window", std::getenv("WSYNC_LOG_LEVEL") ? "" : "warn");

  auto source = Must(wsync::transport::verbs::CreateVerbsTransport({}), "create transport");
  auto target = Must(wsync::transport::verbs::CreateVerbsTransport({}), "create transport");
  if (!source->viable()) {
    std::printf("verbs transport not viable: %s\n", source->reason().c_str());
    std::printf("{\"bench\":\"verbs_window\",\"value\":null,\"baseline\":null,\"ratio\":null}\n");
    return 0;
  }
  std::vector<std::vector<uint8_t>> mem(regions, std::vector<uint8_t>(region_bytes, 0));
  std::vector<std::unique_ptr<LocalRegion>> regs;
  for (auto& m : mem) regs.push_back(Must(target->RegisterMemory(m.data(), m.size()), "register"));
  std::vector<Pair> pairs;
  for (uint64_t i = 0; i < connections; ++i) pairs.push_back(Connect(*source, *target));

  absl::Time t0 = absl::Now();
  for (uint64_t c = 0; c < cycles; ++c) {
    Must(target->SetWriteWindow(false), "close window");
    Must(target->SetWriteWindow(true), "open window");
  }
  const double window_ms = absl::ToDoubleMilliseconds(absl::Now() - t0) / cycles;

  t0 = absl::Now();
  for (uint64_t c = 0; c < cycles; ++c) {
    pairs.clear();
    for (uint64_t i = 0; i < connections; ++i) pairs.push_back(Connect(*source, *target));
  }
  const double reconnect_ms = absl::ToDoubleMilliseconds(absl::Now() - t0) / cycles;

  t0 = absl::Now();
  for (uint64_t c = 0; c < cycles; ++c) {
    for (uint64_t i = 0; i < regions; ++i) {
      regs[i].reset();
      regs[i] = Must(target->RegisterMemory(mem[i].data(), mem[i].size()), "re-register");
    }
  }
  const double rereg_ms = absl::ToDoubleMilliseconds(absl::Now() - t0) / cycles;

  std::printf("verbs write window, %llu connections (%s), %llu regions of %llu bytes, %llu cycles\n",
              static_cast<unsigned long long>(connections), "2 QPs each on one device",
              static_cast<unsigned long long>(regions), static_cast<unsigned long long>(region_bytes),
              static_cast<unsigned long long>(cycles));
  std::printf("%-12s %14s\n", "way", "ms per cycle");
  std::printf("%-12s %14.3f\n", "window", window_ms);
  std::printf("%-12s %14.3f\n", "reconnect", reconnect_ms);
  std::printf("%-12s %14.3f\n", "reregister", rereg_ms);
  std::printf(
      "{\"bench\":\"verbs_window\",\"value\":%.4f,\"baseline\":%.4f,\"ratio\":%.4f,\"reconnect_ms\":%.4f,"
      "\"connections\":%llu,\"regions\":%llu,\"region_bytes\":%llu}\n",
      window_ms, rereg_ms, window_ms / rereg_ms, reconnect_ms, static_cast<unsigned long long>(connections),
      static_cast<unsigned long long>(regions), static_cast<unsigned long long>(region_bytes));
  return 0;
}
