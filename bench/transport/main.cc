// bench_transport: transport throughput next to a plain-TCP baseline measured in the same run.
//   bench_transport            tcp transport on 127.0.0.1 vs iperf3 (or a socket-to-socket loop without it)
//   bench_transport --fabric   fabric transport vs raw libfabric writes (fabric_bench.cc), tcp and verbs beside
// Other modes (e.g. --verbs) plug in as sibling sources; see CMakeLists.txt. Last line: one JSON object.

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "base/logging.h"
#include "bench/transport/tcp_bench.h"
#ifdef WSYNC_WITH_FABRIC
#include "bench/transport/fabric_bench.h"
#endif
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

#ifdef WSYNC_WITH_FABRIC
double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// The fabric transport, the raw-libfabric baseline, the tcp transport (and verbs where a device is viable), one run.
// Each size is measured raw (spinning and paced receiver) and then through the transport, size after size; with
// `repeat` > 1 the whole sweep runs that many times and every figure is the median over the repetitions (ratios are
// taken per repetition, then their median): on a loaded machine one figure can be off by a scheduler hiccup; tcp and
// verbs run once.
int RunFabric(const wsync::bench::TcpBenchOptions& opts, const std::string& provider, int repeat) {
  wsync::bench::RawFabricOptions raw_opts;
  raw_opts.provider = provider;
  raw_opts.sizes = opts.sizes;
  raw_opts.per_size = opts.per_size;
  std::string used;
  const size_t n = opts.sizes.size();
  // Per size, per repetition.
  std::vector<std::vector<double>> spin_g(n), paced_g(n), raw_g(n), fab_g(n), ratio_r(n);
  // Interleaved per size (raw spinning, raw paced, fabric, then the next size): the three figures a ratio is taken
  // from are measured seconds apart, not a whole sweep apart (on a shared machine the load drifts between sweeps).
  for (int rep = 0; rep < std::max(1, repeat); ++rep) {
    for (size_t i = 0; i < n; ++i) {
      wsync::bench::TcpBenchOptions one = opts;
      one.sizes = {opts.sizes[i]};
      raw_opts.sizes = one.sizes;
      // Two ways for the raw receiver to progress; the better one is the baseline.
      raw_opts.progress_pause_us = 0;
      auto spin = wsync::bench::RunRawFabricSweep(raw_opts, &used);
      raw_opts.progress_pause_us = 50;
      auto paced = wsync::bench::RunRawFabricSweep(raw_opts, &used);
      if (!spin.ok() || !paced.ok()) {
        std::fprintf(stderr, "raw libfabric baseline failed: %s\n",
                     (spin.ok() ? paced.status() : spin.status()).ToString().c_str());
        return 1;
      }
      wsync::transport::TransportOptions topts;
      topts.bind_host = "127.0.0.1";
      topts.fabric_provider = used;  // the transport on exactly the provider the baseline ran on
      auto fab = wsync::bench::RunTransportSweep("fabric", topts, one);
      if (!fab.ok()) {
        std::fprintf(stderr, "fabric transport sweep failed: %s\n", fab.status().ToString().c_str());
        return 1;
      }
      const double r = std::max((*spin)[0].gbps(), (*paced)[0].gbps()), f = (*fab)[0].gbps();
      spin_g[i].push_back((*spin)[0].gbps());
      paced_g[i].push_back((*paced)[0].gbps());
      raw_g[i].push_back(r);
      fab_g[i].push_back(f);
      ratio_r[i].push_back(r > 0 ? f / r : 0);
    }
  }
  wsync::transport::TransportOptions topts;
  topts.bind_host = "127.0.0.1";
  topts.tcp_streams = opts.streams;
  auto tcp = wsync::bench::RunTransportSweep("tcp", topts, opts);
  if (!tcp.ok()) {
    std::fprintf(stderr, "tcp transport sweep failed: %s\n", tcp.status().ToString().c_str());
    return 1;
  }
  auto verbs = wsync::bench::RunTransportSweep("verbs", topts, opts);
  if (!verbs.ok()) std::printf("verbs: not measured (%s)\n", std::string(verbs.status().message()).c_str());

  std::printf("\nfabric transport on %s vs raw libfabric (fi_writemsg window, same provider, same run; median of %d)\n",
              used.c_str(), std::max(1, repeat));
  std::printf("%10s %10s %10s %12s %8s %16s %10s %10s\n", "message", "raw spin", "raw paced", "fabric GB/s", "ratio",
              "ratio min-max", "tcp GB/s", "verbs GB/s");
  nlohmann::ordered_json sizes = nlohmann::ordered_json::object();
  double min_ratio = 1e9;
  for (size_t i = 0; i < n; ++i) {
    const double ratio = Median(ratio_r[i]), f = Median(fab_g[i]), t = (*tcp)[i].gbps();
    const double v = verbs.ok() ? (*verbs)[i].gbps() : 0;
    const auto [lo, hi] = std::minmax_element(ratio_r[i].begin(), ratio_r[i].end());
    min_ratio = std::min(min_ratio, ratio);
    std::printf("%10s %10.3f %10.3f %12.3f %7.2fx %7.2f-%-7.2f %10.3f %10s\n", HumanSize(opts.sizes[i]).c_str(),
                Median(spin_g[i]), Median(paced_g[i]), f, ratio, *lo, *hi, t,
                verbs.ok() ? absl::StrFormat("%.3f", v).c_str() : "-");
    nlohmann::ordered_json e = {{"raw", Median(raw_g[i])},
                                {"raw_spin", Median(spin_g[i])},
                                {"raw_paced", Median(paced_g[i])},
                                {"fabric", f},
                                {"ratio", ratio},
                                {"ratios", ratio_r[i]},
                                {"tcp", t}};
    if (verbs.ok()) e["verbs"] = v;
    sizes[std::to_string(opts.sizes[i])] = e;
  }
  const double at_max = Median(fab_g.back()), raw_max = Median(raw_g.back());
  nlohmann::ordered_json out = {
      {"bench", "transport_fabric"},
      {"provider", used},
      {"value", at_max},
      {"baseline", raw_max},
      {"ratio", Median(ratio_r.back())},
      {"min_ratio", min_ratio},
      {"repeat", std::max(1, repeat)},
      {"unit", "GB/s"},
      {"message_bytes", opts.sizes.back()},
      {"baseline_tool", "raw libfabric fi_writemsg window (receiver spinning or paced, the better per size)"},
      {"sizes", sizes},
  };
  std::printf("%s\n", out.dump().c_str());
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"wsync transport throughput vs a baseline measured in the same run (loopback only)"};
  wsync::bench::TcpBenchOptions opts;
  double per_size_ms = 500;
  double iperf_seconds = 3;
  uint64_t min_size = 4 << 10;
  uint64_t max_size = 64 << 20;
  std::string log_level = "warn";
  bool fabric = false;
  std::string fabric_provider;
  int repeat = 1;
  app.add_flag("--fabric", fabric,
               "the fabric transport vs a raw-libfabric baseline, with tcp (and verbs where viable) in the same run");
  app.add_option("--fabric-provider", fabric_provider, "libfabric provider for --fabric (default: libfabric's pick)");
  app.add_option("--repeat", repeat, "--fabric: alternate baseline and fabric sweeps this often, report medians")
      ->capture_default_str();
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
  if (fabric) {
#ifdef WSYNC_WITH_FABRIC
    return RunFabric(opts, fabric_provider, repeat);
#else
    std::fprintf(stderr, "--fabric: built without libfabric support (install libfabric-dev and reconfigure)\n");
    return 2;
#endif
  }
  return RunTcp(opts, iperf_seconds);
}
