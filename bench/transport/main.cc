// bench_transport: transport throughput next to a plain-TCP baseline measured in the same run.
//   bench_transport            tcp transport on 127.0.0.1 vs iperf3 (or a socket-to-socket loop without it)
// Other modes (e.g. --verbs) plug in as sibling sources; see CMakeLists.txt. Last line: one JSON object.

#include <cstdio>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "base/logging.h"
#include "bench/transport/tcp_bench.h"
#include "nlohmann/json.hpp"

namespace {

std::string HumanSize(uint64_t b) {
  if (b >= (1 << 20)) return absl::StrFormat("%d MiB", b >> 20);
  if (b >= (1 << 10)) return absl::StrFormat("%d KiB", b >> 10);
  return absl::StrFormat("%d B", b);
}

int RunTcp(const wsync::bench::TcpBenchOptions& opts, double iperf_seconds) {
  // The baseline first, while nothing else of ours runs.
  wsync::bench::Baseline base;
  auto iperf = wsync::bench::RunIperf3Loopback(absl::Seconds(iperf_seconds), opts.streams);
  if (iperf.ok()) {
    base = *iperf;
  } else {
    std::printf("baseline: iperf3 unavailable (%s); using a socket-to-socket loop instead\n",
                iperf.status().ToString().c_str());
    auto sock = wsync::bench::RunSocketLoopback(absl::Seconds(iperf_seconds));
    if (!sock.ok()) {
      std::fprintf(stderr, "baseline failed: %s\n", sock.status().ToString().c_str());
      return 1;
    }
    base = *sock;
    base.note = std::string(iperf.status().message());
  }

  auto points = wsync::bench::RunTcpTransportSweep(opts);
  if (!points.ok()) {
    std::fprintf(stderr, "tcp transport sweep failed: %s\n", points.status().ToString().c_str());
    return 1;
  }

  std::printf("\ntcp transport on 127.0.0.1 (%d stream(s) per endpoint, %d batch(es) in flight)\n", opts.streams,
              opts.in_flight);
  std::printf("%10s %14s %10s %12s\n", "message", "writes/batch", "GB/s", "vs baseline");
  nlohmann::ordered_json sizes = nlohmann::ordered_json::object();
  double at_max = 0;
  uint64_t max_size = 0;
  for (const auto& p : *points) {
    std::printf("%10s %14llu %10.2f %11.2fx\n", HumanSize(p.message_bytes).c_str(),
                static_cast<unsigned long long>(p.writes_per_batch), p.gbps(),
                base.gbps > 0 ? p.gbps() / base.gbps : 0.0);
    sizes[std::to_string(p.message_bytes)] = p.gbps();
    if (p.message_bytes >= max_size) {
      max_size = p.message_bytes;
      at_max = p.gbps();
    }
  }
  std::printf("%10s %14s %10.2f %11s   (%s, same run)\n", base.tool.c_str(), "-", base.gbps, "1.00x",
              base.tool == "iperf3" ? "iperf3 -c 127.0.0.1 -J -P <streams>" : "plain socket loop");

  nlohmann::ordered_json out = {
      {"bench", "transport_tcp"},
      {"value", at_max},
      {"baseline", base.gbps},
      {"ratio", base.gbps > 0 ? at_max / base.gbps : 0.0},
      {"unit", "GB/s"},
      {"message_bytes", max_size},
      {"baseline_tool", base.tool},
      {"streams", opts.streams},
      {"sizes", sizes},
  };
  if (!base.note.empty()) out["baseline_note"] = base.note;
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"wsync transport throughput vs a baseline measured in the same run (loopback only)"};
  wsync::bench::TcpBenchOptions opts;
  double per_size_ms = 500;
  double iperf_seconds = 3;
  uint64_t min_size = 4 << 10;
  uint64_t max_size = 64 << 20;
  std::string log_level = "warn";
  app.add_option("--streams", opts.streams, "tcp connections per endpoint for large batches")->capture_default_str();
  app.add_option("--in-flight", opts.in_flight, "batches outstanding at once")->capture_default_str();
  app.add_option("--per-size-ms", per_size_ms, "measurement time per message size")->capture_default_str();
  app.add_option("--baseline-seconds", iperf_seconds, "iperf3 -t / socket baseline duration")->capture_default_str();
  app.add_option("--min-size", min_size, "smallest message (bytes)")->capture_default_str();
  app.add_option("--max-size", max_size, "largest message (bytes); sizes step by 4x")->capture_default_str();
  app.add_option("--log-level", log_level, "spdlog level")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  wsync::InitLogging("bench_transport", log_level);

  opts.per_size = absl::Milliseconds(per_size_ms);
  for (uint64_t s = min_size; s <= max_size; s *= 4) opts.sizes.push_back(s);
  if (opts.sizes.empty() || opts.sizes.back() != max_size) opts.sizes.push_back(max_size);
  return RunTcp(opts, iperf_seconds);
}
