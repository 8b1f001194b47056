// Verbs-specific behaviour, beyond the conformance suite: MR chunking, multi-QP and multi-device striping,
// bounded send queues, completion errors and blobs crossing a process boundary. Needs an RDMA device (soft-RoCE
// in the test VM); exits 77 without one.

#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "tests/transport/verbs_test_util.h"
#include "transport/transport.h"
#include "transport/verbs/verbs_transport.h"
#include "transport/verbs/verbs_wire.h"

namespace {

using wsync::transport::Endpoint;
using wsync::transport::LocalRegion;
using wsync::transport::RemoteRegion;
using wsync::transport::Transport;
using wsync::transport::TransportOptions;
using wsync::transport::WriteRequest;
using wsync::transport::verbs::CreateVerbsTransport;
using wsync::transport::verbs::GetVerbsEndpointStats;
using wsync::transport::verbs::GetVerbsRegionInfo;
using wsync::transport::verbs::VerbsOptions;

constexpr uint8_t kUntouched = 0xEE;
const absl::Duration kTimeout = absl::Seconds(30);

uint8_t Pattern(uint64_t seed, uint64_t i) { return static_cast<uint8_t>((i * 131 + seed * 7 + (i >> 9)) & 0xff); }

std::unique_ptr<Transport> MakeVerbs(const VerbsOptions& vo, const TransportOptions& opts = {}) {
  auto t = CreateVerbsTransport(opts, vo);
  INFO(t.status().ToString());
  REQUIRE(t.ok());
  wsync::transport::verbs::testing::SkipUnlessViable(**t);
  return std::move(*t);
}

struct Mem {
  std::vector<uint8_t> bytes;
  std::unique_ptr<LocalRegion> region;
};

Mem Register(Transport& t, uint64_t len, int64_t seed) {
  Mem m;
  m.bytes.resize(len);
  for (uint64_t i = 0; i < len; ++i) m.bytes[i] = seed < 0 ? kUntouched : Pattern(seed, i);
  auto r = t.RegisterMemory(m.bytes.data(), len);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  m.region = std::move(*r);
  return m;
}

struct Link {
  std::unique_ptr<Endpoint> src, dst;
};

Link Connect(Transport& a, Transport& b) {
  auto ea = a.CreateEndpoint();
  auto eb = b.CreateEndpoint();
  REQUIRE(ea.ok());
  REQUIRE(eb.ok());
  Link l{std::move(*ea), std::move(*eb)};
  // Verbs connecting is local QP state changes only: no need to run the two sides concurrently.
  REQUIRE(l.src->Connect(l.dst->LocalInfo(), kTimeout).ok());
  REQUIRE(l.dst->Connect(l.src->LocalInfo(), kTimeout).ok());
  return l;
}

std::unique_ptr<RemoteRegion> Import(Transport& t, const LocalRegion& r) {
  auto rr = t.ImportRegion(r.Descriptor());
  REQUIRE(rr.ok());
  return std::move(*rr);
}

void RequireOk(const absl::Status& s) {
  INFO(s.ToString());
  REQUIRE(s.ok());
}

}  // namespace

