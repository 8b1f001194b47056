#include "client/ring/ring.h"

#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/fd_passing.h"

namespace wsync {
namespace {

using ring_wire::FrameHeader;
using ring_wire::TensorFrameHeader;

constexpr absl::Duration kLong = absl::Seconds(10);

uint64_t Mix(uint64_t x) {  // splitmix64 finaliser: the independent pattern
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint8_t PatternByte(uint64_t bucket, uint64_t tensor, uint64_t offset) {
  return static_cast<uint8_t>(Mix((bucket << 40) ^ (tensor << 32) ^ (offset / 8)) >> (8 * (offset % 8)));
}

void FillPattern(uint8_t* dst, uint64_t bytes, uint64_t bucket, uint64_t tensor) {
  for (uint64_t i = 0; i < bytes; ++i) dst[i] = PatternByte(bucket, tensor, i);
}

bool CheckPattern(const uint8_t* src, uint64_t bytes, uint64_t bucket, uint64_t tensor) {
  for (uint64_t i = 0; i < bytes; ++i) {
    if (src[i] != PatternByte(bucket, tensor, i)) return false;
  }
  return true;
}

struct TensorSpec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t bytes;
};

// Deterministic odd-sized bucket `b` whose frames total at most `max_frames` bytes (so with a wrap inside it
// still spans at most 2 * max_frames).
std::vector<TensorSpec> MakeBucket(uint64_t b, uint64_t max_frames) {
  static constexpr DType kTypes[] = {DType::kU8, DType::kBF16, DType::kF32, DType::kF8E4M3, DType::kI64};
  std::vector<TensorSpec> out;
  uint64_t sum = 0;
  const int n = 1 + static_cast<int>(Mix(b) % 5);
  for (int t = 0; t < n; ++t) {
    const uint64_t r = Mix(b * 131 + t);
    TensorSpec s;
    s.name = absl::StrCat("model.layers.", b % 61, ".mlp.experts.", t, ".down_proj.weight");
    s.dtype = kTypes[r % 5];
    const int64_t rows = 1 + static_cast<int64_t>((r >> 8) % 7);
    int64_t cols = static_cast<int64_t>((r >> 16) % (max_frames / 4 / rows / DTypeSize(s.dtype) + 1));
    if ((r >> 40) % 17 == 0) cols = 0;  // empty tensors happen (e.g. zero local experts)
    s.shape = {rows, cols};
    s.bytes = rows * cols * DTypeSize(s.dtype);
    const uint64_t frame = ring_wire::TensorFrameBytes(s.name.size(), s.bytes);
    if (sum + frame > max_frames) {
      if (!out.empty()) break;
      s.shape = {1};
      s.bytes = DTypeSize(s.dtype);
    }
    sum += ring_wire::TensorFrameBytes(s.name.size(), s.bytes);
    out.push_back(std::move(s));
  }
  return out;
}

// Writes bucket `b` (its seq must be `b`); retries a tensor while `on_full` frees space.
template <typename OnFull>
absl::Status ProduceBucket(RingProducer& p, uint64_t b, uint64_t max_frames, absl::Duration timeout,
                           OnFull on_full) {
  const auto specs = MakeBucket(b, max_frames);
  for (size_t t = 0; t < specs.size(); ++t) {
    const TensorSpec& s = specs[t];
    absl::StatusOr<uint8_t*> dst;
    while (true) {
      dst = p.BeginTensor(s.name, s.dtype, s.shape, s.bytes, timeout);
      if (!absl::IsDeadlineExceeded(dst.status())) break;
      if (!on_full()) return dst.status();
    }
    if (!dst.ok()) return dst.status();
    FillPattern(*dst, s.bytes, b, t);
    absl::Status st = p.FinishTensor();
    if (!st.ok()) return st;
  }
  absl::StatusOr<uint64_t> seq = p.CommitBucket();
  if (!seq.ok()) return seq.status();
  if (*seq != b) return absl::InternalError(absl::StrCat("committed seq ", *seq, ", expected ", b));
  return absl::OkStatus();
}

absl::Status ProduceBucket(RingProducer& p, uint64_t b, uint64_t max_frames) {
  return ProduceBucket(p, b, max_frames, kLong, [] { return false; });
}

// Empty string when `v` is bucket `b` exactly, else what differs.
std::string VerifyBucket(const BucketView& v, uint64_t b, uint64_t max_frames) {
  const auto specs = MakeBucket(b, max_frames);
  if (v.seq != b) return absl::StrCat("seq ", v.seq, " != ", b);
  if (v.tensors.size() != specs.size()) return absl::StrCat("bucket ", b, ": ", v.tensors.size(), " tensors");
  for (size_t t = 0; t < specs.size(); ++t) {
    const TensorView& tv = v.tensors[t];
    const TensorSpec& s = specs[t];
    if (tv.name != s.name || tv.dtype != s.dtype || tv.shape != s.shape || tv.bytes != s.bytes) {
      return absl::StrCat("bucket ", b, " tensor ", t, ": metadata differs (", tv.name, ")");
    }
    if (reinterpret_cast<uintptr_t>(tv.data) % 64 != 0) return "data not 64-byte aligned";
    if (!CheckPattern(tv.data, tv.bytes, b, t)) return absl::StrCat("bucket ", b, " tensor ", t, ": bytes differ");
  }
  return "";
}

// Runs `fn` in a child process; returns its exit code (or 128 + signal).
template <typename Fn>
pid_t Spawn(Fn fn) {
  pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 1;
    try {
      rc = fn();
    } catch (...) {
    }
    ::_exit(rc);
  }
  return pid;
}

int Wait(pid_t pid) {
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + WTERMSIG(status);
}

TEST_CASE("ring: round trip of one bucket", "[ring]") {
  auto c = RingConsumer::Create("roundtrip", 1 << 20);
  REQUIRE(c.ok());
  auto p = RingProducer::Attach(c->fd());
  REQUIRE(p.ok());
  CHECK(p->name() == "roundtrip");
  CHECK(c->producer_attached());
  CHECK(c->producer_pid() == ::getpid());

  std::vector<float> w(3 * 5);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.5f * i;
  auto dst = p->BeginTensor("model.embed_tokens.weight", DType::kF32, {3, 5}, w.size() * 4, kLong);
  REQUIRE(dst.ok());
  std::memcpy(*dst, w.data(), w.size() * 4);
  REQUIRE(p->FinishTensor().ok());
  dst = p->BeginTensor("model.norm.weight", DType::kBF16, {7}, 14, kLong);
  REQUIRE(dst.ok());
  std::memset(*dst, 0xab, 14);
  REQUIRE(p->FinishTensor().ok());

  // Nothing is visible before the commit.
  CHECK(absl::IsDeadlineExceeded(c->NextBucket(absl::ZeroDuration()).status()));
  auto seq = p->CommitBucket();
  REQUIRE(seq.ok());
  CHECK(*seq == 0);

  auto b = c->NextBucket(kLong);
  REQUIRE(b.ok());
  CHECK(b->seq == 0);
  REQUIRE(b->tensors.size() == 2);
  CHECK(b->tensors[0].name == "model.embed_tokens.weight");
  CHECK(b->tensors[0].dtype == DType::kF32);
  CHECK(b->tensors[0].shape == std::vector<int64_t>{3, 5});
  CHECK(b->tensors[0].bytes == 60);
  CHECK(std::memcmp(b->tensors[0].data, w.data(), 60) == 0);
  CHECK(b->tensors[1].name == "model.norm.weight");
  CHECK(b->tensors[1].data[13] == 0xab);
  CHECK(b->payload_bytes == 74);
  REQUIRE(c->Release(*b).ok());

  // Producer detach clears the attachment; a new producer continues the seq.
  CHECK(absl::IsFailedPrecondition(RingProducer::Attach(c->fd()).status()));  // one producer at a time
  p = absl::CancelledError("detach");  // destroys the producer
  CHECK_FALSE(c->producer_attached());
  auto p2 = RingProducer::Attach(c->fd());
  REQUIRE(p2.ok());
  CHECK(p2->next_seq() == 1);
}

TEST_CASE("ring: a drained ring takes a frame longer than the room before the wrap", "[ring]") {
  // The demo's case: a 384 MiB ring, the embedding (most of the ring) pushed alone after the ring drained, with the
  // write position past the middle of a lap. The producer must not wait for the consumer to skip a padding frame it
  // only parses with the next bucket (that bucket is this frame's): it skips the lap's rest itself.
  constexpr uint64_t kCap = 64 * 1024;
  auto c = RingConsumer::Create("drained-wrap", kCap);
  REQUIRE(c.ok());
  auto p = RingProducer::Attach(c->fd());
  REQUIRE(p.ok());
  auto push = [&](const std::string& name, uint64_t bytes, uint8_t fill) {
    auto dst = p->BeginTensor(name, DType::kU8, {static_cast<int64_t>(bytes)}, bytes, absl::Seconds(2));
    REQUIRE(dst.ok());
    std::memset(*dst, fill, bytes);
    REQUIRE(p->FinishTensor().ok());
    REQUIRE(p->CommitBucket().ok());
    auto b = c->NextBucket(absl::Seconds(2));
    REQUIRE(b.ok());
    REQUIRE(b->tensors.size() == 1);
    CHECK(b->tensors[0].name == name);
    CHECK(b->tensors[0].bytes == bytes);
    bool same = true;
    for (uint64_t i = 0; i < bytes; ++i) same &= b->tensors[0].data[i] == fill;
    CHECK(same);
    REQUIRE(c->Release(*b).ok());
  };
  for (int lap = 0; lap < 3; ++lap) {
    push("small.a", 20 * 1024, 1);           // the write position moves past the middle of the lap
    push("big.embed", 48 * 1024, 2);         // longer than the room left before the wrap, drained ring
    push("small.b", 5 * 1024 + 3, 3);
  }
  // Nothing more is pending and the positions stay consistent for a new producer.
  CHECK(absl::IsDeadlineExceeded(c->NextBucket(absl::ZeroDuration()).status()));
}

TEST_CASE("ring: wrap-around over many laps, odd sizes", "[ring]") {
  constexpr uint64_t kCap = 64 * 1024;
  constexpr uint64_t kMaxFrames = kCap / 2;
  auto c = RingConsumer::Create("wrap", kCap);
  REQUIRE(c.ok());
  auto p = RingProducer::Attach(c->fd());
  REQUIRE(p.ok());

  uint64_t consumed = 0, bytes = 0;
  std::string error;
  auto consume_one = [&] {
    auto b = c->NextBucket(absl::ZeroDuration());
    if (!b.ok()) {
      error = std::string(b.status().message());
      return false;
    }
    std::string diff = VerifyBucket(*b, consumed, kMaxFrames);
    if (!diff.empty()) {
      error = diff;
      return false;
    }
    bytes += b->end - b->begin;
    ++consumed;
    return c->Release(*b).ok();
  };
  constexpr uint64_t kBuckets = 1500;
  for (uint64_t b = 0; b < kBuckets; ++b) {
    // Zero timeout: a full ring makes the consumer drain a bucket, so buckets pile up and laps interleave.
    absl::Status st = ProduceBucket(*p, b, kMaxFrames, absl::ZeroDuration(), consume_one);
    INFO(error);
    REQUIRE(st.ok());
    if (Mix(b) % 3 == 0) {
      while (consumed <= b) REQUIRE(consume_one());
    }
  }
  while (consumed < kBuckets) {
    INFO(error);
    REQUIRE(consume_one());
  }
  CHECK(bytes > 20 * kCap);  // many laps
  CHECK(absl::IsDeadlineExceeded(c->NextBucket(absl::ZeroDuration()).status()));
}

TEST_CASE("ring: full ring blocks the producer until the consumer releases", "[ring]") {
  constexpr uint64_t kCap = 64 * 1024;
  auto c = RingConsumer::Create("full", kCap);
  REQUIRE(c.ok());
  auto p = RingProducer::Attach(c->fd());
  REQUIRE(p.ok());
  std::vector<uint8_t> src(40000, 7);
  auto dst = p->BeginTensor("a", DType::kU8, {40000}, 40000, kLong);
  REQUIRE(dst.ok());
  REQUIRE(p->FinishTensor().ok());
  REQUIRE(p->CommitBucket().ok());

  auto t0 = absl::Now();
  auto blocked = p->BeginTensor("b", DType::kU8, {30000}, 30000, absl::Milliseconds(50));
  CHECK(absl::IsDeadlineExceeded(blocked.status()));
  CHECK(absl::Now() - t0 >= absl::Milliseconds(45));
  CHECK(absl::StrContains(blocked.status().message(), "no space for tensor 'b'"));

  std::thread consumer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    auto b = c->NextBucket(kLong);
    if (b.ok()) (void)c->Release(*b);
  });
  t0 = absl::Now();
  auto ok = p->BeginTensor("b", DType::kU8, {30000}, 30000, kLong);
  const absl::Duration waited = absl::Now() - t0;
  consumer.join();
  REQUIRE(ok.ok());
  CHECK(waited >= absl::Milliseconds(80));
  CHECK(waited < absl::Seconds(5));
  std::memset(*ok, 9, 30000);
  REQUIRE(p->FinishTensor().ok());
  REQUIRE(p->CommitBucket().ok());
  auto b = c->NextBucket(kLong);
  REQUIRE(b.ok());
  CHECK(b->seq == 1);
  CHECK(b->tensors.at(0).name == "b");
  CHECK(b->tensors.at(0).data[29999] == 9);
}

