// bench_transport_verbs: RDMA WRITE throughput of the verbs transport for 4 KiB .. 64 MiB writes, one process,
// loopback between two transport instances on the same device, next to a baseline measured in the same run
// (perftest ib_write_bw; run_verbs_bench.sh collects it). A figure, not a test.
//
// Usage: bench_transport_verbs [--baseline FILE] [--bytes-per-size N] [--sizes a,b,...] [--qps N] [--device D]
//   FILE: lines "<message bytes> <Gb/s>" (ib_write_bw --report_gbits averages).
// The last line of output is one JSON object: {"bench":"transport_verbs","value":V,"baseline":B,"ratio":R} where
// V is our GB/s at the largest size, B ib_write_bw's GB/s at that size (null without a baseline), R = V / B.

#include "bench/transport/verbs_bench.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "transport/transport.h"
#include "transport/verbs/verbs_transport.h"

namespace {

using wsync::transport::BatchId;
using wsync::transport::Endpoint;
using wsync::transport::LocalRegion;
using wsync::transport::RemoteRegion;
using wsync::transport::Transport;
using wsync::transport::TransportOptions;
using wsync::transport::WriteRequest;

struct Args {
  std::string baseline_file;
  uint64_t bytes_per_size = 32ull << 20;
  std::vector<uint64_t> sizes = {4ull << 10, 16ull << 10, 64ull << 10, 256ull << 10,
                                 1ull << 20, 4ull << 20,  16ull << 20, 64ull << 20};
  int qps = 0;
  std::string device;
};

[[noreturn]] void Die(const std::string& msg) {
  std::fprintf(stderr, "bench_transport_verbs: %s\n", msg.c_str());
  std::exit(1);
}

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Die("missing value for " + k);
      return argv[++i];
    };
    if (k == "--baseline") {
      a.baseline_file = value();
    } else if (k == "--bytes-per-size") {
      if (!absl::SimpleAtoi(value(), &a.bytes_per_size)) Die("bad --bytes-per-size");
    } else if (k == "--qps") {
      if (!absl::SimpleAtoi(value(), &a.qps)) Die("bad --qps");
    } else if (k == "--device") {
      a.device = value();
    } else if (k == "--sizes") {
      a.sizes.clear();
      for (absl::string_view s : absl::StrSplit(value(), ',')) {
        uint64_t v = 0;
        if (!absl::SimpleAtoi(s, &v) || v == 0) Die("bad --sizes");
        a.sizes.push_back(v);
      }
    } else {
      Die("unknown argument " + k + " (see the header of verbs_bench.cc)");
    }
  }
  return a;
}

std::map<uint64_t, double> ReadBaseline(const std::string& path) {
  std::map<uint64_t, double> gbytes;
  if (path.empty()) return gbytes;
  std::ifstream in(path);
  if (!in) Die("cannot read " + path);
  uint64_t size;
  double gbits;
  while (in >> size >> gbits) gbytes[size] = gbits / 8.0;
  return gbytes;
}

std::string Human(uint64_t n) {
  if (n >= (1ull << 20)) return absl::StrFormat("%d MiB", n >> 20);
  if (n >= (1ull << 10)) return absl::StrFormat("%d KiB", n >> 10);
  return absl::StrFormat("%d B", n);
}

template <typename T>
T Must(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) Die(absl::StrFormat("%s: %s", what, v.status().ToString()));
  return std::move(*v);
}

void Must(const absl::Status& s, const char* what) {
  if (!s.ok()) Die(absl::StrFormat("%s: %s", what, s.ToString()));
}

