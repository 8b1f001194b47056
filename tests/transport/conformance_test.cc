// Behaviour every transport must have. Linked once per backend with its factory (see conformance.h): tcp, tcp through
// the fault decorator, fabric (tcp;ofi_rxm, sockets, and the forced efa/cxi memory-registration modes), verbs in the
// soft-RoCE VM, mooncake (protocol tcp) writing into the real Mooncake Transfer Engine in a process of its own (a
// PeerReceiver: the cases write into its memory and read it back; those that need a wsync receiving transport say
// by name that they do not apply). What each instance reports (Transport::Query) is held against what it does: bytes
// checked against a pattern computed independently of the memory the transport read, windows and grants enforced
// exactly where the instance says so and refusals counted where it says so, device sinks where it says it can write
// them, Post returning while the peer's process is stopped, cancel, a dead peer named within the deadline,
// Endpoint::Reusable.

#include "tests/transport/conformance.h"

#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "tests/transport/pattern.h"
#include "tests/transport/peer_process.h"

namespace {

using wsync::transport::BatchId;
using wsync::transport::Endpoint;
using wsync::transport::LocalRegion;
using wsync::transport::RemoteRegion;
using wsync::transport::Transport;
using wsync::transport::WriteRequest;
using wsync::transport::testing::PeerReceiver;

constexpr uint8_t kUntouched = 0xEE;
const absl::Duration kTimeout = absl::Seconds(20);

using wsync::transport::testing::PatternByte;

void FillPattern(uint8_t* p, uint64_t n, uint64_t seed, uint64_t base = 0) {
  for (uint64_t i = 0; i < n; ++i) p[i] = PatternByte(seed, base + i);
}

// Index of the first byte of p[0..n) that differs from pattern(seed) at base.., or -1.
int64_t FirstPatternMismatch(const uint8_t* p, uint64_t n, uint64_t seed, uint64_t base) {
  for (uint64_t i = 0; i < n; ++i) {
    if (p[i] != PatternByte(seed, base + i)) return static_cast<int64_t>(i);
  }
  return -1;
}

int64_t FirstMismatch(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) return 0;
  if (std::memcmp(got.data(), want.data(), got.size()) == 0) return -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

// Memory plus its registration on one transport, and (for targets) the peer's imported view of it.
struct Buffer {
  std::vector<uint8_t> bytes;
  std::unique_ptr<LocalRegion> region;
};

Buffer Register(Transport& t, uint64_t len, uint8_t fill) {
  Buffer b;
  b.bytes.assign(len, fill);
  auto r = t.RegisterMemory(b.bytes.data(), len);
  REQUIRE(r.ok());
  b.region = std::move(*r);
  return b;
}

Buffer RegisterPattern(Transport& t, uint64_t len, uint64_t seed) {
  Buffer b = Register(t, len, 0);
  FillPattern(b.bytes.data(), len, seed);
  return b;
}

std::unique_ptr<RemoteRegion> Import(Transport& t, const LocalRegion& r) {
  auto rr = t.ImportRegion(r.Descriptor());
  REQUIRE(rr.ok());
  return std::move(*rr);
}

// A case, or the rest of one, that does not apply to this backend or instance: said by name with the reason (Catch2 2
// has no skip; a warning is printed with the case's name whether it passes or not), never passed in silence.
void SkipRest(const std::string& what, const std::string& why) { WARN("SKIPPED " << what << ": " << why); }

std::unique_ptr<Transport> MakeViable() {
  std::unique_ptr<Transport> t = MakeTransportUnderTest();
  REQUIRE(t != nullptr);
  INFO(t->reason());
  REQUIRE(t->viable());
  return t;
}

// Both sides create an endpoint, swap LocalInfo (as the control plane would) and connect concurrently.
struct Link {
  std::unique_ptr<Endpoint> src;  // on the sending transport
  std::unique_ptr<Endpoint> dst;  // on the receiving transport
};

Link Connect(Transport& sender, Transport& receiver) {
  Link l;
  auto a = sender.CreateEndpoint();
  auto b = receiver.CreateEndpoint();
  INFO(a.status().ToString() << " / " << b.status().ToString());
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  l.src = std::move(*a);
  l.dst = std::move(*b);
  const std::string src_info = l.src->LocalInfo();
  const std::string dst_info = l.dst->LocalInfo();
  absl::Status dst_status;
  std::thread t([&] { dst_status = l.dst->Connect(src_info, kTimeout); });
  absl::Status src_status = l.src->Connect(dst_info, kTimeout);
  t.join();
  INFO(src_status.ToString() << " / " << dst_status.ToString());
  REQUIRE(src_status.ok());
  REQUIRE(dst_status.ok());
  return l;
}

void RequireOk(const absl::Status& s) {
  INFO(s.ToString());
  REQUIRE(s.ok());
}

// Destination memory on the receiving side: registered with a transport instance of this process, or added to the
// backend's PeerReceiver. Bytes() is what the receiving memory holds now (a peer's is read back from it).
class Dest {
 public:
  Dest() = default;
  Dest(Buffer local, std::string descriptor) : local_(std::move(local)), descriptor_(std::move(descriptor)) {}
  Dest(PeerReceiver* peer, std::string descriptor, uint64_t size)
      : peer_(peer), descriptor_(std::move(descriptor)), size_(size) {}
  const std::string& descriptor() const { return descriptor_; }
  uint64_t size() const { return peer_ != nullptr ? size_ : local_.bytes.size(); }
  const std::vector<uint8_t>& Bytes() {
    if (peer_ == nullptr) return local_.bytes;
    const std::string got = peer_->Read(descriptor_);
    read_.assign(got.begin(), got.end());
    return read_;
  }
  void Fill(uint8_t fill) {
    if (peer_ != nullptr) {
      peer_->Fill(descriptor_, fill);
    } else {
      std::fill(local_.bytes.begin(), local_.bytes.end(), fill);
    }
  }
  // Deregisters a local region (the memory stays readable); nothing for a peer's.
  void Deregister() { local_.region.reset(); }

 private:
  PeerReceiver* peer_ = nullptr;
  Buffer local_;
  std::string descriptor_;
  uint64_t size_ = 0;
  std::vector<uint8_t> read_;
};

// The receiving side of a case: a transport instance (as if in a process of its own), or the backend's PeerReceiver
// (conformance.h), a process of its own.
class Receiver {
 public:
  Receiver() : peer_(MakePeerReceiverUnderTest()) {
    if (peer_ == nullptr) t_ = MakeViable();
  }
  PeerReceiver* peer() const { return peer_.get(); }
  Dest Register(uint64_t len, uint8_t fill) {
    if (peer_ != nullptr) return Dest(peer_.get(), peer_->AddRegion(len, fill), len);
    REQUIRE(t_ != nullptr);
    Buffer b = ::Register(*t_, len, fill);
    std::string desc = b.region->Descriptor();
    return Dest(std::move(b), std::move(desc));
  }
  // Sender and receiver connect as the control plane has them (a peer receiver takes no Connect of its own).
  Link Connect(Transport& sender) {
    if (peer_ == nullptr) return ::Connect(sender, *t_);
    Link l;
    auto a = sender.CreateEndpoint();
    RequireOk(a.status());
    l.src = std::move(*a);
    RequireOk(l.src->Connect(peer_->ConnectInfo(), kTimeout));
    return l;
  }
  // The whole receiving side goes away: its endpoint, its regions and its transport, or the peer's process.
  void Destroy(Link& link, Dest& dst) {
    if (peer_ != nullptr) {
      peer_->Kill();
      return;
    }
    link.dst.reset();
    dst.Deregister();  // deregisters first: the memory stays valid until no write targets it
    t_.reset();
  }

 private:
  std::unique_ptr<PeerReceiver> peer_;
  std::unique_ptr<Transport> t_;
};

std::unique_ptr<RemoteRegion> Import(Transport& t, const Dest& d) {
  auto rr = t.ImportRegion(d.descriptor());
  RequireOk(rr.status());
  return std::move(*rr);
}

// Applies a write to an expected image using the pattern, not the source memory.
void Expect(std::vector<uint8_t>& image, uint64_t dst_offset, uint64_t src_seed, uint64_t src_offset, uint64_t len) {
  FillPattern(image.data() + dst_offset, len, src_seed, src_offset);
}

}  // namespace

// The default of conformance.h: no peer receiver, the receiving side is a transport instance.
__attribute__((weak)) std::unique_ptr<PeerReceiver> MakePeerReceiverUnderTest() { return nullptr; }

