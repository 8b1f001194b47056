// The target's apply path for delta records into `cuda` segments (docs/delta.md, "GPU memory"), on a CPU: an
// in-process TargetNode whose engine rank attaches one cuda segment and one host segment over the real attach
// protocol; the cuda segment is imported by a test importer that puts host memory behind it (its sink takes dense
// writes, its scatter is the host SegmentScatter, counting read-backs), so every line of the target's device path
// runs: records staged over the real tcp transport, checked, base checks by read-back (a range last written dense)
// or by the checksum recorded from the previous record, one scatter flush per segment, the checksums recorded
// after it, and a refusal that writes nothing. Every byte is compared with the test's own versions of the weights.
// Built a second time with WSYNC_DELTA_DEVICE_CUDA as tests/cuda/delta_device_cuda_test: the same updates into
// device memory through the real CudaSink and device scatter (exits 77 without a GPU).

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#ifdef WSYNC_DELTA_DEVICE_CUDA
#include <cuda_runtime.h>
#endif

#include "absl/strings/match.h"
#include "base/fd_passing.h"
#include "base/status.h"
#include "daemon/node/segment_scatter.h"
#include "daemon/node/target_node.h"
#include "replica/delta.h"
#include "transport/transport.h"

namespace wsync::daemon {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kCudaBytes = 8192, kHostBytes = 1024;
constexpr uint64_t kA = 4096, kB = 64, kC = 256;  // a.weight, b.weight in the cuda segment; c.weight in the host one
constexpr uint64_t kAOff = 0, kBOff = 4096, kCOff = 0;

class FakeAdapter final : public EngineAdapter {
 public:
  using AttachFn = std::function<absl::Status(const AttachInfo&)>;
  explicit FakeAdapter(AttachFn attach) : attach_(std::move(attach)) {}
  const std::string& kind() const override { return kind_; }
  const std::string& address() const override { return address_; }
  absl::StatusOr<EngineDescription> Describe() override { return EngineDescription{"gpu0", "fake", 1, "0", false}; }
  absl::Status RequestAttach(const AttachInfo& info) override { return attach_(info); }
  absl::Status Pause(const std::string&) override { return absl::OkStatus(); }
  absl::Status PostProcess(const std::string&) override { return absl::OkStatus(); }
  absl::Status SetWeightVersion(const std::string&) override { return absl::OkStatus(); }
  absl::Status Continue() override { return absl::OkStatus(); }

 private:
  std::string kind_ = "fake", address_ = "fake+test://nowhere:1";
  AttachFn attach_;
};

// The cuda segment's memory: host memory standing in for it (the CPU build: the transport writes it through a
// sink, as it writes a real cuda segment through its staging pool, and records go through the host scatter), or,
// with WSYNC_DELTA_DEVICE_CUDA (tests/cuda: delta_device_cuda_test), device memory of this process behind the real
// CudaSink and device scatter (WrapCudaMemory). Either way the target's read-backs are counted.
struct FakeDevice {
  std::atomic<int> read_backs{0};
#ifdef WSYNC_DELTA_DEVICE_CUDA
  uint8_t* dev = nullptr;
  FakeDevice() { REQUIRE(cudaMalloc(&dev, kCudaBytes) == cudaSuccess); }
  ~FakeDevice() { cudaFree(dev); }
  std::vector<uint8_t> Bytes() const {
    std::vector<uint8_t> out(kCudaBytes);
    REQUIRE(cudaMemcpy(out.data(), dev, kCudaBytes, cudaMemcpyDeviceToHost) == cudaSuccess);
    return out;
  }
#else
  std::vector<uint8_t> mem = std::vector<uint8_t>(kCudaBytes);
  std::vector<uint8_t> Bytes() const { return mem; }
#endif
};

#ifndef WSYNC_DELTA_DEVICE_CUDA
class HostSink final : public transport::RegionSink {
 public:
  explicit HostSink(FakeDevice* d) : d_(d) {}
  uint64_t length() const override { return d_->mem.size(); }
  uint64_t chunk_bytes() const override { return 1024; }
  absl::StatusOr<Staging> Acquire() override { return Staging{new uint8_t[1024], 0}; }
  absl::Status Submit(const Staging& s, uint64_t offset, uint64_t len) override {
    std::memcpy(d_->mem.data() + offset, s.data, len);
    delete[] s.data;
    return absl::OkStatus();
  }
  void Cancel(const Staging& s) override { delete[] s.data; }
  absl::Status Flush() override { return absl::OkStatus(); }
  std::string Describe() const override { return "fake device"; }