TEST_CASE("ring: size limits and misuse are reported clearly", "[ring]") {
  constexpr uint64_t kCap = 64 * 1024;
  auto c = RingConsumer::Create("limits", kCap);
  REQUIRE(c.ok());
  auto p = RingProducer::Attach(c->fd());
  REQUIRE(p.ok());

  auto big = p->BeginTensor("lm_head.weight", DType::kBF16, {1024, 64}, 1024 * 64 * 2, kLong);
  REQUIRE(absl::IsInvalidArgument(big.status()));
  CHECK(absl::StrContains(big.status().message(), "lm_head.weight"));
  CHECK(absl::StrContains(big.status().message(), "131072"));
  const uint64_t max = p->MaxTensorBytes(1);
  CHECK(p->BeginTensor("x", DType::kU8, {static_cast<int64_t>(max + 1)}, max + 1, kLong).status().code() ==
        absl::StatusCode::kInvalidArgument);
  auto exact = p->BeginTensor("x", DType::kU8, {static_cast<int64_t>(max)}, max, kLong);
  REQUIRE(exact.ok());
  REQUIRE(p->FinishTensor().ok());
  // The bucket is (nearly) full: the next tensor must wait for the next bucket.
  CHECK_FALSE(p->FitsInBucket(1, 4096));
  auto over = p->BeginTensor("y", DType::kU8, {4096}, 4096, kLong);
  REQUIRE(absl::IsInvalidArgument(over.status()));
  CHECK(absl::StrContains(over.status().message(), "commit the bucket first"));
  REQUIRE(p->CommitBucket().ok());

  CHECK(absl::IsInvalidArgument(p->BeginTensor("s", DType::kF32, {3, 3}, 35, kLong).status()));
  CHECK(absl::IsInvalidArgument(p->BeginTensor("s", DType::kInvalid, {3}, 3, kLong).status()));
  CHECK(absl::IsInvalidArgument(p->BeginTensor("", DType::kU8, {3}, 3, kLong).status()));
  CHECK(absl::IsInvalidArgument(
      p->BeginTensor("s", DType::kU8, {1, 1, 1, 1, 1, 1, 1, 1, 1}, 1, kLong).status()));
  CHECK(absl::IsFailedPrecondition(p->FinishTensor()));
  CHECK(absl::IsFailedPrecondition(p->CommitBucket().status()));

  auto big_bucket = c->NextBucket(kLong);
  REQUIRE(big_bucket.ok());
  REQUIRE(c->Release(*big_bucket).ok());
  REQUIRE(p->BeginTensor("z0", DType::kU8, {8}, 8, kLong).ok());
  REQUIRE(p->FinishTensor().ok());
  REQUIRE(p->CommitBucket().ok());
  auto b0 = c->NextBucket(kLong);
  REQUIRE(b0.ok());
  REQUIRE(p->BeginTensor("z", DType::kU8, {8}, 8, kLong).ok());
  CHECK(absl::IsFailedPrecondition(p->BeginTensor("z2", DType::kU8, {8}, 8, kLong).status()));
  CHECK(absl::IsFailedPrecondition(p->CommitBucket().status()));
  REQUIRE(p->FinishTensor().ok());
  REQUIRE(p->CommitBucket().ok());
  auto b1 = c->NextBucket(kLong);
  REQUIRE(b1.ok());
  CHECK(absl::IsFailedPrecondition(c->Release(*b1)));  // out of order
  REQUIRE(c->Release(*b0).ok());
  REQUIRE(c->Release(*b1).ok());
  CHECK(absl::IsFailedPrecondition(c->Release(*b1)));

  // AbortBucket drops uncommitted tensors.
  REQUIRE(p->BeginTensor("gone", DType::kU8, {8}, 8, kLong).ok());
  p->AbortBucket();
  REQUIRE(ProduceBucket(*p, 3, 4096).ok());
  auto b3 = c->NextBucket(kLong);
  REQUIRE(b3.ok());
  CHECK(VerifyBucket(*b3, 3, 4096).empty());

  CHECK(absl::IsInvalidArgument(RingConsumer::Create("bad", 5000).status()));
  char tmp[] = "/tmp/ring_test_XXXXXX";
  ScopedFd not_a_ring(::mkstemp(tmp));
  REQUIRE(not_a_ring.valid());
  ::unlink(tmp);
  REQUIRE(::ftruncate(not_a_ring.get(), 16384) == 0);
  auto bad = RingProducer::Attach(not_a_ring.get());
  CHECK(absl::IsInvalidArgument(bad.status()));
  CHECK(absl::StrContains(bad.status().message(), "not a wsync ring"));
}