TEST_CASE("a single write lands byte for byte and touches nothing else", "[transport]") {
  auto sender = MakeViable();
  Receiver receiver;
  Buffer src = RegisterPattern(*sender, 1 << 20, 1);
  Dest dst = receiver.Register(1 << 20, kUntouched);
  auto remote = Import(*sender, dst);
  REQUIRE(remote->length() == dst.size());
  Link link = receiver.Connect(*sender);

  WriteRequest w{src.region.get(), 4096, remote.get(), 777, 100000};
  RequireOk(link.src->Write({&w, 1}, kTimeout));

  std::vector<uint8_t> want(dst.size(), kUntouched);
  Expect(want, 777, 1, 4096, 100000);
  CHECK(FirstMismatch(dst.Bytes(), want) == -1);
}

TEST_CASE("batched writes to several regions, several batches outstanding", "[transport]") {
  auto sender = MakeViable();
  Receiver receiver;
  constexpr uint64_t kSrcLen = 4 << 20;
  constexpr uint64_t kDstLen = 1 << 20;
  constexpr uint64_t kSlot = 16 << 10;
  Buffer src = RegisterPattern(*sender, kSrcLen, 2);
  std::vector<Dest> dst;
  std::vector<std::unique_ptr<RemoteRegion>> remote;
  std::vector<std::vector<uint8_t>> want;
  for (int i = 0; i < 3; ++i) {
    dst.push_back(receiver.Register(kDstLen, kUntouched));
    remote.push_back(Import(*sender, dst.back()));
    want.emplace_back(kDstLen, kUntouched);
  }
  Link link = receiver.Connect(*sender);

  std::mt19937_64 rng(42);
  std::vector<std::vector<WriteRequest>> batches(3);
  for (int r = 0; r < 3; ++r) {
    for (uint64_t slot = 0; slot < kDstLen / kSlot; ++slot) {
      const uint64_t len = 1 + rng() % kSlot;
      const uint64_t dst_off = slot * kSlot + rng() % (kSlot - len + 1);
      const uint64_t src_off = rng() % (kSrcLen - len + 1);
      batches[slot % 3].push_back(WriteRequest{src.region.get(), src_off, remote[r].get(), dst_off, len});
      Expect(want[r], dst_off, 2, src_off, len);
    }
  }
  std::vector<BatchId> ids;
  for (const auto& b : batches) {
    auto id = link.src->Post(b);
    RequireOk(id.status());
    ids.push_back(*id);
  }
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) RequireOk(link.src->Wait(*it, kTimeout));
  for (int r = 0; r < 3; ++r) CHECK(FirstMismatch(dst[r].Bytes(), want[r]) == -1);

  // An empty batch completes too.
  RequireOk(link.src->Write({}, kTimeout));
}

TEST_CASE("a region larger than one chunk, whole and unaligned", "[transport]") {
  auto sender = MakeViable();
  Receiver receiver;
  constexpr uint64_t kLen = (64 << 20) + (8 << 20) + 12345;
  Buffer src = RegisterPattern(*sender, kLen, 3);
  Dest dst = receiver.Register(kLen, kUntouched);
  auto remote = Import(*sender, dst);
  Link link = receiver.Connect(*sender);

  WriteRequest whole{src.region.get(), 0, remote.get(), 0, kLen};
  RequireOk(link.src->Write({&whole, 1}, kTimeout));
  CHECK(FirstPatternMismatch(dst.Bytes().data(), kLen, 3, 0) == -1);

  // Shifted by an odd amount: source offset 3 lands at destination offset 0.
  dst.Fill(kUntouched);
  WriteRequest shifted{src.region.get(), 3, remote.get(), 0, kLen - 7};
  RequireOk(link.src->Write({&shifted, 1}, kTimeout));
  const std::vector<uint8_t>& got = dst.Bytes();
  CHECK(FirstPatternMismatch(got.data(), kLen - 7, 3, 3) == -1);
  for (uint64_t i = kLen - 7; i < kLen; ++i) CHECK(got[i] == kUntouched);
}

TEST_CASE("thousands of small parameters in one batch", "[transport]") {
  auto sender = MakeViable();
  Receiver receiver;
  std::mt19937_64 rng(7);
  constexpr int kParams = 5000;
  std::vector<uint64_t> sizes(kParams);
  for (auto& s : sizes) s = 4ull << (rng() % 11);  // 4 B .. 4 KiB
  // Source: packed in order. Destination: shuffled order, 64-byte gaps between parameters.
  std::vector<uint64_t> src_off(kParams), dst_off(kParams), order(kParams);
  uint64_t src_len = 0;
  for (int i = 0; i < kParams; ++i) {
    src_off[i] = src_len;
    src_len += sizes[i];
  }
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  uint64_t dst_len = 0;
  for (uint64_t i : order) {
    dst_off[i] = dst_len;
    dst_len += sizes[i] + 64;
  }
  Buffer src = RegisterPattern(*sender, src_len, 4);
  Dest dst = receiver.Register(dst_len, kUntouched);
  auto remote = Import(*sender, dst);
  Link link = receiver.Connect(*sender);

  std::vector<WriteRequest> writes;
  std::vector<uint8_t> want(dst_len, kUntouched);
  for (int i = 0; i < kParams; ++i) {
    writes.push_back(WriteRequest{src.region.get(), src_off[i], remote.get(), dst_off[i], sizes[i]});
    Expect(want, dst_off[i], 4, src_off[i], sizes[i]);
  }
  RequireOk(link.src->Write(writes, kTimeout));
  CHECK(FirstMismatch(dst.Bytes(), want) == -1);
}