TEST_CASE("verbs: regions above the MR size limit are split; writes crossing chunk boundaries land", "[verbs]") {
  VerbsOptions src_opts, dst_opts;
  src_opts.max_mr_chunk = 64 << 10;
  dst_opts.max_mr_chunk = 48 << 10;  // different boundaries on the two sides
  auto a = MakeVerbs(src_opts);
  auto b = MakeVerbs(dst_opts);
  constexpr uint64_t kLen = (1 << 20) + 123;
  Mem src = Register(*a, kLen, 1);
  Mem dst = Register(*b, kLen, -1);

  auto info = GetVerbsRegionInfo(*src.region);
  REQUIRE(info.has_value());
  CHECK(info->chunk_size == (64 << 10));
  CHECK(info->num_chunks == 17);
  auto desc = wsync::transport::verbs::DecodeRegionDesc(dst.region->Descriptor());
  REQUIRE(desc.ok());
  CHECK(desc->chunk_size == (48 << 10));
  CHECK(desc->num_chunks == 22);
  CHECK(desc->rkeys.size() == desc->num_devices * 22u);
  CHECK(desc->base == reinterpret_cast<uintptr_t>(dst.bytes.data()));
  CHECK(desc->length == kLen);

  auto remote = Import(*a, *dst.region);
  Link link = Connect(*a, *b);
  WriteRequest whole{src.region.get(), 0, remote.get(), 0, kLen};
  RequireOk(link.src->Write({&whole, 1}, kTimeout));
  CHECK(std::memcmp(src.bytes.data(), dst.bytes.data(), kLen) == 0);

  std::vector<uint8_t> want = dst.bytes;
  std::mt19937_64 rng(3);
  std::vector<WriteRequest> writes;
  for (int i = 0; i < 64; ++i) {
    uint64_t len = 1 + rng() % (200 << 10);
    uint64_t s = rng() % (kLen - len + 1), d = rng() % (kLen - len + 1);
    writes.push_back({src.region.get(), s, remote.get(), d, len});
  }
  // Later writes win where they overlap; the transport gives no ordering between writes of a batch, so apply
  // one batch per write.
  for (const WriteRequest& w : writes) {
    RequireOk(link.src->Write({&w, 1}, kTimeout));
    std::memcpy(want.data() + w.dst_offset, src.bytes.data() + w.src_offset, w.length);
  }
  CHECK(std::memcmp(want.data(), dst.bytes.data(), kLen) == 0);
  auto stats = GetVerbsEndpointStats(*link.src);
  REQUIRE(stats.has_value());
  uint64_t wrs = std::accumulate(stats->wrs_per_qp.begin(), stats->wrs_per_qp.end(), uint64_t{0});
  CHECK(wrs > writes.size() + 17);  // chunk boundaries forced extra work requests
}

TEST_CASE("verbs: large writes are striped over several QPs", "[verbs]") {
  VerbsOptions vo;
  vo.qps_per_device = 4;
  vo.stripe_bytes = 64 << 10;
  auto a = MakeVerbs(vo);
  auto b = MakeVerbs(vo);
  constexpr uint64_t kLen = 4 << 20;
  Mem src = Register(*a, kLen, 2);
  Mem dst = Register(*b, kLen, -1);
  auto remote = Import(*a, *dst.region);
  Link link = Connect(*a, *b);
  WriteRequest w{src.region.get(), 0, remote.get(), 0, kLen};
  RequireOk(link.src->Write({&w, 1}, kTimeout));
  CHECK(std::memcmp(src.bytes.data(), dst.bytes.data(), kLen) == 0);

  auto stats = GetVerbsEndpointStats(*link.src);
  REQUIRE(stats.has_value());
  REQUIRE(stats->wrs_per_qp.size() == 4);
  for (size_t q = 0; q < 4; ++q) {
    INFO("qp " << q);
    CHECK(stats->wrs_per_qp[q] == 16);
    CHECK(stats->bytes_per_qp[q] == kLen / 4);
  }
}