 private:
  FakeDevice* d_;
};

class HostCudaSegment final : public CudaSegment {
 public:
  explicit HostCudaSegment(FakeDevice* d)
      : sink_(std::make_shared<HostSink>(d)), scatter_(MakeHostScatter(d->mem.data(), d->mem.size())) {}
  std::shared_ptr<transport::RegionSink> sink() const override { return sink_; }
  std::string device() const override { return "fake:0"; }
  absl::StatusOr<SegmentScatter*> Scatter() override { return scatter_.get(); }

 private:
  std::shared_ptr<HostSink> sink_;
  std::unique_ptr<SegmentScatter> scatter_;
};
#endif

class CountingScatter final : public SegmentScatter {
 public:
  CountingScatter(FakeDevice* d, SegmentScatter* inner) : d_(d), inner_(inner) {}
  absl::Status ReadBack(uint64_t offset, uint64_t bytes, uint8_t* out) override {
    ++d_->read_backs;
    return inner_->ReadBack(offset, bytes, out);
  }
  absl::StatusOr<replica::delta::Info> Add(uint64_t offset, uint64_t bytes, const uint8_t* enc, uint64_t enc_bytes,
                                           uint64_t base) override {
    return inner_->Add(offset, bytes, enc, enc_bytes, base);
  }
  absl::Status Flush() override { return inner_->Flush(); }

 private:
  FakeDevice* d_;
  SegmentScatter* inner_;
};

// The segment the target imports: the memory above, its scatter's read-backs counted.
class CountingSegment final : public CudaSegment {
 public:
  CountingSegment(FakeDevice* d, std::unique_ptr<CudaSegment> inner) : d_(d), inner_(std::move(inner)) {}
  std::shared_ptr<transport::RegionSink> sink() const override { return inner_->sink(); }
  std::string device() const override { return inner_->device(); }
  absl::StatusOr<SegmentScatter*> Scatter() override {
    if (counting_ == nullptr) {
      WSYNC_ASSIGN_OR_RETURN(SegmentScatter * s, inner_->Scatter());
      counting_ = std::make_unique<CountingScatter>(d_, s);
    }
    return counting_.get();
  }

 private:
  FakeDevice* d_;
  std::unique_ptr<CudaSegment> inner_;
  std::unique_ptr<CountingScatter> counting_;
};

absl::StatusOr<std::unique_ptr<CudaSegment>> ImportFake(FakeDevice* d) {
#ifdef WSYNC_DELTA_DEVICE_CUDA
  WSYNC_ASSIGN_OR_RETURN(auto inner, WrapCudaMemory(d->dev, kCudaBytes, 0, "test device memory"));
#else
  std::unique_ptr<CudaSegment> inner = std::make_unique<HostCudaSegment>(d);
#endif
  return std::unique_ptr<CudaSegment>(std::make_unique<CountingSegment>(d, std::move(inner)));
}

Json Param(const std::string& name, const std::string& dtype, std::vector<uint64_t> shape, int seg, uint64_t off,
           uint64_t bytes) {
  return {{"name", name}, {"dtype", dtype}, {"shape", shape}, {"segment", seg}, {"offset", off}, {"bytes", bytes}};
}

// Everything one update writes: the dense bytes of every parameter (a flat buffer: a, b, c), and where they go.
struct Weights {
  std::vector<uint8_t> bytes = std::vector<uint8_t>(kA + kB + kC);
  uint8_t* a() { return bytes.data(); }
  uint8_t* b() { return bytes.data() + kA; }
  uint8_t* c() { return bytes.data() + kA + kB; }
};

// The next step: about 2 % of the bf16 elements of a and c change, b does not.
Weights Step(const Weights& prev, uint32_t seed) {
  Weights w = prev;
  std::mt19937 rng(seed);
  for (uint64_t i = 0; i < kA / 2; ++i)
    if (rng() % 50 == 0) w.a()[2 * i] ^= static_cast<uint8_t>(1 + rng() % 255);
  for (uint64_t i = 0; i < kC / 4; ++i)
    if (rng() % 50 == 0) w.c()[4 * i] ^= static_cast<uint8_t>(1 + rng() % 255);
  return w;
}

struct Harness {
  FakeDevice dev;
  std::string dir;
  std::unique_ptr<transport::Transport> target_tr, source_tr;
  std::unique_ptr<TargetNode> node;
  ScopedFd rank_sock, host_fd;
  uint8_t* host_view = nullptr;  // the engine's own mapping of its host segment
  v1::RankLayout layout;
  std::unique_ptr<transport::Endpoint> ep;
  std::vector<std::unique_ptr<transport::RemoteRegion>> segs;  // by layout segment index
  std::unique_ptr<transport::RemoteRegion> staging;
  uint64_t staging_bytes = 0;
  std::vector<uint8_t> src = std::vector<uint8_t>(64 << 10);
  std::unique_ptr<transport::LocalRegion> src_region;

