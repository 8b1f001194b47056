// The attach protocol (docs/engines.md) against an in-process TargetNode with the real tcp transport: a good attach
// of several segments per rank, every validation the target does (token, uid, fd count, segment bounds, overlap,
// dtype × shape, duplicate rank, file size), detach making the engine unusable, and the commit messages that
// PostProcess sends to every rank before it calls the adapter. The engine side is this test, speaking the wire
// protocol over the socket, driven from a fake EngineAdapter's RequestAttach.

#include <catch2/catch.hpp>

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#define XXH_INLINE_ALL  // the test's own copy of the hash: nothing shared with the daemon's build of it
#include <xxhash.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/fd_passing.h"
#include "daemon/common/window_assignments.h"
#include "daemon/node/target_node.h"
#include "transport/transport.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace wsync::daemon {
namespace {

using Json = nlohmann::json;

class FakeAdapter final : public EngineAdapter {
 public:
  using AttachFn = std::function<absl::Status(const AttachInfo&)>;
  FakeAdapter(int ranks, AttachFn attach, std::vector<std::string>* calls)
      : ranks_(ranks), attach_(std::move(attach)), calls_(calls) {}
  const std::string& kind() const override { return kind_; }
  const std::string& address() const override { return address_; }
  absl::StatusOr<EngineDescription> Describe() override {
    return EngineDescription{"fake0", "fake", ranks_, "0", false};
  }
  absl::Status RequestAttach(const AttachInfo& info) override { return attach_(info); }
  absl::Status Pause(const std::string& mode) override { return Log("pause " + mode); }
  absl::Status PostProcess(const std::string& v) override { return Log("post_process " + v); }
  absl::Status SetWeightVersion(const std::string& v) override { return Log("set_version " + v); }
  absl::Status Continue() override { return Log("continue"); }

 private:
  absl::Status Log(const std::string& s) {
    calls_->push_back(s);
    return absl::OkStatus();
  }
  std::string kind_ = "fake", address_ = "fake+test://nowhere:1";
  int ranks_;
  AttachFn attach_;
  std::vector<std::string>* calls_;
};

struct Segment {
  ScopedFd fd;
  uint64_t bytes;
};

Segment MakeSegment(uint64_t bytes, uint64_t file_bytes = 0) {
  Segment s{ScopedFd(memfd_create("target-node-test", MFD_CLOEXEC)), bytes};
  REQUIRE(s.fd.valid());
  REQUIRE(ftruncate(s.fd.get(), static_cast<off_t>(file_bytes ? file_bytes : bytes)) == 0);
  return s;
}

// A rank of 2 segments: two bf16 params in segment 0, one in segment 1 (id 7: ids need not be 0..n-1).
Json AttachMessage(const AttachInfo& info, int rank, int world) {
  Json params = Json::array({
      {{"name", "a.weight"}, {"dtype", "bfloat16"}, {"shape", {4, 8}}, {"segment", 0}, {"offset", 0}, {"bytes", 64}},
      {{"name", "b.weight"}, {"dtype", "bfloat16"}, {"shape", {8}}, {"segment", 0}, {"offset", 256}, {"bytes", 16}},
      {{"name", "c.weight"}, {"dtype", "float32"}, {"shape", {2, 2}}, {"segment", 7}, {"offset", 0}, {"bytes", 16}},
  });
  return {{"type", "attach"},
          {"protocol", 1},
          {"token", info.token},
          {"engine_id", info.engine_id},
          {"kind", "fake"},
          {"mode", "direct"},
          {"rank", rank},
          {"world_size", world},
          {"parallelism", {{"tp_size", world}, {"tp_rank", rank}}},
          {"model_config_json", "{\"architectures\":[\"X\"]}"},
          {"segments", Json::array({{{"id", 0}, {"kind", "host"}, {"bytes", 4096}},
                                    {{"id", 7}, {"kind", "host"}, {"bytes", 1024}}})},
          {"params", params}};
}

// One engine rank's connection to the target's socket.
struct RankConn {
  ScopedFd sock;
  std::vector<Segment> segments;