TEST_CASE("verbs: an explicit device list stripes over every device", "[verbs]") {
  const char* dev = std::getenv("RXE_DEV");
  if (dev == nullptr) {
    WARN("RXE_DEV not set (not in the test VM); skipping");
    return;
  }
  // The same port opened twice acts as two NICs: separate contexts, PDs, MRs and rkeys per device.
  TransportOptions opts;
  opts.devices = {dev, dev};
  VerbsOptions vo;
  vo.qps_per_device = 1;
  vo.stripe_bytes = 256 << 10;
  auto a = MakeVerbs(vo, opts);
  auto b = MakeVerbs(vo, opts);
  constexpr uint64_t kLen = 2 << 20;
  Mem src = Register(*a, kLen, 3);
  Mem dst = Register(*b, kLen, -1);
  auto info = GetVerbsRegionInfo(*src.region);
  REQUIRE(info.has_value());
  CHECK(info->devices.size() == 2);
  CHECK(info->preferred_devices.size() == 2);
  auto remote = Import(*a, *dst.region);
  Link link = Connect(*a, *b);
  WriteRequest w{src.region.get(), 0, remote.get(), 0, kLen};
  RequireOk(link.src->Write({&w, 1}, kTimeout));
  CHECK(std::memcmp(src.bytes.data(), dst.bytes.data(), kLen) == 0);
  auto stats = GetVerbsEndpointStats(*link.src);
  REQUIRE(stats.has_value());
  REQUIRE(stats->wrs_per_qp.size() == 2);
  CHECK(stats->bytes_per_qp[0] == kLen / 2);
  CHECK(stats->bytes_per_qp[1] == kLen / 2);
}

TEST_CASE("verbs: a tiny send queue bounds outstanding work without losing writes", "[verbs]") {
  VerbsOptions vo;
  vo.max_send_wr = 8;
  vo.signal_every = 4;
  auto a = MakeVerbs(vo);
  auto b = MakeVerbs(vo);
  constexpr int kWrites = 2000;
  constexpr uint64_t kSize = 512;
  Mem src = Register(*a, kWrites * kSize, 4);
  Mem dst = Register(*b, kWrites * kSize * 2, -1);
  auto remote = Import(*a, *dst.region);
  Link link = Connect(*a, *b);
  std::vector<WriteRequest> writes;
  for (int i = 0; i < kWrites; ++i) {
    writes.push_back({src.region.get(), i * kSize, remote.get(), (kWrites - 1 - i) * kSize * 2, kSize});
  }
  RequireOk(link.src->Write(writes, kTimeout));
  for (int i = 0; i < kWrites; ++i) {
    INFO("write " << i);
    REQUIRE(std::memcmp(src.bytes.data() + i * kSize, dst.bytes.data() + (kWrites - 1 - i) * kSize * 2, kSize) == 0);
  }
  auto stats = GetVerbsEndpointStats(*link.src);
  REQUIRE(stats.has_value());
  CHECK(stats->post_calls >= kWrites / 4);
  CHECK(stats->signaled_wrs == stats->post_calls);  // one signaled WR per linked list
  CHECK(stats->send_queue_full_waits > 0);
}

TEST_CASE("verbs: a write into a deregistered peer region fails naming the peer and the write", "[verbs]") {
  auto a = MakeVerbs({});
  auto b = MakeVerbs({});
  constexpr uint64_t kLen = 256 << 10;
  Mem src = Register(*a, kLen, 5);
  Mem dst = Register(*b, kLen, -1);
  auto remote = Import(*a, *dst.region);
  Link link = Connect(*a, *b);
  const std::string peer = link.src->PeerName();

  dst.region.reset();  // the peer deregisters; its rkeys are now invalid
  std::vector<WriteRequest> writes = {{src.region.get(), 0, remote.get(), 4096, 1000},
                                      {src.region.get(), 0, remote.get(), 8192, 1000}};
  absl::Status s = link.src->Write(writes, kTimeout);
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(s.message(), peer));
  CHECK(absl::StrContains(s.message(), "write #"));
  CHECK(absl::StrContains(s.message(), "dst offset"));
  WARN("completion error as reported: " << s.ToString());

  // The endpoint stays failed...
  auto again = link.src->Post(writes);
  CHECK(again.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(again.status().message(), "re-create"));

  // ... and re-created endpoints (with a fresh registration) carry the next batch.
  dst.region.reset();
  auto r = b->RegisterMemory(dst.bytes.data(), kLen);
  REQUIRE(r.ok());
  dst.region = std::move(*r);
  remote = Import(*a, *dst.region);
  for (WriteRequest& w : writes) w.dst = remote.get();
  link = Connect(*a, *b);
  RequireOk(link.src->Write(writes, kTimeout));
  CHECK(std::memcmp(src.bytes.data(), dst.bytes.data() + 4096, 1000) == 0);
  CHECK(std::memcmp(src.bytes.data(), dst.bytes.data() + 8192, 1000) == 0);
}