TEST_CASE("concurrent writes from one source to several targets", "[transport]") {
  constexpr int kTargets = 4;
  constexpr uint64_t kLen = 16 << 20;
  auto sender = MakeViable();
  Buffer src = RegisterPattern(*sender, kLen, 5);
  std::vector<std::unique_ptr<Receiver>> receivers;
  std::vector<Dest> dst;
  std::vector<std::unique_ptr<RemoteRegion>> remote;
  std::vector<Link> links;
  for (int i = 0; i < kTargets; ++i) {
    receivers.push_back(std::make_unique<Receiver>());
    dst.push_back(receivers.back()->Register(kLen, kUntouched));
    remote.push_back(Import(*sender, dst.back()));
    links.push_back(receivers.back()->Connect(*sender));
  }
  std::vector<absl::Status> results(kTargets);
  std::vector<std::thread> threads;
  for (int i = 0; i < kTargets; ++i) {
    threads.emplace_back([&, i] {
      // Each target gets the source rotated by a different amount, in two writes per round.
      const uint64_t cut = (i + 1) * (kLen / 8) + i;
      for (int round = 0; round < 3 && results[i].ok(); ++round) {
        WriteRequest w[2] = {{src.region.get(), cut, remote[i].get(), 0, kLen - cut},
                             {src.region.get(), 0, remote[i].get(), kLen - cut, cut}};
        results[i] = links[i].src->Write(w, kTimeout);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kTargets; ++i) {
    INFO("target " << i << ": " << results[i].ToString());
    REQUIRE(results[i].ok());
    const uint64_t cut = (i + 1) * (kLen / 8) + i;
    const std::vector<uint8_t>& got = dst[i].Bytes();
    CHECK(FirstPatternMismatch(got.data(), kLen - cut, 5, cut) == -1);
    CHECK(FirstPatternMismatch(got.data() + kLen - cut, cut, 5, 0) == -1);
  }
}

TEST_CASE("out-of-bounds requests are rejected before anything is sent", "[transport][errors]") {
  auto sender = MakeViable();
  Receiver receiver;
  Buffer src = RegisterPattern(*sender, 64 << 10, 6);
  Dest dst = receiver.Register(32 << 10, kUntouched);
  auto remote = Import(*sender, dst);
  Link link = receiver.Connect(*sender);
  const LocalRegion* s = src.region.get();
  const RemoteRegion* d = remote.get();

  struct Case {
    const char* what;
    WriteRequest w;
    absl::StatusCode code;
  };
  const Case cases[] = {
      {"dst end past the region", {s, 0, d, 30 << 10, 4 << 10}, absl::StatusCode::kOutOfRange},
      {"dst offset past the region", {s, 0, d, (32 << 10) + 1, 0}, absl::StatusCode::kOutOfRange},
      {"dst offset + length overflows", {s, 0, d, UINT64_MAX - 8, 16}, absl::StatusCode::kOutOfRange},
      {"src end past the region", {s, 63 << 10, d, 0, 4 << 10}, absl::StatusCode::kOutOfRange},
      {"src offset + length overflows", {s, UINT64_MAX - 8, d, 0, 16}, absl::StatusCode::kOutOfRange},
      {"no source", {nullptr, 0, d, 0, 1}, absl::StatusCode::kInvalidArgument},
      {"no destination", {s, 0, nullptr, 0, 1}, absl::StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    CHECK(wsync::transport::ValidateWrite(c.w).code() == c.code);
    // A valid write ahead of the bad one in the same batch must not be sent either.
    WriteRequest batch[2] = {{s, 0, d, 0, 1024}, c.w};
    auto id = link.src->Post(batch);
    CHECK(id.status().code() == c.code);
  }
  // The endpoint still works, and nothing from the rejected batches arrived.
  WriteRequest ok{s, 0, d, 8192, 1024};
  RequireOk(link.src->Write({&ok, 1}, kTimeout));
  std::vector<uint8_t> want(dst.size(), kUntouched);
  Expect(want, 8192, 6, 0, 1024);
  CHECK(FirstMismatch(dst.Bytes(), want) == -1);
}

TEST_CASE("garbage and foreign descriptors are rejected", "[transport][errors]") {
  auto sender = MakeViable();
  Receiver receiver;
  Receiver other;
  Buffer src = RegisterPattern(*sender, 64 << 10, 7);
  Dest dst = receiver.Register(64 << 10, kUntouched);
  Dest foreign = other.Register(64 << 10, kUntouched);
  const std::string desc = dst.descriptor();

  CHECK_FALSE(sender->ImportRegion("").ok());
  CHECK_FALSE(sender->ImportRegion("garbage").ok());
  if (receiver.peer() == nullptr) {
    CHECK_FALSE(sender->ImportRegion(desc.substr(0, desc.size() - 1)).ok());
  } else {
    SkipRest("a descriptor cut short by one byte is rejected",
             "this backend's descriptors are text wsync builds from what the peer publishes (\"" + desc +
                 "\"): one cut short by a digit names a shorter region of the same peer, a valid descriptor; cut "
                 "in half it is rejected");
    CHECK_FALSE(sender->ImportRegion(desc.substr(0, desc.size() / 2)).ok());
  }
  CHECK_FALSE(sender->ImportRegion(std::string(desc.size(), '\0')).ok());

  // A valid descriptor of a third transport (or peer), written through an endpoint connected to `receiver`: either
  // Post or Wait fails (no hang), and neither region changes.
  auto remote = Import(*sender, foreign);
  Link link = receiver.Connect(*sender);
  WriteRequest w{src.region.get(), 0, remote.get(), 0, 4096};
  auto id = link.src->Post({&w, 1});
  if (id.ok()) CHECK_FALSE(link.src->Wait(*id, kTimeout).ok());
  const std::vector<uint8_t> got = dst.Bytes();
  CHECK(std::all_of(got.begin(), got.end(), [](uint8_t b) { return b == kUntouched; }));
  const std::vector<uint8_t>& got_foreign = foreign.Bytes();
  CHECK(std::all_of(got_foreign.begin(), got_foreign.end(), [](uint8_t b) { return b == kUntouched; }));
}

TEST_CASE("a destroyed peer fails the batch with a status naming it, no hang", "[transport][errors]") {
  auto sender = MakeViable();
  Receiver receiver;
  constexpr uint64_t kLen = 8 << 20;
  Buffer src = RegisterPattern(*sender, kLen, 8);
  Dest dst = receiver.Register(kLen, kUntouched);
  auto remote = Import(*sender, dst);
  Link link = receiver.Connect(*sender);
  WriteRequest w{src.region.get(), 0, remote.get(), 0, kLen};
  RequireOk(link.src->Write({&w, 1}, kTimeout));
  CHECK(FirstPatternMismatch(dst.Bytes().data(), kLen, 8, 0) == -1);
  const std::string peer = link.src->PeerName();

  // The whole peer goes away: endpoint, region, transport (or its process).
  receiver.Destroy(link, dst);

  const absl::Time start = absl::Now();
  absl::Status s;
  for (int i = 0; i < 3 && s.ok(); ++i) {  // the first post may still be buffered by the kernel
    auto id = link.src->Post({&w, 1});
    s = id.ok() ? link.src->Wait(*id, kTimeout) : id.status();
  }
  INFO(s.ToString());
  CHECK_FALSE(s.ok());
  CHECK(s.code() != absl::StatusCode::kDeadlineExceeded);
  CHECK(absl::StrContains(s.message(), peer));
  CHECK(absl::Now() - start < kTimeout);
}

TEST_CASE("a peer destroyed in the middle of a large batch: error or success, never a hang", "[transport][errors]") {
  auto sender = MakeViable();
  Receiver receiver;
  constexpr uint64_t kLen = 64 << 20;
  constexpr int kCopies = 3;
  Buffer src = RegisterPattern(*sender, kLen, 9);
  auto dst = std::make_unique<Dest>(receiver.Register(kCopies * kLen, kUntouched));
  auto remote = Import(*sender, *dst);
  Link link = receiver.Connect(*sender);
  std::vector<WriteRequest> writes;
  for (uint64_t i = 0; i < kCopies; ++i) {
    writes.push_back(WriteRequest{src.region.get(), 0, remote.get(), i * kLen, kLen});
  }

  auto id = link.src->Post(writes);
  RequireOk(id.status());
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    receiver.Destroy(link, *dst);
    dst.reset();
  });
  // Bounded by the transport's own stall detection (io_timeout 15 s, plus a stream open of up to 10 s when the
  // peer vanished while the batch was opening its parallel streams): on a loaded 2-core machine that can pass 20 s,
  // so "never a hang" is checked against a minute.
  const absl::Duration kPeerGone = absl::Seconds(60);
  const absl::Time start = absl::Now();
  absl::Status s = link.src->Wait(*id, kPeerGone);
  killer.join();
  INFO(s.ToString() << " after " << absl::FormatDuration(absl::Now() - start));
  CHECK(absl::Now() - start < kPeerGone);
  CHECK(s.code() != absl::StatusCode::kDeadlineExceeded);
  if (!s.ok()) CHECK(absl::StrContains(s.message(), link.src->PeerName()));
}

TEST_CASE("Wait times out and leaves the batch outstanding", "[transport][errors]") {
  auto sender = MakeViable();
  Receiver receiver;
  constexpr uint64_t kLen = 64 << 20;
  constexpr uint64_t kPiece = 1 << 20;
  Buffer src = RegisterPattern(*sender, kLen, 10);
  Dest dst = receiver.Register(kLen, kUntouched);
  auto remote = Import(*sender, dst);
  Link link = receiver.Connect(*sender);
  std::vector<WriteRequest> writes;  // reversed piece order: a different layout than the source, same bytes
  for (uint64_t off = kLen; off > 0; off -= kPiece) {
    writes.push_back(WriteRequest{src.region.get(), off - kPiece, remote.get(), off - kPiece, kPiece});
  }

  // Whether a batch is still in flight when Post returns is up to the transport and the scheduler: a Post that waits
  // for room in a small transmit queue (libfabric) returns with only its last few writes outstanding, and those may
  // land before the first Wait. So up to 8 batches are posted; a Wait(0) must find one of them unfinished (each batch
  // once finished before it was 3 in 8 on a loaded machine, so 8 in a row are ~0.04 %), and every batch, found
  // unfinished or not, must complete with every byte and be waited for once.
  int unfinished = 0;
  for (int attempt = 0; attempt < 8 && unfinished == 0; ++attempt) {
    if (attempt > 0) dst.Fill(kUntouched);
    auto id = link.src->Post(writes);
    RequireOk(id.status());
    absl::Status early = link.src->Wait(*id, absl::ZeroDuration());
    INFO("attempt " << attempt << ": " << early.ToString());
    if (early.code() == absl::StatusCode::kDeadlineExceeded) {
      ++unfinished;
      RequireOk(link.src->Wait(*id, kTimeout));  // left outstanding by the timed-out Wait
    } else {
      RequireOk(early);  // finished already: no other error is acceptable
    }
    CHECK(FirstPatternMismatch(dst.Bytes().data(), kLen, 10, 0) == -1);
    // A batch is waited for once.
    CHECK_FALSE(link.src->Wait(*id, absl::ZeroDuration()).ok());
  }
  CHECK(unfinished == 1);
}

// Endpoint::Post never blocks (transport.h): it accepts a batch far larger than the send queues hold and returns,
// and what it kept inside the endpoint is handed on by the owner's Wait calls. To a peer that is gone after it was
// reached, nothing frees room in a send queue: a Post that waits for room lasts until the batch fails (verbs: the
// QP's retries, ~0.5 s; fabric: the provider's peer timeout, 5 s). Fails when a backend's Post waits for room and
// the peer's loss is slow to show; tcp;ofi_rxm gets a reset from the gone peer within milliseconds, so there the
// stopped-peer case below is the one that tells a waiting Post apart.
TEST_CASE("post never blocks: a batch larger than the send queues, to a peer that is gone, returns at once",
          "[transport][post]") {
  auto sender = MakeViable();
  Receiver receiver;
  constexpr uint64_t kLen = 8 << 20;
  constexpr uint64_t kPiece = 4096;  // 2048 writes: more than any backend's send queues take at once
  Buffer src = RegisterPattern(*sender, kLen, 61);
  Dest dst = receiver.Register(kLen, kUntouched);
  auto remote = Import(*sender, dst);
  Link link = receiver.Connect(*sender);
  WriteRequest first{src.region.get(), 0, remote.get(), 0, kPiece};
  RequireOk(link.src->Write({&first, 1}, kTimeout));  // the peer was reached
  CHECK(FirstPatternMismatch(dst.Bytes().data(), kPiece, 61, 0) == -1);
  receiver.Destroy(link, dst);

  std::vector<WriteRequest> writes;
  for (uint64_t off = 0; off < kLen; off += kPiece)
    writes.push_back({src.region.get(), off, remote.get(), off, kPiece});
  absl::Status st;
  absl::Duration post_took, failed_after;
  for (int i = 0; i < 3 && st.ok(); ++i) {  // the first batch may still be taken by the kernel's socket buffers
    const absl::Time t0 = absl::Now();
    auto id = link.src->Post(writes);
    post_took = absl::Now() - t0;
    st = id.ok() ? link.src->Wait(*id, absl::Seconds(60)) : id.status();
    failed_after = absl::Now() - t0;
  }
  INFO(st.ToString() << "; Post took " << absl::FormatDuration(post_took) << ", the batch failed after "
                     << absl::FormatDuration(failed_after));
  CHECK_FALSE(st.ok());
  CHECK(st.code() != absl::StatusCode::kDeadlineExceeded);
  CHECK((post_took < absl::Milliseconds(100) || post_took * 4 < failed_after));
}

namespace {

using wsync::transport::testing::FromHex;
using wsync::transport::testing::ToHex;

constexpr uint64_t kHeldLen = 64 << 20;
constexpr uint64_t kHeldPiece = 32 << 10;  // 2048 writes a batch
constexpr uint64_t kHeldSeed = 63;
// How long a Post to the stopped peer may take to return: it does not wait on that peer at all, so this only has to
// end before fabric gives up on a peer that takes no bytes (its peer timeout, 5 s: a blocked Post would then return
// with its connection failed, which the case would see only later and under another name).
constexpr std::chrono::seconds kPostBound{3};
// How long the peer stays stopped with the batches outstanding: longer than the progress timeout the factories give a
// transport that judges its peer (tcp: send_progress_timeout 1 s, conformance.h), so that a transport which takes a
// peer answering its probes with a zero window for a gone one fails the batches before the peer resumes.
constexpr std::chrono::milliseconds kStoppedFor{2500};

// The stopped-peer case's receiver in a process of its own: this executable's [.held_peer] case, or the backend's
// PeerReceiver. Killed on destruction.
class HeldPeer {
 public:
  HeldPeer() : receiver_(MakePeerReceiverUnderTest()) {
    if (receiver_ != nullptr) {
      region_ = receiver_->AddRegion(kHeldLen, kUntouched);
      info_ = receiver_->ConnectInfo();
    } else {
      process_ = std::make_unique<wsync::transport::testing::PeerProcess>("conformance_peer", "[.held_peer]");
      info_ = FromHex(process_->Next("info"));
      region_ = FromHex(process_->Next("region"));
    }
  }
  const std::string& info() const { return info_; }
  const std::string& region() const { return region_; }
  // The sender endpoint's LocalInfo, for the peer's Connect (a PeerReceiver takes none).
  void Connect(const std::string& sender_info) {
    if (process_ != nullptr) process_->Send(ToHex(sender_info));
  }
  void Stop() { process_ != nullptr ? process_->Stop() : receiver_->Stop(); }
  void Resume() { process_ != nullptr ? process_->Resume() : receiver_->Resume(); }
  // Once every batch completed: where the peer's memory first differs from the pattern, "-1" where nowhere.
  std::string Mismatch() {
    if (process_ == nullptr) {
      const std::string got = receiver_->Read(region_);
      REQUIRE(got.size() == kHeldLen);
      return std::to_string(FirstPatternMismatch(reinterpret_cast<const uint8_t*>(got.data()), kHeldLen, kHeldSeed, 0));
    }
    process_->Send("check");
    return process_->Next("mismatch");
  }

 private:
  std::unique_ptr<PeerReceiver> receiver_;
  std::unique_ptr<wsync::transport::testing::PeerProcess> process_;
  std::string info_, region_;
};

}  // namespace

// The receiving peer of the stopped-peer case, in its own process: prints its endpoint and region, connects to the
// sender, and once told that the sender's batches completed, prints where its memory first differs from the pattern.
TEST_CASE("(peer process) the receiver the stopped-peer case stops", "[.held_peer]") {
  auto t = MakeViable();
  Buffer dst = Register(*t, kHeldLen, kUntouched);
  auto ep = t->CreateEndpoint();
  RequireOk(ep.status());
  printf("PEER info %s\nPEER region %s\n", ToHex((*ep)->LocalInfo()).c_str(), ToHex(dst.region->Descriptor()).c_str());
  fflush(stdout);
  std::string line;
  REQUIRE(std::getline(std::cin, line));
  RequireOk((*ep)->Connect(FromHex(line), kTimeout));
  REQUIRE(std::getline(std::cin, line));  // "check": every batch completed
  // The bytes were written by the transport's own threads (tcp: its connection threads), with nothing in this process
  // ordering their writes before this read: the transport is released first (joining them), then the memory is read.
  ep->reset();
  dst.region.reset();
  t.reset();
  printf("PEER mismatch %lld\n",
         static_cast<long long>(FirstPatternMismatch(dst.bytes.data(), kHeldLen, kHeldSeed, 0)));
  fflush(stdout);
  std::getline(std::cin, line);  // until the case is done with it
}

// Endpoint::Post never blocks (transport.h), told apart from a Post that waits for its bytes to go out without
// relying on timing: the receiving peer runs in its own process, stopped (SIGSTOP) once a first write landed, so that
// nothing sent to it completes, whatever the backend's send queues or the kernel's socket buffers take, until it is
// resumed. While it is stopped, three batches of 2048 writes, 64 MiB each (more than any backend's send queues, and
// together more than the socket buffers of tcp's 4 streams, 16 + 16 MiB each at most), are posted: each Post must
// return (within kPostBound), and Wait(batch, 0) right after it must find the batch unfinished. Resumed, every batch
// completes and every byte lands. Fails when a backend's Post waits for room in its queues or for the batch: it does
// not return while the peer is stopped (tcp, fabric and the fault decorator each failed so when made to). On verbs the
// NIC answers for a stopped process (soft-RoCE: the kernel), so there the stop holds nothing: the case still requires
// that Post returns and that one Wait(batch, 0), which hands on one send queue's worth, leaves 2048 writes unfinished.
// The peer stays stopped kStoppedFor (2.5 s) in all, longer than the progress timeout a tcp transport is given here
// (1 s): a live peer that only stopped reading is waited for (transport.h, send_progress_timeout), so each batch is
// still unfinished, not failed, just before the peer resumes. Fails when tcp takes such a peer for a gone one (with
// TCP_USER_TIMEOUT set to the progress timeout, Linux aborts the connection once zero-window probing lasted that long,
// answered or not: the batches failed with "the peer acknowledged no byte within the send progress timeout").
TEST_CASE("post never blocks: batches to a live peer whose process is stopped are accepted, unfinished, and land",
          "[transport][post]") {
  // Declared before the peer: on a failure the peer is killed first, so no endpoint is torn down towards a stopped one.
  std::unique_ptr<Transport> sender;
  Buffer src;
  absl::StatusOr<std::unique_ptr<RemoteRegion>> remote;
  std::unique_ptr<Endpoint> ep;
  HeldPeer peer;
  const std::string info = peer.info();
  const std::string region = peer.region();
  REQUIRE_FALSE(info.empty());
  REQUIRE_FALSE(region.empty());
  sender = MakeViable();
  src = RegisterPattern(*sender, kHeldLen, kHeldSeed);
  remote = sender->ImportRegion(region);
  RequireOk(remote.status());
  auto made = sender->CreateEndpoint();
  RequireOk(made.status());
  ep = std::move(*made);
  peer.Connect(ep->LocalInfo());
  RequireOk(ep->Connect(info, kTimeout));
  WriteRequest first{src.region.get(), 0, remote->get(), 0, kHeldPiece};
  RequireOk(ep->Write({&first, 1}, kTimeout));  // the peer was reached: whatever connects lazily is connected
  std::vector<WriteRequest> writes;
  for (uint64_t off = 0; off < kHeldLen; off += kHeldPiece)
    writes.push_back({src.region.get(), off, remote->get(), off, kHeldPiece});

  peer.Stop();
  const auto stopped_at = std::chrono::steady_clock::now();
  std::vector<BatchId> ids;
  for (int i = 0; i < 3; ++i) {
    // Posted from a thread of its own, so that a Post that blocks is reported rather than hung on.
    std::mutex mu;
    std::condition_variable cv;
    bool returned = false;
    absl::StatusOr<BatchId> id;
    std::thread poster([&] {
      absl::StatusOr<BatchId> r = ep->Post(writes);
      std::lock_guard<std::mutex> lock(mu);
      id = std::move(r);
      returned = true;
      cv.notify_all();
    });
    bool in_time;
    {
      std::unique_lock<std::mutex> lock(mu);
      in_time = cv.wait_for(lock, kPostBound, [&] { return returned; });
    }
    if (!in_time) peer.Resume();  // lets the blocked Post finish, so that its thread can be joined
    poster.join();
    INFO("batch " << i << ": Post did not return while the peer was stopped");
    REQUIRE(in_time);
    RequireOk(id.status());
    const absl::Status early = ep->Wait(*id, absl::ZeroDuration());
    INFO("batch " << i << ": " << early.ToString());
    REQUIRE(early.code() == absl::StatusCode::kDeadlineExceeded);
    ids.push_back(*id);
  }
  // The stop itself is what is tested: its length, not an event, is the condition.
  // Still outstanding (DeadlineExceeded, and found again by the Wait after the resume: a batch that failed with that
  // code is gone by then, NotFound).
  // Where the NIC acknowledges writes for the process (verbs, and fabric over verbs: soft-RoCE's kernel, an RDMA
  // NIC's hardware), the stop holds nothing and the batches may well be complete by now: only tcp-like backends, where
  // the receiving process itself reads the bytes, are checked for still holding them.
  const bool nic_acknowledges = absl::StrContains(sender->Query().provider, "verbs");
  std::this_thread::sleep_until(stopped_at + kStoppedFor);
  std::vector<std::string> held(ids.size());
  std::vector<bool> done(ids.size(), false);  // completed (and so waited for) while the peer was stopped
  for (size_t i = 0; i < ids.size(); ++i) {
    const absl::Status st = ep->Wait(ids[i], absl::ZeroDuration());
    held[i] = st.ToString();
    INFO("batch " << i << " after the peer was stopped " << kStoppedFor.count() << " ms: " << held[i]);
    done[i] = nic_acknowledges && st.ok();
    if (done[i]) continue;
    REQUIRE(st.code() == absl::StatusCode::kDeadlineExceeded);
  }
  peer.Resume();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (done[i]) continue;
    INFO("batch " << i << "; after the peer was stopped " << kStoppedFor.count() << " ms it was: " << held[i]);
    RequireOk(ep->Wait(ids[i], kTimeout));
  }
  CHECK(peer.Mismatch() == "-1");
}

// A peer that is gone without a word (its namespace's link down: nothing it sends or acknowledges arrives any more) is
// reported within a bounded time, whether the batch was being sent or the peer had stopped reading first (a zero
// window, then silence): the batch fails, not with DeadlineExceeded, naming the peer, within kGoneBound of the link
// going down. Runs only in a network namespace of its own (private_netns.sh sets WSYNC_TEST_PRIVATE_NETNS), where it
// takes the loopback link down with `ip link set lo down`; the peer is the stopped-peer case's, in a process of its
// own. Fails when tcp waits for such a peer as for a live one (no TCP_USER_TIMEOUT and no judgement of its own: the
// batch fails only at the i/o timeout, 15 s, or the kernel's retries, minutes).
namespace {

constexpr absl::Duration kGoneBound = absl::Seconds(6);

void SetLoopback(bool up) {
  const std::string cmd = absl::StrCat("ip link set lo ", up ? "up" : "down");
  INFO(cmd);
  REQUIRE(std::system(cmd.c_str()) == 0);
}

}  // namespace

TEST_CASE("a peer whose link went down fails the batch in bounded time, sending or after a zero window",
          "[.dead_link]") {
  INFO("run through tests/transport/private_netns.sh: this case takes the namespace's loopback link down");
  REQUIRE(std::getenv("WSYNC_TEST_PRIVATE_NETNS") != nullptr);
  std::unique_ptr<Transport> sender;
  Buffer src;
  absl::StatusOr<std::unique_ptr<RemoteRegion>> remote;
  wsync::transport::testing::PeerProcess peer("conformance_peer", "[.held_peer]");
  const std::string info = FromHex(peer.Next("info"));
  const std::string region = FromHex(peer.Next("region"));
  REQUIRE_FALSE(info.empty());
  sender = MakeViable();
  src = RegisterPattern(*sender, kHeldLen, kHeldSeed);
  remote = sender->ImportRegion(region);
  RequireOk(remote.status());
  std::vector<WriteRequest> writes;
  for (uint64_t off = 0; off < kHeldLen; off += kHeldPiece)
    writes.push_back({src.region.get(), off, remote->get(), off, kHeldPiece});
  auto connected = [&] {
    auto made = sender->CreateEndpoint();
    RequireOk(made.status());
    RequireOk((*made)->Connect(info, kTimeout));
    WriteRequest first{src.region.get(), 0, remote->get(), 0, kHeldPiece};
    RequireOk((*made)->Write({&first, 1}, kTimeout));  // the peer was reached
    return *std::move(made);
  };
  // The link goes down, then `post` (if given) posts the batch; the batch must fail within kGoneBound.
  auto fails_in_time = [&](Endpoint& ep, absl::StatusOr<BatchId> id, const char* what) {
    const absl::Time down = absl::Now();
    SetLoopback(false);
    if (!id.ok()) id = ep.Post(writes);
    RequireOk(id.status());
    const absl::Status st = ep.Wait(*id, absl::Seconds(60));
    const absl::Duration took = absl::Now() - down;
    SetLoopback(true);
    INFO(what << ": " << st.ToString() << " after " << absl::FormatDuration(took));
    CHECK_FALSE(st.ok());
    CHECK(st.code() != absl::StatusCode::kDeadlineExceeded);
    CHECK(absl::StrContains(st.message(), ep.PeerName()));
    CHECK(took < kGoneBound);
  };
  peer.Send(ToHex(sender->CreateEndpoint().value()->LocalInfo()));  // the peer's Connect: not used to send here
  {
    // The link goes down between two batches to a peer that reads (taken down during one, it could lose the race
    // with the batch's last bytes on loopback): the next batch is posted into silence.
    std::unique_ptr<Endpoint> ep = connected();
    fails_in_time(*ep, absl::UnavailableError("not posted yet"), "sending");
  }
  {
    // The peer stopped reading (a zero window it answers probes for), then its link went down.
    std::unique_ptr<Endpoint> ep = connected();
    peer.Stop();
    auto id = ep->Post(writes);
    RequireOk(id.status());
    REQUIRE(ep->Wait(*id, absl::ZeroDuration()).code() == absl::StatusCode::kDeadlineExceeded);
    fails_in_time(*ep, *id, "stopped, then gone");
    peer.Kill();
  }
}

// Completion delivery (transport.h): a batch far larger than the send queues completes through Wait(batch, 0) calls
// alone, each made when CompletionFd polls readable where the instance has one (else at once); every byte lands. The
// fd is readable after a Cancel from another thread. Fails when a backend's completion path does not signal its fd
// (the poll times out), or when Wait does not hand on what Post kept back (the batch never completes).
TEST_CASE("completion delivery: Wait(batch, 0) on CompletionFd drives a large batch; Cancel signals the fd",
          "[transport][post]") {
  auto sender = MakeViable();
  Receiver receiver;
  constexpr uint64_t kLen = 16 << 20;
  constexpr uint64_t kPiece = 4096;
  Buffer src = RegisterPattern(*sender, kLen, 62);
  Dest dst = receiver.Register(kLen, kUntouched);
  auto remote = Import(*sender, dst);
  Link link = receiver.Connect(*sender);
  std::vector<WriteRequest> writes;  // reversed order: the destination layout differs from the source's
  for (uint64_t off = kLen; off > 0; off -= kPiece)
    writes.push_back({src.region.get(), kLen - off, remote.get(), off - kPiece, kPiece});
  auto id = link.src->Post(writes);
  RequireOk(id.status());
  const int fd = link.src->CompletionFd();
  const absl::Time deadline = absl::Now() + kTimeout;
  absl::Status st;
  int polls = 0;
  for (;;) {
    if (fd >= 0) {
      pollfd p{fd, POLLIN, 0};
      const int ms =
          static_cast<int>(absl::ToInt64Milliseconds(std::max(deadline - absl::Now(), absl::ZeroDuration())));
      INFO("poll " << polls);
      REQUIRE(poll(&p, 1, ms) == 1);  // timed out: the completion never reached the fd
      ++polls;
    } else {
      sched_yield();
    }
    st = link.src->Wait(*id, absl::ZeroDuration());
    if (st.code() != absl::StatusCode::kDeadlineExceeded) break;
    INFO("the batch is still outstanding");
    REQUIRE(absl::Now() < deadline);
  }
  RequireOk(st);
  const std::vector<uint8_t>& got = dst.Bytes();
  for (uint64_t off = kLen; off > 0; off -= kPiece) {
    const int64_t bad = FirstPatternMismatch(got.data() + off - kPiece, kPiece, 62, kLen - off);
    INFO("piece at destination offset " << off - kPiece);
    REQUIRE(bad == -1);
  }
  if (fd < 0) {
    SkipRest("Cancel signals CompletionFd", "this instance has no CompletionFd (-1): its owner polls in Wait");
    return;
  }
  // Consumed by the Wait that answered: a Cancel from another thread makes it readable again.
  WriteRequest one{src.region.get(), 0, remote.get(), 0, kPiece};
  RequireOk(link.src->Write({&one, 1}, kTimeout));
  CHECK(link.src->Wait(*id, absl::ZeroDuration()).code() == absl::StatusCode::kNotFound);  // consumes the fd
  pollfd p{fd, POLLIN, 0};
  REQUIRE(poll(&p, 1, 0) == 0);  // nothing happened since
  std::thread canceller([&] { link.src->Cancel(absl::CancelledError("conformance: cancelled")); });
  CHECK(poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(kTimeout))) == 1);
  canceller.join();
}

