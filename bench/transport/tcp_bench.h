#pragma once
// Throughput of the tcp transport on loopback, and the plain-TCP baselines it is compared with.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace wsync::bench {

struct SizePoint {
  uint64_t message_bytes = 0;     // size of one WriteRequest
  uint64_t writes_per_batch = 0;  // messages per Post
  uint64_t bytes = 0;             // moved during the measurement
  double seconds = 0;
  double gbps() const { return seconds > 0 ? bytes / seconds / 1e9 : 0; }
};

struct TcpBenchOptions {
  std::vector<uint64_t> sizes;                      // message sizes to sweep
  absl::Duration per_size = absl::Milliseconds(500);  // measurement time per size
  int streams = 4;                                  // TransportOptions::tcp_streams
  uint64_t batch_bytes = 16 << 20;                  // small messages are grouped into batches of about this much
  int in_flight = 2;                                // batches outstanding at once
};

// Sender and receiver transports in this process, connected over 127.0.0.1.
absl::StatusOr<std::vector<SizePoint>> RunTcpTransportSweep(const TcpBenchOptions& opts);
// The same sweep on any backend (`name` as CreateTransport takes it), sender and receiver in this process.
absl::StatusOr<std::vector<SizePoint>> RunTransportSweep(const std::string& name,
                                                         const transport::TransportOptions& topts,
                                                         const TcpBenchOptions& opts);

struct Baseline {
  std::string tool;  // "iperf3" or "socket"
  double gbps = 0;
  std::string note;  // why a fallback was used, if one was
};

// `iperf3 -c 127.0.0.1 -J -t <seconds>` against a one-shot `iperf3 -s -1` started here. NotFound when iperf3 is
// not installed; other errors when it fails to run.
absl::StatusOr<Baseline> RunIperf3Loopback(absl::Duration duration, int streams);

// One TCP connection over 127.0.0.1, one thread sending 4 MiB buffers, one receiving them.
absl::StatusOr<Baseline> RunSocketLoopback(absl::Duration duration);

}  // namespace wsync::bench
