// bench_mooncake_write: wsync's mooncake transport writing into memory a real Mooncake Transfer Engine registered,
// the way a source writes into SGLang. Posts batches of `--batch` writes of `--block` bytes, cycling over
// [base, base + length) of the peer's buffer, keeping `--inflight` batches outstanding, for `--duration` seconds.
// Prints "wsync_gbps=<GB/s>" as its last line; run_mooncake_bench.sh puts it next to Mooncake's own writer
// (transfer_engine_bench, same sizes, same peer) and prints the JSON line.

#include <cstdio>
#include <deque>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "transport/mooncake/mooncake_transport.h"

int main(int argc, char** argv) {
  CLI::App app{"bench_mooncake_write: wsync mooncake-transport write throughput into a Mooncake peer"};
  std::string session, base_hex;
  uint64_t length = 0, block = 4 << 20;
  int batch = 8, inflight = 2, streams = 4;
  double duration = 3;
  app.add_option("--session", session, "peer session id ip:port")->required();
  app.add_option("--base", base_hex, "peer buffer base address (hex)")->required();
  app.add_option("--length", length, "peer buffer bytes")->required();
  app.add_option("--block", block, "bytes per write request");
  app.add_option("--batch", batch, "writes per batch");
  app.add_option("--inflight", inflight, "batches outstanding");
  app.add_option("--streams", streams, "data connections of the endpoint");
  app.add_option("--duration", duration, "seconds");
  CLI11_PARSE(app, argc, argv);
  uint64_t base = 0;
  if (!absl::SimpleHexAtoi(base_hex, &base) || length < block || block == 0) {
    std::fprintf(stderr, "bad --base/--length/--block\n");
    return 2;
  }
  namespace tr = wsync::transport;
  tr::TransportOptions to;
  to.tcp_streams = streams;
  tr::mooncake::MooncakeOptions mo;
  mo.chunk_bytes = block;
  auto t = tr::mooncake::CreateMooncakeTransport(to, mo);
  std::vector<uint8_t> src(block * batch);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  auto local = (*t)->RegisterMemory(src.data(), src.size());
  auto desc = tr::mooncake::MakeRegionDescriptor(session, base, length);
  if (!local.ok() || !desc.ok()) {
    std::fprintf(stderr, "setup: %s %s\n", local.status().ToString().c_str(), desc.status().ToString().c_str());
    return 1;
  }
  auto remote = (*t)->ImportRegion(*desc);
  auto ep = (*t)->CreateEndpoint();
  if (!remote.ok() || !ep.ok()) return 1;
  if (auto st = (*ep)->Connect(session, absl::Seconds(10)); !st.ok()) {
    std::fprintf(stderr, "connect: %s\n", st.ToString().c_str());
    return 1;
  }
  const uint64_t slots = length / block;
  uint64_t next = 0, bytes = 0;
  std::deque<tr::BatchId> pending;
  const absl::Time start = absl::Now(), end = start + absl::Seconds(duration);
  while (absl::Now() < end || !pending.empty()) {
    if (absl::Now() < end && static_cast<int>(pending.size()) < inflight) {
      std::vector<tr::WriteRequest> ws(batch);
      for (int i = 0; i < batch; ++i) {
        ws[i] = {local->get(), static_cast<uint64_t>(i) * block, remote->get(), (next++ % slots) * block, block};
      }
      auto id = (*ep)->Post(ws);
      if (!id.ok()) {
        std::fprintf(stderr, "post: %s\n", id.status().ToString().c_str());
        return 1;
      }
      pending.push_back(*id);
      continue;
    }
    if (auto st = (*ep)->Wait(pending.front(), absl::Seconds(30)); !st.ok()) {
      std::fprintf(stderr, "wait: %s\n", st.ToString().c_str());
      return 1;
    }
    pending.pop_front();
    bytes += block * batch;
  }
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  std::printf("wsync mooncake write: %.2f GB in %.2f s\nwsync_gbps=%.4f\n", bytes / 1e9, secs, bytes / 1e9 / secs);
  return 0;
}