// Endpoint::Reusable, one meaning on every backend: it is what a target daemon answers a repeat ConnectTarget of the
// same source with (the same endpoint and grant, or a new one). A granted receiving endpoint is reusable for the
// sender endpoint it was connected with while that one writes; a second sender endpoint it declares reusable for
// writes through it bit-exactly with only its LocalInfo (the receiving endpoint is not connected again), and the
// first keeps writing; no endpoint is reusable once its grant is revoked or it was cancelled. A backend without
// write grants has no granted endpoints: the case does not apply to it. Fails when a backend's Reusable ignores its
// grant's revocation or a Cancel, answers false while it serves, or true for a sender it does not serve.
TEST_CASE(
    "a granted endpoint is reusable as it declares: repeat senders write through it; never after revoke or cancel",
    "[transport][grants]") {
  using wsync::transport::Transport;
  if (MakePeerReceiverUnderTest() != nullptr) {
    SkipRest("repeat senders through a granted endpoint (Reusable)",
             "the receiving side is the backend's peer, not a wsync transport: no target daemon answers a repeat "
             "ConnectTarget and there is no granted endpoint to reuse");
    return;
  }
  auto sender = MakeViable();
  auto receiver = MakeViable();
  if (const absl::Status st = receiver->RequireGrants(true); !st.ok()) {
    SkipRest("repeat senders through a granted endpoint (Reusable)",
             "no write grants on this instance (" + receiver->Query().provider + "): " + st.ToString());
    return;
  }
  constexpr uint64_t kLen = 1 << 16;
  Buffer src = RegisterPattern(*sender, kLen, 21);
  Buffer dst = Register(*receiver, kLen, kUntouched);
  auto remote = Import(*sender, *dst.region);
  auto grant_for = [&](const std::string& peer) {
    Transport::WriteGrant g;
    g.peer = peer;
    g.scope = "engine0/0";
    g.regions = {dst.region.get()};
    auto ep = receiver->CreateGrantedEndpoint(g);
    INFO(ep.status().ToString());
    REQUIRE(ep.ok());
    return *std::move(ep);
  };
  auto sender_endpoint = [&] {
    auto ep = sender->CreateEndpoint();
    REQUIRE(ep.ok());
    return *std::move(ep);
  };
  // Both sides connect, as ConnectTarget and the source do.
  auto pair = [&](Endpoint& granted, Endpoint& from) {
    absl::Status granted_status;
    std::thread t([&] { granted_status = granted.Connect(from.LocalInfo(), kTimeout); });
    absl::Status from_status = from.Connect(granted.LocalInfo(), kTimeout);
    t.join();
    RequireOk(granted_status);
    RequireOk(from_status);
  };
  auto write = [&](Endpoint& from, uint64_t off, uint64_t len) {
    return from.Write({WriteRequest{src.region.get(), off, remote.get(), off, len}}, kTimeout);
  };

  std::unique_ptr<Endpoint> granted = grant_for("source:one");
  std::unique_ptr<Endpoint> first = sender_endpoint();
  CHECK_FALSE(granted->Reusable(first->LocalInfo()));  // not connected yet
  pair(*granted, *first);
  RequireOk(write(*first, 0, kLen / 2));
  CHECK(granted->Reusable(first->LocalInfo()));  // the sender it serves, writing

  // A second sender endpoint of the same source: if the endpoint declares it served, it writes through the same
  // endpoint and grant with nothing but their LocalInfo; the first goes on writing beside it.
  std::unique_ptr<Endpoint> second = sender_endpoint();
  if (granted->Reusable(second->LocalInfo())) {
    RequireOk(second->Connect(granted->LocalInfo(), kTimeout));
    RequireOk(write(*second, kLen / 2, kLen / 2));
    RequireOk(write(*first, 0, 64));
    CHECK(FirstPatternMismatch(dst.bytes.data(), kLen, 21, 0) == -1);
    CHECK(granted->Reusable(first->LocalInfo()));
  }

  // Revoked: never reusable again, for any sender.
  receiver->RevokeGrants([](const Transport::WriteGrant& g) { return g.peer != "source:one"; });
  CHECK_FALSE(granted->Reusable(first->LocalInfo()));
  CHECK_FALSE(granted->Reusable(second->LocalInfo()));

  // Cancelled: likewise, though its grant lives and its sender is connected.
  std::unique_ptr<Endpoint> granted2 = grant_for("source:two");
  std::unique_ptr<Endpoint> third = sender_endpoint();
  pair(*granted2, *third);
  RequireOk(write(*third, 0, 64));
  REQUIRE(granted2->Reusable(third->LocalInfo()));
  granted2->Cancel(absl::CancelledError("test: the update was aborted"));
  CHECK_FALSE(granted2->Reusable(third->LocalInfo()));
  // A plain endpoint carries no grant: never reusable.
  auto plain = receiver->CreateEndpoint();
  REQUIRE(plain.ok());
  CHECK_FALSE((*plain)->Reusable(first->LocalInfo()));
}