  Harness() {
    char tmpl[] = "/tmp/wsync-delta-device.XXXXXX";
    dir = mkdtemp(tmpl);
    auto t = transport::CreateTransport("tcp", {});
    REQUIRE(t.ok());
    target_tr = *std::move(t);
    t = transport::CreateTransport("tcp", {});
    REQUIRE(t.ok());
    source_tr = *std::move(t);
    TargetOptions o;
    o.node_id = "gpu-node";
    o.engine_socket = dir + "/engines.sock";
    o.attach_timeout = absl::Seconds(10);
    o.facade_host = "";
    o.import_cuda_segment = [this](const CudaSegmentDesc& d, const std::string&) {
      CHECK(d.bytes == kCudaBytes);
      return ImportFake(&dev);
    };
    node = std::make_unique<TargetNode>(o, target_tr.get());
    REQUIRE(node->Start().ok());
    REQUIRE(
        node->AddEngine(std::make_unique<FakeAdapter>([this](const AttachInfo& info) { return Attach(info); })).ok());
    auto regs = node->Registrations();
    REQUIRE(regs.size() == 1);
    layout = regs[0].ranks(0);
    for (const auto& seg : layout.segments()) {
      auto r = source_tr->ImportRegion(seg.region_descriptor());
      REQUIRE(r.ok());
      segs.push_back(*std::move(r));
    }
    auto sr = source_tr->RegisterSourceMemory(src.data(), src.size());
    REQUIRE(sr.ok());
    src_region = *std::move(sr);
    auto e = source_tr->CreateEndpoint();
    REQUIRE(e.ok());
    ep = *std::move(e);
    v1::ConnectTargetRequest req;
    req.set_engine_id("gpu0");
    req.set_rank(0);
    req.set_source_endpoint_info(ep->LocalInfo());
    req.set_source_node("src0");
    req.set_delta_write_bytes(kA + kB + kC);
    auto reply = node->ConnectTarget(req);
    INFO(reply.status().ToString());
    REQUIRE(reply.ok());
    REQUIRE(reply->staging_refused().empty());
    REQUIRE_FALSE(reply->staging_descriptor().empty());
    REQUIRE(ep->Connect(reply->target_endpoint_info(), absl::Seconds(10)).ok());
    auto st = source_tr->ImportRegion(reply->staging_descriptor());
    REQUIRE(st.ok());
    staging = *std::move(st);
    staging_bytes = reply->staging_bytes();
  }
  ~Harness() {
    ep.reset();
    node.reset();
    if (host_view != nullptr) munmap(host_view, kHostBytes);
    std::system(("rm -rf " + dir).c_str());
  }