TEST_CASE("ring: concurrent producer and consumer threads", "[ring]") {
  constexpr uint64_t kCap = 256 * 1024;
  constexpr uint64_t kMaxFrames = 96 * 1024;
  constexpr uint64_t kBuckets = 3000;
  auto c = RingConsumer::Create("threads", kCap);
  REQUIRE(c.ok());
  std::string producer_error;
  std::thread producer([&] {
    auto p = RingProducer::Attach(c->fd());
    if (!p.ok()) {
      producer_error = p.status().ToString();
      return;
    }
    for (uint64_t b = 0; b < kBuckets; ++b) {
      absl::Status st = ProduceBucket(*p, b, kMaxFrames);
      if (!st.ok()) {
        producer_error = st.ToString();
        return;
      }
    }
  });
  std::string error;
  for (uint64_t b = 0; b < kBuckets && error.empty(); ++b) {
    auto v = c->NextBucket(kLong);
    if (!v.ok()) {
      error = v.status().ToString();
      break;
    }
    error = VerifyBucket(*v, b, kMaxFrames);
    if (error.empty() && !c->Release(*v).ok()) error = "release";
  }
  producer.join();
  CHECK(producer_error == "");
  CHECK(error == "");
}

TEST_CASE("ring: producer in another process (fd inherited)", "[ring]") {
  constexpr uint64_t kCap = 1 << 20;
  constexpr uint64_t kMaxFrames = 256 * 1024;
  constexpr uint64_t kBuckets = 400;
  auto c = RingConsumer::Create("procs", kCap);
  REQUIRE(c.ok());
  const int fd = c->fd();
  pid_t child = Spawn([&] {
    auto p = RingProducer::Attach(fd);
    if (!p.ok()) return 2;
    for (uint64_t b = 0; b < kBuckets; ++b) {
      if (!ProduceBucket(*p, b, kMaxFrames).ok()) return 3;
    }
    return 0;
  });
  std::string error;
  for (uint64_t b = 0; b < kBuckets && error.empty(); ++b) {
    auto v = c->NextBucket(kLong);
    if (!v.ok()) {
      error = v.status().ToString();
      break;
    }
    error = VerifyBucket(*v, b, kMaxFrames);
    if (error.empty() && !c->Release(*v).ok()) error = "release";
  }
  CHECK(error == "");
  CHECK(Wait(child) == 0);
  CHECK_FALSE(c->producer_attached());  // clean exit detached
}