// What the instance reports (Transport::Query) held against behaviour. A refused write is one whose Post or Wait
// fails (not with DeadlineExceeded: a refusal is an answer, not a hang) and of which no byte lands; the endpoint it
// was written through is not used again (the contract: re-create it). An instance says exactly whether it enforces
// windows and grants: one that says so and cannot, or says not and can, fails. Each case fails when the backend's
// check is removed: a window, grant or revocation that is not enforced lands the write's bytes (checked against the
// pattern, untouched bytes against their fill), a refusal not counted where the instance reports refusals_counted
// leaves refused_writes() where it was, and an instance whose Query no longer tells a provider that picks memory keys
// (fabric's FI_MR_PROV_KEY) from one that does not reports windows it then refuses to close.
namespace {

using wsync::transport::Capabilities;

// Writes `len` bytes of `src` (pattern `seed`) at offset 0 of `dst` through a fresh endpoint of `sender` connected
// with the receiving endpoint `granted` (null: a plain endpoint of `receiver`). Returns the write's status.
absl::Status WriteOnce(Transport& sender, Transport& receiver, Endpoint* granted, const LocalRegion& src,
                       const RemoteRegion& dst, uint64_t len) {
  auto from = sender.CreateEndpoint();
  REQUIRE(from.ok());
  std::unique_ptr<Endpoint> plain;
  Endpoint* to = granted;
  if (to == nullptr) {
    auto p = receiver.CreateEndpoint();
    REQUIRE(p.ok());
    plain = *std::move(p);
    to = plain.get();
  }
  absl::Status to_status;
  std::thread t([&] { to_status = to->Connect((*from)->LocalInfo(), kTimeout); });
  absl::Status from_status = (*from)->Connect(to->LocalInfo(), kTimeout);
  t.join();
  RequireOk(to_status);
  if (!from_status.ok()) return from_status;  // refused at connection time (a backend may refuse that early)
  WriteRequest w{&src, 0, &dst, 0, len};
  return (*from)->Write({&w, 1}, kTimeout);
}

// A refusal: failed with an answer, nothing landed, counted where the backend promises it.
void CheckRefused(const absl::Status& st, const Capabilities& caps, const Transport& receiver, uint64_t refused_before,
                  const Buffer& dst, uint8_t fill) {
  INFO("write status: " << st.ToString());
  CHECK_FALSE(st.ok());
  CHECK(st.code() != absl::StatusCode::kDeadlineExceeded);
  CHECK(std::all_of(dst.bytes.begin(), dst.bytes.end(), [&](uint8_t b) { return b == fill; }));
  if (caps.refusals_counted) CHECK(receiver.refused_writes() > refused_before);
}

}  // namespace