// GB/s for writes of `size` bytes: batches of up to 8 MiB, two batches in flight.
double Measure(Endpoint& ep, const LocalRegion& src, const RemoteRegion& dst, uint64_t size, uint64_t total) {
  const uint64_t region = src.length();
  const uint64_t per_batch = std::max<uint64_t>(1, std::min<uint64_t>((8ull << 20) / size, 2048));
  const uint64_t batches = std::max<uint64_t>(2, (std::max(total, size) + size * per_batch - 1) / (size * per_batch));
  uint64_t cursor = 0;
  auto make_batch = [&]() {
    std::vector<WriteRequest> ws;
    for (uint64_t i = 0; i < per_batch; ++i) {
      if (cursor + size > region) cursor = 0;
      ws.push_back({&src, cursor, &dst, cursor, size});
      cursor += size;
    }
    return ws;
  };
  Must(ep.Write(make_batch(), absl::Minutes(2)), "warm-up write");
  std::deque<BatchId> inflight;
  absl::Time start = absl::Now();
  for (uint64_t b = 0; b < batches; ++b) {
    inflight.push_back(Must(ep.Post(make_batch()), "post"));
    if (inflight.size() == 2) {
      Must(ep.Wait(inflight.front(), absl::Minutes(2)), "wait");
      inflight.pop_front();
    }
  }
  while (!inflight.empty()) {
    Must(ep.Wait(inflight.front(), absl::Minutes(2)), "wait");
    inflight.pop_front();
  }
  double secs = absl::ToDoubleSeconds(absl::Now() - start);
  return static_cast<double>(batches * per_batch * size) / secs / 1e9;
}

}  // namespace

namespace wsync::bench {

int RunVerbsBench(int argc, char** argv) {
  Args args = Parse(argc, argv);
  wsync::InitLogging("bench_verbs", std::getenv("WSYNC_LOG_LEVEL") ? "" : "warn");
  std::map<uint64_t, double> baseline = ReadBaseline(args.baseline_file);

  TransportOptions opts;
  if (!args.device.empty()) opts.devices = {args.device};
  wsync::transport::verbs::VerbsOptions vo;
  vo.qps_per_device = args.qps;
  auto a = Must(wsync::transport::verbs::CreateVerbsTransport(opts, vo), "create transport");
  auto b = Must(wsync::transport::verbs::CreateVerbsTransport(opts, vo), "create transport");
  if (!a->viable()) {
    std::printf("verbs transport not viable: %s\n", a->reason().c_str());
    std::printf("{\"bench\":\"transport_verbs\",\"value\":null,\"baseline\":null,\"ratio\":null}\n");
    return 0;
  }

  const uint64_t len = *std::max_element(args.sizes.begin(), args.sizes.end());
  std::vector<uint8_t> src_mem(len, 0x5a), dst_mem(len, 0);
  absl::Time t0 = absl::Now();
  auto src = Must(a->RegisterMemory(src_mem.data(), len), "register source");
  auto dst = Must(b->RegisterMemory(dst_mem.data(), len), "register destination");
  double reg_ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
  auto remote = Must(a->ImportRegion(dst->Descriptor()), "import");
  auto ea = Must(a->CreateEndpoint(), "endpoint");
  auto eb = Must(b->CreateEndpoint(), "endpoint");
  Must(ea->Connect(eb->LocalInfo(), absl::Seconds(10)), "connect");
  Must(eb->Connect(ea->LocalInfo(), absl::Seconds(10)), "connect");

  std::printf("verbs RDMA WRITE, one process, loopback to %s; registration of 2 x %s took %.1f ms\n",
              ea->PeerName().c_str(), Human(len).c_str(), reg_ms);
  std::printf("%10s %14s %20s %8s\n", "size", "verbs GB/s", "ib_write_bw GB/s", "ratio");
  double value = 0, base = -1;
  for (uint64_t size : args.sizes) {
    double gbs = Measure(*ea, *src, *remote, size, args.bytes_per_size);
    auto it = baseline.find(size);
    double bl = it == baseline.end() ? -1 : it->second;
    if (bl > 0) {
      std::printf("%10s %14.4f %20.4f %8.2f\n", Human(size).c_str(), gbs, bl, gbs / bl);
    } else {
      std::printf("%10s %14.4f %20s %8s\n", Human(size).c_str(), gbs, "-", "-");
    }
    std::fflush(stdout);
    if (size == len) {
      value = gbs;
      base = bl;
    }
  }
  if (base > 0) {
    std::printf("{\"bench\":\"transport_verbs\",\"value\":%.4f,\"baseline\":%.4f,\"ratio\":%.3f}\n", value, base,
                value / base);
  } else {
    std::printf("{\"bench\":\"transport_verbs\",\"value\":%.4f,\"baseline\":null,\"ratio\":null}\n", value);
  }
  return 0;
}

}  // namespace wsync::bench