TEST_CASE("ring: fd passed over a unix socket to a forked producer", "[ring][fd]") {
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
  ScopedFd parent_sock(sv[0]), child_sock(sv[1]);
  // Fork before the ring exists, so the child can only get it through the socket.
  pid_t child = Spawn([&] {
    parent_sock.reset();
    auto got = ReceiveFd(child_sock.get());
    if (!got.ok() || got->message != "ring=rank3") return 2;
    auto p = RingProducer::Attach(got->fd.get());
    if (!p.ok()) return 3;
    for (uint64_t b = 0; b < 20; ++b) {
      if (!ProduceBucket(*p, b, 8192).ok()) return 4;
    }
    return 0;
  });
  child_sock.reset();
  auto c = RingConsumer::Create("rank3", 64 * 1024);
  REQUIRE(c.ok());
  REQUIRE(SendFd(parent_sock.get(), c->fd(), "ring=rank3").ok());
  for (uint64_t b = 0; b < 20; ++b) {
    auto v = c->NextBucket(kLong);
    REQUIRE(v.ok());
    CHECK(VerifyBucket(*v, b, 8192) == "");
    REQUIRE(c->Release(*v).ok());
  }
  CHECK(Wait(child) == 0);
  CHECK(absl::IsUnavailable(ReceiveFd(parent_sock.get()).status()));  // child closed its end
}