TEST_CASE("write window: closed refuses and counts, re-opened lands; closing after a write refuses the next",
          "[transport][window]") {
  auto sender = MakeViable();
  auto receiver = MakeViable();
  const Capabilities caps = receiver->Query();
  INFO("instance: " << caps.provider);
  constexpr uint64_t kLen = 256 << 10;
  const absl::Status closed = receiver->SetWriteWindow(false);
  INFO(closed.ToString());
  CHECK(closed.ok() == caps.write_windows);  // reported as it is, either way
  if (!closed.ok()) {
    CHECK(closed.code() == absl::StatusCode::kUnimplemented);
    SkipRest("writes refused while the window is closed",
             MakePeerReceiverUnderTest() != nullptr
                 ? "the receiving side is the backend's peer, which has no write window; this instance reports "
                   "none and refuses SetWriteWindow: " +
                       closed.ToString()
                 : "this instance reports no window enforcement and refuses SetWriteWindow: " + closed.ToString());
    return;
  }
  Buffer src = RegisterPattern(*sender, kLen, 31);
  Buffer dst = Register(*receiver, kLen, kUntouched);
  auto remote = Import(*sender, *dst.region);
  // Closed: refused, nothing lands, counted.
  uint64_t before = receiver->refused_writes();
  CheckRefused(WriteOnce(*sender, *receiver, nullptr, *src.region, *remote, kLen), caps, *receiver, before, dst,
               kUntouched);

  // Re-opened: a new connection's write lands bit for bit.
  RequireOk(receiver->SetWriteWindow(true));
  RequireOk(WriteOnce(*sender, *receiver, nullptr, *src.region, *remote, kLen));
  CHECK(FirstPatternMismatch(dst.bytes.data(), kLen, 31, 0) == -1);

  // Closed after writes landed on a live connection: its next write is refused, the memory keeps what landed.
  Link link = Connect(*sender, *receiver);
  Buffer src2 = RegisterPattern(*sender, kLen, 32);
  WriteRequest first{src2.region.get(), 0, remote.get(), 0, kLen / 2};
  RequireOk(link.src->Write({&first, 1}, kTimeout));
  CHECK(FirstPatternMismatch(dst.bytes.data(), kLen / 2, 32, 0) == -1);
  RequireOk(receiver->SetWriteWindow(false));
  before = receiver->refused_writes();
  WriteRequest second{src2.region.get(), kLen / 2, remote.get(), kLen / 2, kLen / 2};
  const absl::Status late = link.src->Write({&second, 1}, kTimeout);
  INFO(late.ToString());
  CHECK_FALSE(late.ok());
  CHECK(late.code() != absl::StatusCode::kDeadlineExceeded);
  CHECK(FirstPatternMismatch(dst.bytes.data(), kLen / 2, 32, 0) == -1);
  CHECK(FirstPatternMismatch(dst.bytes.data() + kLen / 2, kLen / 2, 31, kLen / 2) == -1);  // not the new bytes
  if (caps.refusals_counted) CHECK(receiver->refused_writes() > before);
}