  absl::Status Attach(const AttachInfo& info) {
    host_fd.reset(memfd_create("delta-device-test", MFD_CLOEXEC));
    if (!host_fd.valid() || ftruncate(host_fd.get(), kHostBytes) != 0) return absl::InternalError("memfd");
    host_view = static_cast<uint8_t*>(mmap(nullptr, kHostBytes, PROT_READ, MAP_SHARED, host_fd.get(), 0));
    rank_sock.reset(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, info.socket_path.c_str(), sizeof(addr.sun_path) - 1);
    if (connect(rank_sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0)
      return absl::InternalError("connect");
    timeval tv{10, 0};
    setsockopt(rank_sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    Json msg = {{"type", "attach"},
                {"protocol", 1},
                {"token", info.token},
                {"engine_id", info.engine_id},
                {"kind", "fake"},
                {"mode", "direct"},
                {"rank", 0},
                {"world_size", 1},
                {"parallelism", {{"tp_size", 1}, {"tp_rank", 0}}},
                {"model_config_json", "{\"architectures\":[\"X\"]}"},
                {"segments", Json::array({{{"id", 0},
                                           {"kind", "cuda"},
                                           {"bytes", kCudaBytes},
                                           {"ipc_handle", std::string(128, 'a')},
                                           {"device_uuid", std::string(32, 'b')}},
                                          {{"id", 1}, {"kind", "host"}, {"bytes", kHostBytes}}})},
                {"params", Json::array({Param("a.weight", "bfloat16", {32, 64}, 0, kAOff, kA),
                                        Param("b.weight", "bfloat16", {32}, 0, kBOff, kB),
                                        Param("c.weight", "float32", {64}, 1, kCOff, kC)})}};
    std::vector<int> fds = {host_fd.get()};
    WSYNC_RETURN_IF_ERROR(SendFds(rank_sock.get(), fds, msg.dump()));
    auto r = ReceiveFds(rank_sock.get());
    if (!r.ok()) return r.status();
    Json reply = Json::parse(r->message);
    if (!reply.value("ok", false)) return absl::FailedPreconditionError(reply.dump());
    return absl::OkStatus();
  }

  // Opens the window for `v`; returns the version the rank reported holding.
  int64_t Open(int64_t v) {
    v1::SetWriteWindowRequest req;
    req.set_open(true);
    req.set_version(v);
    req.set_assignments_given(true);
    auto* a = req.add_assignments();
    a->set_source_node("src0");
    a->set_engine_id("gpu0");
    a->set_rank(0);
    v1::SetWriteWindowReply reply = node->SetWriteWindow(req);
    REQUIRE(reply.held_size() == 1);
    return reply.held(0).version();
  }
  void Close(int64_t v) {
    v1::SetWriteWindowRequest req;
    req.set_open(false);
    req.set_version(v);
    node->SetWriteWindow(req);
  }
  // Writes `bytes` at `dst_offset` of segment `seg` (layout index) or of the staging region (seg < 0).
  void Write(int seg, uint64_t dst_offset, const uint8_t* bytes, uint64_t len) {
    REQUIRE(len <= src.size());
    std::memcpy(src.data(), bytes, len);
    transport::WriteRequest w{src_region.get(), 0, seg < 0 ? staging.get() : segs[seg].get(), dst_offset, len};
    auto batch = ep->Post({&w, 1});
    REQUIRE(batch.ok());
    REQUIRE(ep->Wait(*batch, absl::Seconds(10)).ok());
  }
  void Dense(const std::string& which, Weights& w) {
    if (which == "a") Write(0, kAOff, w.a(), kA);
    if (which == "b") Write(0, kBOff, w.b(), kB);
    if (which == "c") Write(1, kCOff, w.c(), kC);
  }
};

// Stages records (layout param index, old → new bytes) for update v; returns (bytes, records).
struct Records {
  std::string bytes;
  uint32_t n = 0;
  void Add(int64_t v, uint32_t param, const uint8_t* old, const uint8_t* neu, uint64_t len, uint32_t elem) {
    std::string enc;
    auto r = replica::delta::Encode(old, neu, len, elem, len, &enc);
    REQUIRE_FALSE(r.dense_smaller);
    DeltaRecordHeader h{kDeltaRecordMagic, param, v, 0, len, enc.size()};
    std::string rec(DeltaRecordBytes(enc.size()), '\0');
    std::memcpy(rec.data(), &h, sizeof(h));
    std::memcpy(rec.data() + sizeof(h), enc.data(), enc.size());
    bytes += rec;
    ++n;
  }
};

absl::StatusOr<v1::ApplyDeltaReply> Apply(Harness& h, int64_t v, const Records& r) {
  if (!r.bytes.empty()) h.Write(-1, 0, reinterpret_cast<const uint8_t*>(r.bytes.data()), r.bytes.size());
  h.Close(v);
  v1::ApplyDeltaRequest req;
  req.set_version(v);
  if (r.n > 0) {
    auto* s = req.add_staged();
    s->set_source_node("src0");
    s->set_engine_id("gpu0");
    s->set_rank(0);
    s->set_bytes(r.bytes.size());
    s->set_records(r.n);
  }
  return h.node->ApplyDelta(req);
}

void RequireHolds(Harness& h, Weights& w) {
  const std::vector<uint8_t> dev = h.dev.Bytes();
  CHECK(std::memcmp(dev.data() + kAOff, w.a(), kA) == 0);
  CHECK(std::memcmp(dev.data() + kBOff, w.b(), kB) == 0);
  CHECK(std::memcmp(h.host_view + kCOff, w.c(), kC) == 0);
}

TEST_CASE("delta into a cuda segment: staged records scattered onto checked bases, checksums recorded, refusals") {
#ifdef WSYNC_DELTA_DEVICE_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("skipped: no CUDA device\n");
    std::exit(77);
  }
#endif
  Harness h;
  // A cuda rank gets a staging region like a host one: a quarter of what the source writes (4 KiB at least).
  CHECK(h.staging_bytes >= (kA + kB + kC) / 4);

  Weights w1;
  std::mt19937 rng(7);
  for (auto& b : w1.bytes) b = static_cast<uint8_t>(rng());
  // Update 1: dense everywhere (the rank holds nothing yet).
  CHECK(h.Open(1) == -1);
  h.Dense("a", w1), h.Dense("b", w1), h.Dense("c", w1);
  auto r1 = Apply(h, 1, {});
  INFO(r1.status().ToString());
  REQUIRE(r1.ok());
  CHECK(r1->ranks_committed() == 1);
  RequireHolds(h, w1);

  // Update 2: records for all three parameters. a and b were written dense: their bases are read back (2).
  Weights w2 = Step(w1, 2);
  REQUIRE(std::memcmp(w2.a(), w1.a(), kA) != 0);  // the test changes something
  CHECK(h.Open(2) == 1);
  Records rec2;
  rec2.Add(2, 0, w1.a(), w2.a(), kA, 2);
  rec2.Add(2, 1, w1.b(), w2.b(), kB, 2);
  rec2.Add(2, 2, w1.c(), w2.c(), kC, 4);
  auto r2 = Apply(h, 2, rec2);
  INFO(r2.status().ToString());
  REQUIRE(r2.ok());
  CHECK(r2->records_applied() == 3);
  CHECK(h.dev.read_backs == 2);
  RequireHolds(h, w2);

  // Update 3: a dense this time, b and c records. b's base is the checksum recorded at update 2: no read-back.
  Weights w3 = Step(w2, 3);
  CHECK(h.Open(3) == 2);
  h.Dense("a", w3);
  Records rec3;
  rec3.Add(3, 1, w2.b(), w3.b(), kB, 2);
  rec3.Add(3, 2, w2.c(), w3.c(), kC, 4);
  auto r3 = Apply(h, 3, rec3);
  INFO(r3.status().ToString());
  REQUIRE(r3.ok());
  CHECK(h.dev.read_backs == 2);
  RequireHolds(h, w3);

  // Update 4: a record for a again. It was written dense at update 3, so the checksum recorded at update 2 is no
  // longer what it holds: the target reads it back (3) instead of refusing a good record.
  Weights w4 = Step(w3, 4);
  CHECK(h.Open(4) == 3);
  Records rec4;
  rec4.Add(4, 0, w3.a(), w4.a(), kA, 2);
  rec4.Add(4, 1, w3.b(), w4.b(), kB, 2);
  h.Dense("c", w4);
  auto r4 = Apply(h, 4, rec4);
  INFO(r4.status().ToString());
  REQUIRE(r4.ok());
  CHECK(h.dev.read_backs == 3);
  RequireHolds(h, w4);

  SECTION("a record onto the wrong base is refused by the recorded checksum; nothing of it is written") {
    Weights w5 = Step(w4, 5);
    CHECK(h.Open(5) == 4);
    Records bad;
    bad.Add(5, 0, w3.a(), w5.a(), kA, 2);  // encoded against update 3's a: the device holds update 4's
    const std::vector<uint8_t> before = h.dev.Bytes();
    auto r5 = Apply(h, 5, bad);
    REQUIRE_FALSE(r5.ok());
    CHECK(r5.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(absl::StrContains(r5.status().message(), "engine gpu0 rank 0 parameter a.weight [0, +4096)"));
    CHECK(h.dev.Bytes() == before);
    CHECK(h.Open(6) == -1);  // the rank holds no known version: the next update is dense
  }
  SECTION("a corrupt record is refused; nothing of it is written") {
    Weights w5 = Step(w4, 5);
    CHECK(h.Open(5) == 4);
    Records bad;
    bad.Add(5, 0, w4.a(), w5.a(), kA, 2);
    bad.bytes[sizeof(DeltaRecordHeader) + replica::delta::kHeaderBytes + 1] ^= 0x40;  // a payload byte
    const std::vector<uint8_t> before = h.dev.Bytes();
    auto r5 = Apply(h, 5, bad);
    REQUIRE_FALSE(r5.ok());
    CHECK(r5.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(h.dev.Bytes() == before);
    CHECK(h.Open(6) == -1);
  }
}

}  // namespace
}  // namespace wsync::daemon