TEST_CASE("verbs: a vanished peer surfaces as Unavailable after the retries", "[verbs]") {
  VerbsOptions vo;
  vo.qp_timeout = 12;  // ~16 ms per try
  vo.retry_cnt = 3;
  auto a = MakeVerbs(vo);
  auto b = MakeVerbs(vo);
  Mem src = Register(*a, 64 << 10, 6);
  Mem dst = Register(*b, 64 << 10, -1);
  auto remote = Import(*a, *dst.region);
  Link link = Connect(*a, *b);
  const std::string peer = link.src->PeerName();
  link.dst.reset();  // the peer's QPs are gone; its region still exists
  WriteRequest w{src.region.get(), 0, remote.get(), 0, 4096};
  absl::Time start = absl::Now();
  absl::Status s = link.src->Write({&w, 1}, kTimeout);
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(s.message(), peer));
  CHECK(absl::StrContains(s.message(), "write #0"));
  CHECK(absl::Now() - start < absl::Seconds(10));
  WARN("vanished peer as reported after " << absl::FormatDuration(absl::Now() - start) << ": " << s.ToString());
}

namespace {

void SendBlob(int fd, const std::string& s) {
  uint32_t n = static_cast<uint32_t>(s.size());
  if (write(fd, &n, sizeof(n)) != sizeof(n) || write(fd, s.data(), n) != static_cast<ssize_t>(n)) _exit(90);
}

std::string RecvBlob(int fd) {
  uint32_t n = 0;
  if (read(fd, &n, sizeof(n)) != sizeof(n)) return {};
  std::string s(n, '\0');
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, &s[got], n - got);
    if (r <= 0) return {};
    got += r;
  }
  return s;
}

// The target process: registers a region, hands out its descriptor and connection info, verifies what arrives.
int RunTargetProcess(int in, int out) {
  auto t = CreateVerbsTransport(TransportOptions{});
  if (!t.ok() || !(*t)->viable()) return 2;
  constexpr uint64_t kLen = 1 << 20;
  std::vector<uint8_t> mem(kLen, kUntouched);
  auto region = (*t)->RegisterMemory(mem.data(), kLen);
  auto ep = (*t)->CreateEndpoint();
  if (!region.ok() || !ep.ok()) return 3;
  SendBlob(out, (*region)->Descriptor());
  SendBlob(out, (*ep)->LocalInfo());
  if (!(*ep)->Connect(RecvBlob(in), kTimeout).ok()) return 4;
  SendBlob(out, "connected");
  if (RecvBlob(in) != "written") return 5;
  for (uint64_t i = 0; i < kLen; ++i) {
    if (mem[i] != Pattern(7, i)) return 6;
  }
  return 0;
}

}  // namespace

TEST_CASE("verbs: descriptors and connection info are plain bytes that work across processes", "[verbs]") {
  int to_child[2], to_parent[2];
  REQUIRE(pipe(to_child) == 0);
  REQUIRE(pipe(to_parent) == 0);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    close(to_child[1]);
    close(to_parent[0]);
    _exit(RunTargetProcess(to_child[0], to_parent[1]));
  }
  close(to_child[0]);
  close(to_parent[1]);
  {
    auto a = MakeVerbs({});
    Mem src = Register(*a, 1 << 20, 7);
    const std::string desc = RecvBlob(to_parent[0]);
    const std::string info = RecvBlob(to_parent[0]);
    REQUIRE(!desc.empty());
    REQUIRE(!info.empty());
    auto remote = a->ImportRegion(desc);
    REQUIRE(remote.ok());
    auto ep = a->CreateEndpoint();
    REQUIRE(ep.ok());
    RequireOk((*ep)->Connect(info, kTimeout));
    SendBlob(to_child[1], (*ep)->LocalInfo());
    REQUIRE(RecvBlob(to_parent[0]) == "connected");
    WriteRequest w{src.region.get(), 0, remote->get(), 0, 1 << 20};
    RequireOk((*ep)->Write({&w, 1}, kTimeout));
    SendBlob(to_child[1], "written");
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  close(to_child[1]);
  close(to_parent[0]);
}