TEST_CASE("write grants: outside the grant, without one and after revocation refused and counted; inside lands",
          "[transport][grants]") {
  auto sender = MakeViable();
  auto receiver = MakeViable();
  const Capabilities caps = receiver->Query();
  INFO("instance: " << caps.provider);
  constexpr uint64_t kLen = 128 << 10;
  const absl::Status required = receiver->RequireGrants(true);
  INFO(required.ToString());
  CHECK(required.ok() == caps.write_grants);  // reported as it is, either way
  if (!required.ok()) {
    CHECK(required.code() == absl::StatusCode::kUnimplemented);
    SkipRest("writes refused outside the grant",
             MakePeerReceiverUnderTest() != nullptr
                 ? "the receiving side is the backend's peer, which grants nothing per connection; this instance "
                   "reports no grants and refuses RequireGrants: " +
                       required.ToString()
                 : "this instance reports no grant enforcement and refuses RequireGrants: " + required.ToString());
    return;
  }
  Buffer src = RegisterPattern(*sender, kLen, 41);
  Buffer granted_mem = Register(*receiver, kLen, kUntouched);
  Buffer other_mem = Register(*receiver, kLen, kUntouched);
  auto granted_remote = Import(*sender, *granted_mem.region);
  auto other_remote = Import(*sender, *other_mem.region);
  auto grant = [&](const std::string& peer) {
    Transport::WriteGrant g;
    g.peer = peer;
    g.scope = "engine0/0";
    g.regions = {granted_mem.region.get()};
    auto ep = receiver->CreateGrantedEndpoint(g);
    INFO(ep.status().ToString());
    REQUIRE(ep.ok());
    return *std::move(ep);
  };

  SECTION("a region the grant does not name") {
    auto g = grant("source:a");
    const uint64_t before = receiver->refused_writes();
    CheckRefused(WriteOnce(*sender, *receiver, g.get(), *src.region, *other_remote, kLen), caps, *receiver, before,
                 other_mem, kUntouched);
    // The granted region through a fresh grant: lands.
    auto g2 = grant("source:a2");
    RequireOk(WriteOnce(*sender, *receiver, g2.get(), *src.region, *granted_remote, kLen));
    CHECK(FirstPatternMismatch(granted_mem.bytes.data(), kLen, 41, 0) == -1);
  }
  SECTION("no grant while grants are required") {
    const uint64_t before = receiver->refused_writes();
    CheckRefused(WriteOnce(*sender, *receiver, nullptr, *src.region, *granted_remote, kLen), caps, *receiver, before,
                 granted_mem, kUntouched);
  }
  SECTION("a revoked grant, on a connection that wrote through it") {
    auto g = grant("source:b");
    auto from = sender->CreateEndpoint();
    REQUIRE(from.ok());
    absl::Status g_status;
    std::thread t([&] { g_status = g->Connect((*from)->LocalInfo(), kTimeout); });
    RequireOk((*from)->Connect(g->LocalInfo(), kTimeout));
    t.join();
    RequireOk(g_status);
    WriteRequest w{src.region.get(), 0, granted_remote.get(), 0, kLen / 2};
    RequireOk((*from)->Write({&w, 1}, kTimeout));
    CHECK(FirstPatternMismatch(granted_mem.bytes.data(), kLen / 2, 41, 0) == -1);
    receiver->RevokeGrants([](const Transport::WriteGrant& gr) { return gr.peer != "source:b"; });
    const uint64_t before = receiver->refused_writes();
    WriteRequest late{src.region.get(), kLen / 2, granted_remote.get(), kLen / 2, kLen / 2};
    const absl::Status st = (*from)->Write({&late, 1}, kTimeout);
    INFO(st.ToString());
    CHECK_FALSE(st.ok());
    CHECK(st.code() != absl::StatusCode::kDeadlineExceeded);
    CHECK(std::all_of(granted_mem.bytes.begin() + kLen / 2, granted_mem.bytes.end(),
                      [](uint8_t b) { return b == kUntouched; }));
    if (caps.refusals_counted) CHECK(receiver->refused_writes() > before);
  }
}

