// Bounded, deterministic fuzzing of the ring's frame parser (RingConsumer): a producer writes valid buckets, the
// test corrupts the shared memory the way a buggy or hostile trainer process could (it holds a writable mapping),
// and the consumer must never read outside the data area, never hang, and never hand out a tensor whose metadata
// it did not validate. Properties, each checked over many seeded rounds:
//   * payload corruption is not the parser's business: every bucket still parses, names/shapes/dtypes intact;
//   * one corrupted byte in a tensor frame's checksummed header is always detected (DataLoss), and the ring then
//     stays broken (every later call returns the same error);
//   * arbitrary corruption of frames and of the header's commit word yields only OK (every view inside the data
//     area, sizes consistent with shape × dtype), DeadlineExceeded or DataLoss.
// The expected frame positions come from the layout documented in client/ring/ring.h, computed here independently.
#include <sys/mman.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "client/ring/ring.h"

namespace wsync {
namespace {

using ring_wire::kFrameAlign;
using ring_wire::kHeaderPageBytes;

constexpr uint64_t kCapacity = 64 * 1024;

uint64_t Align64(uint64_t v) { return (v + kFrameAlign - 1) / kFrameAlign * kFrameAlign; }

struct Written {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> payload;
  uint64_t frame_pos = 0;  // data-area offset of the tensor frame (its 128-byte header: FrameHeader + shape)
  uint64_t data_pos = 0;   // data-area offset of the payload
};

// The test's own MAP_SHARED view of the ring file: what any process holding the fd can write.
class RawView {
 public:
  explicit RawView(int fd) {
    base_ = static_cast<uint8_t*>(
        mmap(nullptr, kHeaderPageBytes + kCapacity, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    REQUIRE(base_ != MAP_FAILED);
  }
  ~RawView() { munmap(base_, kHeaderPageBytes + kCapacity); }
  uint8_t* data() const { return base_ + kHeaderPageBytes; }
  ring_wire::RingHeader* header() const { return reinterpret_cast<ring_wire::RingHeader*>(base_); }

 private:
  uint8_t* base_;
};

struct Fixture {
  RingConsumer consumer;
  RingProducer producer;
  std::vector<Written> tensors;
  std::vector<int> bucket_sizes;
};

// Writes `buckets` small buckets (never wrapping: the total stays below the capacity) and records where every
// frame must be according to the documented layout; REQUIREs that the payload really is there.
Fixture Make(std::mt19937_64& rng, int buckets) {
  auto consumer = RingConsumer::Create("fuzz", kCapacity);
  REQUIRE(consumer.ok());
  auto producer = RingProducer::Attach(consumer->fd());
  REQUIRE(producer.ok());
  Fixture f{std::move(*consumer), std::move(*producer), {}, {}};
  static constexpr DType kTypes[] = {DType::kU8, DType::kBF16, DType::kF32, DType::kI64};
  uint64_t pos = 0;
  for (int b = 0; b < buckets; ++b) {
    const int n = 1 + static_cast<int>(rng() % 3);
    for (int t = 0; t < n; ++t) {
      Written w;
      w.name = absl::StrCat("model.layers.", b, ".w", t, std::string(rng() % 40, 'x'));
      w.dtype = kTypes[rng() % 4];
      const int64_t rows = 1 + static_cast<int64_t>(rng() % 8), cols = 1 + static_cast<int64_t>(rng() % 32);
      w.shape = {rows, cols};
      w.payload.resize(static_cast<size_t>(rows * cols) * DTypeSize(w.dtype));
      for (auto& x : w.payload) x = static_cast<uint8_t>(rng());
      auto dst = f.producer.BeginTensor(w.name, w.dtype, w.shape, w.payload.size(), absl::Seconds(1));
      REQUIRE(dst.ok());
      std::memcpy(*dst, w.payload.data(), w.payload.size());
      REQUIRE(f.producer.FinishTensor().ok());
      w.frame_pos = pos;
      w.data_pos = pos + Align64(128 + w.name.size());
      pos = w.data_pos + Align64(w.payload.size());
      f.tensors.push_back(std::move(w));
    }
    REQUIRE(f.producer.CommitBucket().ok());
    f.bucket_sizes.push_back(n);
    pos += kFrameAlign;  // the bucket-end frame
  }
  REQUIRE(pos < kCapacity);
  return f;
}

enum class Outcome { kAllOk, kDataLoss, kOther };

// Drains the ring with zero-timeout reads, checking every view it hands out. Returns how it ended.
Outcome Drain(RingConsumer& c, const std::vector<Written>* expect, std::string* why) {
  const uint8_t* lo = c.data_area();
  const uint8_t* hi = lo + c.capacity();
  size_t next = 0;
  for (int i = 0; i < 64; ++i) {  // more iterations than buckets: a parser that loops forever fails here
    auto b = c.NextBucket(absl::ZeroDuration());
    if (absl::IsDeadlineExceeded(b.status())) return Outcome::kAllOk;
    if (absl::IsDataLoss(b.status())) {
      *why = std::string(b.status().message());
      // Broken for good: the same error again, nothing handed out.
      auto again = c.NextBucket(absl::ZeroDuration());
      REQUIRE(absl::IsDataLoss(again.status()));
      return Outcome::kDataLoss;
    }
    if (!b.ok()) {
      *why = b.status().ToString();
      return Outcome::kOther;
    }
    for (const TensorView& t : b->tensors) {
      REQUIRE(t.data >= lo);
      REQUIRE(t.data + t.bytes <= hi);
      REQUIRE(reinterpret_cast<const uint8_t*>(t.name.data()) >= lo);
      REQUIRE(reinterpret_cast<const uint8_t*>(t.name.data()) + t.name.size() <= hi);
      REQUIRE(t.shape.size() <= static_cast<size_t>(ring_wire::kMaxDims));
      uint64_t elems = 1;
      for (int64_t d : t.shape) {
        REQUIRE(d >= 0);
        elems *= static_cast<uint64_t>(d);
      }
      REQUIRE(elems * DTypeSize(t.dtype) == t.bytes);
      if (expect != nullptr) {
        REQUIRE(next < expect->size());
        const Written& w = (*expect)[next++];
        REQUIRE(std::string(t.name) == w.name);
        REQUIRE(t.dtype == w.dtype);
        REQUIRE(t.shape == w.shape);
        REQUIRE(t.data == lo + w.data_pos);
      }
    }
    REQUIRE(c.Release(*b).ok());
  }
  FAIL("the consumer returned more buckets than were ever written");
  return Outcome::kOther;
}

TEST_CASE("ring fuzz: the documented layout is what the producer writes") {
  std::mt19937_64 rng(1);
  Fixture f = Make(rng, 4);
  RawView raw(f.consumer.fd());
  for (const Written& w : f.tensors) {
    REQUIRE(std::memcmp(raw.data() + w.data_pos, w.payload.data(), w.payload.size()) == 0);
    REQUIRE(std::memcmp(raw.data() + w.frame_pos + 128, w.name.data(), w.name.size()) == 0);
  }
  std::string why;
  REQUIRE(Drain(f.consumer, &f.tensors, &why) == Outcome::kAllOk);
}

TEST_CASE("ring fuzz: payload corruption never affects parsing") {
  std::mt19937_64 rng(2);
  for (int round = 0; round < 300; ++round) {
    Fixture f = Make(rng, 1 + static_cast<int>(rng() % 4));
    RawView raw(f.consumer.fd());
    for (int k = 0; k < 8; ++k) {
      const Written& w = f.tensors[rng() % f.tensors.size()];
      raw.data()[w.data_pos + rng() % w.payload.size()] ^= static_cast<uint8_t>(1 + rng() % 255);
    }
    std::string why;
    INFO("round " << round << ": " << why);
    REQUIRE(Drain(f.consumer, &f.tensors, &why) == Outcome::kAllOk);
  }
}

TEST_CASE("ring fuzz: one corrupted header or name byte is always detected") {
  std::mt19937_64 rng(3);
  int detected = 0;
  for (int round = 0; round < 400; ++round) {
    Fixture f = Make(rng, 1 + static_cast<int>(rng() % 4));
    RawView raw(f.consumer.fd());
    const Written& w = f.tensors[rng() % f.tensors.size()];
    // The checksummed bytes of a tensor frame: FrameHeader + shape (128 bytes) and the name.
    const uint64_t off = w.frame_pos + rng() % (128 + w.name.size());
    raw.data()[off] ^= static_cast<uint8_t>(1 + rng() % 255);
    std::string why;
    const Outcome o = Drain(f.consumer, nullptr, &why);
    INFO("round " << round << ": corrupted data-area byte " << off << " (" << w.name << "): " << why);
    REQUIRE(o == Outcome::kDataLoss);
    ++detected;
  }
  REQUIRE(detected == 400);
}

TEST_CASE("ring fuzz: arbitrary corruption and bogus commit positions stay inside the data area") {
  std::mt19937_64 rng(4);
  int ok = 0, loss = 0;
  for (int round = 0; round < 1500; ++round) {
    Fixture f = Make(rng, 1 + static_cast<int>(rng() % 4));
    RawView raw(f.consumer.fd());
    const uint64_t written = f.tensors.back().data_pos + Align64(f.tensors.back().payload.size()) + kFrameAlign;
    const int mode = static_cast<int>(rng() % 4);
    if (mode == 0 || mode == 3) {  // random bytes anywhere in the written frames
      const int n = 1 + static_cast<int>(rng() % 16);
      for (int k = 0; k < n; ++k) raw.data()[rng() % written] = static_cast<uint8_t>(rng());
    }
    if (mode == 1) {  // a whole 64-byte frame unit replaced by random words, checksum recomputed by the attacker
      const uint64_t unit = (rng() % (written / kFrameAlign)) * kFrameAlign;
      for (uint64_t i = 0; i < kFrameAlign; ++i) raw.data()[unit + i] = static_cast<uint8_t>(rng());
      ring_wire::FrameHeader h;
      std::memcpy(&h, raw.data() + unit, sizeof h);
      h.magic = ring_wire::kFrameMagic;
      h.kind = static_cast<uint8_t>(1 + rng() % 3);
      h.position = unit;
      h.header_bytes = 64;
      h.checksum = 0;
      h.checksum = ring_wire::FrameChecksum(&h, sizeof h);
      std::memcpy(raw.data() + unit, &h, sizeof h);
    }
    if (mode == 2 || mode == 3) {  // the commit word points anywhere
      const uint64_t choices[] = {rng() % (2 * kCapacity), written - kFrameAlign, written + kFrameAlign,
                                  rng(), kCapacity, kCapacity + written};
      raw.header()->commit.store(choices[rng() % 6]);
    }
    std::string why;
    const Outcome o = Drain(f.consumer, nullptr, &why);
    INFO("round " << round << " mode " << mode << ": " << why);
    REQUIRE(o != Outcome::kOther);
    (o == Outcome::kAllOk ? ok : loss)++;
  }
  // Both outcomes must actually occur, or the mutator is not exercising the parser.
  REQUIRE(ok > 0);
  REQUIRE(loss > 100);
}

}  // namespace
}  // namespace wsync