namespace {

// Device memory stand-in for RegisterSink: "device" bytes in host memory the NIC must not write directly. It has no
// dma-buf, so verbs takes the host-mirror path; CopyMirror is the "H2D copy". Staging by chunks is tcp's path and
// must not be used by verbs.
class FakeDeviceSink final : public wsync::transport::RegionSink {
 public:
  explicit FakeDeviceSink(std::vector<uint8_t>* device) : device_(device) {}
  uint64_t length() const override { return device_->size(); }
  uint64_t chunk_bytes() const override { return 1 << 20; }
  absl::StatusOr<Staging> Acquire() override { return absl::InternalError("verbs must not stage by chunks"); }
  absl::Status Submit(const Staging&, uint64_t, uint64_t) override {
    return absl::InternalError("verbs must not stage by chunks");
  }
  void Cancel(const Staging&) override {}
  absl::Status Flush() override { return absl::OkStatus(); }
  std::string Describe() const override { return "fake device memory"; }
  absl::StatusOr<Dmabuf> ExportDmabuf() override {
    return absl::FailedPreconditionError("the fake device has no dma-buf");
  }
  absl::StatusOr<uint8_t*> HostMirror() override {
    if (mirror_.empty()) mirror_ = *device_;  // starts as the device's bytes
    return mirror_.data();
  }
  absl::Status CopyMirror() override {
    ++copies;
    std::memcpy(device_->data(), mirror_.data(), mirror_.size());
    return absl::OkStatus();
  }
  int copies = 0;

 private:
  std::vector<uint8_t>* device_;
  std::vector<uint8_t> mirror_;
};

}  // namespace

TEST_CASE("verbs: device memory without GPUDirect is written through a host mirror and lands when settled",
          "[verbs]") {
  auto a = MakeVerbs({});
  auto b = MakeVerbs({});
  constexpr uint64_t kLen = (3 << 20) + 77;
  Mem src = Register(*a, kLen, 5);
  std::vector<uint8_t> device(kLen);
  for (uint64_t i = 0; i < kLen; ++i) device[i] = Pattern(9, i);
  const std::vector<uint8_t> before = device;
  auto sink = std::make_shared<FakeDeviceSink>(&device);
  auto region = b->RegisterSink(sink);
  INFO(region.status().ToString());
  REQUIRE(region.ok());
  const std::string path = (*region)->DevicePath();
  INFO(path);
  CHECK(absl::StartsWith(path, "staging (no GPUDirect: "));
  // The reason is the first missing piece: this rdma-core's symbol, else the sink's own refusal.
  CHECK((absl::StrContains(path, "the fake device has no dma-buf") || absl::StrContains(path, "ibv_reg_dmabuf_mr")));

  auto remote = Import(*a, **region);
  Link link = Connect(*a, *b);
  WriteRequest w1{src.region.get(), 0, remote.get(), 4096, 1 << 20};
  WriteRequest w2{src.region.get(), 2 << 20, remote.get(), kLen - 1000, 1000};
  RequireOk(link.src->Write({&w1, 1}, kTimeout));
  RequireOk(link.src->Write({&w2, 1}, kTimeout));
  CHECK(device == before);  // nothing reaches the device before the settle
  CHECK(sink->copies == 0);
  RequireOk((*region)->Settle());
  CHECK(sink->copies == 1);
  std::vector<uint8_t> want = before;
  std::memcpy(want.data() + 4096, src.bytes.data(), 1 << 20);
  std::memcpy(want.data() + kLen - 1000, src.bytes.data() + (2 << 20), 1000);
  CHECK(device == want);  // the written ranges, every other byte as it was
}