TEST_CASE("fd passing: framing on stream and seqpacket sockets", "[fd]") {
  const int type = GENERATE(SOCK_STREAM, SOCK_SEQPACKET);
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, type, 0, sv) == 0);
  ScopedFd a(sv[0]), b(sv[1]);
  int p1[2];
  REQUIRE(::pipe(p1) == 0);
  ScopedFd r(p1[0]), w(p1[1]);
  // Two frames back to back, one with an empty message: framing must keep them apart.
  REQUIRE(SendFd(a.get(), w.get(), "first").ok());
  REQUIRE(SendFd(a.get(), r.get(), "").ok());
  auto f1 = ReceiveFd(b.get());
  auto f2 = ReceiveFd(b.get());
  REQUIRE(f1.ok());
  REQUIRE(f2.ok());
  CHECK(f1->message == "first");
  CHECK(f2->message == "");
  REQUIRE(::write(f1->fd.get(), "x", 1) == 1);  // received write end, received read end
  char ch = 0;
  REQUIRE(::read(f2->fd.get(), &ch, 1) == 1);
  CHECK(ch == 'x');
  CHECK(absl::IsInvalidArgument(SendFd(a.get(), w.get(), std::string(kMaxFdMessageBytes + 1, 'x'))));
}

TEST_CASE("ring: producer dying mid-tensor or mid-bucket leaves nothing partial", "[ring][torn]") {
  constexpr uint64_t kCap = 128 * 1024;
  constexpr uint64_t kMaxFrames = 16 * 1024;
  auto c = RingConsumer::Create("torn", kCap);
  REQUIRE(c.ok());
  const int fd = c->fd();

  // Child 1: commits bucket 0, dies halfway through writing a tensor of bucket 1.
  pid_t child = Spawn([&] {
    auto p = RingProducer::Attach(fd);
    if (!p.ok() || !ProduceBucket(*p, 0, kMaxFrames).ok()) return 2;
    auto dst = p->BeginTensor("half.written", DType::kU8, {10000}, 10000, kLong);
    if (!dst.ok()) return 3;
    std::memset(*dst, 1, 5000);
    ::_exit(0);
  });
  REQUIRE(Wait(child) == 0);
  auto b = c->NextBucket(kLong);
  REQUIRE(b.ok());
  CHECK(VerifyBucket(*b, 0, kMaxFrames) == "");
  REQUIRE(c->Release(*b).ok());
  CHECK(absl::IsDeadlineExceeded(c->NextBucket(absl::Milliseconds(20)).status()));
  CHECK(c->producer_attached());
  CHECK(c->producer_pid() == child);
  CHECK(absl::IsFailedPrecondition(RingProducer::Attach(fd).status()));
  auto discarded = c->ResetUncommitted();
  REQUIRE(discarded.ok());
  CHECK(*discarded > 0);

  // Child 2: continues at seq 1, commits buckets 1 and 2, dies after a finished tensor of bucket 3.
  child = Spawn([&] {
    auto p = RingProducer::Attach(fd);
    if (!p.ok() || p->next_seq() != 1) return 2;
    if (!ProduceBucket(*p, 1, kMaxFrames).ok() || !ProduceBucket(*p, 2, kMaxFrames).ok()) return 3;
    auto dst = p->BeginTensor("finished.but.uncommitted", DType::kU8, {64}, 64, kLong);
    if (!dst.ok() || !p->FinishTensor().ok()) return 4;
    ::_exit(0);
  });
  REQUIRE(Wait(child) == 0);
  // Simulate dying between publishing next_seq and commit: recovery must not trust it.
  {
    auto m = RingMapping::Attach(fd);
    REQUIRE(m.ok());
    m->header()->next_seq.store(99);
  }
  REQUIRE(c->ResetUncommitted().ok());
  auto p = RingProducer::Attach(fd);
  REQUIRE(p.ok());
  CHECK(p->next_seq() == 3);
  REQUIRE(ProduceBucket(*p, 3, kMaxFrames).ok());
  for (uint64_t s = 1; s <= 3; ++s) {
    auto v = c->NextBucket(kLong);
    REQUIRE(v.ok());
    CHECK(VerifyBucket(*v, s, kMaxFrames) == "");
    REQUIRE(c->Release(*v).ok());
  }
  CHECK(absl::IsDeadlineExceeded(c->NextBucket(absl::ZeroDuration()).status()));
}