// Endpoint::Cancel (transport.h): every batch in flight and every later Post/Wait fails with the caller's reason,
// at once, without waiting for the network; what had landed by then is the batches' bytes or untouched, nothing else.
// Fails when a backend's Cancel does not reach its queued writes (a Wait that completes them all after the cancel, or
// runs into its deadline).
// How long a peer receiver's memory is watched after a Cancel returned, the endpoint still alive: longer than the
// mooncake endpoint takes to send the 256 MiB queued here when its Cancel drops nothing (it then failed so).
constexpr std::chrono::milliseconds kAfterCancel{500};

TEST_CASE("cancel: queued batches fail with the caller's reason at once; later calls fail; no torn bytes",
          "[transport][cancel]") {
  auto sender = MakeViable();
  Receiver receiver;
  constexpr uint64_t kLen = 32 << 20;
  constexpr int kBatches = 8;
  Buffer src = RegisterPattern(*sender, kLen, 51);
  Dest dst = receiver.Register(kBatches * kLen, kUntouched);
  auto remote = Import(*sender, dst);
  Link link = receiver.Connect(*sender);
  std::vector<BatchId> ids;
  for (int i = 0; i < kBatches; ++i) {
    WriteRequest w{src.region.get(), 0, remote.get(), static_cast<uint64_t>(i) * kLen, kLen};
    auto id = link.src->Post({&w, 1});
    RequireOk(id.status());
    ids.push_back(*id);
  }
  const absl::Time t0 = absl::Now();
  link.src->Cancel(absl::CancelledError("conformance: the update was aborted"));
  int cancelled = 0;
  for (BatchId id : ids) {
    const absl::Status st = link.src->Wait(id, kTimeout);
    INFO(st.ToString());
    CHECK(st.code() != absl::StatusCode::kDeadlineExceeded);
    if (!st.ok()) {
      ++cancelled;
      CHECK(absl::StrContains(st.message(), "conformance: the update was aborted"));
    }
  }
  // 256 MiB were queued: on every backend here the cancel catches most of them in flight.
  CHECK(cancelled > 0);
  CHECK(absl::Now() - t0 < absl::Seconds(5));
  WriteRequest again{src.region.get(), 0, remote.get(), 0, 4096};
  auto later = link.src->Post({&again, 1});
  if (later.ok()) {
    const absl::Status st = link.src->Wait(*later, kTimeout);
    CHECK_FALSE(st.ok());
    CHECK(st.code() != absl::StatusCode::kDeadlineExceeded);
  }
  // A peer receiver's memory is read while the sender's endpoint still exists: after the Cancel returned, nothing
  // lands but what was on the wire when it was called (PeerReceiver::InFlightBound), never a request still queued
  // in the endpoint. A receiver in this process is not read while its threads may still apply bytes.
  std::vector<uint8_t> at_cancel;
  if (receiver.peer() != nullptr) {
    at_cancel = dst.Bytes();
    // A cancelled endpoint lives on until its owner re-creates it; a while of it (its length, not an event, is the
    // condition, as for the stopped peer) must hand nothing queued to the network.
    std::this_thread::sleep_for(kAfterCancel);
    link.src.reset();  // its connections' threads joined: whatever they sent is on its way
  } else {
    receiver.Destroy(link, dst);  // its threads joined: the memory is read after them
  }
  // Every byte is the pattern or untouched. (Bytes a receiver had buffered when the cancel came may still land after
  // it returned: a tcp receiver applies what reached its socket.)
  const std::vector<uint8_t>& got = dst.Bytes();
  if (receiver.peer() != nullptr) {
    uint64_t landed_after = 0;
    for (uint64_t j = 0; j < got.size(); ++j) landed_after += got[j] != at_cancel[j];
    INFO(landed_after << " bytes landed after the Cancel returned; at most " << receiver.peer()->InFlightBound()
                      << " were on the wire");
    CHECK(landed_after <= receiver.peer()->InFlightBound());
  }
  for (int i = 0; i < kBatches; ++i) {
    const uint8_t* p = got.data() + static_cast<uint64_t>(i) * kLen;
    uint64_t torn = kLen;
    for (uint64_t j = 0; j < kLen && torn == kLen; ++j)
      if (p[j] != kUntouched && p[j] != PatternByte(51, j)) torn = j;
    INFO("batch " << i << ": byte " << torn << " is neither the pattern nor untouched");
    CHECK(torn == kLen);
  }
}

// Device memory where the instance says it writes it (Capabilities::writes_into_device). Host memory stands in for the
// device's and is read only after Settle, as a target reads an engine's GPU memory only after the commit: a backend
// whose receiver is the CPU stages writes through the sink (Acquire/Submit), a NIC backend writes the sink's host
// mirror and Settle copies it (CopyMirror). Every byte is checked against the pattern. An instance that says it cannot
// refuses the registration. Fails when an instance reports a path to device memory it has not (the registration or
// the bytes fail) or denies one it has (the registration succeeds).
namespace {

class HostStandInSink final : public wsync::transport::RegionSink {
 public:
  explicit HostStandInSink(uint64_t len) : device_(len, kUntouched) {
    for (int i = 0; i < kBuffers; ++i) {
      buffers_.emplace_back(kChunk);
      free_.push_back(i);
    }
  }
  uint64_t length() const override { return device_.size(); }
  uint64_t chunk_bytes() const override { return kChunk; }
  absl::StatusOr<Staging> Acquire() override {
    std::unique_lock<std::mutex> l(mu_);
    freed_.wait(l, [&] { return !free_.empty(); });
    const int slot = free_.back();
    free_.pop_back();
    return Staging{buffers_[slot].data(), slot};
  }
  // Disjoint ranges of one batch arrive on several connection threads at once: each copies its own bytes.
  absl::Status Submit(const Staging& s, uint64_t offset, uint64_t len) override {
    std::memcpy(device_.data() + offset, s.data, len);
    Release(s.slot);
    return absl::OkStatus();
  }
  void Cancel(const Staging& s) override { Release(s.slot); }
  absl::Status Flush() override { return absl::OkStatus(); }
  std::string Describe() const override { return "conformance sink (host memory standing in for a device's)"; }
  absl::StatusOr<uint8_t*> HostMirror() override {
    mirror_ = device_;
    return mirror_.data();
  }
  absl::Status CopyMirror() override {
    device_ = mirror_;
    return absl::OkStatus();
  }
  const std::vector<uint8_t>& device() const { return device_; }

 private:
  static constexpr int kBuffers = 4;
  static constexpr uint64_t kChunk = 64 << 10;
  void Release(int slot) {
    std::lock_guard<std::mutex> l(mu_);
    free_.push_back(slot);
    freed_.notify_one();
  }
  std::vector<uint8_t> device_, mirror_;
  std::vector<std::vector<uint8_t>> buffers_;
  std::mutex mu_;
  std::condition_variable freed_;
  std::vector<int> free_;
};

}  // namespace

TEST_CASE("device sinks where the instance says it can: every byte there after Settle; refused where it says not",
          "[transport][device]") {
  auto sender = MakeViable();
  auto receiver = MakeViable();
  const Capabilities caps = receiver->Query();
  INFO("instance: " << caps.provider);
  constexpr uint64_t kLen = (1 << 20) + 4099;  // several staging chunks and an odd tail
  auto sink = std::make_shared<HostStandInSink>(kLen);
  auto region = receiver->RegisterSink(sink);
  INFO(region.status().ToString());
  if (!caps.writes_into_device) {
    CHECK_FALSE(region.ok());
    SkipRest("bytes written into a device sink",
             "this instance reports no device sinks and refused the sink: " + region.status().ToString());
    return;
  }
  REQUIRE(region.ok());
  Buffer src = RegisterPattern(*sender, kLen, 61);
  auto remote = Import(*sender, **region);
  Link link = Connect(*sender, *receiver);
  WriteRequest w[2] = {{src.region.get(), 3, remote.get(), 0, kLen / 2},
                       {src.region.get(), 3 + kLen / 2, remote.get(), kLen / 2, kLen - kLen / 2 - 3}};
  RequireOk(link.src->Write(w, kTimeout));
  RequireOk((*region)->Settle());
  CHECK(FirstPatternMismatch(sink->device().data(), kLen - 3, 61, 3) == -1);
  for (uint64_t i = kLen - 3; i < kLen; ++i) CHECK(sink->device()[i] == kUntouched);
}