namespace {

const absl::Status kCancelReason = absl::AbortedError("update 7 aborted: node n1 lost its lease");

// Cancels `ep` from another thread `after` from now; returns when it was called through `at`.
std::thread CancelLater(Endpoint& ep, absl::Duration after, absl::Time* at) {
  return std::thread([&ep, after, at] {
    absl::SleepFor(after);
    *at = absl::Now();
    ep.Cancel(kCancelReason);
  });
}

void CheckCancelReason(const absl::Status& s) {
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kAborted);
  CHECK(absl::StrContains(s.message(), "node n1 lost its lease"));
}

}  // namespace

TEST_CASE("verbs: Cancel releases a Wait and a Post stuck on a vanished peer at once; the QPs flush; a new "
          "endpoint works", "[verbs][cancel]") {
  VerbsOptions vo;
  vo.qp_timeout = 20;  // ~4 s per try, 6 tries: without Cancel the batches would hang ~30 s
  vo.max_send_wr = 16;
  vo.signal_every = 4;
  vo.qps_per_device = 1;
  TransportOptions opts;
  opts.io_timeout = absl::Seconds(60);  // Post's wait for send-queue room
  auto a = MakeVerbs(vo, opts);
  auto b = MakeVerbs(vo, opts);
  constexpr uint64_t kPiece = 16 << 10;
  constexpr int kPieces = 256;
  constexpr uint64_t kLen = kPiece * kPieces;
  Mem src = Register(*a, kLen, 11);
  Mem dst = Register(*b, kLen, -1);
  auto remote = Import(*a, *dst.region);
  std::vector<WriteRequest> writes;
  for (int i = 0; i < kPieces; ++i) writes.push_back({src.region.get(), i * kPiece, remote.get(), i * kPiece, kPiece});

  SECTION("a Wait") {
    Link link = Connect(*a, *b);
    link.dst.reset();  // the peer's QPs are gone: nothing is acknowledged
    auto id = link.src->Post(absl::MakeSpan(writes).subspan(0, 8));  // fits the send queue
    REQUIRE(id.ok());
    CHECK(link.src->Wait(*id, absl::Milliseconds(300)).code() == absl::StatusCode::kDeadlineExceeded);
    absl::Time cancelled_at;
    std::thread canceller = CancelLater(*link.src, absl::Milliseconds(300), &cancelled_at);
    absl::Status s = link.src->Wait(*id, kTimeout);  // concurrent with the Cancel
    const absl::Time returned = absl::Now();
    canceller.join();
    CheckCancelReason(s);
    WARN("Wait returned " << absl::FormatDuration(returned - cancelled_at) << " after the Cancel");
    CHECK(returned - cancelled_at < absl::Seconds(1));
  }

  SECTION("a batch larger than the send queue, its backlog never posted after the Cancel, then the refusals") {
    Link link = Connect(*a, *b);
    link.dst.reset();
    absl::Time cancelled_at;
    std::thread canceller = CancelLater(*link.src, absl::Milliseconds(300), &cancelled_at);
    const absl::Time p0 = absl::Now();
    auto id = link.src->Post(writes);  // 256 WRs, room for 16: the rest waits in the endpoint (Post never blocks)
    const absl::Duration post_took = absl::Now() - p0;
    REQUIRE(id.ok());  // posted in part: its Wait reports the reason
    WARN("Post returned after " << absl::FormatDuration(post_took));
    CHECK(post_took < absl::Milliseconds(250));  // before the Cancel: it waited for no completion
    const absl::Status waited = link.src->Wait(*id, kTimeout);  // concurrent with the Cancel
    const absl::Time returned = absl::Now();
    canceller.join();
    CheckCancelReason(waited);
    WARN("Wait returned " << absl::FormatDuration(returned - cancelled_at) << " after the Cancel");
    CHECK(returned - cancelled_at < absl::Seconds(1));

    // The endpoint refuses new work; the QPs are in the error state, so every WR still queued flushes (retired by
    // the refused Post's poll) instead of waiting out the retries.
    absl::SleepFor(absl::Milliseconds(200));
    auto again = link.src->Post(absl::MakeSpan(writes).subspan(0, 1));
    CheckCancelReason(again.status());
    CHECK(absl::StrContains(again.status().message(), "re-create"));
    auto stats = GetVerbsEndpointStats(*link.src);
    REQUIRE(stats.has_value());
    CHECK(stats->cancelled);
    CHECK(stats->outstanding_wrs == 0);
    link.src->Cancel(absl::InternalError("a second reason"));  // later calls change nothing
    CheckCancelReason(link.src->Post(absl::MakeSpan(writes).subspan(0, 1)).status());
    const absl::Time d0 = absl::Now();
    link.src.reset();
    CHECK(absl::Now() - d0 < absl::Seconds(1));
  }
  CHECK(std::all_of(dst.bytes.begin(), dst.bytes.end(), [](uint8_t v) { return v == kUntouched; }));

  // A new endpoint pair over the same regions carries the whole batch.
  Link fresh = Connect(*a, *b);
  RequireOk(fresh.src->Write(writes, kTimeout));
  CHECK(std::memcmp(src.bytes.data(), dst.bytes.data(), kLen) == 0);
}