TEST_CASE("ring: corrupt committed frames are DataLoss, never a crash", "[ring][torn]") {
  constexpr uint64_t kCap = 64 * 1024;
  auto c = RingConsumer::Create("corrupt", kCap);
  REQUIRE(c.ok());
  auto p = RingProducer::Attach(c->fd());
  REQUIRE(p.ok());
  auto m = RingMapping::Attach(c->fd());  // a second view to tamper with
  REQUIRE(m.ok());
  uint8_t* data = m->data();
  ring_wire::RingHeader* h = m->header();

  const std::string name = "model.layers.0.self_attn.q_proj.weight";
  auto dst = p->BeginTensor(name, DType::kBF16, {4, 8}, 64, kLong);
  REQUIRE(dst.ok());
  REQUIRE(p->FinishTensor().ok());
  REQUIRE(p->CommitBucket().ok());
  // Frame 0 at offset 0: tensor (128 + name -> 192, + 64 data = 256 bytes); end frame at 256; commit 320.
  REQUIRE(h->commit.load() == 320);

  auto reseal = [&](auto&& edit) {
    TensorFrameHeader t;
    std::memcpy(&t, data, sizeof(t));
    edit(t);
    t.frame.checksum = ring_wire::FrameChecksum(&t, sizeof(t), name);
    std::memcpy(data, &t, sizeof(t));
  };
  std::string expect;
  SECTION("bad magic") {
    data[0] ^= 0xff;
    expect = "bad magic";
  }
  SECTION("flipped shape byte") {
    data[sizeof(FrameHeader) + 3] ^= 0x10;
    expect = "checksum mismatch";
  }
  SECTION("flipped name byte") {
    data[sizeof(TensorFrameHeader) + 5] ^= 0x20;
    expect = "checksum mismatch";
  }
  SECTION("length beyond committed region") {
    reseal([](TensorFrameHeader& t) { t.frame.total_bytes = 1 << 20; });
    expect = "runs past the committed region";
  }
  SECTION("data outside frame") {
    reseal([](TensorFrameHeader& t) { t.frame.data_offset = 4096; });
    expect = "outside the";
  }
  SECTION("shape disagrees with length") {
    reseal([](TensorFrameHeader& t) { t.shape[1] = 9; });
    expect = "shape needs";
  }
  SECTION("stale frame from an earlier lap") {
    reseal([&](TensorFrameHeader& t) { t.frame.position += kCap; });
    expect = "stale frame";
  }
  SECTION("commit beyond the ring") {
    h->commit.store(kCap * 4);
    expect = "invalid commit position";
  }
  SECTION("commit inside a bucket") {
    h->commit.store(256);
    expect = "inside bucket";
  }
  SECTION("bucket end disagrees") {
    FrameHeader f;
    std::memcpy(&f, data + 256, sizeof(f));
    f.count = 2;
    f.checksum = ring_wire::FrameChecksum(&f, sizeof(f));
    std::memcpy(data + 256, &f, sizeof(f));
    expect = "bucket end says";
  }
  auto b = c->NextBucket(absl::Milliseconds(100));
  REQUIRE(absl::IsDataLoss(b.status()));
  INFO(b.status().message());
  CHECK(absl::StrContains(b.status().message(), expect));
  CHECK(absl::StrContains(b.status().message(), "ring 'corrupt'"));
  // Sticky: the ring is not trusted any more.
  CHECK(absl::IsDataLoss(c->NextBucket(absl::ZeroDuration()).status()));
}

