// Runs the conformance suite on the mooncake backend (protocol tcp). Its receiving side is the real Mooncake Transfer
// Engine in a process of its own (tests/engines/mooncake_peer.py, one per receiving side), which registers each
// destination region the suite asks for and reads its bytes back; the suite checks them against the pattern. Run
// through tests/engines/run_mooncake_test.sh (WSYNC_MOONCAKE_PYTHON, WSYNC_MOONCAKE_PEER).
#include <cstdlib>

#include "spdlog/spdlog.h"
#include "tests/transport/conformance.h"
#include "tests/transport/mooncake_peer.h"
#include "transport/mooncake/mooncake_transport.h"

namespace {

using wsync::transport::mooncake::MooncakeOptions;

constexpr int kStreams = 4;                   // data connections per endpoint
constexpr uint64_t kChunkBytes = 4ull << 20;  // one request

class MooncakeReceiver final : public wsync::transport::testing::PeerReceiver {
 public:
  // The peer's built-in parameters are left alone; the suite's regions come on top.
  MooncakeReceiver() : peer_(wsync::transport::testing::Layout({{{"unused", 64, 1}}})) {}

  std::string AddRegion(uint64_t length, uint8_t fill) override {
    const uint64_t addr = peer_.AddRegion(length, fill);
    auto d = wsync::transport::mooncake::MakeRegionDescriptor(peer_.session_id(), addr, length);
    INFO(d.status().ToString());
    REQUIRE(d.ok());
    return *d;
  }
  std::string Read(const std::string& descriptor) override {
    auto f = Fields(descriptor);
    return peer_.Read(f.base_addr, f.length);
  }
  void Fill(const std::string& descriptor, uint8_t fill) override {
    auto f = Fields(descriptor);
    peer_.Fill(f.base_addr, f.length, fill);
  }
  std::string ConnectInfo() const override { return peer_.session_id(); }
  void Stop() override { peer_.Stop(); }
  void Resume() override { peer_.Resume(); }
  void Kill() override { peer_.Kill(); }
  uint64_t InFlightBound() const override { return kStreams * kChunkBytes; }

 private:
  static wsync::transport::mooncake::RegionDescriptorFields Fields(const std::string& descriptor) {
    auto f = wsync::transport::mooncake::ParseRegionDescriptor(descriptor);
    REQUIRE(f.ok());
    return *f;
  }
  wsync::transport::testing::Peer peer_;
};

}  // namespace

std::unique_ptr<wsync::transport::Transport> MakeTransportUnderTest() {
  wsync::transport::TransportOptions opts;
  opts.io_timeout = absl::Seconds(15);  // as tcp's factory: above the stopped-peer case's 2.5 s stop
  opts.tcp_streams = kStreams;
  MooncakeOptions m;
  m.protocol = "tcp";
  m.chunk_bytes = kChunkBytes;
  auto t = wsync::transport::mooncake::CreateMooncakeTransport(opts, m);
  if (!t.ok()) {
    spdlog::critical("cannot create the mooncake transport: {}", t.status().ToString());
    std::abort();
  }
  return std::move(*t);
}

std::unique_ptr<wsync::transport::testing::PeerReceiver> MakePeerReceiverUnderTest() {
  return std::make_unique<MooncakeReceiver>();
}