TEST_CASE("verbs: Cancel during a large in-flight batch to a live peer returns at once with the reason; nothing "
          "lands after it", "[verbs][cancel]") {
  auto a = MakeVerbs({});
  auto b = MakeVerbs({});
  // soft-RoCE under emulation moves ~35 MB/s: ~1 s of writes, cancelled 100 ms after they start, during the Post
  // or the Wait. rxe sends a linked list inside ibv_post_send, in the kernel, which the guest's one emulated CPU does
  // not leave for the cancelling thread: a list (32 WRs of 64 KiB here) is how late a Cancel can be noticed there.
  constexpr uint64_t kLen = 32 << 20;
  Mem src = Register(*a, kLen, 12);
  Mem dst = Register(*b, kLen, -1);
  auto remote = Import(*a, *dst.region);
  Link link = Connect(*a, *b);
  std::vector<WriteRequest> writes;
  constexpr uint64_t kPiece = 64 << 10;
  for (uint64_t off = 0; off < kLen; off += kPiece) writes.push_back({src.region.get(), off, remote.get(), off, kPiece});

  absl::Time cancelled_at;
  std::thread canceller = CancelLater(*link.src, absl::Milliseconds(100), &cancelled_at);
  auto id = link.src->Post(writes);
  absl::Status s = id.ok() ? link.src->Wait(*id, kTimeout) : id.status();
  const absl::Time returned = absl::Now();
  canceller.join();
  CheckCancelReason(s);
  WARN("the batch failed " << absl::FormatDuration(returned - cancelled_at) << " after the Cancel");
  CHECK(returned - cancelled_at < absl::Seconds(1));

  // The QPs are in the error state: the NIC stops sending, so the peer's memory stops changing.
  absl::SleepFor(absl::Milliseconds(200));
  const std::vector<uint8_t> snapshot = dst.bytes;
  absl::SleepFor(absl::Milliseconds(500));
  CHECK(dst.bytes == snapshot);
  uint64_t landed = 0;
  for (uint64_t i = 0; i < kLen; i += 4096) landed += (snapshot[i] == src.bytes[i]) ? 4096 : 0;
  WARN("cancelled when about " << landed << " of " << kLen << " bytes had landed");
  CHECK(landed < kLen);

  auto again = link.src->Post(writes);
  CheckCancelReason(again.status());
  auto stats = GetVerbsEndpointStats(*link.src);
  REQUIRE(stats.has_value());
  CHECK(stats->outstanding_wrs == 0);

  Link fresh = Connect(*a, *b);
  RequireOk(fresh.src->Write(writes, kTimeout));
  CHECK(std::memcmp(src.bytes.data(), dst.bytes.data(), kLen) == 0);
}