  static RankConn Connect(const std::string& path) {
    RankConn c;
    c.sock.reset(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    REQUIRE(connect(c.sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
    timeval tv{10, 0};
    setsockopt(c.sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return c;
  }
  // Sends `msg` with the fds of `segments`; returns the target's reply.
  Json Attach(const Json& msg) {
    std::vector<int> fds;
    for (const auto& s : segments) fds.push_back(s.fd.get());
    REQUIRE(SendFds(sock.get(), fds, msg.dump()).ok());
    return Next();
  }
  Json Next() {
    auto r = ReceiveFds(sock.get());
    if (!r.ok()) return Json{{"closed", r.status().ToString()}};
    return Json::parse(r->message);
  }
};

std::vector<Segment> TwoSegments() {
  std::vector<Segment> s;
  s.push_back(MakeSegment(4096));
  s.push_back(MakeSegment(1024));
  return s;
}

// The tcp transport, or the backend named (fabric on tcp;ofi_rxm, which every Debian libfabric1 has).
std::unique_ptr<transport::Transport> MakeBackend(const std::string& backend = "tcp") {
  transport::TransportOptions o;
  if (backend == "fabric") o.fabric_provider = "tcp;ofi_rxm";
  auto tr = transport::CreateTransport(backend, o);
  REQUIRE(tr.ok());
  INFO((*tr)->reason());
  REQUIRE((*tr)->viable());
  return *std::move(tr);
}

struct Fixture {
  explicit Fixture(const std::string& backend = "tcp") {
    char tmpl[] = "/tmp/wsync-target-test.XXXXXX";
    dir = mkdtemp(tmpl);
    transport = MakeBackend(backend);
  }
  ~Fixture() {
    node.reset();
    std::system(("rm -rf " + dir).c_str());
  }
  void Start(TargetOptions o = {}) {
    o.node_id = "test-target";
    o.engine_socket = dir + "/engines.sock";
    if (o.attach_timeout == absl::Seconds(120)) o.attach_timeout = absl::Seconds(2);
    o.facade_host = facade_host;
    node = std::make_unique<TargetNode>(o, transport.get());
    REQUIRE(node->Start().ok());
  }
  // Adds an engine of `ranks` ranks whose RequestAttach runs `fn`.
  absl::Status Add(int ranks, FakeAdapter::AttachFn fn) {
    return node->AddEngine(std::make_unique<FakeAdapter>(ranks, std::move(fn), &calls));
  }

  std::string dir, facade_host;
  std::unique_ptr<transport::Transport> transport;
  std::unique_ptr<TargetNode> node;
  std::vector<std::string> calls;
  std::vector<RankConn> conns;  // attached ranks stay connected
};

// Runs one attach of rank 0 of a 1-rank engine with `edit` applied to the message (and `segs` as its fds);
// returns the reply. AddEngine fails (the fake returns the refusal), so the test does not wait for a timeout.
Json AttachOnce(Fixture& f, std::function<void(Json&)> edit, std::vector<Segment> segs = TwoSegments()) {
  Json reply;
  absl::Status st = f.Add(1, [&](const AttachInfo& info) {
    RankConn c = RankConn::Connect(info.socket_path);
    c.segments = std::move(segs);
    Json msg = AttachMessage(info, 0, 1);
    edit(msg);
    reply = c.Attach(msg);
    if (reply.value("ok", false)) {
      f.conns.push_back(std::move(c));
      return absl::OkStatus();
    }
    return absl::FailedPreconditionError(reply.value("error", "refused"));
  });
  if (reply.value("ok", false)) CHECK(st.ok());
  return reply;
}

void RequireRefused(const Json& reply, const std::string& needle) {
  INFO(reply.dump());
  CHECK(reply.value("type", "") == "attached");
  CHECK_FALSE(reply.value("ok", true));
  CHECK(absl::StrContains(reply.value("error", ""), needle));
}

TEST_CASE("target: two ranks attach two segments each; registration has one descriptor per segment") {
  Fixture f;
  f.Start();
  REQUIRE(f.Add(2, [&](const AttachInfo& info) {
            CHECK(info.engine_id == "fake0");
            CHECK(info.token.size() == 64);
            for (int r = 0; r < 2; ++r) {
              RankConn c = RankConn::Connect(info.socket_path);
              c.segments = TwoSegments();
              Json reply = c.Attach(AttachMessage(info, r, 2));
              INFO(reply.dump());
              CHECK(reply == Json({{"type", "attached"}, {"ok", true}}));
              f.conns.push_back(std::move(c));
            }
            return absl::OkStatus();
          }).ok());
  auto regs = f.node->Registrations();
  REQUIRE(regs.size() == 1);
  CHECK(regs[0].kind() == "fake");
  CHECK(regs[0].control_address().empty());  // no facade host in this fixture
  REQUIRE(regs[0].ranks_size() == 2);
  for (int r = 0; r < 2; ++r) {
    const auto& l = regs[0].ranks(r);
    CHECK(l.rank() == r);
    CHECK(l.parallelism().tp_rank() == r);
    CHECK(l.region_bytes() == 4096 + 1024);
    REQUIRE(l.segments_size() == 2);
    CHECK(l.segments(1).id() == 7);
    for (const auto& s : l.segments()) CHECK_FALSE(s.region_descriptor().empty());
    REQUIRE(l.params_size() == 3);
    CHECK(l.params(2).segment() == 7);
  }
  CHECK(f.node->EngineInfo("fake0")->model_config_json() == "{\"architectures\":[\"X\"]}");
}

TEST_CASE("target: the quantization a rank reports reaches its registration") {
  Fixture f;
  f.Start();
  const Json reply = AttachOnce(f, [](Json& m) {
    m["params"][2]["name"] = "a.weight_scale_inv";
    m["quantization"] = {{"method", "fp8_block"}, {"block_size", {64, 32}}, {"scale_format", "ue8m0"}};
  });
  INFO(reply.dump());
  REQUIRE(reply.value("ok", false));
  auto regs = f.node->Registrations();
  REQUIRE(regs.size() == 1);
  REQUIRE(regs[0].ranks_size() == 1);
  const v1::WeightQuantization& q = regs[0].ranks(0).quantization();
  CHECK(q.method() == "fp8_block");
  REQUIRE(q.block_size_size() == 2);
  CHECK(q.block_size(0) == 64);
  CHECK(q.block_size(1) == 32);
  CHECK(q.scale_format() == "ue8m0");
}

std::string Xxh128(const uint8_t* p, size_t n) {
  const XXH128_hash_t h = XXH3_128bits(p, n);
  return absl::StrFormat("%016x%016x", h.high64, h.low64);
}

TEST_CASE("target: checksums of whole parameters and byte ranges come from the engine's memory (wsyncctl verify)") {
  Fixture f;
  f.Start();
  std::vector<uint8_t*> maps;  // the engine's own mappings of its two segments
  REQUIRE(f.Add(1, [&](const AttachInfo& info) {
            RankConn c = RankConn::Connect(info.socket_path);
            c.segments = TwoSegments();
            for (const auto& s : c.segments) {
              void* p = mmap(nullptr, s.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, s.fd.get(), 0);
              REQUIRE(p != MAP_FAILED);
              maps.push_back(static_cast<uint8_t*>(p));
            }
            for (uint64_t i = 0; i < 4096; ++i) maps[0][i] = static_cast<uint8_t>(i * 7 + 3);
            for (uint64_t i = 0; i < 1024; ++i) maps[1][i] = static_cast<uint8_t>(i * 13 + 1);
            REQUIRE(c.Attach(AttachMessage(info, 0, 1)).value("ok", false));
            f.conns.push_back(std::move(c));
            return absl::OkStatus();
          }).ok());
  auto whole = f.node->Checksums("fake0", v1::RankRequest());
  REQUIRE(whole.ok());
  REQUIRE(whole->params_size() == 3);
  CHECK(whole->params(0).name() == "a.weight");
  CHECK(whole->params(0).xxh128() == Xxh128(maps[0], 64));
  CHECK(whole->params(1).xxh128() == Xxh128(maps[0] + 256, 16));
  CHECK(whole->params(2).xxh128() == Xxh128(maps[1], 16));
  CHECK_FALSE(whole->params(2).range());

  v1::RankRequest req;
  auto* r = req.add_ranges();
  r->set_param("a.weight");
  r->set_offset(8);
  r->set_length(16);
  r = req.add_ranges();
  r->set_param("c.weight");
  r->set_offset(0);
  r->set_length(16);
  auto ranges = f.node->Checksums("fake0", req);
  REQUIRE(ranges.ok());
  REQUIRE(ranges->params_size() == 2);
  CHECK(ranges->params(0).range());
  CHECK(ranges->params(0).offset() == 8);
  CHECK(ranges->params(0).bytes() == 16);
  CHECK(ranges->params(0).xxh128() == Xxh128(maps[0] + 8, 16));
  const std::string c_before = ranges->params(1).xxh128();

  maps[1][5] ^= 0x40;  // one byte of c.weight changed by the engine
  auto after = f.node->Checksums("fake0", req);
  REQUIRE(after.ok());
  CHECK(after->params(0).xxh128() == ranges->params(0).xxh128());
  CHECK(after->params(1).xxh128() != c_before);
  CHECK(after->params(1).xxh128() == Xxh128(maps[1], 16));

  req.mutable_ranges(1)->set_length(17);  // past the end of c.weight's 16 bytes
  auto outside = f.node->Checksums("fake0", req);
  CHECK(outside.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(outside.status().message(), "c.weight"));
  req.mutable_ranges(1)->set_param("nope.weight");
  CHECK(f.node->Checksums("fake0", req).status().code() == absl::StatusCode::kNotFound);
  v1::RankRequest bad_rank;
  bad_rank.set_rank(1);
  CHECK(f.node->Checksums("fake0", bad_rank).status().code() == absl::StatusCode::kInvalidArgument);
  munmap(maps[0], 4096);
  munmap(maps[1], 1024);
}

// Staged updates of an engine whose segments are staging memory (vLLM's staged attach, docs/engines.md): the verify
// hashes them in this daemon's mapping with a digest of the whole staging memory (every host segment in id order);
// Switch accepts only that digest, and refuses, naming the rank, once a byte changed after the verify.
TEST_CASE("target: an engine that stages in place: staging hashed for the verify, Switch refuses it changed since") {
  Fixture f;
  f.Start();
  std::vector<uint8_t*> maps;
  REQUIRE(f.Add(1, [&](const AttachInfo& info) {
             RankConn c = RankConn::Connect(info.socket_path);
             c.segments = TwoSegments();
             for (const auto& s : c.segments) {
               void* p = mmap(nullptr, s.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, s.fd.get(), 0);
               REQUIRE(p != MAP_FAILED);
               maps.push_back(static_cast<uint8_t*>(p));
             }
             for (uint64_t i = 0; i < 4096; ++i) maps[0][i] = static_cast<uint8_t>(i * 5 + 1);
             for (uint64_t i = 0; i < 1024; ++i) maps[1][i] = static_cast<uint8_t>(i * 11 + 2);
             Json msg = AttachMessage(info, 0, 1);
             msg["stages_in_place"] = true;
             REQUIRE(c.Attach(msg).value("ok", false));
             f.conns.push_back(std::move(c));
             return absl::OkStatus();
           }).ok());
  auto whole = [&] {
    std::vector<uint8_t> all(maps[0], maps[0] + 4096);
    all.insert(all.end(), maps[1], maps[1] + 1024);
    return Xxh128(all.data(), all.size());
  };
  auto info = f.node->EngineInfo("fake0");
  REQUIRE(info.ok());
  CHECK(info->staging());
  v1::RankRequest req;
  req.set_staging(true);
  auto* r = req.add_ranges();
  r->set_param("b.weight");
  r->set_length(16);
  auto verified = f.node->Checksums("fake0", req);
  REQUIRE(verified.ok());
  CHECK(verified->staging_digest() == whole());
  CHECK(verified->params(0).xxh128() == Xxh128(maps[0] + 256, 16));

  v1::SwitchRequest sw;
  sw.set_version("5");
  CHECK(f.node->Switch("fake0", sw, false).code() == absl::StatusCode::kInvalidArgument);  // one digest per rank
  sw.add_staging_digests(verified->staging_digest());
  CHECK(f.node->Switch("fake0", sw, false).ok());
  maps[1][1000] ^= 1;  // a byte outside every parameter still counts: the reload copies the whole segment
  const absl::Status changed = f.node->Switch("fake0", sw, false);
  CHECK(changed.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(changed.message(), "rank 0's staging memory is not what was verified"));

  // Switch in two calls (the coordinator's order): a prepare re-hashes while the engine serves and arms the switch,
  // which then, inside the paused window, does not hash again, once.
  maps[1][1000] ^= 1;  // as verified again
  CHECK(f.node->Switch("fake0", sw, /*prepare=*/true).ok());
  maps[0][7] ^= 1;  // between the prepare and the switch: not seen (docs/security.md says why this is accepted)
  CHECK(f.node->Switch("fake0", sw, false).ok());
  const absl::Status unarmed = f.node->Switch("fake0", sw, false);  // one switch per prepare: this one hashes
  CHECK(unarmed.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(unarmed.message(), "rank 0's staging memory is not what was verified"));
  // A change after the verify: the prepare refuses it and arms nothing.
  const absl::Status prepare_refused = f.node->Switch("fake0", sw, true);
  CHECK(prepare_refused.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(prepare_refused.message(), "rank 0's staging memory is not what was verified"));
  CHECK(f.node->Switch("fake0", sw, false).code() == absl::StatusCode::kFailedPrecondition);
  // A write window opened after the prepare (sources may write again): the switch hashes again.
  maps[0][7] ^= 1;
  CHECK(f.node->Switch("fake0", sw, /*prepare=*/true).ok());
  v1::SetWriteWindowRequest open;
  open.set_open(true);
  open.set_version(6);
  f.node->SetWriteWindow(open);
  maps[0][7] ^= 1;
  CHECK(f.node->Switch("fake0", sw, false).code() == absl::StatusCode::kFailedPrecondition);
  munmap(maps[0], 4096);
  munmap(maps[1], 1024);
}

TEST_CASE("target: staging is refused for an engine that does not stage in place, and the two staging forms clash") {
  Fixture f;
  f.Start();
  RequireRefused(AttachOnce(f, [](Json& m) { m["stages_in_place"] = 1; }), "\"stages_in_place\" must be a boolean");
  std::vector<Segment> four = TwoSegments();
  four.push_back(MakeSegment(4096));
  four.push_back(MakeSegment(1024));
  RequireRefused(AttachOnce(
                     f,
                     [](Json& m) {
                       m["segments"].push_back({{"id", 10}, {"kind", "host"}, {"bytes", 4096}});
                       m["segments"].push_back({{"id", 17}, {"kind", "host"}, {"bytes", 1024}});
                       m["staging_segment_shift"] = 10;
                       m["stages_in_place"] = true;
                     },
                     std::move(four)),
                 "stages_in_place and staging_segment_shift exclude each other");
  REQUIRE(AttachOnce(f, [](Json&) {}).value("ok", false));
  v1::RankRequest req;
  req.set_staging(true);
  const auto st = f.node->Checksums("fake0", req);
  CHECK(st.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(st.status().message(), "offers no staging memory"));
  v1::SwitchRequest sw;
  sw.add_staging_digests("x");
  CHECK(f.node->Switch("fake0", sw, false).code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("target: attach validation refuses bad messages with a reason") {
  Fixture f;
  f.Start();
  SECTION("wrong token") {
    RequireRefused(AttachOnce(f, [](Json& m) { m["token"] = std::string(64, '0'); }), "token is not valid");
  }
  SECTION("unknown engine id") {
    RequireRefused(AttachOnce(f, [](Json& m) { m["engine_id"] = "other"; }), "token is not valid");
  }
  SECTION("fewer fds than segments") {
    std::vector<Segment> one;
    one.push_back(MakeSegment(4096));
    RequireRefused(AttachOnce(f, [](Json&) {}, std::move(one)), "2 host segments but 1 file descriptors");
  }
  SECTION("parameter outside its segment") {
    RequireRefused(AttachOnce(f, [](Json& m) { m["params"][2]["offset"] = 1016; }),
                   "parameter c.weight [1016, +16) lies outside segment 7");
  }
  SECTION("parameter in a segment that does not exist") {
    RequireRefused(AttachOnce(f, [](Json& m) { m["params"][1]["segment"] = 3; }), "b.weight: no segment 3");
  }
  SECTION("overlapping parameters") {
    RequireRefused(AttachOnce(f, [](Json& m) { m["params"][1]["offset"] = 32; }),
                   "a.weight and b.weight overlap in segment 0");
  }
  SECTION("dtype x shape disagrees with bytes") {
    RequireRefused(AttachOnce(f, [](Json& m) { m["params"][0]["shape"] = {4, 4}; }), "a.weight: bfloat16");
  }
  SECTION("a shape whose element count does not fit 64 bits") {
    // 2^32 x 2^32 x 4 elements wrap to 0 in 64-bit arithmetic, which would match "bytes": 0.
    RequireRefused(AttachOnce(f,
                              [](Json& m) {
                                m["params"][0]["shape"] = {uint64_t{1} << 32, uint64_t{1} << 32, 4};
                                m["params"][0]["bytes"] = 0;
                              }),
                   "parameter a.weight: shape [4294967296, 4294967296, 4] has more than 2^64 elements");
  }
  SECTION("a shape entry beyond int64") {
    RequireRefused(AttachOnce(f, [](Json& m) { m["params"][0]["shape"] = {uint64_t{1} << 63}; }),
                   "a.weight: shape entries must be integers in [0, 2^63)");
  }
  SECTION("unknown dtype") {
    RequireRefused(AttachOnce(f, [](Json& m) { m["params"][0]["dtype"] = "bfloat17"; }), "unknown dtype");
  }
  SECTION("rank outside the world") {
    RequireRefused(AttachOnce(f, [](Json& m) { m["rank"] = 1; }), "rank 1 is outside [0, 1)");
  }
  SECTION("world size differs from the engine's") {
    RequireRefused(AttachOnce(f, [](Json& m) {
                     m["world_size"] = 2;
                     m["rank"] = 1;
                   }),
                   "world_size 2 but the engine has 1 ranks");
  }
  SECTION("unknown segment kind") {
    RequireRefused(AttachOnce(f, [](Json& m) { m["segments"][1]["kind"] = "gpu"; }),
                   "segment 7: unknown segment kind \"gpu\" (known: host, cuda, mooncake)");
  }
  SECTION("a segment kind no target daemon writes") {
    RequireRefused(AttachOnce(f, [](Json& m) { m["segments"][1]["kind"] = "mooncake"; }),
                   "segment 7: kind \"mooncake\" cannot be attached to a target daemon");
  }
  SECTION("segment file smaller than declared") {
    std::vector<Segment> segs;
    segs.push_back(MakeSegment(4096, 100));
    segs.push_back(MakeSegment(1024));
    RequireRefused(AttachOnce(f, [](Json&) {}, std::move(segs)), "is 100 bytes, smaller than the 4096");
  }
  // cuda segments carry no fd; their fields are checked before any CUDA call (tests/cuda covers the import).
  auto cuda_segment = [](Json& m) {
    m["segments"][1] = {{"id", 7}, {"kind", "cuda"}, {"bytes", 1024}, {"handle_type", "cuda_ipc"},
                        {"ipc_handle", std::string(128, 'a')}, {"offset", 512},
                        {"device_uuid", "GPU-0123abcd-0123-4567-89ab-0123456789ab"}};
  };
  auto one_host_fd = [] {
    std::vector<Segment> segs;
    segs.push_back(MakeSegment(4096));
    return segs;
  };
  SECTION("cuda segment without an IPC handle") {
    RequireRefused(AttachOnce(f, [&](Json& m) {
                     cuda_segment(m);
                     m["segments"][1].erase("ipc_handle");
                   }, one_host_fd()),
                   "ipc_handle");
  }
  SECTION("cuda segment with a short IPC handle") {
    RequireRefused(AttachOnce(f, [&](Json& m) {
                     cuda_segment(m);
                     m["segments"][1]["ipc_handle"] = "abcd";
                   }, one_host_fd()),
                   "segment 7: \"ipc_handle\" must be 64 bytes in hex, got 4 hex digits");
  }
  SECTION("cuda segment from a VMM allocation") {
    RequireRefused(AttachOnce(f, [&](Json& m) {
                     cuda_segment(m);
                     m["segments"][1]["handle_type"] = "cuda_vmm_fd";
                   }, one_host_fd()),
                   "VMM allocations");
  }
  SECTION("cuda segment with an fd for it") {
    RequireRefused(AttachOnce(f, cuda_segment), "1 host segments but 2 file descriptors");
  }
  SECTION("cuda segment on a machine without a GPU (or a build without CUDA)") {
    const Json r = AttachOnce(f, cuda_segment, one_host_fd());
    RequireRefused(r, "rank 0 segment 7");
    const std::string e = r.value("error", "");
    CHECK((absl::StrContains(e, "sees no CUDA device") || absl::StrContains(e, "built without CUDA") ||
           absl::StrContains(e, "which this wsyncd does not see")));
  }
  SECTION("wrong protocol version") {
    RequireRefused(AttachOnce(f, [](Json& m) { m["protocol"] = 2; }), "attach protocol 2");
  }
  // c.weight is float32 [2, 2]: named as an FP8 block scale, it says FP8 without the rank reporting it.
  auto fp8_names = [](Json& m) { m["params"][2]["name"] = "a.weight_scale_inv"; };
  SECTION("FP8 block scales without a reported quantization") {
    RequireRefused(AttachOnce(f, fp8_names),
                   "engine fake0 rank 0: parameter a.weight_scale_inv is an FP8 block scale but the engine reports no "
                   "quantization");
  }
  SECTION("a quantization wsync cannot write") {
    RequireRefused(AttachOnce(f, [](Json& m) { m["quantization"] = {{"method", "vllm:awq"}}; }),
                   "quantization: unknown method 'vllm:awq'");
  }
  SECTION("fp8_block with one block size") {
    RequireRefused(AttachOnce(f, [&](Json& m) {
                     fp8_names(m);
                     m["quantization"] = {{"method", "fp8_block"}, {"block_size", {128}}};
                   }),
                   "fp8_block needs block_size [block_n, block_k]");
  }
  SECTION("a block size of 0") {
    RequireRefused(AttachOnce(f, [&](Json& m) {
                     m["quantization"] = {{"method", "fp8_block"}, {"block_size", {128, 0}}};
                   }),
                   "quantization.block_size must hold positive integers");
  }
  SECTION("an unknown scale format") {
    RequireRefused(AttachOnce(f, [&](Json& m) {
                     m["quantization"] = {{"method", "fp8_block"}, {"block_size", {128, 128}}, {"scale_format", "e8"}};
                   }),
                   "unknown scale_format 'e8'");
  }
  SECTION("not JSON") {
    Json reply;
    (void)f.Add(1, [&](const AttachInfo& info) {
      RankConn c = RankConn::Connect(info.socket_path);
      REQUIRE(SendFds(c.sock.get(), {}, "{not json").ok());
      reply = c.Next();
      return absl::FailedPreconditionError("refused");
    });
    RequireRefused(reply, "attach");
  }
  // A refused engine is forgotten: nothing registered.
  CHECK(f.node->Registrations().empty());
}

TEST_CASE("target: a rank that attaches twice is refused; missing ranks are named after the timeout") {
  Fixture f;
  f.Start();
  Json second;
  absl::Status st = f.Add(2, [&](const AttachInfo& info) {
    RankConn c = RankConn::Connect(info.socket_path);
    c.segments = TwoSegments();
    CHECK(c.Attach(AttachMessage(info, 0, 2)).value("ok", false));
    f.conns.push_back(std::move(c));
    RankConn d = RankConn::Connect(info.socket_path);
    d.segments = TwoSegments();
    second = d.Attach(AttachMessage(info, 0, 2));
    return absl::OkStatus();  // rank 1 never comes
  });
  RequireRefused(second, "engine fake0 rank 0 is already attached");
  INFO(st.ToString());
  CHECK(absl::IsDeadlineExceeded(st));
  CHECK(absl::StrContains(st.message(), "engine fake0"));
  CHECK(absl::StrContains(st.message(), "ranks [1] did not attach"));
}

TEST_CASE("target: PostProcess sends commit to every rank, then calls the adapter; a detached rank fails it") {
  Fixture f;
  f.facade_host = "127.0.0.1";
  f.Start();
  REQUIRE(f.Add(2, [&](const AttachInfo& info) {
            for (int r = 0; r < 2; ++r) {
              RankConn c = RankConn::Connect(info.socket_path);
              c.segments = TwoSegments();
              REQUIRE(c.Attach(AttachMessage(info, r, 2)).value("ok", false));
              f.conns.push_back(std::move(c));
            }
            return absl::OkStatus();
          }).ok());
  const std::string facade = f.node->Registrations()[0].control_address();
  REQUIRE_FALSE(facade.empty());

  // Through the facade, as the coordinator calls it.
  auto stub = v1::EngineControl::NewStub(grpc::CreateChannel(facade, grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    v1::EngineInfo info;
    REQUIRE(stub->GetInfo(&ctx, v1::GetEngineInfoRequest(), &info).ok());
    CHECK(info.engine_id() == "fake0");
    CHECK(info.kind() == "fake");
    CHECK(info.num_ranks() == 2);
  }
  {
    grpc::ClientContext ctx;
    v1::PostProcessRequest req;
    req.set_version("7");
    v1::EngineReply rep;
    REQUIRE(stub->PostProcess(&ctx, req, &rep).ok());
    CHECK(rep.success());
  }
  for (auto& c : f.conns) CHECK(c.Next() == Json({{"type", "commit"}, {"version", "7"}}));
  CHECK(f.calls == std::vector<std::string>{"post_process 7"});
  {
    grpc::ClientContext ctx;
    v1::VerifyReply rep;
    CHECK(stub->Verify(&ctx, v1::VerifyRequest(), &rep).error_code() == grpc::StatusCode::UNIMPLEMENTED);
  }

  // Rank 1 detaches (its socket closes): every control call names the engine and the rank; nothing is called.
  f.conns[1].sock.reset();
  absl::Status st;
  for (int i = 0; i < 100; ++i) {  // the loop thread notices the close asynchronously
    st = f.node->PostProcess("fake0", "8");
    // Until it has, the commit to rank 1 may fail on the closed socket (also naming the rank).
    if (!st.ok()) CHECK(absl::StrContains(st.message(), "engine fake0 rank 1"));
    if (absl::StrContains(st.message(), "is detached")) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  INFO(st.ToString());
  CHECK(absl::IsFailedPrecondition(st));
  CHECK(absl::StrContains(st.message(), "engine fake0 rank 1 is detached"));
  CHECK(absl::StrContains(f.node->Pause("fake0", "retract").message(), "engine fake0 rank 1"));
  {
    grpc::ClientContext ctx;
    v1::EngineReply rep;
    grpc::Status gs = stub->Continue(&ctx, v1::ContinueRequest(), &rep);
    CHECK(gs.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(absl::StrContains(gs.error_message(), "rank 1"));
  }
  // PostProcess "8" may have succeeded before the close was seen; afterwards nothing reaches the adapter.
  const size_t before = f.calls.size();
  CHECK_FALSE(f.node->SetWeightVersion("fake0", "8").ok());
  CHECK(f.calls.size() == before);
}

TEST_CASE("target: a peer of another uid is refused (SO_PEERCRED)") {
  if (getuid() != 0) {
    WARN("skipped: needs root to run a peer under another uid");
    return;
  }
  Fixture f;
  chmod(f.dir.c_str(), 0711);  // the other uid must reach the socket; the daemon's check is what refuses it
  TargetOptions o;
  o.engine_uids = {12345};  // makes the socket connectable (0666) for uids other than the daemon's
  f.Start(o);
  absl::Status st = f.Add(1, [&](const AttachInfo& info) {
    pid_t pid = fork();
    if (pid == 0) {
      if (setgid(65534) != 0 || setuid(65534) != 0) _exit(3);
      int s = socket(AF_UNIX, SOCK_STREAM, 0);
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      std::strncpy(addr.sun_path, info.socket_path.c_str(), sizeof(addr.sun_path) - 1);
      if (connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) _exit(4);
      auto r = ReceiveFds(s);  // refused before it sends anything
      if (!r.ok()) _exit(5);
      Json j = Json::parse(r->message);
      _exit(!j.value("ok", true) && absl::StrContains(j.value("error", ""), "uid 65534 may not attach") ? 0 : 6);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
    return absl::FailedPreconditionError("refused");
  });
  CHECK_FALSE(st.ok());
}

}  // namespace
}  // namespace wsync::daemon

namespace wsync::daemon {
namespace {

// Connects a fresh "source" endpoint (any local process can do this) to rank 0 of fake0 and writes `byte` into the
// first 64 bytes of segment 0.
absl::Status WriteAsPeer(Fixture& f, transport::Transport& peer, const std::string& descriptor, uint8_t byte) {
  auto region = peer.ImportRegion(descriptor);
  if (!region.ok()) return region.status();
  auto ep = peer.CreateEndpoint();
  if (!ep.ok()) return ep.status();
  v1::ConnectTargetRequest req;
  req.set_engine_id("fake0");
  req.set_rank(0);
  req.set_source_endpoint_info((*ep)->LocalInfo());
  auto info = f.node->ConnectTarget(req);
  if (!info.ok()) return info.status();
  if (auto st = (*ep)->Connect(info->target_endpoint_info(), absl::Seconds(10)); !st.ok()) return st;
  static std::vector<uint8_t> src(64);
  std::fill(src.begin(), src.end(), byte);
  auto local = peer.RegisterMemory(src.data(), src.size());
  if (!local.ok()) return local.status();
  transport::WriteRequest w{local->get(), 0, region->get(), 0, src.size()};
  return (*ep)->Write({w}, absl::Seconds(10));
}

TEST_CASE("target: writes into engine memory are refused unless the coordinator opened the write window") {
  Fixture f;
  f.Start();
  AttachOnce(f, [](Json&) {});
  REQUIRE(f.conns.size() == 1);
  // The engine's memory, read independently through its own fd.
  const int fd = f.conns[0].segments[0].fd.get();
  void* mem = mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd, 0);
  REQUIRE(mem != MAP_FAILED);
  auto bytes = [&](uint8_t want) {
    const auto* p = static_cast<const uint8_t*>(mem);
    return std::all_of(p, p + 64, [&](uint8_t b) { return b == want; });
  };
  const std::string desc = f.node->Registrations()[0].ranks(0).segments(0).region_descriptor();
  auto peer = transport::CreateTransport("tcp", {});
  REQUIRE(peer.ok());

  CHECK(f.node->Status().write_window() == "closed");  // from Start on
  absl::Status st = WriteAsPeer(f, **peer, desc, 0xAB);
  INFO(st.ToString());
  CHECK(st.code() == absl::StatusCode::kPermissionDenied);
  CHECK(absl::StrContains(st.message(), "write window is closed"));
  CHECK(bytes(0));  // untouched
  CHECK(f.node->Status().refused_writes() >= 1);

  v1::SetWriteWindowRequest open;
  open.set_open(true);
  open.set_version(7);
  CHECK(f.node->SetWriteWindow(open).enforced());
  CHECK(f.node->Status().write_window() == "open");
  CHECK(WriteAsPeer(f, **peer, desc, 0xAB).ok());
  CHECK(bytes(0xAB));

  v1::SetWriteWindowRequest close;
  close.set_open(false);
  f.node->SetWriteWindow(close);
  CHECK(WriteAsPeer(f, **peer, desc, 0xCD).code() == absl::StatusCode::kPermissionDenied);
  CHECK(bytes(0xAB));  // the update's bytes stay
  munmap(mem, 4096);
}

// Connection ownership: while a source's connection to an engine rank is live, a repeat ConnectTarget under the same
// identity (a retried call, a second process of that source) gets the same grant, and the open update's writes go
// on through the connection; only once that connection closed does a new ConnectTarget replace it (and so revoke
// the old grant).
TEST_CASE("target: a repeat ConnectTarget during an open update gets the same grant; a closed connection is replaced",
          "[faults]") {
  Fixture f;
  f.Start();
  AttachOnce(f, [](Json&) {});
  REQUIRE(f.conns.size() == 1);
  const int fd = f.conns[0].segments[0].fd.get();
  void* mem = mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd, 0);
  REQUIRE(mem != MAP_FAILED);
  const std::string desc = f.node->Registrations()[0].ranks(0).segments(0).region_descriptor();
  auto peer = transport::CreateTransport("tcp", {});
  REQUIRE(peer.ok());
  auto region = (*peer)->ImportRegion(desc);
  REQUIRE(region.ok());
  // The update's bytes (the test's own pattern, the expectation) and where they go: 4096 bytes of segment 0.
  std::vector<uint8_t> src(4096);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 3);
  auto local = (*peer)->RegisterMemory(src.data(), src.size());
  REQUIRE(local.ok());
  auto write = [&](transport::Endpoint& ep, uint64_t off, uint64_t len) {
    transport::WriteRequest w{local->get(), off, region->get(), off, len};
    return ep.Write({w}, absl::Seconds(10));
  };
  const std::string source = "source:train0";
  auto connect = [&](transport::Endpoint& ep) {
    v1::ConnectTargetRequest req;
    req.set_engine_id("fake0");
    req.set_rank(0);
    req.set_source_endpoint_info(ep.LocalInfo());
    return f.node->ConnectTarget(req, source);
  };

  v1::SetWriteWindowRequest open;
  open.set_open(true);
  open.set_version(1);
  REQUIRE(f.node->SetWriteWindow(open).enforced());
  auto ep = (*peer)->CreateEndpoint();
  REQUIRE(ep.ok());
  auto first = connect(**ep);
  REQUIRE(first.ok());
  REQUIRE((*ep)->Connect(first->target_endpoint_info(), absl::Seconds(10)).ok());
  REQUIRE(write(**ep, 0, 2048).ok());  // the first half of the update

  // The repeats, mid-update: the same grant each time, the connection untouched.
  for (int i = 0; i < 3; ++i) {
    auto again = connect(**ep);
    REQUIRE(again.ok());
    CHECK(again->target_endpoint_info() == first->target_endpoint_info());
  }
  // A second endpoint of the same source connects with the grant it was given (tcp: the same write secret).
  auto ep2 = (*peer)->CreateEndpoint();
  REQUIRE(ep2.ok());
  auto from2 = connect(**ep2);
  REQUIRE(from2.ok());
  CHECK(from2->target_endpoint_info() == first->target_endpoint_info());
  REQUIRE((*ep2)->Connect(from2->target_endpoint_info(), absl::Seconds(10)).ok());
  absl::Status rest = write(**ep, 2048, 2048);  // the rest of the update, through the first connection
  INFO(rest.ToString());
  REQUIRE(rest.ok());
  CHECK(std::memcmp(mem, src.data(), src.size()) == 0);  // bit-exact

  // Both connections close: the next ConnectTarget (once the target saw them go) replaces the grant.
  ep->reset();
  ep2->reset();
  std::string replaced;
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (replaced.empty() && absl::Now() < deadline) {
    auto probe = (*peer)->CreateEndpoint();
    REQUIRE(probe.ok());
    auto r = connect(**probe);
    REQUIRE(r.ok());
    if (r->target_endpoint_info() != first->target_endpoint_info()) {
      replaced = r->target_endpoint_info();
      REQUIRE((*probe)->Connect(replaced, absl::Seconds(10)).ok());
      std::fill(src.begin(), src.begin() + 64, 0x5A);
      CHECK(write(**probe, 0, 64).ok());  // the new grant writes
    } else {
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
  REQUIRE_FALSE(replaced.empty());
  CHECK(static_cast<const uint8_t*>(mem)[0] == 0x5A);
  // The replaced grant is revoked: a connection presenting it is refused.
  auto stale = (*peer)->CreateEndpoint();
  REQUIRE(stale.ok());
  absl::Status st = (*stale)->Connect(first->target_endpoint_info(), absl::Seconds(10));
  if (st.ok()) st = write(**stale, 0, 64);
  INFO(st.ToString());
  CHECK(st.code() == absl::StatusCode::kPermissionDenied);
  munmap(mem, 4096);
}

// Write-window assignments kept between updates (docs/operations.md, "Write windows"). An open that names the
// assignments this target holds narrows grants as the one that carried them did, including grants given since; one
// naming other assignments, or any after the target holds none (never given, an older coordinator's open in
// between), changes nothing and asks for them. The digest held is computed from what arrived, never the label sent.
TEST_CASE("target: an open naming the held assignments keeps them; any other name opens nothing", "[faults]") {
  Fixture f;
  f.Start();
  AttachOnce(f, [](Json&) {});
  REQUIRE(f.conns.size() == 1);
  void* mem = mmap(nullptr, 4096, PROT_READ, MAP_SHARED, f.conns[0].segments[0].fd.get(), 0);
  REQUIRE(mem != MAP_FAILED);
  const std::string desc = f.node->Registrations()[0].ranks(0).segments(0).region_descriptor();
  auto peer = transport::CreateTransport("tcp", {});
  REQUIRE(peer.ok());
  auto region = (*peer)->ImportRegion(desc);
  REQUIRE(region.ok());
  std::vector<uint8_t> src(64);
  auto local = (*peer)->RegisterMemory(src.data(), src.size());
  REQUIRE(local.ok());
  // A connection of source `id` to fake0 rank 0 (its grant bound to the identity "source:ID").
  auto connect = [&](const std::string& id) -> std::unique_ptr<transport::Endpoint> {
    auto ep = (*peer)->CreateEndpoint();
    REQUIRE(ep.ok());
    v1::ConnectTargetRequest req;
    req.set_engine_id("fake0");
    req.set_rank(0);
    req.set_source_endpoint_info((*ep)->LocalInfo());
    auto info = f.node->ConnectTarget(req, "source:" + id);
    INFO(info.status().ToString());
    REQUIRE(info.ok());
    REQUIRE((*ep)->Connect(info->target_endpoint_info(), absl::Seconds(10)).ok());
    return *std::move(ep);
  };
  // Writes `byte` over a.weight (segment 0, bytes [0, 64)) through `ep`.
  auto write = [&](transport::Endpoint& ep, uint8_t byte) {
    std::fill(src.begin(), src.end(), byte);
    transport::WriteRequest w{local->get(), 0, region->get(), 0, src.size()};
    return ep.Write({w}, absl::Seconds(10));
  };
  auto holds = [&](uint8_t byte) {
    const auto* p = static_cast<const uint8_t*>(mem);
    return std::all_of(p, p + 64, [&](uint8_t b) { return b == byte; });
  };
  // The plan's open request giving fake0 rank 0 to `source`.
  auto plan = [](const std::string& source, int64_t v) {
    v1::SetWriteWindowRequest r;
    r.set_open(true);
    r.set_version(v);
    r.set_assignments_given(true);
    auto* a = r.add_assignments();
    a->set_source_node(source);
    a->set_engine_id("fake0");
    a->set_rank(0);
    auto* w = a->add_writes();
    w->set_param("a.weight");
    w->set_offset(0);
    w->set_length(64);
    r.set_assignments_digest(WindowAssignmentsDigest(r.assignments()));
    return r;
  };
  auto close = [&] {
    v1::SetWriteWindowRequest c;
    f.node->SetWriteWindow(c);
    REQUIRE(f.node->Status().write_window() == "closed");
  };
  const v1::SetWriteWindowRequest a = plan("train0", 1), b = plan("train2", 1);
  const std::string da = a.assignments_digest(), db = b.assignments_digest();
  REQUIRE(da != db);

  // 1. Named before any were given (a new daemon): nothing opens.
  v1::SetWriteWindowReply r = f.node->SetWriteWindow(NamingHeldAssignments(a));
  CHECK(r.assignments_missing());
  CHECK(r.assignments_digest().empty());
  CHECK(f.node->Status().write_window() == "closed");

  // 2. Given: held under their digest.
  auto ep0 = connect("train0");
  r = f.node->SetWriteWindow(a);
  CHECK_FALSE(r.assignments_missing());
  CHECK(r.assignments_digest() == da);
  CHECK(r.grants_revoked() == 0);
  REQUIRE(write(*ep0, 0x11).ok());
  CHECK(holds(0x11));
  close();

  // 3. Named: kept. train1 connected while the window was closed; the kept plan does not give it the rank, so its
  //    grant is revoked at the opening, train0's stays.
  auto ep1 = connect("train1");
  r = f.node->SetWriteWindow(NamingHeldAssignments(a));
  CHECK_FALSE(r.assignments_missing());
  CHECK(r.assignments_digest() == da);
  CHECK(r.grants_revoked() == 1);
  CHECK(f.node->Status().write_window() == "open");
  CHECK(absl::IsPermissionDenied(write(*ep1, 0x22)));
  CHECK(holds(0x11));
  REQUIRE(write(*ep0, 0x33).ok());
  CHECK(holds(0x33));
  close();

  // 4. Naming other assignments: nothing opens, the held ones stay.
  r = f.node->SetWriteWindow(NamingHeldAssignments(b));
  CHECK(r.assignments_missing());
  CHECK(r.assignments_digest() == da);
  CHECK(f.node->Status().write_window() == "closed");
  CHECK(absl::IsPermissionDenied(write(*ep0, 0x44)));
  CHECK(holds(0x33));

  // 5. A re-plan gives the rank to train2, in a request whose label is not the digest of what it carries: held
  //    under the digest of the content; train0's grant is revoked, train2's (given while closed) kept.
  auto ep2 = connect("train2");
  v1::SetWriteWindowRequest mislabelled = b;
  mislabelled.set_assignments_digest(da);
  r = f.node->SetWriteWindow(mislabelled);
  CHECK(r.assignments_digest() == db);
  CHECK(r.grants_revoked() == 1);
  CHECK(absl::IsPermissionDenied(write(*ep0, 0x55)));
  REQUIRE(write(*ep2, 0x66).ok());
  CHECK(holds(0x66));
  close();
  CHECK(f.node->SetWriteWindow(NamingHeldAssignments(a)).assignments_missing());
  CHECK(f.node->Status().write_window() == "closed");

  // 6. The re-plan named: kept.
  r = f.node->SetWriteWindow(NamingHeldAssignments(b));
  CHECK_FALSE(r.assignments_missing());
  CHECK(r.assignments_digest() == db);
  REQUIRE(write(*ep2, 0x77).ok());
  CHECK(holds(0x77));
  close();

  // 7. An older coordinator's open (no assignments) in between: nothing is held any more.
  v1::SetWriteWindowRequest older;
  older.set_open(true);
  older.set_version(2);
  CHECK(f.node->SetWriteWindow(older).assignments_digest().empty());
  close();
  CHECK(f.node->SetWriteWindow(NamingHeldAssignments(b)).assignments_missing());
  CHECK(f.node->Status().write_window() == "closed");
  munmap(mem, 4096);
}

// Endpoint::Reusable has one meaning on every backend (transport/transport.h); on it ConnectTarget decides. During
// an open update, on tcp and on fabric: a retried ConnectTarget of the source's endpoint and one from a second endpoint
// of the same source are answered with the live endpoint (the same grant), and the update goes on writing through
// the first connection, bit-exact. Before, fabric (no PeerConnected) replaced the endpoint, revoking the grant the
// update wrote with.
TEST_CASE("target: a repeat ConnectTarget during an open update keeps the live endpoint on every backend with grants",
          "[faults]") {
  const std::string backend = GENERATE(as<std::string>{}, "tcp", "fabric");
  INFO("backend " << backend);
  Fixture f(backend);
  f.Start();
  AttachOnce(f, [](Json&) {});
  REQUIRE(f.conns.size() == 1);
  void* mem = mmap(nullptr, 4096, PROT_READ, MAP_SHARED, f.conns[0].segments[0].fd.get(), 0);
  REQUIRE(mem != MAP_FAILED);
  const std::string desc = f.node->Registrations()[0].ranks(0).segments(0).region_descriptor();
  auto peer = MakeBackend(backend);
  auto region = peer->ImportRegion(desc);
  REQUIRE(region.ok());
  std::vector<uint8_t> src(4096);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 13 + 5);
  auto local = peer->RegisterMemory(src.data(), src.size());
  REQUIRE(local.ok());
  auto write = [&](transport::Endpoint& ep, uint64_t off, uint64_t len) {
    transport::WriteRequest w{local->get(), off, region->get(), off, len};
    return ep.Write({w}, absl::Seconds(10));
  };
  auto connect = [&](const std::string& sender_info) {
    v1::ConnectTargetRequest req;
    req.set_engine_id("fake0");
    req.set_rank(0);
    req.set_source_endpoint_info(sender_info);
    return f.node->ConnectTarget(req, "source:train0");
  };
  v1::SetWriteWindowRequest open;
  open.set_open(true);
  open.set_version(1);
  f.node->SetWriteWindow(open);
  auto ep = peer->CreateEndpoint();
  REQUIRE(ep.ok());
  auto first = connect((*ep)->LocalInfo());
  INFO(first.status().ToString());
  REQUIRE(first.ok());
  REQUIRE((*ep)->Connect(first->target_endpoint_info(), absl::Seconds(10)).ok());
  absl::Status half = write(**ep, 0, 2048);
  INFO(half.ToString());
  REQUIRE(half.ok());

  auto retried = connect((*ep)->LocalInfo());  // a retried call of the same sender endpoint
  REQUIRE(retried.ok());
  CHECK(retried->target_endpoint_info() == first->target_endpoint_info());
  auto ep2 = peer->CreateEndpoint();  // a second endpoint of the same source
  REQUIRE(ep2.ok());
  auto second = connect((*ep2)->LocalInfo());
  REQUIRE(second.ok());
  CHECK(second->target_endpoint_info() == first->target_endpoint_info());
  REQUIRE((*ep2)->Connect(second->target_endpoint_info(), absl::Seconds(10)).ok());

  absl::Status rest = write(**ep, 2048, 2048);  // the update goes on through the first connection
  INFO(rest.ToString());
  CHECK(rest.ok());
  CHECK(std::memcmp(mem, src.data(), src.size()) == 0);
  absl::Status beside = write(**ep2, 0, 64);  // and the second writes with the same grant
  INFO(beside.ToString());
  CHECK(beside.ok());
  munmap(mem, 4096);
}

// Counts the bytes registered through it that are still registered (its regions wrap the inner transport's and
// deregister with them): the test's own measure of what the target keeps registered.
class CountingTransport final : public transport::Transport {
 public:
  explicit CountingTransport(std::unique_ptr<transport::Transport> inner) : inner_(std::move(inner)) {}
  int64_t live_bytes() const { return live_.load(); }

  std::string name() const override { return inner_->name(); }
  bool viable() const override { return inner_->viable(); }
  std::string reason() const override { return inner_->reason(); }
  transport::Capabilities Query() const override { return inner_->Query(); }
  absl::StatusOr<std::unique_ptr<transport::LocalRegion>> RegisterMemory(void* addr, uint64_t len) override {
    return Wrap(inner_->RegisterMemory(addr, len));
  }
  absl::StatusOr<std::unique_ptr<transport::LocalRegion>> RegisterSourceMemory(void* addr, uint64_t len) override {
    return Wrap(inner_->RegisterSourceMemory(addr, len));
  }
  absl::StatusOr<std::unique_ptr<transport::RemoteRegion>> ImportRegion(const std::string& d) override {
    return inner_->ImportRegion(d);
  }
  absl::StatusOr<std::unique_ptr<transport::Endpoint>> CreateEndpoint() override { return inner_->CreateEndpoint(); }
  absl::Status SetWriteWindow(bool open) override { return inner_->SetWriteWindow(open); }
  uint64_t refused_writes() const override { return inner_->refused_writes(); }
  absl::StatusOr<std::unique_ptr<transport::Endpoint>> CreateGrantedEndpoint(const WriteGrant& grant) override {
    WriteGrant in = grant;
    for (auto& r : in.regions) r = static_cast<const Region*>(r)->inner.get();
    return inner_->CreateGrantedEndpoint(in);
  }
  void RevokeGrants(const std::function<bool(const WriteGrant&)>& keep) override { inner_->RevokeGrants(keep); }
  absl::Status RequireGrants(bool require) override { return inner_->RequireGrants(require); }

 private:
  struct Region final : transport::LocalRegion {
    Region(std::unique_ptr<transport::LocalRegion> r, std::atomic<int64_t>* l) : inner(std::move(r)), live(l) {
      *live += static_cast<int64_t>(inner->length());
    }
    ~Region() override { *live -= static_cast<int64_t>(inner->length()); }
    void* addr() const override { return inner->addr(); }
    uint64_t length() const override { return inner->length(); }
    std::string Descriptor() const override { return inner->Descriptor(); }
    std::unique_ptr<transport::LocalRegion> inner;
    std::atomic<int64_t>* live;
  };
  absl::StatusOr<std::unique_ptr<transport::LocalRegion>> Wrap(
      absl::StatusOr<std::unique_ptr<transport::LocalRegion>> r) {
    if (!r.ok()) return r.status();
    return std::unique_ptr<transport::LocalRegion>(std::make_unique<Region>(*std::move(r), &live_));
  }
  std::unique_ptr<transport::Transport> inner_;
  std::atomic<int64_t> live_{0};
};

// Delta staging is owned by the connections whose grants name it (issue 39): 100 re-plans, each giving the rank to
// a new source (the old one gone: source churn) that asks for staging of alternating sizes, leave the target's
// registered memory at the engine's segments plus the current source's one region, every time.
TEST_CASE("target: 100 re-plans with source churn leave registered memory flat (delta staging is freed)", "[faults]") {
  Fixture f;
  auto counting = std::make_unique<CountingTransport>(std::move(f.transport));
  CountingTransport* counted = counting.get();
  f.transport = std::move(counting);
  TargetOptions o;
  o.delta_staging_fraction = 1.0;  // staging = what the source asks for (≤ the rank's 5120 bytes), 4 KiB pages
  f.Start(o);
  AttachOnce(f, [](Json&) {});
  REQUIRE(f.conns.size() == 1);
  const int64_t engine_bytes = counted->live_bytes();
  REQUIRE(engine_bytes == 4096 + 1024);  // the rank's two segments
  auto peer = transport::CreateTransport("tcp", {});
  REQUIRE(peer.ok());
  std::vector<uint8_t> src(64, 0x5C);
  auto local = (*peer)->RegisterMemory(src.data(), src.size());
  REQUIRE(local.ok());
  auto plan = [](const std::string& source, int64_t v) {
    v1::SetWriteWindowRequest r;
    r.set_open(true);
    r.set_version(v);
    r.set_assignments_given(true);
    auto* a = r.add_assignments();
    a->set_source_node(source);
    a->set_engine_id("fake0");
    a->set_rank(0);
    r.set_assignments_digest(WindowAssignmentsDigest(r.assignments()));
    return r;
  };
  std::unique_ptr<transport::Endpoint> previous;
  for (int i = 0; i < 100; ++i) {
    const std::string id = absl::StrCat("train", i);
    auto ep = (*peer)->CreateEndpoint();
    REQUIRE(ep.ok());
    v1::ConnectTargetRequest req;
    req.set_engine_id("fake0");
    req.set_rank(0);
    req.set_source_endpoint_info((*ep)->LocalInfo());
    req.set_source_node(id);
    req.set_delta_write_bytes(i % 2 == 0 ? 4096 : 5000);
    auto info = f.node->ConnectTarget(req, "source:" + id);
    INFO("re-plan " << i << ": " << info.status().ToString());
    REQUIRE(info.ok());
    const uint64_t want = i % 2 == 0 ? 4096 : 8192;  // rounded up to whole pages
    REQUIRE(info->staging_bytes() == want);
    REQUIRE((*ep)->Connect(info->target_endpoint_info(), absl::Seconds(10)).ok());
    // The re-plan: the rank is now the new source's; the old source's connection goes with its grant.
    f.node->SetWriteWindow(plan(id, i + 1));
    previous.reset();
    CHECK(counted->live_bytes() == engine_bytes + static_cast<int64_t>(want));
    // The current source's staging is alive and writable under its grant.
    auto staging = (*peer)->ImportRegion(info->staging_descriptor());
    REQUIRE(staging.ok());
    transport::WriteRequest w{local->get(), 0, staging->get(), 0, src.size()};
    absl::Status wrote = (*ep)->Write({w}, absl::Seconds(10));
    INFO(wrote.ToString());
    REQUIRE(wrote.ok());
    v1::SetWriteWindowRequest close;
    f.node->SetWriteWindow(close);
    previous = *std::move(ep);
  }
}

}  // namespace
}  // namespace wsync::daemon