TEST_CASE("ring: closing the consumer aborts a waiting producer", "[ring]") {
  auto c = std::make_unique<absl::StatusOr<RingConsumer>>(RingConsumer::Create("closing", 16 * 1024));
  REQUIRE((*c).ok());
  auto p = RingProducer::Attach((**c).fd());
  REQUIRE(p.ok());
  REQUIRE(p->BeginTensor("a", DType::kU8, {12000}, 12000, kLong).ok());
  REQUIRE(p->FinishTensor().ok());
  REQUIRE(p->CommitBucket().ok());
  std::thread closer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    c.reset();
  });
  const absl::Time t0 = absl::Now();
  auto st = p->BeginTensor("b", DType::kU8, {12000}, 12000, kLong);
  closer.join();
  CHECK(absl::IsAborted(st.status()));
  CHECK(absl::Now() - t0 < absl::Seconds(2));
}

TEST_CASE("ring: moving handles keeps one owner", "[ring]") {
  auto c = RingConsumer::Create("moves", 64 * 1024);
  REQUIRE(c.ok());
  RingConsumer consumer = std::move(*c);
  auto p = RingProducer::Attach(consumer.fd());
  REQUIRE(p.ok());
  RingProducer producer = std::move(*p);
  REQUIRE(ProduceBucket(producer, 0, 8192).ok());
  RingProducer other = std::move(producer);
  REQUIRE(ProduceBucket(other, 1, 8192).ok());
  for (uint64_t s = 0; s < 2; ++s) {
    auto b = consumer.NextBucket(kLong);
    REQUIRE(b.ok());
    CHECK(VerifyBucket(*b, s, 8192) == "");
    REQUIRE(consumer.Release(*b).ok());
  }
  other = std::move(other);  // self-move is harmless
  CHECK(consumer.producer_attached());
  { RingProducer gone = std::move(other); }
  CHECK_FALSE(consumer.producer_attached());
}

}  // namespace
}  // namespace wsync
